"""The scontrol and sinfo parsers on a capture of a real Slurm 22.05 (three nodes, two of them
DOWN, one drained by nodescope and one by a person, two partitions), on hostile text, and the
scontrol runner's timeouts and refusals on stand-in programs."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.remediation.policy import PartitionLoad
from nodescope.remediation.slurm import (
    Scontrol,
    SlurmError,
    node_named,
    node_view,
    parse_nodes,
    parse_partitions,
    parse_sinfo_reasons,
    split_fields,
    strip_reason,
)
from tests.conftest import REPO

CAPTURE = REPO / "tests" / "fixtures" / "captures" / "slurm-22.05-scontrol"


def test_nodes_of_a_real_scontrol() -> None:
    parsed = parse_nodes((CAPTURE / "show-node.txt").read_text())
    assert parsed.skipped == 0
    by_name = {n.name: n for n in parsed.items}
    assert sorted(by_name) == ["ghost1", "ghost2", "vm"]
    ghost1, ghost2, vm = by_name["ghost1"], by_name["ghost2"], by_name["vm"]
    assert ghost1.state == "DOWN" and ghost1.flags == {"DOWN", "DRAIN"} and ghost1.drained
    # Slurm's "[root@2026-...]" suffix is not part of the reason nodescope set.
    assert ghost1.reason == "nodescope: gpu_xid_memory gpu=0: Xid 48"
    assert not ghost2.drained and ghost2.reason is None
    assert vm.flags == {"IDLE", "DRAIN"} and vm.reason == "maintenance by bob; ticket=42"
    assert vm.partitions == ("test", "gpu") and vm.hostname == "vm"


def test_partitions_of_a_real_scontrol() -> None:
    parsed = parse_partitions((CAPTURE / "show-partition.txt").read_text())
    assert parsed.skipped == 0
    assert [(p.name, p.total_nodes) for p in parsed.items] == [("test", 3), ("gpu", 2)]
    assert parsed.items[0].fields["Nodes"] == "ghost[1-2],vm"


def test_sinfo_reasons_of_a_real_sinfo() -> None:
    parsed = parse_sinfo_reasons((CAPTURE / "sinfo-R-N.txt").read_text())
    assert parsed.skipped == 0
    assert ("ghost1", "nodescope: gpu_xid_memory gpu=0: Xid 48") in parsed.items
    assert ("vm", "maintenance by bob; ticket=42") in parsed.items


def test_node_view_counts_the_other_nodescope_drains_of_each_partition() -> None:
    nodes = parse_nodes((CAPTURE / "show-node.txt").read_text()).items
    parts = parse_partitions((CAPTURE / "show-partition.txt").read_text()).items
    view = node_view("ghost2", nodes, parts)
    assert view is not None and not view.drained and view.reason is None
    assert view.partitions == (PartitionLoad("test", 3, 1), PartitionLoad("gpu", 2, 0))
    vm = node_view("vm", nodes, parts)
    assert vm is not None and vm.drained and vm.reason == "maintenance by bob; ticket=42"
    assert node_view("absent", nodes, parts) is None


def test_the_node_of_this_host_by_name_then_by_node_hostname() -> None:
    nodes = parse_nodes((CAPTURE / "show-node.txt").read_text()).items
    assert node_named(nodes, ["vm.example.org", "vm"]) == "vm"
    assert node_named(nodes, ["ghost2"]) == "ghost2"
    assert node_named(nodes, ["elsewhere"]) is None


def test_a_line_that_is_not_a_record_is_skipped_and_counted() -> None:
    text = (CAPTURE / "show-node.txt").read_text()
    hostile = "garbage\nNodeName=bad name State=IDLE\nNodeName=x\nNodeName=ok State=IDLE\x07\n"
    parsed = parse_nodes(hostile + text)
    assert parsed.skipped == 4
    assert len(parsed.items) == 3
    assert parse_partitions("PartitionName=p TotalNodes=many\n").skipped == 1
    assert parse_sinfo_reasons("no separator\n|reason\n").skipped == 2


def test_reason_is_the_rest_of_the_line_and_other_values_keep_their_words() -> None:
    fields = split_fields("NodeName=a OS=Linux 6.1 #1 SMP @0  State=IDLE Reason=x=1 Y=2 [u@1]")
    assert fields == {"NodeName": "a", "OS": "Linux 6.1 #1 SMP @0", "State": "IDLE",
                      "Reason": "x=1 Y=2 [u@1]"}  # fmt: skip
    assert strip_reason("x=1 Y=2 [root@2026-12-03T18:52:12]") == "x=1 Y=2"
    assert strip_reason("(null)") is None


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_parsers_take_any_text(text: str) -> None:
    for parser in (parse_nodes, parse_partitions, parse_sinfo_reasons):
        parsed = parser(text)
        assert parsed.skipped >= 0
        assert len(parsed.items) + parsed.skipped <= len(text.splitlines())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from((CAPTURE / "show-node.txt").read_text().splitlines()), max_size=6),
       st.text(max_size=60))  # fmt: skip
def test_a_real_line_with_junk_appended_is_still_one_record_or_one_skip(
    lines: list[str], junk: str
) -> None:
    text = "\n".join(line + junk for line in lines)
    parsed = parse_nodes(text)
    assert len(parsed.items) + parsed.skipped == len([x for x in text.splitlines() if x.strip()])


def _program(tmp_path: Path, body: str) -> str:
    path = tmp_path / "scontrol"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.alone  # a bound on wall-clock time
def test_scontrol_that_hangs_is_abandoned_at_its_timeout(tmp_path: Path) -> None:
    scontrol = Scontrol(_program(tmp_path, "exec sleep 30\n"), timeout=0.3)
    started = time.monotonic()
    with pytest.raises(SlurmError, match="did not answer"):
        scontrol.nodes()
    assert time.monotonic() - started < 5


def test_scontrol_refusals_are_errors_with_its_words(tmp_path: Path) -> None:
    scontrol = Scontrol(_program(tmp_path, "echo 'Invalid node name' >&2; exit 1\n"))
    with pytest.raises(SlurmError, match="Invalid node name"):
        scontrol.drain("n1", "nodescope: x")
    with pytest.raises(SlurmError, match="cannot run"):
        Scontrol(str(tmp_path / "absent")).nodes()


def test_arguments_travel_as_one_word_each(tmp_path: Path) -> None:
    log = tmp_path / "argv"
    scontrol = Scontrol(_program(tmp_path, f'for a in "$@"; do echo "[$a]"; done > {log}\n'))
    scontrol.drain("n1", "nodescope: kind gpu=0: a b; $(reboot)")
    assert log.read_text().splitlines() == [
        "[update]",
        "[nodename=n1]",
        "[state=drain]",
        "[reason=nodescope: kind gpu=0: a b; $(reboot)]",
    ]
    with pytest.raises(SlurmError, match="not a node name"):
        scontrol.resume("n1 state=down")
    with pytest.raises(SlurmError, match="not a job id"):
        scontrol.requeue("1 2")
    assert os.path.exists(log)
