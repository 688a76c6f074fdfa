"""An :class:`Analysis` for people (text), for programs (a JSON document) and as a picture
(SVG written here, element by element: per kind, each rank's bytes and waits as bars)."""

from __future__ import annotations

import html
from typing import Any

from nodescope.collectives.model import Analysis, KindReport
from nodescope.jsonout import plain
from nodescope.svgaxis import nice_ticks, scale, value_axis

#: The ``format`` of the JSON document; a change that removes or renames a field bumps it.
DOCUMENT_FORMAT = "nodescope-collectives/1"


def to_document(analysis: Analysis) -> dict[str, Any]:
    document: dict[str, Any] = {"format": DOCUMENT_FORMAT}
    document.update(plain(analysis))
    document["summary"] = plain(analysis.summary())
    # Runs of ranks, [first, last] each: a large world with few ranks read stays short.
    document["missing_ranks"] = [list(run) for run in analysis.missing_ranks()]
    document["missing_rank_count"] = analysis.missing_count()
    return document


def missing_text(analysis: Analysis) -> str | None:
    """``3 of 4 ranks have no trace: 1-3``, None when every rank of the world was read (or
    the files do not say how many there are)."""
    count = analysis.missing_count()
    if not count or analysis.world_size is None:
        return None
    runs = analysis.missing_ranks()
    listed = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:20])
    more = f" and {len(runs) - 20} more runs" if len(runs) > 20 else ""
    verb = "has" if count == 1 else "have"
    return f"{count} of {analysis.world_size} ranks {verb} no trace: {listed}{more}"


def human_bytes(value: int | None) -> str:
    if value is None:
        return "?"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{value} B"  # not reached: the loop returns at TiB


def human_ns(value: int | None) -> str:
    if value is None:
        return "?"
    if value < 1_000_000:
        return f"{value / 1000:.1f} µs"
    if value < 1_000_000_000:
        return f"{value / 1_000_000:.1f} ms"
    return f"{value / 1_000_000_000:.2f} s"


def _skew(value: float | None) -> str:
    return "?" if value is None else f"{value:.4f}"


def render_text(analysis: Analysis) -> str:
    ranks = " ".join(str(r) for r in analysis.ranks) or "none"
    world = f" of world size {analysis.world_size}" if analysis.world_size is not None else ""
    lines = [
        f"{_count(len(analysis.files), 'file')}, {_count(len(analysis.ranks), 'rank')}"
        f" ({ranks}){world}"
    ]
    missing = missing_text(analysis)
    if missing:
        lines.append(f"missing: {missing}")
    for report in analysis.files:
        state = f"error: {report.error}" if report.error else f"{report.records} collective calls"
        extra = []
        if report.skipped:
            extra.append(f"{report.skipped} bad records skipped")
        if report.truncated:
            extra.append("truncated at the event cap")
        rank = "?" if report.rank is None else str(report.rank)
        suffix = f" ({'; '.join(extra)})" if extra else ""
        lines.append(f"  {report.path}: {report.format or 'unknown'}, rank {rank}, {state}{suffix}")
    if analysis.files_dropped:
        lines.append(f"  {analysis.files_dropped} more files not read (the file cap)")
    for kind in analysis.kinds:
        lines.append("")
        lines.extend(_kind_text(kind, missing))
    if not analysis.kinds:
        lines.append("no collectives found")
    return "\n".join(lines) + "\n"


def _kind_text(kind: KindReport, missing: str | None) -> list[str]:
    head = f"{kind.kind}: {_count(kind.collectives, 'collective')}"
    if kind.incomplete:
        head += f" ({kind.incomplete} not seen on every rank)"
    lines = [head]
    if kind.partial:
        listed = "; ".join(
            f"#{i.index} without rank{'s' if len(i.missing) > 1 else ''}"
            f" {', '.join(str(r) for r in i.missing)}"
            for i in kind.partial[-5:]
        )
        lines.append(f"  not recorded by every rank (latest last): {listed}")
    if kind.skew is not None or kind.max_instance_skew is not None:
        lines.append(
            f"  skew δ = std/mean of the bytes each rank sends: {_skew(kind.skew)}"
            f" (largest in one collective {_skew(kind.max_instance_skew)})"
        )
    if kind.destinations:
        parts = ", ".join(f"{d.rank}: {human_bytes(d.recv_bytes)}" for d in kind.destinations)
        lines.append(f"  received per destination rank: {parts}")
        lines.append(
            f"  hottest destination: rank {kind.hot_destination}"
            f" (δ over destinations {_skew(kind.destination_skew)})"
        )
    lines.append(
        f"  {'rank':>6} {'calls':>6} {'sent':>11} {'received':>11} {'busy':>10}"
        f" {'waited':>10} {'max wait':>10} {'last':>5}"
    )
    for r in kind.ranks:
        lines.append(
            f"  {r.rank:>6} {r.calls:>6} {human_bytes(r.send_bytes):>11}"
            f" {human_bytes(r.recv_bytes):>11} {human_ns(r.busy_ns):>10}"
            f" {human_ns(r.wait_ns):>10} {human_ns(r.max_wait_ns):>10} {r.last_count:>5}"
        )
    if kind.straggler is not None:
        figures = next(r for r in kind.ranks if r.rank == kind.straggler)
        worst = kind.worst
        where = f" (collective #{worst.index}, rank {worst.straggler} last)" if worst else ""
        lines.append(
            f"  straggler: rank {kind.straggler}, last to arrive in {figures.last_count} of"
            f" {kind.collectives}, the others waited {human_ns(figures.caused_ns)} for it"
            f" in all; longest wait {human_ns(kind.max_wait_ns)}{where}"
        )
        listed = ", ".join(
            f"#{i.index} rank {i.straggler} {human_ns(i.max_wait_ns)}" for i in kind.slowest[:5]
        )
        lines.append(f"  longest waits (collective, last rank, wait): {listed}")
    elif missing:
        # A rank without a trace may be the one the others waited for: no verdict.
        lines.append("  straggler: cannot be judged, not every rank's trace was read")
    else:
        lines.append("  straggler: none (every collective began on all ranks at once)")
    return lines


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


_SENT = "#4e79a7"
_RECEIVED = "#a0cbe8"
_WAIT = "#f28e2b"
_STRAGGLER = "#e15759"


def render_svg(analysis: Analysis, width: int = 900) -> str:
    """One panel per kind: on the left each rank's sent and received bytes, on the right the
    time it waited for others; the straggler's bar is red and the hottest destination named."""
    missing = missing_text(analysis)
    # A line under the title names the ranks without a trace, when some are.
    panel_height, top = 190, 58 if missing else 40
    height = top + max(1, len(analysis.kinds)) * (panel_height + 20) + 10
    half = (width - 60) // 2
    world = f" of world size {analysis.world_size}" if analysis.world_size is not None else ""
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}"'
        f' viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">collectives of'
        f" {_count(len(analysis.ranks), 'rank')}{world}</text>",
    ]
    if missing:
        out.append(
            f'<text x="10" y="42" fill="{_STRAGGLER}">missing: {html.escape(missing)};'
            " the straggler cannot be judged without them</text>"
        )
    if not analysis.kinds:
        out.append(f'<text x="10" y="{top + 20}">no collectives found</text>')
    y = top
    for kind in analysis.kinds:
        title = f"{kind.kind}: {_count(kind.collectives, 'collective')}"
        if kind.skew is not None:
            title += f", δ {kind.skew:.3f}"
        if kind.straggler is not None:
            title += f", straggler rank {kind.straggler} (max wait {human_ns(kind.max_wait_ns)})"
        out.append(f'<text x="10" y="{y + 14}" font-weight="bold">{html.escape(title)}</text>')
        chart_top, chart_height = y + 24, panel_height - 50
        out.extend(_bytes_chart(kind, 20, chart_top, half, chart_height))
        out.extend(_wait_chart(kind, 40 + half, chart_top, half, chart_height))
        y += panel_height + 20
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _frame(x: int, y: int, w: int, h: int, label: str) -> list[str]:
    return [
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="#f7f7f7" stroke="#ccc"/>',
        f'<text x="{x + 4}" y="{y + 12}" fill="#444">{html.escape(label)}</text>',
    ]


#: Room left of a chart for its value axis' labels, and above its bars for the title.
_AXIS, _TITLE, _LABELS = 58, 20, 16


def _bytes_chart(kind: KindReport, x: int, y: int, w: int, h: int) -> list[str]:
    out = _frame(x, y, w, h, "bytes sent (dark) and received (light) per rank")
    ranks = kind.ranks
    top = max([r.send_bytes or 0 for r in ranks] + [r.recv_bytes or 0 for r in ranks])
    ticks = nice_ticks(float(top), 4)
    plot_x, plot_w, plot_h = x + _AXIS, w - _AXIS - 5, h - _TITLE - _LABELS
    out.extend(value_axis(ticks, "B", plot_x, y + _TITLE, plot_w, plot_h))
    slot = plot_w / max(1, len(ranks))
    base = y + _TITLE + plot_h
    for i, r in enumerate(ranks):
        left = plot_x + i * slot
        bar = max(1.0, slot / 2 - 2)
        for j, (value, colour) in enumerate(((r.send_bytes, _SENT), (r.recv_bytes, _RECEIVED))):
            size = scale(float(value or 0), ticks, plot_h)
            out.append(
                f'<rect x="{left + 1 + j * (bar + 1):.1f}" y="{base - size:.1f}"'
                f' width="{bar:.1f}" height="{size:.1f}" fill="{colour}">'
                f"<title>rank {r.rank}: {human_bytes(value)}</title></rect>"
            )
        label = f"{r.rank}*" if r.rank == kind.hot_destination else str(r.rank)
        out.append(
            f'<text x="{left + slot / 2:.1f}" y="{y + h - 4}" text-anchor="middle">'
            f"{html.escape(label)}</text>"
        )
    return out


def _wait_chart(kind: KindReport, x: int, y: int, w: int, h: int) -> list[str]:
    out = _frame(x, y, w, h, "time each rank waited for the last one (red: the straggler)")
    ranks = kind.ranks
    # The axis is in seconds (with µ/m prefixes); the figures are nanoseconds.
    top = max([r.wait_ns for r in ranks] + [0]) / 1e9
    ticks = nice_ticks(top, 4)
    plot_x, plot_w, plot_h = x + _AXIS, w - _AXIS - 5, h - _TITLE - _LABELS
    out.extend(value_axis(ticks, "s", plot_x, y + _TITLE, plot_w, plot_h))
    slot = plot_w / max(1, len(ranks))
    base = y + _TITLE + plot_h
    for i, r in enumerate(ranks):
        left = plot_x + i * slot
        size = scale(r.wait_ns / 1e9, ticks, plot_h)
        out.append(
            f'<rect x="{left + 1:.1f}" y="{base - size:.1f}" width="{max(1.0, slot - 2):.1f}"'
            f' height="{size:.1f}" fill="{_WAIT}">'
            f"<title>rank {r.rank}: waited {human_ns(r.wait_ns)}</title></rect>"
        )
        middle = f'x="{left + slot / 2:.1f}" y="{y + h - 4}" text-anchor="middle"'
        if r.rank == kind.straggler:
            # The straggler barely waits: its bar is short, so its label carries the news.
            out.append(
                f'<text {middle} fill="{_STRAGGLER}" font-weight="bold">'
                f"{r.rank} last ×{r.last_count}</text>"
            )
        else:
            out.append(f"<text {middle}>{r.rank}</text>")
    return out
