"""NVLink arbitration stalls and bandwidth saturation, from the ``nvlink_counter`` module.

Input: two snapshots of the ``nvlink_kmod`` source (the module's ABI,
``kmod/include/uapi/linux/nvlink_counter.h``). Pure: no IO, no clock.

Units and default bands (the seed's, configurable through :class:`NvlinkThresholds`):

* stall rate, in stall cycles per microsecond, averaged over the interval between the two
  reads: below 500 normal, 500 to 2,000 warning, above 2,000 critical;
* utilisation, the larger of TX and RX bytes per second over the link's configured capacity
  per direction, as a fraction: below 0.70 normal, 0.70 to 0.90 warning, above 0.90 critical.

A band's lower bound belongs to it (500 is a warning, 2,000 still a warning, 2,001 critical).
Averages decide the severity; the module's per-sample maxima over the same interval are in
the evidence, and a link whose average is normal but whose per-sample stall peak reached the
critical band gets a warning of its own kind (``nvlink_stall_burst``): the burst a 1 s poll
averages away.

A stall (per link, burst or folded per switch) is a finding once it has held in every cycle
for ``[detectors.nvlink] min_stall_seconds`` (default 5 s; the time is the derived stage's,
``Derived.held_since``): a blip of a few seconds is none. Saturation is reported at once.

A device whose registers stopped answering (a GPU that fell off the bus) is one
``nvlink_counter_device_gone`` finding for the device (subjects ``{"device": N}``, evidence
``links_gone``), not one per link: the device went away, and its 18 links would be 18 alerts.

Saturation from NVML: a link the module does not serve (no module, or a module whose records
leave that GPU's link out) gets the same bands from NVML's per-link data counters (fields
138/139, the ``nvml`` source's two latest reads, ``Derived.gpu_rates``) over the capacity of
one link of the GPU's NVLink generation (:func:`nvlink_capacity`, by model name). Same kind
and subjects as the module's finding, so a link is one alert whichever source measured it;
the evidence says NVML measured it (``nvml_data_counters``) and has no per-sample peak (NVML
keeps none). A link the module serves is the module's alone: no double report.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from nodescope.alerts import AlertRule
from nodescope.config import NvlinkSettings
from nodescope.detectors.common import jobs
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.finding import Finding, Severity
from nodescope.model.nvlink_kmod import (
    NVLINK_KMOD,
    LinkRates,
    LinkRatesTable,
    NvlcSnapshot,
    NvlinkKmodRates,
    snapshot_rates,
)
from nodescope.model.nvml import NVML, NvLinkRates, NvmlData
from nodescope.model.snapshot import Snapshot

STALL = "nvlink_arbitration_stall"
STALL_BURST = "nvlink_stall_burst"
SATURATION = "nvlink_bandwidth_saturation"
GONE = "nvlink_counter_device_gone"
SWITCH_STALL = "nvswitch_stall"

_STALL_SIGNAL = "stall-cycle counters read by the `nvlink_counter` module"
_STALL_HARDWARE = (
    "only with a register map the operator supplies: no public document gives NVLink or"
    " NVSwitch stall registers (docs/datasources.md §8); without one these findings stay silent"
)
_BANDS = severities(Severity.WARNING, Severity.CRITICAL)
_BAND_ACTIONS = actions(critical="drain", warning="alert")

# Stalls, bursts and saturation take the [alerts] defaults (held for a while); counter
# registers that read all-ones stay gone, so that fires at once.
SPECS = (
    FindingKind(
        STALL,
        _BANDS,
        _BAND_ACTIONS,
        meaning="an NVLink spends its cycles in arbitration stalls (band of the average rate)",
        signal=_STALL_SIGNAL,
        hardware=_STALL_HARDWARE,
    ),
    FindingKind(
        STALL_BURST,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="an NVLink's per-sample stall peaks reach the critical band while its"
        " average is normal",
        signal=_STALL_SIGNAL,
        hardware=_STALL_HARDWARE,
    ),
    FindingKind(
        SWITCH_STALL,
        _BANDS,
        _BAND_ACTIONS,
        meaning="several NVLinks into one NVSwitch stall together: the switch, not each link",
        signal=_STALL_SIGNAL,
        hardware=_STALL_HARDWARE,
    ),
    FindingKind(
        SATURATION,
        _BANDS,
        _BAND_ACTIONS,
        meaning="an NVLink carries most of its capacity (band of its busier direction)",
        signal="the `nvlink_counter` module's per-link bytes, else NVML's NVLink data"
        " counters (fields 138–141)",
        hardware="yes through NVML; the module's `nvml` source on any NVLink GPU",
        contention=True,
    ),
    FindingKind(
        GONE,
        severities(Severity.CRITICAL),
        actions(critical="drain"),
        meaning="a device's NVLink counter registers read all-ones or the device was removed",
        signal="`/dev/nvlink_stats` disappearing",
        hardware="yes (the module is nodescope's own)",
        alert=AlertRule(for_seconds=0.0, resolve_after_seconds=300.0),
    ),
)


@dataclass(frozen=True, slots=True)
class NvlinkThresholds:
    """Band bounds: stall rates in cycles per microsecond, utilisation as a fraction."""

    stall_warning_cycles_per_us: float = 500.0
    stall_critical_cycles_per_us: float = 2000.0
    utilisation_warning_ratio: float = 0.70
    utilisation_critical_ratio: float = 0.90
    #: report per-sample stall peaks in the critical band when the average is normal
    burst_findings: bool = True

    def __post_init__(self) -> None:
        for lo, hi in (
            (self.stall_warning_cycles_per_us, self.stall_critical_cycles_per_us),
            (self.utilisation_warning_ratio, self.utilisation_critical_ratio),
        ):
            if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
                raise ValueError(f"band bounds {lo}, {hi}: need 0 < warning <= critical")


DEFAULT_THRESHOLDS = NvlinkThresholds()


def band(value: float, warning: float, critical: float) -> Severity | None:
    """``None`` below ``warning``; WARNING from ``warning`` to ``critical``; CRITICAL above."""
    if value > critical:
        return Severity.CRITICAL
    if value >= warning:
        return Severity.WARNING
    return None


def _subjects(lr: LinkRates) -> dict[str, str]:
    return {"device": str(lr.device), "link": str(lr.link)}


def _link_findings(lr: LinkRates, seconds: float, t: NvlinkThresholds) -> Iterable[Finding]:
    where = f"device {lr.device} link {lr.link}"
    stall = lr.stall_cycles_per_microsecond
    if stall is not None:
        evidence = {
            "stall_cycles_per_microsecond": stall,
            "window_max_stall_cycles_per_microsecond": float(
                lr.window_max_stall_cycles_per_microsecond
            ),
            "interval_seconds": seconds,
        }
        if lr.window_stall_over_threshold_ratio is not None:
            evidence["window_stall_over_threshold_ratio"] = lr.window_stall_over_threshold_ratio
        severity = band(stall, t.stall_warning_cycles_per_us, t.stall_critical_cycles_per_us)
        peak = float(lr.window_max_stall_cycles_per_microsecond)
        if severity is not None:
            yield Finding(
                STALL,
                severity,
                _subjects(lr),
                evidence,
                f"NVLink arbitration stalls on {where}: {stall:.0f} stall cycles/µs over "
                f"{seconds:.1f} s (peak {peak:.0f}/µs per sample)",
            )
        elif t.burst_findings and peak > t.stall_critical_cycles_per_us:
            yield Finding(
                STALL_BURST,
                Severity.WARNING,
                _subjects(lr),
                evidence,
                f"NVLink stall bursts on {where}: per-sample peak {peak:.0f} stall cycles/µs, "
                f"average {stall:.0f}/µs over {seconds:.1f} s",
            )
    util = lr.utilisation
    if util is not None:
        severity = band(util, t.utilisation_warning_ratio, t.utilisation_critical_ratio)
        if severity is not None:
            yield Finding(
                SATURATION,
                severity,
                _subjects(lr),
                {
                    "utilisation_ratio": util,
                    "window_max_utilisation_ratio": lr.window_max_utilisation,
                    "tx_bytes_per_second": lr.tx_bytes_per_second or 0.0,
                    "rx_bytes_per_second": lr.rx_bytes_per_second or 0.0,
                    "interval_seconds": seconds,
                },
                f"NVLink bandwidth on {where} at {util:.0%} of capacity over {seconds:.1f} s "
                f"(peak {lr.window_max_utilisation:.0%} per sample)",
            )


def evaluate(
    prev: NvlcSnapshot, cur: NvlcSnapshot, thresholds: NvlinkThresholds = DEFAULT_THRESHOLDS
) -> list[Finding]:
    """Findings for every link of ``cur`` from two snapshots of the same reader.

    The interval is the module's sample timestamps; snapshots without usable timestamps
    (not increasing) give no rate findings, only device-gone ones (one per device).
    """
    return _findings(snapshot_rates(prev, cur, 0.0), thresholds)


def _dated(prev: NvlcSnapshot, cur: NvlcSnapshot) -> bool:
    """Whether the module's sample timestamps give the interval (see ``interval_seconds``)."""
    return cur.header.timestamp_ns > prev.header.timestamp_ns > 0


def _gone_finding(device: int, links: int) -> Finding:
    """One finding for a module device whose registers stopped answering: the device went
    away, not each of its links, so it is one alert however many links it carried (a GPU
    that falls off the bus takes its 18 NVLinks with it)."""
    return Finding(
        GONE,
        Severity.CRITICAL,
        {"device": str(device)},
        {"device_gone": 1.0, "links_gone": float(links)},
        f"device {device}: counter registers of its {links} link{'s' if links != 1 else ''}"
        " read all-ones or the device was removed; the module stopped reading them",
    )


def _findings(rates: NvlinkKmodRates, thresholds: NvlinkThresholds) -> list[Finding]:
    findings: list[Finding] = []
    seconds = rates.seconds
    links = rates.links
    # A gone link's counters are frozen: no rate finding from them either.
    gone = Counter(d for d, g in zip(links.device, links.device_gone, strict=True) if g)
    if seconds > 0:
        for i in _notable(links, thresholds):
            if not links.device_gone[i]:
                findings.extend(_link_findings(links[i], seconds, thresholds))
    findings.extend(_gone_finding(device, n) for device, n in sorted(gone.items()))
    return findings


def _notable(links: LinkRatesTable, t: NvlinkThresholds) -> list[int]:
    """The links on which :func:`_link_findings` may find something: most links are in no
    band, and this skips making their rows and evidence (one pass over the columns)."""
    stall_floor = t.stall_warning_cycles_per_us
    peak_floor = t.stall_critical_cycles_per_us if t.burst_findings else math.inf
    util_floor = t.utilisation_warning_ratio
    return [
        i
        for i, (stall, peak, util) in enumerate(
            zip(
                links.stall_cycles_per_microsecond,
                links.window_max_stall_cycles_per_microsecond,
                links.utilisation,
                strict=True,
            )
        )
        if (stall is not None and (stall >= stall_floor or peak > peak_floor))
        or (util is not None and util >= util_floor)
    ]


def thresholds(bands: NvlinkSettings) -> NvlinkThresholds:
    """The bands of the ``[detectors.nvlink]`` table (validated when the file was loaded)."""
    return NvlinkThresholds(
        stall_warning_cycles_per_us=bands.stall_warning_cycles_per_us,
        stall_critical_cycles_per_us=bands.stall_critical_cycles_per_us,
        utilisation_warning_ratio=bands.utilisation_warning_ratio,
        utilisation_critical_ratio=bands.utilisation_critical_ratio,
        burst_findings=bands.burst_findings,
    )


#: More than this share of the links into one NVSwitch stalling in one interval is the
#: switch's trouble (or its fabric's), not each link's: a congested or failing switch slows
#: every GPU's links to it at once, while a GPU's own problem stays on that GPU's links.
SWITCH_FOLD_SHARE = 0.5


def fold_switch_stalls(
    findings: list[Finding],
    nvml: NvmlData | None,
    jobs_by_gpu: Mapping[int, Sequence[str]],
) -> list[Finding]:
    """``findings`` with the stall findings of every NVSwitch that more than
    :data:`SWITCH_FOLD_SHARE` of its links (of at least two GPUs) stall on folded into one
    finding that names the switch, its stalled GPUs and links, and the jobs on those GPUs.
    Which switch a link reaches is NVML's remote end of the link (kmod devices are GPU
    indices); without NVML nothing folds."""
    if nvml is None:
        return findings
    switch_of: dict[tuple[int, int], str] = {}
    for gpu in nvml.gpus:
        for link in gpu.nvlinks:
            if link.remote_type == "switch" and link.remote_pci_address and link.active:
                switch_of[(gpu.index, link.link)] = link.remote_pci_address.lower()
    links_into = Counter(switch_of.values())
    stalled: dict[str, list[Finding]] = defaultdict(list)
    for finding in findings:
        if finding.kind not in (STALL, STALL_BURST):
            continue
        try:
            where = (int(finding.subjects["device"]), int(finding.subjects["link"]))
        except (KeyError, ValueError):
            continue
        switch = switch_of.get(where)
        if switch is not None:
            stalled[switch].append(finding)
    folded: set[int] = set()
    switches: list[Finding] = []
    for switch, parts in sorted(stalled.items()):
        gpus = sorted({int(f.subjects["device"]) for f in parts})
        if len(parts) <= SWITCH_FOLD_SHARE * links_into[switch] or len(gpus) < 2:
            continue
        folded.update(id(f) for f in parts)
        jobs = sorted({j for g in gpus for j in jobs_by_gpu.get(g, ())})
        peaks = [f.evidence.get("window_max_stall_cycles_per_microsecond", 0.0) for f in parts]
        averages = [f.evidence.get("stall_cycles_per_microsecond", 0.0) for f in parts]
        evidence = {
            "links_stalled": float(len(parts)),
            "links_into_switch": float(links_into[switch]),
            "gpus_stalled": float(len(gpus)),
            "max_stall_cycles_per_microsecond": max(averages),
            "max_window_stall_cycles_per_microsecond": max(peaks),
        }
        on_jobs = f"; jobs {', '.join(jobs)}" if jobs else ""
        switches.append(
            Finding(
                SWITCH_STALL,
                max(f.severity for f in parts),
                {"nvswitch": switch},
                evidence,
                f"NVSwitch {switch}: {len(parts)} of the {links_into[switch]} NVLinks into it"
                f" stall (GPUs {', '.join(str(g) for g in gpus)}{on_jobs}; average up to"
                f" {max(averages):.0f} stall cycles/µs, per-sample peak {max(peaks):.0f}/µs):"
                f" the switch, not each link",
            )
        )
    return [f for f in findings if id(f) not in folded] + switches


def detect(
    previous: Snapshot | None, snapshot: Snapshot, settings: NvlinkSettings
) -> list[Finding]:
    """The registry's form: the module's two latest samples, then NVML's for the links the
    module does not serve, ``[detectors.nvlink]`` bands."""
    if not settings.enabled:
        return []
    findings = _module_findings(previous, snapshot, settings)
    findings.extend(nvml_saturation(snapshot, thresholds(settings)))
    return findings


def _module_findings(
    previous: Snapshot | None, snapshot: Snapshot, settings: NvlinkSettings
) -> list[Finding]:
    pair = snapshot.pair(NVLINK_KMOD)
    if pair is None:
        return []
    prev, cur, _seconds = pair
    if prev.snapshot is None or cur.snapshot is None:
        return []
    rates = snapshot.derived.nvlink_rates
    bands = thresholds(settings)
    if rates is None or not _dated(prev.snapshot, cur.snapshot):
        findings = evaluate(prev.snapshot, cur.snapshot, bands)
    else:
        # The module's timestamps date the interval, so the source's deriver (whose record
        # the exporter asks for too) computed exactly what evaluate() would.
        findings = _findings(rates, bands)
    if not any(f.kind in (STALL, STALL_BURST) for f in findings):
        return findings
    jobs_by_gpu: dict[int, list[str]] = defaultdict(list)
    for view in jobs(snapshot):
        for gpu in view.gpus:
            jobs_by_gpu[gpu].append(view.job_id)
    folded = fold_switch_stalls(findings, snapshot.latest(NVML), jobs_by_gpu)
    return _held_stalls(folded, previous, snapshot, settings.min_stall_seconds)


_STALL_KINDS = frozenset({STALL, STALL_BURST, SWITCH_STALL})


def _held_stalls(
    findings: list[Finding], previous: Snapshot | None, snapshot: Snapshot, minimum: float
) -> list[Finding]:
    """The stall findings whose link (or switch) has stalled in every cycle for at least
    ``minimum`` seconds, with ``held_seconds``; the other findings as they are."""
    stalls = [f for f in findings if f.kind in _STALL_KINDS]
    since = snapshot.derived.held_since(
        "nvlink_stalls",
        {f.key for f in stalls},
        snapshot.monotonic,
        None if previous is None else previous.monotonic,
    )
    kept = [f for f in findings if f.kind not in _STALL_KINDS]
    for finding in stalls:
        held = snapshot.monotonic - since[finding.key]
        if held >= minimum:
            kept.append(replace(finding, evidence={**finding.evidence, "held_seconds": held}))
    return kept


# --------------------------------------------------------------------------------------------
# Saturation from NVML's per-link counters

#: Bytes per second per direction of one NVLink, by GPU model: a model matches when its key is
#: part of the GPU's name. NVIDIA's NVLink bandwidth per GPU (both directions, every link) over
#: its link count: NVLink 5 (Blackwell) 1.8 TB/s over 18 links; NVLink 4 (Hopper) 900 GB/s
#: over 18 (H800 400 GB/s over 8); NVLink 3 (A100) 600 GB/s over 12 (A800 400 GB/s over 8);
#: NVLink 2 (V100) 300 GB/s over 6; NVLink 1 (P100) 160 GB/s over 4.
NVLINK_CAPACITY_BY_MODEL: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GB200", "GB300", "B100", "B200", "B300"), 50e9),
    (("GH200", "H100", "H200", "H800"), 25e9),
    (("A100", "A800"), 25e9),
    (("V100",), 25e9),
    (("P100",), 20e9),
)


def nvlink_capacity(gpu_name: str) -> float | None:
    """Bytes per second per direction of one NVLink of the GPU model ``gpu_name``; ``None``
    for a model the table does not know (no utilisation is better than a guessed one)."""
    upper = gpu_name.upper()
    for models, capacity in NVLINK_CAPACITY_BY_MODEL:
        if any(model in upper for model in models):
            return capacity
    return None


def module_links(snapshot: Snapshot) -> frozenset[tuple[int, int]]:
    """(GPU index, link) of every link the nvlink_counter module serves in this snapshot."""
    kmod = snapshot.latest(NVLINK_KMOD)
    if kmod is None or kmod.snapshot is None:
        return frozenset()
    records = kmod.snapshot.records
    return frozenset(zip(records.device, records.link, strict=True))


def nvml_saturation(snapshot: Snapshot, bands: NvlinkThresholds) -> list[Finding]:
    """Saturation findings from NVML's per-link data counters for every link of a GPU of a
    known model that the module does not serve."""
    nvml_pair = snapshot.pair(NVML)
    if nvml_pair is None or nvml_pair[1].nvlink_data_source != "nvml":
        return []
    rates = snapshot.derived.gpu_rates
    if rates is None:
        return []
    served = module_links(snapshot)
    names = {gpu.uuid: gpu.name for gpu in nvml_pair[1].gpus}
    seconds = nvml_pair[2]
    findings = []
    for gpu in rates.gpus:
        capacity = nvlink_capacity(names.get(gpu.uuid, ""))
        if capacity is None:
            continue
        for link in gpu.nvlinks:
            if (gpu.index, link.link) in served:
                continue
            finding = _nvml_link_finding(gpu.index, link, capacity, seconds, bands)
            if finding is not None:
                findings.append(finding)
    return findings


def _nvml_link_finding(
    gpu: int, link: NvLinkRates, capacity: float, seconds: float, t: NvlinkThresholds
) -> Finding | None:
    tx, rx = link.data_tx_bytes_per_second, link.data_rx_bytes_per_second
    if tx is None and rx is None:
        return None
    util = max(tx or 0.0, rx or 0.0) / capacity
    severity = band(util, t.utilisation_warning_ratio, t.utilisation_critical_ratio)
    if severity is None:
        return None
    return Finding(
        SATURATION,
        severity,
        {"device": str(gpu), "link": str(link.link)},
        {
            "utilisation_ratio": util,
            "tx_bytes_per_second": tx or 0.0,
            "rx_bytes_per_second": rx or 0.0,
            "capacity_bytes_per_second": capacity,
            "interval_seconds": seconds,
            "nvml_data_counters": 1.0,
        },
        f"NVLink bandwidth on device {gpu} link {link.link} at {util:.0%} of its"
        f" {capacity / 1e9:.0f} GB/s per direction over {seconds:.1f} s (NVML data counters)",
    )
