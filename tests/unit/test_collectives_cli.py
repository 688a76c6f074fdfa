"""``nodescope analyze`` in-process: the document, the picture, directories and exit status."""

from __future__ import annotations

import json
import os
import pty
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


def test_one_rank_of_four_names_the_missing_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    svg = tmp_path / "one.svg"
    assert main(["analyze", "--svg", str(svg), str(KINETO[0])]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 file, 1 rank (0) of world size 4\n")
    assert "missing: 3 of 4 ranks have no trace: 1-3\n" in out
    # With three ranks unread the one the others waited for may be among them.
    assert "straggler: none" not in out
    assert "straggler: cannot be judged, not every rank's trace was read" in out
    texts = "".join(ET.parse(svg).getroot().itertext())
    assert "3 of 4 ranks have no trace: 1-3" in texts
    assert main(["analyze", "--json", str(KINETO[0]), str(KINETO[2])]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["world_size"] == 4
    assert document["missing_ranks"] == [[1, 1], [3, 3]]
    assert document["missing_rank_count"] == 2
    assert [f["world_size"] for f in document["files"]] == [4, 4]


def test_a_flight_recorder_dump_names_its_world_from_the_groups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dumps = sorted(p for p in (KINETO[0].parent).glob("fr_trace_rank_*") if not p.suffix)
    assert main(["analyze", str(dumps[1])]) == 0
    out = capsys.readouterr().out
    assert "1 rank (1) of world size 4" in out
    assert "missing: 3 of 4 ranks have no trace: 0, 2-3" in out
    assert main(["analyze", *map(str, dumps)]) == 0
    out = capsys.readouterr().out
    assert "world size 4" in out and "missing:" not in out


def test_every_rank_read_names_nothing_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "--json", *map(str, KINETO)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["world_size"] == 4
    assert document["missing_ranks"] == [] and document["missing_rank_count"] == 0


def test_the_progress_line_is_drawn_on_a_terminal_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Under pytest stderr is no terminal: nothing but the errors may reach it.
    assert main(["analyze", *map(str, KINETO)]) == 0
    assert capsys.readouterr().err == ""
    script = (
        "import sys\n"
        "from nodescope.cli.main import main\n"
        f"sys.exit(main(['analyze', *{[str(p) for p in KINETO]!r}]))\n"
    )
    pid, fd = pty.fork()
    if pid == 0:  # the child: stderr and stdout are the terminal
        os.execv(sys.executable, [sys.executable, "-c", script])
    seen = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    text = seen.decode()
    assert f"] {len(KINETO)}/{len(KINETO)}  read rank3.json" in text
    assert "4 files, 4 ranks (0 1 2 3) of world size 4" in text
