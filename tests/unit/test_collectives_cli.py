"""``nodescope analyze`` in-process: the document, the picture, directories and exit status."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from nodescope.cli.analyze import DEFAULT_MAX_FILE_MIB
from nodescope.cli.main import main
from nodescope.collectives import Limits
from tests.conftest import REPO
from tests.unit.test_collectives import DELAY_RANK, KINETO, expected_skew


def test_json_document_and_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "collectives.svg"
    assert main(["analyze", "--json", "--svg", str(svg), *map(str, KINETO)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["format"] == "nodescope-collectives/1"
    kinds = {k["kind"]: k for k in document["kinds"]}
    assert kinds["all_to_all"]["skew"] == pytest.approx(expected_skew())
    assert kinds["all_reduce"]["straggler"] == DELAY_RANK
    assert document["summary"]["straggler"] == DELAY_RANK
    assert ET.parse(svg).getroot().tag == "{http://www.w3.org/2000/svg}svg"


def test_a_directory_stands_for_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for path in KINETO:
        shutil.copy(path, tmp_path / path.name)
    assert main(["analyze", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(KINETO)} files, 4 ranks (0 1 2 3)")
    assert f"straggler: rank {DELAY_RANK}," in out


def test_nothing_readable_is_exit_status_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junk = tmp_path / "rank0.json"
    junk.write_text("{not json")
    assert main(["analyze", str(junk), str(tmp_path / "missing.json")]) == 1
    captured = capsys.readouterr()
    assert "no collectives found" in captured.out
    assert "missing.json" in captured.err and "not JSON" in captured.err


def test_the_default_file_cap_is_the_analysis_default() -> None:
    assert Limits().max_file_bytes == DEFAULT_MAX_FILE_MIB << 20


def test_registering_the_command_imports_no_analysis() -> None:
    code = (
        "import sys\n"
        "from nodescope.cli.main import build_parser\n"
        "build_parser()\n"
        "print(','.join(m for m in sys.modules if m.startswith('nodescope.collectives')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
