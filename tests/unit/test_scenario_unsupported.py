"""NVML calls a scenario's GPU does not support (``hardware.gpus.N.nvml_unsupported``): how
the loader reads and rejects them, and the fake NVML and the nvml source on such a GPU.

A GPU before Ampere retires pages instead of remapping rows, so its driver answers
nvmlDeviceGetRemappedRows with NOT_SUPPORTED; the tests take that call as their example.
Each builds the small node of ``test_scenario.small_document`` (one GPU).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from nodescope.errors import ParseError
from nodescope.model.gpu_health import GpuHealth
from nodescope.sim.node import SimulatedNode, make_temp_root
from nodescope.sim.scenario import Scenario, ScenarioLoader
from nodescope.sources.nvml import NvmlSource
from tests.unit.test_scenario import small_document

_LOADER = ScenarioLoader()
REMAP = "nvmlDeviceGetRemappedRows"


def document(unsupported: list[str] | None, timeline: list[dict[str, Any]]) -> dict[str, Any]:
    doc = small_document()
    doc.pop("expect")
    doc["timeline"] = timeline
    if unsupported is not None:
        doc["hardware"]["gpus"]["0"]["nvml_unsupported"] = unsupported
    return doc


def load(unsupported: list[str] | None, timeline: list[dict[str, Any]] | None = None) -> Scenario:
    return _LOADER.parse(document(unsupported, timeline or []), Path("v100.json"))


@pytest.fixture
def scratch() -> Iterator[Path]:
    root = make_temp_root("nodescope-test-unsupported-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_the_loader_reads_the_calls_and_a_gpu_supports_all_by_default() -> None:
    scenario = load([REMAP, "nvmlGpmQueryDeviceSupport"])
    assert scenario.hardware.gpus[0].nvml_unsupported == {REMAP, "nvmlGpmQueryDeviceSupport"}
    assert load(None).hardware.gpus[0].nvml_unsupported == frozenset()


@pytest.mark.parametrize(
    ("names", "message"),
    [
        # A misspelt call would leave the real one supported without a word.
        (["nvmlDeviceGetRemapedRows"], "/hardware/gpus/0/nvml_unsupported/0: "),
        # A call that is not a GPU's: no GPU can lack it.
        (["nvmlInit"], "/hardware/gpus/0/nvml_unsupported/0: "),
        ([REMAP, "nvmlShutdown"], "/hardware/gpus/0/nvml_unsupported/1: "),
        ([REMAP, REMAP], "/hardware/gpus/0/nvml_unsupported: lists an NVML call twice"),
        (["not a call"], "/hardware/gpus/0/nvml_unsupported/0: "),
    ],
)
def test_a_call_the_node_does_not_answer_is_rejected_with_its_pointer(
    names: list[str], message: str
) -> None:
    with pytest.raises(ParseError) as caught:
        load(names)
    assert str(caught.value).startswith(f"v100.json: {message}"), str(caught.value)


def test_the_fake_gpu_answers_not_supported_for_the_listed_call_only(scratch: Path) -> None:
    node = SimulatedNode(load([REMAP]), scratch / "node")
    node.materialise()
    nvml = node.nvml
    nvml.nvmlInit()
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetRemappedRows(handle)
        assert nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle) == 0
    finally:
        nvml.nvmlShutdown()


def health_at(root: Path, scenario: Scenario, times: tuple[float, ...]) -> dict[float, GpuHealth]:
    """GPU 0's health as the nvml source reads it at each of ``times``."""
    node = SimulatedNode(scenario, root / "node")
    node.materialise()
    (source,) = [s for s in node.sources() if isinstance(s, NvmlSource)]
    source.health_every = 1
    read: dict[float, GpuHealth] = {}
    try:
        for t in times:
            node.advance_to(t)
            read[t] = source.collect(node.roots).health[0]
    finally:
        source.close()
    return read


RETIREMENT = [{"kind": "gpu_retired_pages", "from": 2, "gpu": 0, "double_bit": 1, "pending": True}]


def test_the_source_reads_page_retirement_and_no_remap_on_such_a_gpu(scratch: Path) -> None:
    read = health_at(scratch, load([REMAP], RETIREMENT), (1, 2))
    for health in read.values():
        assert health.row_remap is None
    before, after = read[1].retired_pages, read[2].retired_pages
    assert before is not None and after is not None
    assert (before.double_bit_ecc, before.pending) == (0, False)
    assert (after.double_bit_ecc, after.pending) == (1, True)


def test_the_same_gpu_without_the_list_reports_its_rows(scratch: Path) -> None:
    read = health_at(scratch, load(None, RETIREMENT), (2,))
    assert read[2].row_remap is not None
    assert read[2].row_remap.pending is False
