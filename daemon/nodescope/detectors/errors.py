"""Error counters judged over windows: PCIe AER and replays, NVLink CRC/replay/recovery,
InfiniBand port and hw counters, corrected ECC errors.

The derived stage counts every error counter's increases over the last minute and hour
(``Derived.error_windows``, :mod:`nodescope.model.error_windows`); this detector judges each
count against the thresholds table (:mod:`nodescope.model.error_thresholds`,
``docs/thresholds.md``). One isolated error never warns (events such as a link going down or
a fatal AER error excepted); a sustained rate warns and a larger one is critical. A finding
holds while its count stays at its bound, that is up to a window after the errors stop, and
names the link (both ends where they are known) and the window.

* ``pcie_aer_errors`` — AER errors of a PCI function by class: correctable by rate (warning,
  then critical), non-fatal a warning and fatal critical from the first error; the message
  names the function, its upstream port and its root port.
* ``gpu_pcie_replays`` — NVML's PCIe replay counter of a GPU.
* ``nvlink_errors`` — per GPU link, NVML's DL CRC-flit, CRC-data, replay and recovery
  counters; the message names the link's remote end.
* ``ib_port_errors`` — every error counter of an InfiniBand port (``counters/``) and its
  ``hw_counters``; ``symbol_error`` as a bit error ratio of the port's line rate. The message
  names the HCA, its port, its network interfaces and its PCI function.
* ``gpu_ecc_corrected`` — corrected ECC errors of a GPU over an hour.
* ``ib_xmit_wait`` — ``port_xmit_wait`` ticks per second at or above
  ``ib_xmit_wait_per_second``: data queued that credits or arbitration kept from leaving.
  Congestion, not an error: a finding of its own, never counted with the errors.

The counters of the NVML and InfiniBand sources are read every ``slow_every`` runs: their
increases count once, at the read that saw them, so a cadence changes no count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nodescope.alerts import AlertRule
from nodescope.config import ErrorsSettings
from nodescope.detectors.common import tcp_evidence, tcp_text
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.error_thresholds import BY_COUNTER, MIN_ERRORS, Threshold
from nodescope.model.error_windows import (
    AER as AER_FAMILY,
)
from nodescope.model.error_windows import (
    ECC as ECC_FAMILY,
)
from nodescope.model.error_windows import (
    HOUR,
    IB,
    IB_HW,
    MINUTE,
    PCIE_REPLAY,
    CounterKey,
    Window,
)
from nodescope.model.error_windows import (
    NVLINK as NVLINK_FAMILY,
)
from nodescope.model.finding import Finding, Severity
from nodescope.model.infiniband import INFINIBAND, InfinibandData, InfinibandRates
from nodescope.model.nvml import NVML, GpuSample, NvmlData
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, PciDevice, Topology

AER = "pcie_aer_errors"
REPLAYS = "gpu_pcie_replays"
NVLINK = "nvlink_errors"
IB_ERRORS = "ib_port_errors"
ECC_CORRECTED = "gpu_ecc_corrected"
IB_XMIT_WAIT = "ib_xmit_wait"

# An error counter that moved is a finding for one interval, so its kind fires at once and
# stays visible a while.
_AT_ONCE_5M = AlertRule(for_seconds=0.0, resolve_after_seconds=300.0)
_AT_ONCE_10M = AlertRule(for_seconds=0.0, resolve_after_seconds=600.0)
_RATES = severities(Severity.WARNING, Severity.CRITICAL)
_RATE_ACTIONS = actions(critical="drain", warning="alert")

SPECS = (
    FindingKind(
        AER,
        _RATES,
        _RATE_ACTIONS,
        meaning="a PCI function reports AER errors: correctable ones at a rate, non-fatal or"
        " fatal ones from the first",
        signal="sysfs `aer_dev_{correctable,nonfatal,fatal}`",
        hardware="yes, where the platform grants the OS AER (firmware-first platforms hide it)",
        alert=_AT_ONCE_10M,
    ),
    FindingKind(
        REPLAYS,
        _RATES,
        _RATE_ACTIONS,
        meaning="a GPU's PCIe link retries transfers at a rate: a marginal link",
        signal="NVML PCIe replay counter",
        hardware="yes",
        alert=_AT_ONCE_5M,
    ),
    FindingKind(
        NVLINK,
        _RATES,
        _RATE_ACTIONS,
        meaning="an NVLink of a GPU counts CRC, replay or recovery errors at a rate",
        signal="NVML NVLink DL error counters (replay, recovery, CRC)",
        hardware="yes",
        alert=_AT_ONCE_5M,
    ),
    FindingKind(
        IB_ERRORS,
        _RATES,
        _RATE_ACTIONS,
        meaning="an InfiniBand port counts errors at a rate (symbol errors as a bit error"
        " ratio of its line rate)",
        signal="InfiniBand port error counters in sysfs (`counters/`, `hw_counters/`)",
        hardware="yes",
        alert=_AT_ONCE_10M,
    ),
    FindingKind(
        ECC_CORRECTED,
        _RATES,
        _RATE_ACTIONS,
        meaning="a GPU corrects ECC errors at a rate over an hour: its memory is wearing out",
        signal="NVML total ECC errors, corrected, volatile",
        hardware="yes, on GPUs with ECC enabled",
        alert=_AT_ONCE_10M,
    ),
    FindingKind(
        IB_XMIT_WAIT,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="data waits to leave an InfiniBand port (no credits, arbitration): congestion,"
        " not an error",
        signal="InfiniBand `port_xmit_wait` in sysfs",
        hardware="yes",
        contention=True,
    ),
)

#: The line rate assumed for a port whose ``rate`` the kernel did not give: EDR, the slowest
#: rate the fabric of a GPU node runs, so its bit error ratio is not understated.
DEFAULT_LINE_GBPS = 100.0

_RANK = {Severity.WARNING: 1, Severity.CRITICAL: 2}


@dataclass(frozen=True, slots=True)
class Verdict:
    """One counter judged: the severity, the row that gave it and the count in its window,
    with the counts of both windows for the evidence."""

    key: CounterKey
    severity: Severity
    row: Threshold
    count: int
    bound: float
    minute: int
    hour: int
    #: the bit error ratio over the row's window, for rows that judge one
    ratio: float | None = None


def _bound(row: Threshold, severity: Severity, settings: ErrorsSettings) -> float | None:
    if severity is Severity.WARNING:
        table, key = row.warning, row.warning_key
    else:
        table, key = row.critical, row.critical_key
    if table is None:
        return None
    value = float(getattr(settings, key)) if key is not None else table
    if row.per_bit:
        return value
    # A configured bound below the table's never judges an isolated error of a counter the
    # table does not judge one of, and never a count of none.
    return max(value, float(min(MIN_ERRORS, table)), 1.0)


def judge(
    key: CounterKey,
    window: Window,
    now: float,
    settings: ErrorsSettings,
    line_gbps: float | None = None,
) -> Verdict | None:
    """The worst severity the table's rows of ``key`` give its counts up to ``now``
    (``None``: no row reached). ``line_gbps``: the port's line rate, for rows that judge a
    bit error ratio."""
    rows = BY_COUNTER.get((key.family, key.counter))
    if not rows:
        return None
    minute, hour = window.count(MINUTE, now), window.count(HOUR, now)
    worst: Verdict | None = None
    for row in rows:
        count = minute if row.window_seconds <= MINUTE else hour
        if count <= 0:
            continue
        bits = (line_gbps or DEFAULT_LINE_GBPS) * 1e9 * row.window_seconds
        for severity in (Severity.CRITICAL, Severity.WARNING):
            bound = _bound(row, severity, settings)
            if bound is None:
                continue
            need = max(bound * bits, float(MIN_ERRORS)) if row.per_bit else bound
            if count < need:
                continue
            if worst is None or _RANK[severity] > _RANK[worst.severity]:
                ratio = count / bits if row.per_bit else None
                worst = Verdict(key, severity, row, count, bound, minute, hour, ratio)
            break
    return worst


def _said(verdict: Verdict) -> str:
    row = verdict.row
    name = verdict.key.counter
    if verdict.ratio is not None:
        return (
            f"{name} {verdict.count} in {row.window} (bit error ratio {verdict.ratio:.1e},"
            f" {verdict.severity.label} from {verdict.bound:.0e})"
        )
    return (
        f"{name} {verdict.count} in {row.window} ({verdict.severity.label} from {verdict.bound:g})"
    )


def _evidence(verdicts: Iterable[Verdict]) -> dict[str, float]:
    evidence: dict[str, float] = {}
    for v in verdicts:
        name = v.key.counter
        evidence[f"{name}_errors_1m"] = float(v.minute)
        evidence[f"{name}_errors_1h"] = float(v.hour)
        if v.ratio is not None:
            evidence[f"{name}_bit_error_ratio"] = v.ratio
    return evidence


def _worst(verdicts: Iterable[Verdict]) -> Severity:
    return max((v.severity for v in verdicts), key=lambda s: _RANK[s])


# --------------------------------------------------------------------------------------------
# The findings of each family, naming both ends of the link


def _aer_finding(
    verdict: Verdict, dev: PciDevice | None, pair: tuple[Topology, Topology] | None
) -> Finding:
    bdf, severity = verdict.key.where[0], verdict.key.counter
    where = f"PCI function {bdf}"
    ends = ""
    types = ""
    if dev is not None:
        names = f" ({', '.join(dev.os_names)})" if dev.os_names else ""
        where = f"{dev.device_class.value} {bdf}{names}"
        if dev.parent is not None:
            ends += f"; upstream port {dev.parent}"
        if dev.root_port is not None and dev.root_port not in (bdf, dev.parent):
            ends += f", root port {dev.root_port}"
        elif dev.root_port == bdf:
            ends += "; a root port"
    if pair is not None:
        before = pair[0].get(bdf)
        old = {} if before is None else {r.severity: r for r in before.aer}
        record = next((r for r in (dev.aer if dev else ()) if r.severity == severity), None)
        prior = old.get(severity)
        if record is not None and prior is not None:
            counts = {p.name: p.value for p in prior.counters}
            moved = sorted(
                (c.name, c.value - counts[c.name])
                for c in record.counters
                if c.name in counts and c.value > counts[c.name]
            )
            if moved:
                types = "; latest read: " + ", ".join(f"{n} +{d}" for n, d in moved)
    return Finding(
        AER,
        verdict.severity,
        {"device": bdf, "severity": severity},
        _evidence((verdict,)),
        f"{verdict.count} {severity} AER error(s) in {verdict.row.window} on {where}"
        f" ({verdict.severity.label} from {verdict.bound:g}){ends}{types}",
    )


def _gpu_name(gpu: GpuSample | None, uuid: str) -> tuple[dict[str, str], str]:
    if gpu is None:
        return {"gpu": uuid}, f"GPU {uuid}"
    return {"gpu": str(gpu.index)}, f"GPU {gpu.index} ({gpu.pci_address})"


def _nvml_findings(verdicts: list[Verdict], nvml: NvmlData | None) -> list[Finding]:
    gpus = {} if nvml is None else {g.uuid: g for g in nvml.gpus}
    findings = []
    links: dict[tuple[str, str], list[Verdict]] = {}
    for v in verdicts:
        uuid = v.key.where[0]
        gpu = gpus.get(uuid)
        subjects, name = _gpu_name(gpu, uuid)
        if v.key.family == PCIE_REPLAY:
            if gpu is not None:
                subjects["device"] = gpu.pci_address
            findings.append(
                Finding(
                    REPLAYS,
                    v.severity,
                    subjects,
                    _evidence((v,)),
                    f"{name} PCIe link to its upstream port: {_said(v)}: TLPs"
                    " retransmitted, bandwidth lost",
                )
            )
        elif v.key.family == ECC_FAMILY:
            findings.append(
                Finding(
                    ECC_CORRECTED,
                    v.severity,
                    subjects,
                    _evidence((v,)),
                    f"{name} corrected {v.count} ECC errors in {v.row.window}"
                    f" ({v.severity.label} from {v.bound:g}): its memory is wearing out;"
                    " action: check row remapping and plan a GPU reset or replacement",
                )
            )
        else:
            links.setdefault((uuid, v.key.where[1]), []).append(v)
    for (uuid, number), found in links.items():
        gpu = gpus.get(uuid)
        subjects, name = _gpu_name(gpu, uuid)
        subjects["nvlink"] = number
        remote = ""
        if gpu is not None:
            nv = gpu.nvlinks
            for i, link in enumerate(nv.link):
                if str(link) == number:
                    peer = nv.remote_pci_address[i]
                    kind = nv.remote_type[i]
                    if peer:
                        remote = f" to {kind + ' ' if kind else ''}{peer}"
        findings.append(
            Finding(
                NVLINK,
                _worst(found),
                subjects,
                _evidence(found),
                f"{name} NVLink {number}{remote}: "
                + "; ".join(_said(v) for v in sorted(found, key=lambda v: v.key.counter)),
            )
        )
    return findings


def _ib_findings(
    verdicts: list[Verdict], ib: InfinibandData | None, pci: Topology | None
) -> list[Finding]:
    ports: dict[tuple[str, str], list[Verdict]] = {}
    for v in verdicts:
        ports.setdefault((v.key.where[0], v.key.where[1]), []).append(v)
    devices = {} if ib is None else {d.name: d for d in ib.devices}
    findings = []
    for (hca, port), found in ports.items():
        device = devices.get(hca)
        ends = ""
        if device is not None:
            if device.netdevs:
                ends += f" ({', '.join(device.netdevs)})"
            if device.pci_address:
                ends += f" at PCI {device.pci_address}"
                dev = None if pci is None else pci.get(device.pci_address)
                if dev is not None and dev.root_port is not None:
                    ends += f" below root port {dev.root_port}"
        findings.append(
            Finding(
                IB_ERRORS,
                _worst(found),
                {"hca": hca, "port": port},
                _evidence(found),
                f"{hca} port {port}{ends} and the switch port at its far end: "
                + "; ".join(_said(v) for v in sorted(found, key=lambda v: v.key.counter)),
            )
        )
    return findings


def _line_rates(ib: InfinibandData | None) -> Mapping[tuple[str, ...], float]:
    if ib is None:
        return {}
    return {(p.device, str(p.port)): p.rate.gbps for p in ib.ports() if p.rate is not None}


def window_findings(snapshot: Snapshot, settings: ErrorsSettings) -> list[Finding]:
    """The findings of every error counter whose window reaches a row of the table."""
    windows = snapshot.derived.error_windows
    now = snapshot.monotonic
    active = list(windows.active(now))
    if not active:
        return []  # the usual case: no error counter moved in the last hour
    ib = snapshot.latest(INFINIBAND)
    rates = _line_rates(ib)
    verdicts = [
        v
        for key, window in active
        if (v := judge(key, window, now, settings, rates.get(key.where[:2]))) is not None
    ]
    if not verdicts:
        return []
    tcp = tcp_evidence(snapshot)
    findings: list[Finding] = []
    topology = snapshot.latest(PCI)
    pair = snapshot.pair(PCI)
    for v in verdicts:
        if v.key.family == AER_FAMILY:
            dev = None if topology is None else topology.get(v.key.where[0])
            found = _aer_finding(v, dev, None if pair is None else (pair[0], pair[1]))
            findings.append(_with_tcp(found, tcp))
    nvml = [v for v in verdicts if v.key.family in (PCIE_REPLAY, NVLINK_FAMILY, ECC_FAMILY)]
    if nvml:
        findings += [
            _with_tcp(f, tcp) if f.kind == REPLAYS else f
            for f in _nvml_findings(nvml, snapshot.latest(NVML))
        ]
    port = [v for v in verdicts if v.key.family in (IB, IB_HW)]
    if port:
        findings += _ib_findings(port, ib, topology)
    return findings


def _with_tcp(finding: Finding, tcp: dict[str, float]) -> Finding:
    if not tcp:
        return finding
    return Finding(
        finding.kind,
        finding.severity,
        finding.subjects,
        {**finding.evidence, **tcp},
        finding.message + tcp_text(tcp),
    )


def xmit_wait_findings(rates: InfinibandRates, xmit_wait_per_second: float) -> list[Finding]:
    """Ports whose transmit waited at or above ``xmit_wait_per_second`` ticks a second."""
    findings: list[Finding] = []
    for port in rates.ports:
        wait = port.xmit_wait_per_second
        if wait is not None and wait > 0 and wait >= xmit_wait_per_second:
            evidence = {"xmit_wait_per_second": wait}
            if port.xmit_bytes_per_second is not None:
                evidence["xmit_bytes_per_second"] = port.xmit_bytes_per_second
            findings.append(
                Finding(
                    IB_XMIT_WAIT,
                    Severity.WARNING,
                    {"hca": port.device, "port": str(port.port)},
                    evidence,
                    f"{port.device} port {port.port}: data waited to leave for {wait:.3g}"
                    f" ticks/s (threshold {xmit_wait_per_second:.3g}): credits or arbitration"
                    " hold back transmit",
                )
            )
    return findings


def detect(
    previous: Snapshot | None, snapshot: Snapshot, settings: ErrorsSettings
) -> list[Finding]:
    if not settings.enabled:
        return []
    findings = window_findings(snapshot, settings)
    ib = snapshot.derived.ib_rates
    if ib is not None:
        findings += xmit_wait_findings(ib, settings.ib_xmit_wait_per_second)
    return findings
