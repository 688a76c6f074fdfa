"""scripts/gpu/nvml-check.py: every NVML call of the nvml source, asked of the fake NVML's GPUs
and reported per GPU model; exit status 2 where NVML does not initialise."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pynvml
import pytest

from nodescope.roots import Roots
from nodescope.sim.fake_nvml import FakeNvml, hgx_h100
from nodescope.sources import nvml as nv
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu" / "nvml-check.py"
NO_FILES = Roots.under("/nonexistent-nodescope-root")


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nvml_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["nvml_check"] = module
    spec.loader.exec_module(module)
    return module


def fake_node() -> FakeNvml:
    """Four H100s: GPU 0 warm and with remapped rows, GPU 1 without row remapping, GPU 3
    lost; none answering the retired-page pending status."""
    gpus = hgx_h100(4)
    gpus[0].remapped_rows_correctable = 3
    gpus[0].temperature_gpu = 61
    gpus[1].unsupported.add("nvmlDeviceGetRemappedRows")
    gpus[3].lost = True
    for gpu in gpus:
        gpu.unsupported.add("nvmlDeviceGetRetiredPagesPendingStatus")
    return FakeNvml(gpus)


def test_every_call_of_the_source_is_asked(script: ModuleType) -> None:
    """What the source calls on a node (health and GPM included) is a subset of what the
    check calls, and so is every function of the source's adapter surface (the fallbacks
    too)."""
    source_node = FakeNvml(hgx_h100(2))
    source = nv.NvmlSource(source_node, event_wait_ms=20, health_every=1, gpm_every=1)
    try:
        for _ in range(3):
            source.collect(NO_FILES)
    finally:
        source.close()
    checked = FakeNvml(hgx_h100(2))
    report = script.check(checked, gpm_wait=0.01, event_wait_ms=20)
    assert report.initialised
    assert set(source_node.calls) <= set(checked.calls)
    adapter = {name for name in dir(nv.NvmlAdapter) if name.startswith("nvml")}
    assert len(adapter) > 40
    assert adapter <= set(checked.calls)
    # NVML was left as found: shut down, GPM buffers and the event set given back.
    assert checked.calls["nvmlShutdown"] == checked.calls["nvmlInit"] == 1
    assert checked.calls["nvmlGpmSampleFree"] == checked.calls["nvmlGpmSampleAlloc"] == 4
    assert checked.registered_event_sets() == 0


def test_each_gpu_says_what_it_answered(script: ModuleType) -> None:
    report = script.check(fake_node(), gpm_wait=0.01, event_wait_ms=20)
    gpu0, gpu1, gpu2, gpu3 = report.gpus
    assert gpu0.name == "NVIDIA H100 80GB HBM3" and gpu0.links == 18
    assert gpu0.pci_address == "0000:19:00.0"
    remap = gpu0.calls["nvmlDeviceGetRemappedRows"]
    assert (remap.status, remap.value) == (
        "ok",
        "correctable 3, uncorrectable 0, pending 0, failed 0",
    )
    assert gpu0.calls["nvmlDeviceGetTemperature:gpu"].value == "61 °C"
    assert gpu0.calls["nvmlDeviceGetRetiredPagesPendingStatus"].status == "NOT_SUPPORTED"
    assert gpu0.calls["nvmlDeviceGetGpuFabricInfoV"].value.startswith("state completed, status 0")
    assert gpu0.calls["nvmlGpmMetricsGet:sm_activity_percent"].status == "ok"
    assert gpu0.calls["nvmlDeviceGetNvLinkErrorCounter:crc_flit"].value.startswith("18 links")
    assert gpu1.calls["nvmlDeviceGetRemappedRows"].status == "NOT_SUPPORTED"
    assert gpu1.calls["nvmlDeviceGetTotalEccErrors:volatile_uncorrected"].status == "ok"
    assert gpu2.calls["nvmlDeviceGetRemappedRows"].status == "ok"
    # A lost GPU gives no handle: nothing more is asked of it.
    assert gpu3.calls == {"nvmlDeviceGetHandleByIndex": script.Outcome("GPU_IS_LOST")}
    assert report.library["nvmlEventSetWait"].value == "no event within 20 ms"


def test_the_table_is_per_gpu_model(script: ModuleType) -> None:
    report = script.check(fake_node(), gpm_wait=0.01, event_wait_ms=20)
    text = script.format_report(report)
    assert "NVIDIA H100 80GB HBM3: GPU 0-2 (18 NVLinks on GPU 0)" in text
    assert "(unknown): GPU 3 (0 NVLinks on GPU 3)" in text
    h100 = text[text.index("NVIDIA H100") : text.index("(unknown)")]
    rows = {line.split()[0]: line for line in h100.splitlines() if line.startswith("  nvml")}
    assert rows["nvmlDeviceGetRemappedRows"].endswith("ok on GPU 0,2; NOT_SUPPORTED on GPU 1")
    assert rows["nvmlDeviceGetTemperature:gpu"].endswith("ok (61 °C) [GPU 0]")
    assert rows["nvmlDeviceGetRetiredPagesPendingStatus"].endswith("NOT_SUPPORTED")
    assert "not supported on this model: nvmlDeviceGetRetiredPagesPendingStatus\n" in text

    document = json.loads(json.dumps(report.as_json()))
    assert document["models"]["NVIDIA H100 80GB HBM3"] == {
        "gpus": [0, 1, 2],
        "unsupported": ["nvmlDeviceGetRetiredPagesPendingStatus"],
    }
    assert document["gpus"][0]["calls"]["nvmlDeviceGetPowerUsage"] == {
        "status": "ok",
        "value": "72000 mW",
        "micros": None,  # untimed without --cost
        "timed": 0,
    }


def test_cost_times_each_call_that_answered_and_leaves_nvml_as_found(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = fake_node()
    report = script.check(node, gpm_wait=0.01, event_wait_ms=20, repeat=7)
    gpu0 = report.gpus[0]
    util = gpu0.calls["nvmlDeviceGetUtilizationRates"]
    assert util.status == "ok" and util.timed == 7 and 0 < util.micros < 1e5
    # Asked of GPUs 0-2 seven times each (the lost GPU 3 gives no handle to ask with).
    assert node.calls["nvmlDeviceGetUtilizationRates"] == 3 * 7
    # A refused call is not timed; calls that change NVML's state are asked once.
    assert gpu0.calls["nvmlDeviceGetRetiredPagesPendingStatus"].micros is None
    assert report.library["nvmlInit"].micros is None
    assert node.calls["nvmlInit"] == node.calls["nvmlShutdown"] == 1
    assert node.calls["nvmlGpmSampleFree"] == node.calls["nvmlGpmSampleAlloc"]
    assert node.registered_event_sets() == 0
    # A per-link call: the median over the links, each link timed.
    errors = gpu0.calls["nvmlDeviceGetNvLinkErrorCounter:replay"]
    assert errors.micros is not None and errors.timed == 18 * 7
    assert f"{util.micros:.1f} µs" in script.format_report(report)

    # Repeats stop once a call has used its time: a slow NVML is timed on fewer calls.
    monkeypatch.setattr(script, "COST_SECONDS", 0.0)
    quick = script.check(fake_node(), gpm_wait=0.01, event_wait_ms=20, repeat=100)
    assert quick.gpus[0].calls["nvmlDeviceGetUtilizationRates"].timed == 1


def test_exit_status_says_whether_nvml_initialised(
    script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert script.main(["--json", "--gpm-wait", "0"], target=fake_node()) == 0
    assert json.loads(capsys.readouterr().out)["initialised"] is True
    assert script.main([], target=FakeNvml.no_driver()) == 2
    assert "NVML did not initialise: LIBRARY_NOT_FOUND" in capsys.readouterr().out


def test_the_real_binding_without_a_driver_exits_2() -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        expected = 2
    else:  # a machine with a GPU: the script reports on it
        pynvml.nvmlShutdown()
        expected = 0
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--gpm-wait", "0.1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == expected, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["initialised"] is (expected == 0)
