"""Thresholds of ``[probe]`` to failures and an exit status, for the Slurm prolog gate.

Pure: a report and :class:`nodescope.config.ProbeSettings` in, failures out. A prolog's
non-zero exit drains the node, so each failure carries one line that Slurm shows as the
reason, naming the device, the figure and the limit. An asymmetric pair's line also names the
path its slower direction takes (``NV#``, PIX … SYS, :mod:`nodescope.model.paths`) and the
NUMA nodes at both ends, the usual explanation of a bias between the two directions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from nodescope.config import ProbeSettings
from nodescope.model.paths import describe
from nodescope.model.probe import (
    EXIT_FAILED,
    EXIT_PASSED,
    PairAsymmetry,
    PeerCopy,
    ProbeDevice,
    ProbeReport,
    ThresholdFailure,
)
from nodescope.probe.sweep import asymmetry


def gbps(value: float) -> str:
    return f"{value / 1e9:.1f} GB/s"


def device_label(device: ProbeDevice | None, index: int, stand_in: bool) -> str:
    """``GPU0 0000:17:00.0``, or ``cpu0`` for the CPU stand-in's buffers."""
    if stand_in:
        return f"cpu{index}"
    if device is None or device.pci_address is None:
        return f"GPU{index}"
    return f"GPU{index} {device.pci_address}"


def pair_asymmetries(
    peers: Iterable[PeerCopy],
    settings: ProbeSettings,
    stand_in: bool = False,
    devices: Iterable[ProbeDevice] = (),
) -> tuple[PairAsymmetry, ...]:
    """One record per unordered pair measured in both directions, flagged when either
    asymmetry reaches its ``max_*`` threshold, with the path of the slower direction and the
    NUMA nodes of ``devices``."""
    by_pair = {(p.src, p.dst): p for p in peers}
    numa = {d.index: d.numa_node for d in devices}
    prefix = "cpu" if stand_in else "GPU"
    out: list[PairAsymmetry] = []
    for (src, dst), forward in sorted(by_pair.items()):
        if src >= dst or (dst, src) not in by_pair:
            continue
        backward = by_pair[(dst, src)]
        bw = asymmetry(forward.bytes_per_second, backward.bytes_per_second)
        lat = asymmetry(forward.latency_seconds, backward.latency_seconds)
        # Slower means less bandwidth; for a pair equal in bandwidth, the higher latency.
        if forward.bytes_per_second != backward.bytes_per_second:
            slow = forward if forward.bytes_per_second < backward.bytes_per_second else backward
        else:
            slow = forward if forward.latency_seconds > backward.latency_seconds else backward
        out.append(
            PairAsymmetry(
                a=src,
                b=dst,
                bandwidth_asymmetry=bw,
                latency_asymmetry=lat,
                slower=f"{prefix}{slow.src}->{prefix}{slow.dst}",
                flagged=bw >= settings.max_bandwidth_asymmetry
                or lat >= settings.max_latency_asymmetry,
                # The two directions share one path; a report that recorded it for one
                # direction only still names it.
                path=slow.path or forward.path or backward.path,
                numa_a=numa.get(src),
                numa_b=numa.get(dst),
            )
        )
    return tuple(out)


def route(pair: PairAsymmetry, prefix: str = "GPU") -> str:
    """How the slower direction of ``pair`` goes: ``path SYS from NUMA node 1 to NUMA node 0,
    across the SMP interconnect between sockets``; empty when the path is unknown."""
    if pair.path is None:
        return ""
    backwards = pair.slower == f"{prefix}{pair.b}->{prefix}{pair.a}"
    src, dst = (pair.numa_b, pair.numa_a) if backwards else (pair.numa_a, pair.numa_b)
    where = ""
    if src is not None and dst is not None:
        where = f" within NUMA node {src}" if src == dst else f" from NUMA node {src} to {dst}"
    crosses = describe(pair.path)
    return f"path {pair.path}{where}" + (f", {crosses}" if crosses else "")


def evaluate(report: ProbeReport, settings: ProbeSettings) -> tuple[ThresholdFailure, ...]:
    """Every threshold the report does not meet, in report order."""
    devices = {d.index: d for d in report.devices}
    failures: list[ThresholdFailure] = []
    minimum_fraction = {"h2d": settings.min_h2d_fraction, "d2h": settings.min_d2h_fraction}
    minimum_rate = {
        "h2d": settings.min_h2d_bytes_per_second,
        "d2h": settings.min_d2h_bytes_per_second,
    }
    for series in report.copies:
        device = devices.get(series.device)
        subject = device_label(device, series.device, report.stand_in)
        name = series.direction.upper()
        limit = minimum_rate[series.direction]
        if limit > 0 and series.peak_bytes_per_second < limit:
            failures.append(
                ThresholdFailure(
                    check=f"min_{series.direction}_bytes_per_second",
                    subject=subject,
                    value=series.peak_bytes_per_second,
                    limit=limit,
                    message=f"{subject} {name} {gbps(series.peak_bytes_per_second)}"
                    f" is below the minimum {gbps(limit)}",
                )
            )
        limit = minimum_fraction[series.direction]
        fraction = series.fraction_of_capacity
        if limit > 0 and fraction is not None and fraction < limit:
            capacity = device.capacity_bytes_per_second if device else None
            link = f" {device.link}" if device and device.link else ""
            of = f" of its {gbps(capacity)}{link} link" if capacity else " of its link"
            failures.append(
                ThresholdFailure(
                    check=f"min_{series.direction}_fraction",
                    subject=subject,
                    value=fraction,
                    limit=limit,
                    message=f"{subject} {name} {gbps(series.peak_bytes_per_second)} is"
                    f" {fraction:.2f}{of}, below {limit:.2f}",
                )
            )
    prefix = "cpu" if report.stand_in else "GPU"
    # Two host buffers have no direction worth gating on: their copies differ by scheduling
    # noise alone, and a prolog must not drain a GPU-less node for it.
    for pair in () if report.stand_in else report.asymmetry:
        subject = f"{prefix}{pair.a}<->{prefix}{pair.b}"
        checks = (
            ("max_bandwidth_asymmetry", "bandwidth", pair.bandwidth_asymmetry,
             settings.max_bandwidth_asymmetry),
            ("max_latency_asymmetry", "latency", pair.latency_asymmetry,
             settings.max_latency_asymmetry),
        )  # fmt: skip
        how = route(pair, prefix)
        for check, what, value, limit in checks:
            if value >= limit:
                failures.append(
                    ThresholdFailure(
                        check=check,
                        subject=subject,
                        value=value,
                        limit=limit,
                        message=f"pair {subject}: {what} asymmetry {value:.2f} (slower"
                        f" {pair.slower}{', ' + how if how else ''}) reaches the maximum"
                        f" {limit:.2f}",
                    )
                )
    limit = settings.min_allreduce_busbw_bytes_per_second
    if limit > 0:
        ar = report.allreduce
        if ar is None:
            failures.append(
                ThresholdFailure(
                    check="min_allreduce_busbw_bytes_per_second",
                    subject="allreduce",
                    value=0.0,
                    limit=limit,
                    message=f"all-reduce not measured; a minimum busbw of {gbps(limit)} is set",
                )
            )
        elif ar.peak_busbw_bytes_per_second < limit:
            failures.append(
                ThresholdFailure(
                    check="min_allreduce_busbw_bytes_per_second",
                    subject="allreduce",
                    value=ar.peak_busbw_bytes_per_second,
                    limit=limit,
                    message=f"all-reduce busbw {gbps(ar.peak_busbw_bytes_per_second)} over"
                    f" {ar.ranks} ranks is below the minimum {gbps(limit)}",
                )
            )
    return tuple(failures)


STAND_IN_ASYMMETRY = "pair asymmetry thresholds: not applied to the CPU stand-in"


def judge(report: ProbeReport, settings: ProbeSettings) -> ProbeReport:
    """The report with its pair asymmetries and failures filled in from ``settings``."""
    skipped = report.skipped
    if report.stand_in and report.peers and STAND_IN_ASYMMETRY not in skipped:
        skipped = (*skipped, STAND_IN_ASYMMETRY)
    with_pairs = replace(
        report,
        asymmetry=pair_asymmetries(report.peers, settings, report.stand_in, report.devices),
        skipped=skipped,
    )
    return replace(with_pairs, failures=evaluate(with_pairs, settings))


def exit_status(report: ProbeReport) -> int:
    return EXIT_PASSED if report.passed else EXIT_FAILED


def reason(failures: Sequence[ThresholdFailure]) -> str:
    """One line for the prolog: the first failure, and how many more there are."""
    if not failures:
        return "passed"
    more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
    return f"{failures[0].message}{more}"
