"""Error counters that moved: PCIe AER and replays, NVLink CRC/replay/recovery, InfiniBand.

Each finding compares a source's two latest reads (``Snapshot.pair``: the source's own
interval, so a source read every 10 s reports its increase for as long as that pair is the
latest). Counter arithmetic (wraps, resets) is :mod:`nodescope.model.counters`'.

* ``pcie_aer_errors`` — ``aer_dev_{correctable,nonfatal,fatal}`` ``TOTAL_ERR_*`` of a PCI
  function increased (``docs/datasources.md`` §2.2; a sum of the named counters where the
  total line is absent). Fatal: critical; non-fatal: warning; correctable: info, and only
  above ``[detectors.errors] aer_correctable_per_second``.
* ``gpu_pcie_replays`` — NVML's PCIe replay counter at or above ``pcie_replays_per_second``
  (§1.5): the link retransmits TLPs, a signal-integrity fault that costs bandwidth.
* ``nvlink_errors`` — per GPU link, NVML's DL CRC-flit, CRC-data or replay counter at or
  above ``nvlink_errors_per_second``, or any recovery (§1.3).
* ``ib_port_errors`` — ``symbol_error`` at or above ``ib_symbol_errors_per_second``, or any
  ``link_downed`` (§7; the counters are 16 and 8 bits wide and saturate).
* ``ib_xmit_wait`` — ``port_xmit_wait`` ticks per second at or above
  ``ib_xmit_wait_per_second``: data queued that credits or arbitration kept from leaving.

These findings hold while the increase is the latest one seen; an alert rule with
``for_seconds = 0`` turns them into alerts at once.

NVML's link error and replay counters and InfiniBand's error counters are read only every
``slow_every`` runs of their sources and carried in between: their change is taken between
the two latest reads of them, over the span between those reads (``nvml.slow_pair``,
``InfinibandRates.slow_seconds``), so an error rate that persists shows on every cycle at
its average over that span, not ten times higher on one cycle in ten.
"""

from __future__ import annotations

from nodescope.config import Config
from nodescope.detectors.common import tcp_evidence, tcp_text
from nodescope.model.counters import counter_delta
from nodescope.model.finding import Finding, Severity
from nodescope.model.infiniband import InfinibandRates, PortRates
from nodescope.model.nvml import NVML, NvmlData, slow_pair
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, AerRecord, Topology

AER = "pcie_aer_errors"
REPLAYS = "gpu_pcie_replays"
NVLINK = "nvlink_errors"
IB_ERRORS = "ib_port_errors"
IB_XMIT_WAIT = "ib_xmit_wait"

_AER_SEVERITY = {
    "fatal": Severity.CRITICAL,
    "nonfatal": Severity.WARNING,
    "correctable": Severity.INFO,
}

#: NVML NVLink DL counters that count errors at a rate, and the one that counts events.
NVLINK_RATE_COUNTERS = ("crc_flit", "crc_data", "replay")
NVLINK_EVENT_COUNTERS = ("recovery",)


def _aer_total(record: AerRecord) -> int:
    return record.total if record.total is not None else sum(c.value for c in record.counters)


def aer_findings(
    previous: Topology,
    current: Topology,
    seconds: float,
    correctable_per_second: float,
    extra_evidence: dict[str, float] | None = None,
) -> list[Finding]:
    findings: list[Finding] = []
    extra = extra_evidence or {}
    for dev in current.devices:
        old = previous.get(dev.bdf)
        if old is None or not dev.aer:
            continue
        before = {r.severity: r for r in old.aer}
        for record in dev.aer:
            prior = before.get(record.severity)
            if prior is None:
                continue
            delta = counter_delta(_aer_total(prior), _aer_total(record), 64)
            if not delta:
                continue
            rate = delta / seconds
            if record.severity == "correctable" and rate < correctable_per_second:
                continue
            moved = {
                c.name: c.value - p.value
                for c in record.counters
                for p in prior.counters
                if p.name == c.name and c.value > p.value
            }
            evidence = {"errors": float(delta), "errors_per_second": rate, **extra}
            evidence.update({f"{name}_errors": float(n) for name, n in moved.items()})
            types = ", ".join(f"{name} +{n}" for name, n in sorted(moved.items()))
            findings.append(
                Finding(
                    AER,
                    _AER_SEVERITY.get(record.severity, Severity.WARNING),
                    {"device": dev.bdf, "severity": record.severity},
                    evidence,
                    f"{delta} {record.severity} AER error(s) on {dev.device_class.value}"
                    f" {dev.bdf}"
                    + (f" ({', '.join(dev.os_names)})" if dev.os_names else "")
                    + f" in {seconds:.0f} s"
                    + (f": {types}" if types else "")
                    + (f"; root port {dev.root_port}" if dev.root_port else "")
                    + tcp_text(extra),
                )
            )
    return findings


def nvml_findings(
    previous: NvmlData,
    current: NvmlData,
    seconds: float,
    replays_per_second: float,
    nvlink_per_second: float,
    extra_evidence: dict[str, float] | None = None,
) -> list[Finding]:
    findings: list[Finding] = []
    extra = extra_evidence or {}
    before = {g.uuid: g for g in previous.gpus}
    for gpu in current.gpus:
        old = before.get(gpu.uuid)
        if old is None:
            continue
        if gpu.pcie_replays is not None and old.pcie_replays is not None:
            delta = counter_delta(old.pcie_replays, gpu.pcie_replays, 32)
            if delta and delta / seconds >= replays_per_second:
                findings.append(
                    Finding(
                        REPLAYS,
                        Severity.WARNING,
                        {"gpu": str(gpu.index), "device": gpu.pci_address},
                        {"replays": float(delta), "replays_per_second": delta / seconds, **extra},
                        f"GPU {gpu.index} ({gpu.pci_address}) PCIe link replayed {delta} TLP(s)"
                        f" in {seconds:.0f} s ({delta / seconds:.2f}/s, threshold"
                        f" {replays_per_second:g}/s){tcp_text(extra)}",
                    )
                )
        links, links_before = gpu.nvlinks, old.nvlinks
        if links.link == links_before.link and links.errors == links_before.errors:
            continue  # no counter of any link moved: the usual case
        errors_before = dict(zip(links_before.link, links_before.errors, strict=True))
        for i, (number, errors) in enumerate(zip(links.link, links.errors, strict=True)):
            counted = errors_before.get(number)
            if counted is None or counted == errors:
                continue  # unknown before, or no counter moved: the usual case
            prior = dict(counted)
            moved: dict[str, int] = {}
            for name, value in errors:
                if name in prior:
                    delta = counter_delta(prior[name], value, 64)
                    if delta:
                        moved[name] = delta
            bad = {
                n: d
                for n, d in moved.items()
                if (n in NVLINK_RATE_COUNTERS and d / seconds >= nvlink_per_second)
                or n in NVLINK_EVENT_COUNTERS
            }
            if not bad:
                continue
            evidence = {f"{n}_errors_per_second": d / seconds for n, d in moved.items()}
            evidence.update({f"{n}_errors": float(d) for n, d in moved.items()})
            findings.append(
                Finding(
                    NVLINK,
                    Severity.WARNING,
                    {"gpu": str(gpu.index), "nvlink": str(number)},
                    evidence,
                    f"GPU {gpu.index} ({gpu.pci_address}) NVLink {number}"
                    + (f" to {remote}" if (remote := links.remote_pci_address[i]) else "")
                    + ": "
                    + ", ".join(f"{n} +{d} ({d / seconds:.2f}/s)" for n, d in sorted(bad.items()))
                    + f" in {seconds:.0f} s",
                )
            )
    return findings


def _counter_rate(port: PortRates, name: str) -> float | None:
    for counter in port.counters:
        if counter.name == name:
            return counter.per_second
    return None


def ib_findings(
    rates: InfinibandRates, symbol_errors_per_second: float, xmit_wait_per_second: float
) -> list[Finding]:
    findings: list[Finding] = []
    # The error counters' rates are over the span between the source's two full reads.
    seconds = rates.seconds if rates.slow_seconds is None else rates.slow_seconds
    for port in rates.ports:
        subjects = {"hca": port.device, "port": str(port.port)}
        where = f"{port.device} port {port.port}"
        symbol = _counter_rate(port, "symbol_error")
        downed = _counter_rate(port, "link_downed")
        problems: list[str] = []
        evidence: dict[str, float] = {}
        if symbol is not None:
            evidence["symbol_errors_per_second"] = symbol
            if symbol > 0 and symbol >= symbol_errors_per_second:
                problems.append(f"{symbol:.2f} symbol errors/s")
        if downed is not None:
            evidence["link_downed_per_second"] = downed
            if downed > 0:
                problems.append(f"link went down {downed * seconds:.0f} time(s)")
        if problems:
            severity = Severity.WARNING
            findings.append(
                Finding(
                    IB_ERRORS,
                    severity,
                    subjects,
                    evidence,
                    f"{where}: {', '.join(problems)} in {seconds:.0f} s",
                )
            )
        wait = port.xmit_wait_per_second
        if wait is not None and wait > 0 and wait >= xmit_wait_per_second:
            evidence = {"xmit_wait_per_second": wait}
            if port.xmit_bytes_per_second is not None:
                evidence["xmit_bytes_per_second"] = port.xmit_bytes_per_second
            findings.append(
                Finding(
                    IB_XMIT_WAIT,
                    Severity.WARNING,
                    subjects,
                    evidence,
                    f"{where}: data waited to leave for {wait:.3g} ticks/s (threshold"
                    f" {xmit_wait_per_second:.3g}): credits or arbitration hold back transmit",
                )
            )
    return findings


def detect(previous: Snapshot | None, snapshot: Snapshot, config: Config) -> list[Finding]:
    settings = config.detectors
    if not settings.errors.enabled:
        return []
    findings: list[Finding] = []
    tcp = tcp_evidence(snapshot)
    pci = snapshot.pair(PCI)
    if pci is not None:
        before, now, seconds = pci
        threshold = settings.errors.aer_correctable_per_second
        # The pci source reads every 30 s: the same pair gives the same findings until then.
        findings += snapshot.derived.reuse(
            AER,
            (before, now),
            (seconds, threshold, tcp),
            lambda: aer_findings(before, now, seconds, threshold, extra_evidence=tcp),
        )
    nvml = snapshot.pair(NVML)
    # The counters these findings compare are read on the source's slow cadence: compare
    # the two latest reads of them, over the span between those reads.
    nvml_slow = None if nvml is None else slow_pair(*nvml)
    if nvml is not None and nvml_slow is not None:
        findings += nvml_findings(
            nvml_slow[0],
            nvml[1],
            nvml_slow[1],
            settings.errors.pcie_replays_per_second,
            settings.errors.nvlink_errors_per_second,
            extra_evidence=tcp,
        )
    ib = snapshot.derived.ib_rates
    if ib is not None:
        findings += ib_findings(
            ib,
            settings.errors.ib_symbol_errors_per_second,
            settings.errors.ib_xmit_wait_per_second,
        )
    return findings
