"""The readable report of ``nodescope probe``: copy figures beside link capacity, the pair
matrices (rows send, columns receive, as CUDA's p2pBandwidthLatencyTest prints them), pair
asymmetry with the path of the slower direction, and the all-reduce in nccl-tests' columns with
its small-message latency."""

from __future__ import annotations

from collections.abc import Callable

from nodescope.model.probe import CopySeries, PeerCopy, ProbeReport
from nodescope.probe.sweep import format_sizes, human_bytes
from nodescope.probe.verdict import device_label, route


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _peer_bandwidth(peer: PeerCopy) -> str:
    return _gb(peer.bytes_per_second)


def _peer_latency(peer: PeerCopy) -> str:
    return f"{peer.latency_seconds * 1e6:.1f}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f}"


def _numa(a: int | None, b: int | None) -> str:
    return (
        "-" if a is None and b is None else f"{'-' if a is None else a}/{'-' if b is None else b}"
    )


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def render(report: ProbeReport) -> str:
    """The whole report as text, ending with the verdict."""
    prefix = "cpu" if report.stand_in else "GPU"
    what = "CPU stand-in (no GPU)" if report.stand_in else f"{len(report.devices)} GPU(s)"
    mode = "quick" if report.quick else "full"
    out = [
        f"nodescope probe: {report.backend}, {what}, {mode} run in"
        f" {report.duration_seconds:.1f} s, torch {report.torch_version}, {report.hostname}"
    ]
    if report.stand_in:
        out.append(f"NOTE: {report.note}")
    if report.sizes is not None and report.sizes.custom:
        out.append(f"sizes (--sizes): {format_sizes(report.sizes.copy)}")
    series: dict[tuple[int, str], CopySeries] = {(s.device, s.direction): s for s in report.copies}

    if report.copies:
        out += ["", "Host <-> device copy bandwidth, peak over sizes (GB/s; fraction of link)"]
        rows = []
        for d in report.devices:
            h2d, d2h = series.get((d.index, "h2d")), series.get((d.index, "d2h"))
            rows.append(
                [
                    device_label(d, d.index, report.stand_in),
                    d.link or "-",
                    _gb(d.capacity_bytes_per_second),
                    _gb(h2d.peak_bytes_per_second if h2d else None),
                    _fraction(h2d.fraction_of_capacity if h2d else None),
                    _gb(d2h.peak_bytes_per_second if d2h else None),
                    _fraction(d2h.fraction_of_capacity if d2h else None),
                ]
            )
        out += _grid(["device", "link", "capacity", "H2D", "frac", "D2H", "frac"], rows)

        sizes = sorted({p.size_bytes for s in report.copies for p in s.points})
        keys = sorted(series)
        header = ["size"] + [f"{prefix}{dev} {direction.upper()}" for dev, direction in keys]
        rows = []
        for size in sizes:
            row = [human_bytes(size)]
            for key in keys:
                point = next((p for p in series[key].points if p.size_bytes == size), None)
                row.append(_gb(point.bytes_per_second if point else None))
            rows.append(row)
        out += ["", "Copy bandwidth by size (GB/s)", *_grid(header, rows)]

    if report.peers:
        indices = [d.index for d in report.devices]
        peers = {(p.src, p.dst): p for p in report.peers}
        copy_size = human_bytes(report.peers[0].size_bytes)
        matrices: tuple[tuple[str, Callable[[PeerCopy], str]], ...] = (
            (f"Pair copy bandwidth, {copy_size} copies (GB/s; row sends, column receives)",
             _peer_bandwidth),
            ("Pair copy latency, small copies (us)", _peer_latency),
        )  # fmt: skip
        for title, fmt in matrices:
            rows = []
            for a in indices:
                row = [f"{prefix}{a}"]
                for b in indices:
                    peer = peers.get((a, b))
                    row.append("X" if a == b else fmt(peer) if peer else "-")
                rows.append(row)
            out += ["", title, *_grid(["", *[f"{prefix}{b}" for b in indices]], rows)]
        no_p2p = sorted({f"{prefix}{p.src}->{prefix}{p.dst}" for p in report.peers
                         if not p.peer_access})  # fmt: skip
        if no_p2p and not report.stand_in:
            out.append("no peer access (staged through host memory): " + ", ".join(no_p2p))

    if report.asymmetry:
        rows = [
            [
                f"{prefix}{a.a}<->{prefix}{a.b}",
                f"{a.bandwidth_asymmetry:.3f}",
                f"{a.latency_asymmetry:.3f}",
                a.slower,
                a.path or "-",
                _numa(a.numa_a, a.numa_b),
                "FLAG" if a.flagged else "",
            ]
            for a in report.asymmetry
        ]
        out += ["", "Pair asymmetry (|a->b - b->a| / mean; path as nvidia-smi topo -m names it)"]
        out += _grid(["pair", "bandwidth", "latency", "slower", "path", "NUMA a/b", ""], rows)
        out += [
            f"  {a.slower}: {how}"
            for a in report.asymmetry
            if a.flagged and (how := route(a, prefix))
        ]

    ar = report.allreduce
    if ar is not None:
        out += ["", f"All-reduce ({ar.backend}, {ar.ranks} ranks, {ar.dtype}, sum)"]
        rows = [
            [
                human_bytes(p.size_bytes),
                f"{p.seconds * 1e6:.1f}",
                _gb(p.algbw_bytes_per_second),
                _gb(p.busbw_bytes_per_second),
            ]
            for p in ar.points
        ]
        out += _grid(["size", "time(us)", "algbw(GB/s)", "busbw(GB/s)"], rows)
        out.append(f"Avg bus bandwidth: {_gb(ar.avg_busbw_bytes_per_second)} GB/s")
        floor = ar.latency_floor
        if floor is not None:
            out.append(
                f"Small-message latency: {_us(floor.median_seconds)} us median,"
                f" {_us(floor.p99_seconds)} us p99 ({human_bytes(floor.size_bytes)},"
                f" {floor.iterations} all-reduces)"
            )
            out += ["", "All-reduce latency, small messages (each timed alone, slowest rank; us)"]
            rows = [
                [
                    human_bytes(f.size_bytes),
                    str(f.iterations),
                    _us(f.min_seconds),
                    _us(f.median_seconds),
                    _us(f.p99_seconds),
                ]
                for f in ar.latency
            ]
            out += _grid(["size", "iters", "min", "median", "p99"], rows)

    if report.skipped:
        out += ["", *[f"skipped: {s}" for s in report.skipped]]
    out.append("")
    if report.passed:
        out.append("PASSED: every [probe] threshold held")
    else:
        out.append(f"FAILED: {len(report.failures)} threshold(s)")
        out += [f"  {f.message}" for f in report.failures]
    return "\n".join(out) + "\n"
