"""Metrics of the last bandwidth probe (``nodescope.sources.probe_report``, source ``probe``).

The figures are those of the report (:mod:`nodescope.model.probe`): peak copy bandwidth per
GPU and direction over the size sweep, its fraction of the link capacity, the GPU pair
matrix, pair asymmetry and the local all-reduce as nccl-tests reports it. They are as old as
``nodescope_probe_last_run_timestamp_seconds`` says: a probe runs on request (the prolog, an
operator), not every scrape. ``gpu`` is the CUDA index in PCI bus order, the NVML index of
``nodescope_gpu_info``; on the CPU stand-in (``stand_in="true"`` on the info metric) it
numbers host buffers.
"""

from __future__ import annotations

from collections.abc import Iterator

from nodescope.model.probe import PROBE, ProbeReport
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "probe"

INFO = metric(
    "nodescope_probe_info",
    "info",
    "the last probe: backend (cuda, or cpu for the stand-in without a GPU), whether it was the"
    " stand-in, quick or full, torch version; value 1",
    ("backend", "stand_in", "mode", "torch_version"),
    area=AREA,
)
LAST_RUN = metric(
    "nodescope_probe_last_run_timestamp_seconds",
    "gauge",
    "UNIX time the last probe finished",
    area=AREA,
)
DURATION = metric(
    "nodescope_probe_duration_seconds",
    "gauge",
    "how long the last probe ran",
    area=AREA,
)
PASSED = metric(
    "nodescope_probe_passed",
    "gauge",
    "1 when the last probe met every [probe] threshold, 0 when it did not",
    area=AREA,
)
FAILURES = metric(
    "nodescope_probe_threshold_failures",
    "gauge",
    "[probe] thresholds the last probe did not meet, by check",
    ("check",),
    area=AREA,
)
GPU_INFO = metric(
    "nodescope_probe_gpu_info",
    "info",
    "a device the last probe measured: its PCI address and the link it was compared with",
    ("gpu", "pci_address", "link"),
    area=AREA,
)
CAPACITY = metric(
    "nodescope_probe_link_capacity_bytes_per_second",
    "gauge",
    "capacity per direction of the narrowest link between the GPU and its root port, at"
    " maximum speed and width, after line encoding: what the copy figures are compared with",
    ("gpu",),
    area=AREA,
)
H2D = metric(
    "nodescope_probe_h2d_bytes_per_second",
    "gauge",
    "host-to-device copy bandwidth from pinned memory, peak over the size sweep",
    ("gpu",),
    area=AREA,
)
D2H = metric(
    "nodescope_probe_d2h_bytes_per_second",
    "gauge",
    "device-to-host copy bandwidth to pinned memory, peak over the size sweep",
    ("gpu",),
    area=AREA,
)
H2D_FRACTION = metric(
    "nodescope_probe_h2d_fraction_of_capacity",
    "gauge",
    "host-to-device peak over the link capacity (about 0.8 on a healthy Gen4/Gen5 x16 link)",
    ("gpu",),
    area=AREA,
)
D2H_FRACTION = metric(
    "nodescope_probe_d2h_fraction_of_capacity",
    "gauge",
    "device-to-host peak over the link capacity",
    ("gpu",),
    area=AREA,
)
PEER_BANDWIDTH = metric(
    "nodescope_probe_peer_bytes_per_second",
    "gauge",
    "copy bandwidth from GPU src to GPU dst (large copies)",
    ("src", "dst"),
    area=AREA,
)
PEER_LATENCY = metric(
    "nodescope_probe_peer_latency_seconds",
    "gauge",
    "mean time of a small copy from GPU src to GPU dst",
    ("src", "dst"),
    area=AREA,
)
ASYMMETRY = metric(
    "nodescope_probe_peer_asymmetry_ratio",
    "gauge",
    "|a->b - b->a| / mean of a GPU pair (a < b), for bandwidth and for latency",
    ("a", "b", "figure"),
    area=AREA,
)
ALLREDUCE_BUSBW = metric(
    "nodescope_probe_allreduce_busbw_bytes_per_second",
    "gauge",
    "local all-reduce bus bandwidth (nccl-tests busbw = algbw x 2(n-1)/n), peak over sizes",
    ("backend", "ranks"),
    area=AREA,
)
ALLREDUCE_ALGBW = metric(
    "nodescope_probe_allreduce_algbw_bytes_per_second",
    "gauge",
    "local all-reduce algorithm bandwidth (size / time) at the size of the peak busbw",
    ("backend", "ranks"),
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterator[Metric]:
    report = snapshot.latest(PROBE)
    if report is None:
        return
    yield from report_families(report)


def report_families(report: ProbeReport) -> Iterator[Metric]:
    info = INFO.family()
    info.add_metric(
        [
            report.backend,
            str(report.stand_in).lower(),
            "quick" if report.quick else "full",
            report.torch_version,
        ],
        1,
    )
    yield info
    for spec, value in (
        (LAST_RUN, report.finished),
        (DURATION, report.duration_seconds),
        (PASSED, 1.0 if report.passed else 0.0),
    ):
        family = spec.family()
        family.add_metric([], value)
        yield family
    failures = FAILURES.family()
    counts: dict[str, int] = {}
    for failure in report.failures:
        counts[failure.check] = counts.get(failure.check, 0) + 1
    for check, count in sorted(counts.items()):
        failures.add_metric([check], count)
    yield failures

    gpu_info, capacity = GPU_INFO.family(), CAPACITY.family()
    for device in report.devices:
        gpu_info.add_metric([str(device.index), device.pci_address or "", device.link or ""], 1)
        if device.capacity_bytes_per_second is not None:
            capacity.add_metric([str(device.index)], device.capacity_bytes_per_second)
    yield gpu_info
    yield capacity

    rate = {"h2d": H2D.family(), "d2h": D2H.family()}
    fraction = {"h2d": H2D_FRACTION.family(), "d2h": D2H_FRACTION.family()}
    for series in report.copies:
        rate[series.direction].add_metric([str(series.device)], series.peak_bytes_per_second)
        if series.fraction_of_capacity is not None:
            fraction[series.direction].add_metric([str(series.device)], series.fraction_of_capacity)
    yield from rate.values()
    yield from fraction.values()

    bandwidth, latency = PEER_BANDWIDTH.family(), PEER_LATENCY.family()
    for peer in report.peers:
        labels = [str(peer.src), str(peer.dst)]
        bandwidth.add_metric(labels, peer.bytes_per_second)
        latency.add_metric(labels, peer.latency_seconds)
    yield bandwidth
    yield latency
    asymmetry = ASYMMETRY.family()
    for pair in report.asymmetry:
        asymmetry.add_metric([str(pair.a), str(pair.b), "bandwidth"], pair.bandwidth_asymmetry)
        asymmetry.add_metric([str(pair.a), str(pair.b), "latency"], pair.latency_asymmetry)
    yield asymmetry

    ar = report.allreduce
    if ar is not None and ar.points:
        best = max(ar.points, key=lambda p: p.busbw_bytes_per_second)
        labels = [ar.backend, str(ar.ranks)]
        busbw, algbw = ALLREDUCE_BUSBW.family(), ALLREDUCE_ALGBW.family()
        busbw.add_metric(labels, ar.peak_busbw_bytes_per_second)
        algbw.add_metric(labels, best.algbw_bytes_per_second)
        yield busbw
        yield algbw
