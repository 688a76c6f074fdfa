#!/usr/bin/env python3
"""Ask every GPU every NVML call the ``nvml`` source makes, and say what each GPU model answers.

For a machine with NVIDIA GPUs, after the README's setup (it uses the project's venv):

    .venv/bin/python scripts/gpu/nvml-check.py            # a table per GPU model
    .venv/bin/python scripts/gpu/nvml-check.py --json     # the same, machine-readable
    .venv/bin/python scripts/gpu/nvml-check.py --source   # the source itself, call by call

The calls and their arguments are the source's own (``nodescope.sources.nvml``: its ECC,
retired-page, threshold and GPM tables, the fields it reads, the links it probes), asked
once each per GPU (per link, the answers of all links are summed up in one row). Each row
says ``ok`` and the first answer, ``NOT_SUPPORTED`` (the source stops asking), another NVML
error by its nvml.h name, or ``MISSING`` where the pynvml binding has no such function.
GPM is sampled twice, ``--gpm-wait`` seconds apart, so its metrics cover a real window.
``--cost N`` also times each call that answered: the median of N calls in microseconds (fewer
when N of them would take over :data:`COST_SECONDS`), except calls that change NVML's state
or wait (init, shutdown, event sets, GPM samples), which are asked once.

``--source`` runs the source instead: two collects a second apart, the Xid thread for two
seconds, then each pynvml call's count, latency and first answer, the per-GPU record, rates
and NV# link counts. Either way a watchdog stops the script after two minutes (eight with
``--cost``).

Exit status: 0 when NVML initialised (whatever the calls answered), 2 when it did not (no
driver, no ``libnvidia-ml.so.1``).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for root in (REPO / "daemon", REPO / "exporters"):
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

import pynvml  # noqa: E402

from nodescope.model.gpu_health import FABRIC_STATES, clock_event_names  # noqa: E402
from nodescope.roots import Roots  # noqa: E402
from nodescope.sources import nvml as nv  # noqa: E402

WATCHDOG_SECONDS = 110
#: ``--cost``: the most time the repeats of one call may take.
COST_SECONDS = 0.5
#: Calls asked once whatever ``--cost`` says: they change what NVML holds, or wait.
ONCE = frozenset(
    {
        "nvmlInit",
        "nvmlShutdown",
        "nvmlEventSetCreate",
        "nvmlEventSetFree",
        "nvmlEventSetWait",
        "nvmlDeviceRegisterEvents",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleFree",
        "nvmlGpmSampleGet",
    }
)
EXIT_OK = 0
EXIT_NO_NVML = 2

OK = "ok"
#: The binding lacks the function (an older nvidia-ml-py): not the driver's answer.
MISSING = "MISSING"
#: NVLink fields 138-141 as the source asks them, by the name rows show.
NVLINK_FIELD_NAMES = {
    nv.FI_NVLINK_DATA_TX: "nvlink_data_tx",
    nv.FI_NVLINK_DATA_RX: "nvlink_data_rx",
    nv.FI_NVLINK_RAW_TX: "nvlink_raw_tx",
    nv.FI_NVLINK_RAW_RX: "nvlink_raw_rx",
}


def error_names() -> dict[int, str]:
    """nvml.h's name of each nvmlReturn_t (``NVML_ERROR_NOT_SUPPORTED`` -> ``NOT_SUPPORTED``)."""
    names: dict[int, str] = {}
    for attr in dir(pynvml):
        if attr.startswith("NVML_ERROR_"):
            value = getattr(pynvml, attr)
            if isinstance(value, int):
                names.setdefault(value, attr.removeprefix("NVML_ERROR_"))
    return names


@dataclass
class Outcome:
    """What one call (or one kind of call over every link) answered on one GPU."""

    status: str
    value: str | None = None
    #: ``--cost``: the median time of one call, and how many calls it is the median of
    micros: float | None = None
    timed: int = 0


@dataclass
class GpuReport:
    index: int
    name: str
    uuid: str
    pci_address: str
    links: int = 0
    calls: dict[str, Outcome] = field(default_factory=dict)


@dataclass
class Report:
    initialised: bool
    error: str | None = None
    driver_version: str | None = None
    #: calls that concern NVML or the node, not one GPU (init, count, event sets)
    library: dict[str, Outcome] = field(default_factory=dict)
    gpus: list[GpuReport] = field(default_factory=list)

    def models(self) -> dict[str, list[GpuReport]]:
        by_name: dict[str, list[GpuReport]] = collections.defaultdict(list)
        for gpu in self.gpus:
            by_name[gpu.name].append(gpu)
        return dict(by_name)

    def unsupported(self, gpus: Sequence[GpuReport]) -> list[str]:
        """Calls every GPU of ``gpus`` answered NOT_SUPPORTED (or lacks), in call order."""
        keys = [key for key in gpus[0].calls] if gpus else []
        return [
            key
            for key in keys
            if all(
                g.calls.get(key, Outcome(MISSING)).status
                in ("NOT_SUPPORTED", "FUNCTION_NOT_FOUND", MISSING)
                for g in gpus
            )
        ]

    def as_json(self) -> dict[str, Any]:
        document = asdict(self)
        document["models"] = {
            name: {"gpus": [g.index for g in gpus], "unsupported": self.unsupported(gpus)}
            for name, gpus in self.models().items()
        }
        return document


class _Links:
    """The answers of one call over a GPU's links, summed up as one :class:`Outcome`."""

    def __init__(self) -> None:
        self.by_status: dict[str, list[int]] = collections.defaultdict(list)
        self.first: dict[str, str | None] = {}
        self.micros: list[float] = []
        self.timed = 0

    def add(self, link: int, outcome: Outcome) -> None:
        self.by_status[outcome.status].append(link)
        self.first.setdefault(outcome.status, outcome.value)
        if outcome.micros is not None:
            self.micros.append(outcome.micros)
            self.timed += outcome.timed

    def outcome(self) -> Outcome:
        # The cost of one call on one link: the median of the links' medians.
        micros = statistics.median(self.micros) if self.micros else None
        if len(self.by_status) == 1:
            ((status, links),) = self.by_status.items()
            first = self.first[status]
            value = f"{len(links)} links" + (f", link {links[0]}: {first}" if first else "")
            return Outcome(status, value, micros, self.timed)
        parts = [f"{status} on links {_ranges(links)}" for status, links in self.by_status.items()]
        worst = next(s for s in self.by_status if s != OK)
        return Outcome(worst, "; ".join(parts), micros, self.timed)


def _ranges(numbers: Iterable[int]) -> str:
    out: list[str] = []
    for n in sorted(numbers):
        if out and out[-1].split("-")[-1] == str(n - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ",".join(out)


def _short(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if isinstance(value, list | tuple) and len(value) > 4:
        return f"{len(value)} items"
    return str(value)[:60]


class Checker:
    """Asks one NVML (pynvml, or an object with its surface) every call of the source."""

    def __init__(
        self, nvml: Any, *, gpm_wait: float = 1.0, event_wait_ms: int = 100, repeat: int = 1
    ) -> None:
        self.nvml = nvml
        self.gpm_wait = gpm_wait
        self.event_wait_ms = event_wait_ms
        #: ``--cost``: calls per timed call (1: each call asked once, untimed)
        self.repeat = repeat
        self.errors = error_names()

    # ---- one call ----------------------------------------------------------------------

    def status_of(self, exc: BaseException) -> str:
        code = getattr(exc, "value", None)
        if isinstance(code, int) and code in self.errors:
            return self.errors[code]
        return type(exc).__name__

    def ask(
        self,
        calls: dict[str, Outcome],
        key: str,
        function: str,
        *args: Any,
        show: Callable[[Any], str] = _short,
    ) -> Any:
        """``function(*args)`` recorded under ``key``; its answer, or ``None``."""
        outcome, answer = self.outcome(function, *args, show=show)
        calls[key] = outcome
        return answer

    def outcome(
        self, function: str, *args: Any, show: Callable[[Any], str] = _short
    ) -> tuple[Outcome, Any]:
        fn = getattr(self.nvml, function, None)
        if fn is None:
            return Outcome(MISSING), None
        try:
            start = time.perf_counter_ns()
            answer = fn(*args)
            took = time.perf_counter_ns() - start
        except pynvml.NVMLError as exc:
            return Outcome(self.status_of(exc)), None
        except Exception as exc:  # a check goes on and names what broke
            return Outcome(type(exc).__name__, str(exc)[:60]), None
        try:
            text = None if answer is None else show(answer)
        except Exception as exc:  # an answer of an unexpected shape
            text = f"unreadable answer ({type(exc).__name__}: {exc})"[:80]
        outcome = Outcome(OK, text)
        if self.repeat > 1 and function not in ONCE:
            outcome.micros, outcome.timed = self.cost(fn, args, took)
        return outcome, answer

    def cost(
        self, fn: Callable[..., Any], args: tuple[Any, ...], first_ns: int
    ) -> tuple[float, int]:
        """The median time of ``fn(*args)`` in microseconds over up to :attr:`repeat` calls
        (the first one's ``first_ns`` included), and how many calls that is: the repeats
        stop after :data:`COST_SECONDS`, or at the first call that fails."""
        samples = [first_ns]
        budget = time.perf_counter_ns() + int(COST_SECONDS * 1e9)
        while len(samples) < self.repeat and time.perf_counter_ns() < budget:
            start = time.perf_counter_ns()
            try:
                fn(*args)
            except Exception:  # it answered once; a later failure ends the timing only
                break
            samples.append(time.perf_counter_ns() - start)
        return statistics.median(samples) / 1e3, len(samples)

    # ---- the whole node ------------------------------------------------------------------

    def run(self) -> Report:
        library: dict[str, Outcome] = {}
        outcome, _ = self.outcome("nvmlInit")
        library["nvmlInit"] = outcome
        if outcome.status != OK:
            return Report(initialised=False, error=outcome.status, library=library)
        report = Report(initialised=True, library=library)
        try:
            version, _ = self.outcome("nvmlSystemGetDriverVersion")
            report.driver_version = version.value if version.status == OK else None
            count = self.ask(library, "nvmlDeviceGetCount", "nvmlDeviceGetCount") or 0
            handles = []
            for index in range(int(count)):
                gpu, handle = self.identify(index)
                report.gpus.append(gpu)
                if handle is not None:
                    handles.append((gpu, handle))
            for gpu, handle in handles:
                self.check_gpu(gpu, handle)
            self.check_gpm(handles)
            self.check_events(library, handles)
        finally:
            library["nvmlShutdown"] = self.outcome("nvmlShutdown")[0]
        return report

    def identify(self, index: int) -> tuple[GpuReport, Any]:
        calls: dict[str, Outcome] = {}
        handle = self.ask(
            calls, "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex", index, show=_opaque
        )
        gpu = GpuReport(index, "(unknown)", "", "", calls=calls)
        if handle is None:
            return gpu, None
        gpu.uuid = str(self.ask(calls, "nvmlDeviceGetUUID", "nvmlDeviceGetUUID", handle) or "")
        gpu.name = str(self.ask(calls, "nvmlDeviceGetName", "nvmlDeviceGetName", handle) or "?")
        pci = self.ask(
            calls, "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo", handle, show=_pci_text
        )
        if pci is not None:
            gpu.pci_address = _pci_text(pci)
        return gpu, handle

    def check_gpu(self, gpu: GpuReport, h: Any) -> None:
        links = self.probe_links(gpu, h)
        gpu.links = len(links)
        self.check_fields(gpu, h, links)
        self.check_per_run(gpu, h)
        self.check_slow(gpu, h, links)
        self.check_health(gpu, h)

    # ---- what the source reads every run, or slowly ---------------------------------------

    def probe_links(self, gpu: GpuReport, h: Any) -> list[int]:
        """The links as the source finds them: NvLinkState up from 0 until NVML refuses."""
        states = _Links()
        links: list[int] = []
        for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 36))):
            outcome, _ = self.outcome("nvmlDeviceGetNvLinkState", h, link)
            if outcome.status != OK and (link > 0 or outcome.status == "INVALID_ARGUMENT"):
                break  # past the last link (or none at all): how the source stops too
            states.add(link, outcome)
            if outcome.status != OK:
                break
            links.append(link)
        if states.by_status:
            gpu.calls["nvmlDeviceGetNvLinkState"] = states.outcome()
        else:
            gpu.calls["nvmlDeviceGetNvLinkState"] = Outcome(OK, "no links")
        return links

    def check_fields(self, gpu: GpuReport, h: Any, links: Sequence[int]) -> None:
        """The fields of the source's per-run call, each with its own nvmlReturn."""
        wanted = [(nv.FI_PCIE_TX_BYTES, 0), (nv.FI_PCIE_RX_BYTES, 0)]
        wanted += [(fid, link) for link in links for fid in nv.NVLINK_FIELDS]
        values = self.ask(
            gpu.calls,
            "nvmlDeviceGetFieldValues",
            "nvmlDeviceGetFieldValues",
            h,
            wanted,
            show=lambda v: f"{len(wanted)} fields",
        )
        if values is None:
            return
        fids, scopes, _stamps, _latency, vtypes, rets, unions = nv.field_columns(values)
        per_field: dict[int, _Links] = collections.defaultdict(_Links)
        for fid, scope, vtype, ret, union in zip(fids, scopes, vtypes, rets, unions, strict=False):
            per_field[fid].add(scope, self.field_outcome(vtype, ret, union))
        for fid, name in ((nv.FI_PCIE_TX_BYTES, "pcie_tx"), (nv.FI_PCIE_RX_BYTES, "pcie_rx")):
            if fid in per_field:
                outcome = per_field[fid].outcome()
                gpu.calls[f"nvmlDeviceGetFieldValues:{name}"] = Outcome(
                    outcome.status, (outcome.value or "").replace("1 links, link 0: ", "")
                )
        for fid, name in NVLINK_FIELD_NAMES.items():
            if fid in per_field:
                gpu.calls[f"nvmlDeviceGetFieldValues:{name}"] = per_field[fid].outcome()

    def field_outcome(self, vtype: int, ret: int, union: int) -> Outcome:
        if ret != pynvml.NVML_SUCCESS:
            return Outcome(self.errors.get(ret, f"nvmlReturn {ret}"))
        try:
            number, _bits = nv.row_value(vtype, union)
        except ValueError as exc:
            return Outcome(OK, str(exc))
        return Outcome(OK, f"{number:g}" if isinstance(number, float) else str(number))

    def check_per_run(self, gpu: GpuReport, h: Any) -> None:
        calls = gpu.calls
        for direction, counter in (
            ("tx", pynvml.NVML_PCIE_UTIL_TX_BYTES),
            ("rx", pynvml.NVML_PCIE_UTIL_RX_BYTES),
        ):
            self.ask(
                calls,
                f"nvmlDeviceGetPcieThroughput:{direction}",
                "nvmlDeviceGetPcieThroughput",
                h,
                counter,
                show=lambda kb: f"{kb} KB/s",
            )
        self.ask(
            calls,
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetUtilizationRates",
            h,
            show=lambda u: f"gpu {u.gpu}%, memory {u.memory}%",
        )
        for function in (
            "nvmlDeviceGetDecoderUtilization",
            "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetJpgUtilization",
        ):
            self.ask(calls, function, function, h, show=lambda a: f"{a[0]}%")
        self.ask(
            calls,
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetComputeRunningProcesses",
            h,
            show=lambda p: f"{len(p)} processes",
        )

    def check_slow(self, gpu: GpuReport, h: Any, links: Sequence[int]) -> None:
        for function in (
            "nvmlDeviceGetCurrPcieLinkGeneration",
            "nvmlDeviceGetCurrPcieLinkWidth",
            "nvmlDeviceGetMaxPcieLinkGeneration",
            "nvmlDeviceGetMaxPcieLinkWidth",
            "nvmlDeviceGetPcieReplayCounter",
        ):
            self.ask(gpu.calls, function, function, h)
        if not links:
            return
        remote_type, remote_pci = _Links(), _Links()
        counters = {name: _Links() for name, _counter in nv.NVLINK_ERROR_COUNTERS}
        for link in links:
            remote_type.add(
                link,
                self.outcome(
                    "nvmlDeviceGetNvLinkRemoteDeviceType",
                    h,
                    link,
                    show=lambda t: nv.REMOTE_TYPES.get(int(t), str(t)),
                )[0],
            )
            remote_pci.add(
                link, self.outcome("nvmlDeviceGetNvLinkRemotePciInfo", h, link, show=_pci_text)[0]
            )
            for name, counter in nv.NVLINK_ERROR_COUNTERS:
                counters[name].add(
                    link, self.outcome("nvmlDeviceGetNvLinkErrorCounter", h, link, counter)[0]
                )
        gpu.calls["nvmlDeviceGetNvLinkRemoteDeviceType"] = remote_type.outcome()
        gpu.calls["nvmlDeviceGetNvLinkRemotePciInfo"] = remote_pci.outcome()
        for name, links_outcome in counters.items():
            gpu.calls[f"nvmlDeviceGetNvLinkErrorCounter:{name}"] = links_outcome.outcome()

    # ---- health ---------------------------------------------------------------------------

    def check_health(self, gpu: GpuReport, h: Any) -> None:
        calls, ask = gpu.calls, self.ask
        for name, error_type, counter_type in nv.ECC_READS:
            ask(
                calls,
                f"nvmlDeviceGetTotalEccErrors:{name}",
                "nvmlDeviceGetTotalEccErrors",
                h,
                error_type,
                counter_type,
            )
        for name, cause in nv.RETIRED_PAGE_READS:
            ask(
                calls,
                f"nvmlDeviceGetRetiredPages:{name}",
                "nvmlDeviceGetRetiredPages",
                h,
                cause,
                show=lambda pages: f"{len(pages)} pages",
            )
        ask(
            calls,
            "nvmlDeviceGetRetiredPagesPendingStatus",
            "nvmlDeviceGetRetiredPagesPendingStatus",
            h,
        )
        ask(
            calls,
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetRemappedRows",
            h,
            show=lambda r: "correctable {}, uncorrectable {}, pending {}, failed {}".format(*r),
        )
        ask(
            calls,
            "nvmlDeviceGetTemperature:gpu",
            "nvmlDeviceGetTemperature",
            h,
            pynvml.NVML_TEMPERATURE_GPU,
            show=lambda c: f"{c} °C",
        )
        self.check_memory_temperature(gpu, h)
        for name, threshold in nv.THRESHOLD_READS:
            ask(
                calls,
                f"nvmlDeviceGetTemperatureThreshold:{name}",
                "nvmlDeviceGetTemperatureThreshold",
                h,
                threshold,
                show=lambda c: f"{c} °C",
            )
        for function in (
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetPowerManagementLimit",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetPowerManagementDefaultLimit",
        ):
            ask(calls, function, function, h, show=lambda mw: f"{mw} mW")
        ask(
            calls,
            "nvmlDeviceGetApplicationsClock:sm",
            "nvmlDeviceGetApplicationsClock",
            h,
            pynvml.NVML_CLOCK_SM,
            show=lambda mhz: f"{mhz} MHz",
        )
        for name, clock in (("sm", pynvml.NVML_CLOCK_SM), ("mem", pynvml.NVML_CLOCK_MEM)):
            ask(
                calls,
                f"nvmlDeviceGetClockInfo:{name}",
                "nvmlDeviceGetClockInfo",
                h,
                clock,
                show=lambda mhz: f"{mhz} MHz",
            )
        # Both names: the source takes the newer and falls back on the older.
        for function in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            ask(calls, function, function, h, show=_reasons_text)
        ask(
            calls,
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetMemoryInfo",
            h,
            show=lambda m: f"used {m.used} of {m.total} bytes",
        )
        self.check_fabric(gpu, h)

    def check_memory_temperature(self, gpu: GpuReport, h: Any) -> None:
        key = "nvmlDeviceGetFieldValues:NVML_FI_DEV_MEMORY_TEMP"
        values = self.ask(gpu.calls, key, "nvmlDeviceGetFieldValues", h, [(nv.FI_MEMORY_TEMP, 0)])
        if values is None:
            return
        _f, _s, _t, _l, vtypes, rets, unions = nv.field_columns(values)
        if len(rets) != 1:
            gpu.calls[key] = Outcome("UNEXPECTED", f"{len(rets)} values for one field")
            return
        outcome = self.field_outcome(vtypes[0], rets[0], unions[0])
        gpu.calls[key] = Outcome(outcome.status, f"{outcome.value} °C" if outcome.value else None)

    def check_fabric(self, gpu: GpuReport, h: Any) -> None:
        v_struct = getattr(pynvml, "c_nvmlGpuFabricInfoV_t", None)
        if v_struct is None:
            gpu.calls["nvmlDeviceGetGpuFabricInfoV"] = Outcome(MISSING)
        else:
            info = v_struct()  # its constructor sets the version
            if (
                self.ask(
                    gpu.calls,
                    "nvmlDeviceGetGpuFabricInfoV",
                    "nvmlDeviceGetGpuFabricInfoV",
                    h,
                    ctypes.byref(info),
                )
                is not None
            ):
                gpu.calls["nvmlDeviceGetGpuFabricInfoV"].value = _fabric_text(info, mask=True)
        info = pynvml.c_nvmlGpuFabricInfo_t()
        if (
            self.ask(
                gpu.calls,
                "nvmlDeviceGetGpuFabricInfo",
                "nvmlDeviceGetGpuFabricInfo",
                h,
                ctypes.byref(info),
            )
            is not None
        ):
            gpu.calls["nvmlDeviceGetGpuFabricInfo"].value = _fabric_text(info, mask=False)

    def check_gpm(self, handles: Sequence[tuple[GpuReport, Any]]) -> None:
        """GPM as the source uses it: support, two samples per GPU ``gpm_wait`` apart, the
        source's metrics between them, the samples freed."""
        sampled: list[tuple[GpuReport, Any, Any]] = []
        for gpu, h in handles:
            support = self.ask(
                gpu.calls,
                "nvmlGpmQueryDeviceSupport",
                "nvmlGpmQueryDeviceSupport",
                h,
                show=lambda s: "supported" if int(s.isSupportedDevice) else "not supported",
            )
            if support is None or not int(support.isSupportedDevice):
                continue
            first = self.ask(gpu.calls, "nvmlGpmSampleAlloc", "nvmlGpmSampleAlloc", show=_opaque)
            second = self.ask(gpu.calls, "nvmlGpmSampleAlloc", "nvmlGpmSampleAlloc", show=_opaque)
            if first is None or second is None:
                self.free_samples(gpu, [s for s in (first, second) if s is not None])
                continue
            if (
                self.ask(gpu.calls, "nvmlGpmSampleGet", "nvmlGpmSampleGet", h, first, show=_opaque)
                is None
            ):
                self.free_samples(gpu, [first, second])
                continue
            sampled.append((gpu, first, second))
        if not sampled:
            return
        # One wait for every GPU: the window each metric covers.
        time.sleep(self.gpm_wait)
        for gpu, first, second in sampled:
            h = next(handle for g, handle in handles if g is gpu)
            if (
                self.ask(gpu.calls, "nvmlGpmSampleGet", "nvmlGpmSampleGet", h, second, show=_opaque)
                is not None
            ):
                self.gpm_metrics(gpu, first, second)
            self.free_samples(gpu, [first, second])

    def gpm_metrics(self, gpu: GpuReport, first: Any, second: Any) -> None:
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(nv.GPM_METRICS)
        request.sample1 = first
        request.sample2 = second
        for i, (_name, metric, _mib) in enumerate(nv.GPM_METRICS):
            request.metrics[i].metricId = metric
        if (
            self.ask(
                gpu.calls,
                "nvmlGpmMetricsGet",
                "nvmlGpmMetricsGet",
                request,
                show=lambda r: f"{r.numMetrics} metrics",
            )
            is None
        ):
            return
        for i, (name, _metric, mib) in enumerate(nv.GPM_METRICS):
            result = request.metrics[i]
            ret = int(result.nvmlReturn)
            key = f"nvmlGpmMetricsGet:{name}"
            if ret != pynvml.NVML_SUCCESS:
                gpu.calls[key] = Outcome(self.errors.get(ret, f"nvmlReturn {ret}"))
            else:
                unit = "MiB/s" if mib else "%"
                gpu.calls[key] = Outcome(OK, f"{float(result.value):g} {unit}")

    def free_samples(self, gpu: GpuReport, samples: Iterable[Any]) -> None:
        for sample in samples:
            self.ask(
                gpu.calls, "nvmlGpmSampleFree", "nvmlGpmSampleFree", sample, show=lambda _n: "freed"
            )

    # ---- Xid events ----------------------------------------------------------------------

    def check_events(
        self, library: dict[str, Outcome], handles: Sequence[tuple[GpuReport, Any]]
    ) -> None:
        xid_bit = int(pynvml.nvmlEventTypeXidCriticalError)
        registrable = []
        for gpu, h in handles:
            mask = self.ask(
                gpu.calls,
                "nvmlDeviceGetSupportedEventTypes",
                "nvmlDeviceGetSupportedEventTypes",
                h,
                show=lambda m: (
                    f"{int(m):#x}" + (" (Xid events)" if int(m) & xid_bit else " (no Xid events)")
                ),
            )
            if mask is not None and int(mask) & xid_bit:
                registrable.append((gpu, h))
        event_set = self.ask(library, "nvmlEventSetCreate", "nvmlEventSetCreate", show=_opaque)
        if event_set is None:
            return
        try:
            for gpu, h in registrable:
                self.ask(
                    gpu.calls,
                    "nvmlDeviceRegisterEvents",
                    "nvmlDeviceRegisterEvents",
                    h,
                    xid_bit,
                    event_set,
                    show=lambda _n: "Xid events registered",
                )
            outcome, data = self.outcome("nvmlEventSetWait", event_set, self.event_wait_ms)
            if outcome.status == "TIMEOUT":
                # What the Xid thread sees almost always: the call works, no Xid came.
                outcome = Outcome(OK, f"no event within {self.event_wait_ms} ms")
            elif outcome.status == OK:
                outcome.value = f"event: Xid {getattr(data, 'eventData', '?')}"
            library["nvmlEventSetWait"] = outcome
        finally:
            library["nvmlEventSetFree"] = self.outcome("nvmlEventSetFree", event_set)[0]


def _opaque(_handle: Any) -> str:
    return "handle"


def _pci_text(info: Any) -> str:
    try:
        return nv.pci_address_of(info)
    except Exception:  # shown as the binding gave it
        return _short(getattr(info, "busId", info))


def _reasons_text(mask: int) -> str:
    names = clock_event_names(int(mask))
    return f"{int(mask):#x}" + (f" ({', '.join(names)})" if names else "")


def _fabric_text(info: Any, *, mask: bool) -> str:
    state = int(info.state)
    text = (
        f"state {FABRIC_STATES.get(state, state)}, status {int(info.status)}, "
        f"clique {int(info.cliqueId)}"
    )
    uuid = nv.fabric_uuid(bytes(info.clusterUuid))
    if uuid:
        text += f", cluster {uuid}"
    if mask:
        text += f", healthMask {int(info.healthMask):#x}"
    return text


def check(
    nvml: Any = pynvml, *, gpm_wait: float = 1.0, event_wait_ms: int = 100, repeat: int = 1
) -> Report:
    """Every call of the source on every GPU of ``nvml`` (pynvml, or a fake with its
    surface); NVML is initialised and shut down again. ``repeat`` > 1 times each call."""
    return Checker(nvml, gpm_wait=gpm_wait, event_wait_ms=event_wait_ms, repeat=repeat).run()


# ---- output -------------------------------------------------------------------------------


def format_report(report: Report) -> str:
    if not report.initialised:
        return (
            f"NVML did not initialise: {report.error}\n"
            "(no NVIDIA driver or libnvidia-ml.so.1: the daemon reports source nvml down)\n"
        )
    lines = [
        f"NVML initialised; driver {report.driver_version or 'unknown'}; {len(report.gpus)} GPU(s)"
    ]
    for key, outcome in report.library.items():
        lines.append(f"  {key:56} {_cell(outcome)}")
    for name, gpus in report.models().items():
        indices = _ranges(g.index for g in gpus)
        lines.append("")
        lines.append(f"{name}: GPU {indices} ({gpus[0].links} NVLinks on GPU {gpus[0].index})")
        keys = list(dict.fromkeys(key for g in gpus for key in g.calls))
        for key in keys:
            lines.append(f"  {key:56} {_row(key, gpus)}")
        unsupported = report.unsupported(gpus)
        lines.append(f"  not supported on this model: {', '.join(unsupported) or 'none'}")
    return "\n".join(lines) + "\n"


def _cell(outcome: Outcome) -> str:
    cost = "" if outcome.micros is None else f" {outcome.micros:.1f} µs"
    if outcome.status == OK:
        return (f"ok ({outcome.value})" if outcome.value else "ok") + cost
    return outcome.status + (f" ({outcome.value})" if outcome.value else "") + cost


def _row(key: str, gpus: Sequence[GpuReport]) -> str:
    """One call across the GPUs of a model: the answer of the first GPU when all answered
    alike, else which GPUs answered what."""
    by_status: dict[str, list[int]] = collections.defaultdict(list)
    for g in gpus:
        by_status[g.calls.get(key, Outcome("not asked")).status].append(g.index)
    first = gpus[0].calls.get(key, Outcome("not asked"))
    if len(by_status) == 1:
        return _cell(first) + (f" [GPU {gpus[0].index}]" if len(gpus) > 1 and first.value else "")
    return "; ".join(f"{status} on GPU {_ranges(idx)}" for status, idx in by_status.items())


# ---- --source: the source itself, traced --------------------------------------------------


class Traced:
    """pynvml with every call timed and its first answer kept."""

    def __init__(self, target: Any = pynvml) -> None:
        self.target = target
        self.lock = threading.Lock()
        self.count: collections.Counter[str] = collections.Counter()
        self.total: dict[str, float] = collections.defaultdict(float)
        self.worst: dict[str, float] = {}
        self.first: dict[str, str] = {}
        self.errors: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.target, name)

        def call(*args: Any) -> Any:
            start = time.perf_counter()
            outcome: str
            try:
                result = fn(*args)
                outcome = short(result)
                return result
            except pynvml.NVMLError as exc:
                outcome = f"raised {type(exc).__name__}: {exc}"
                with self.lock:
                    self.errors[name][type(exc).__name__] += 1
                raise
            finally:
                took = time.perf_counter() - start
                with self.lock:
                    self.count[name] += 1
                    self.total[name] += took
                    self.worst[name] = max(self.worst.get(name, 0.0), took)
                    self.first.setdefault(name, outcome)

        call.__name__ = name
        return call

    def report(self) -> None:
        print(f"\n{'call':46} {'n':>5} {'total ms':>9} {'max ms':>8}  first answer / errors")
        for name in sorted(self.count):
            errors = ", ".join(f"{k}×{v}" for k, v in sorted(self.errors[name].items()))
            print(
                f"{name:46} {self.count[name]:5d} {self.total[name] * 1e3:9.2f} "
                f"{self.worst[name] * 1e3:8.2f}  {self.first[name][:90]}"
                + (f"  [{errors}]" if errors else "")
            )


def short(value: Any) -> str:
    if not isinstance(value, (str, bytes)) and hasattr(value, "__len__"):
        try:
            items = list(value)
        except TypeError:
            return repr(value)[:90]
        return f"{len(items)} items: " + ", ".join(str(i)[:40] for i in items[:2])
    return str(value)[:90]


def run_source(target: Any = pynvml) -> int:
    """The source over ``target`` (pynvml, or a fake with its surface), every call traced."""
    traced = Traced(target)
    # health_every=1, gpm_every=1: the three collects read the health and GPM figures too.
    source = nv.NvmlSource(
        traced, retry_seconds=3600, event_wait_ms=200, health_every=1, gpm_every=1
    )
    roots = Roots()
    try:
        start = time.perf_counter()
        try:
            first = source.collect(roots)
        except nv.NvmlUnavailable as exc:
            print(f"NVML is unavailable on this machine: {exc}")
            print("(no NVIDIA driver or libnvidia-ml.so.1: the daemon reports source nvml down)")
            traced.report()
            return EXIT_NO_NVML
        print(
            f"first collect: {(time.perf_counter() - start) * 1e3:.1f} ms, "
            f"{first.device_count} GPU(s)"
        )
        time.sleep(1.0)
        start = time.perf_counter()
        second = source.collect(roots)
        print(f"second collect: {(time.perf_counter() - start) * 1e3:.1f} ms")
        for gpu in second.gpus:
            active = sum(1 for link in gpu.nvlinks if link.active)
            print(
                f"GPU {gpu.index} {gpu.name} {gpu.uuid} at {gpu.pci_address}: "
                f"PCIe gen {gpu.pcie_gen_current}/{gpu.pcie_gen_max} "
                f"x{gpu.pcie_width_current}/x{gpu.pcie_width_max}, replays {gpu.pcie_replays}, "
                f"PCIe bytes via {gpu.pcie_bytes_source}, NVLinks {active}/{len(gpu.nvlinks)} "
                f"active, {len(gpu.processes)} compute process(es), util gpu "
                f"{gpu.gpu_util_percent}% dec {gpu.decoder_util_percent}% enc "
                f"{gpu.encoder_util_percent}% jpeg {gpu.jpeg_util_percent}%"
            )
            if gpu.unsupported:
                print(f"  not supported: {', '.join(gpu.unsupported)}")
        for health in second.health:
            print(f"GPU {health.index} health: {health}")
        for rates in nv.gpu_rates(first, second, 1.0).gpus:
            nvlink_tx = sum(r.data_tx_bytes_per_second or 0.0 for r in rates.nvlinks)
            nvlink_rx = sum(r.data_rx_bytes_per_second or 0.0 for r in rates.nvlinks)
            print(
                f"GPU {rates.index}: PCIe tx {fmt(rates.pcie_tx_bytes_per_second)} "
                f"rx {fmt(rates.pcie_rx_bytes_per_second)} ({rates.pcie_rate_basis}); "
                f"NVLink data tx {fmt(nvlink_tx)} rx {fmt(nvlink_rx)}"
            )
        for pair in nv.nvlink_pairs(second.gpus):
            print(f"GPU{pair.gpu_a} - GPU{pair.gpu_b}: NV{pair.links} ({pair.via})")
        time.sleep(2.0)
        last = source.collect(roots)
        print(f"Xid source: {last.xid_source}; Xid counts: {last.xids or 'none'}")
        for event in last.events:
            print(f"event: {event}")
    finally:
        start = time.perf_counter()
        source.close()
        print(f"close: {(time.perf_counter() - start) * 1e3:.1f} ms")
    traced.report()
    return EXIT_OK


def fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e9:.3f} GB/s"


def watchdog(seconds: int = WATCHDOG_SECONDS) -> None:
    def expire(_signum: int, _frame: Any) -> None:
        print(f"nvml-check: stopped after {seconds} s", file=sys.stderr)
        sys.exit(EXIT_NO_NVML)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)


def main(argv: Sequence[str] | None = None, target: Any = pynvml) -> int:
    """``target`` is the NVML to check: pynvml, or a fake with its surface."""
    parser = argparse.ArgumentParser(
        description="Ask every GPU every NVML call the nvml source makes."
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--gpm-wait", type=float, default=1.0, metavar="SECONDS", help="between two GPM samples"
    )
    parser.add_argument(
        "--source", action="store_true", help="run the nvml source instead, every call traced"
    )
    parser.add_argument(
        "--cost",
        type=int,
        default=1,
        metavar="N",
        help="time each call that answered: the median of N calls, in microseconds",
    )
    args = parser.parse_args(argv)
    if args.cost < 1:
        parser.error("--cost takes a count of 1 or more")
    # Timed calls take longer: each may repeat for COST_SECONDS (most take microseconds).
    watchdog(WATCHDOG_SECONDS if args.cost == 1 else 4 * WATCHDOG_SECONDS)
    try:
        if args.source:
            return run_source(target)
        report = check(target, gpm_wait=args.gpm_wait, repeat=args.cost)
    finally:
        signal.alarm(0)  # a caller that goes on (a test) must not be stopped later
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        print(format_report(report), end="")
    return EXIT_OK if report.initialised else EXIT_NO_NVML


if __name__ == "__main__":
    sys.exit(main())
