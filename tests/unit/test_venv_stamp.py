"""scripts/lib.sh's venv_serves: when the set-up commands may skip reinstalling the project
into an existing virtual environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "scripts" / "lib.sh"


def serves(have: str, want: str) -> bool:
    done = subprocess.run(
        ["bash", "-c", f'. "{LIB}"; venv_serves "$1" "$2"', "venv_serves", have, want],
        check=False,
    )
    return done.returncode == 0


@pytest.mark.parametrize(
    ("have", "want", "expected"),
    [
        # The test suite's environment serves the benchmark's, which asks for fewer extras.
        ("h1 /src/nodescope .[test,probe]", "h1 /src/nodescope .[test]", True),
        ("h1 /src/nodescope .[test]", "h1 /src/nodescope .[test,probe]", False),
        ("h1 /src/nodescope .[test]", "h1 /src/nodescope .", True),
        ("h1 /src/nodescope .", "h1 /src/nodescope .", True),
        # Another checkout: an editable install there runs that checkout's code.
        ("h1 /src/nodescope .[test]", "h1 /tmp/worktree .[test]", False),
        ("h1 /a dir/nodescope .[test]", "h1 /a dir/nodescope .[test]", True),
        # pyproject.toml changed, or nothing was installed yet.
        ("h0 /src/nodescope .[test]", "h1 /src/nodescope .[test]", False),
        ("", "h1 /src/nodescope .", False),
    ],
)
def test_an_install_serves_what_it_covers(have: str, want: str, expected: bool) -> None:
    assert serves(have, want) is expected
