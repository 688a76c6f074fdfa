"""Value axes for the SVG pictures nodescope draws (the job report's timeline, the collective
charts): round tick values that cover the data, labelled with SI prefixes and the unit.

A tick step is 1, 2 or 5 times a power of ten, the steps a reader adds up without effort;
the top tick is at or above the largest value, so every bar and line lies inside the axis.
"""

from __future__ import annotations

import html
import math

#: SI prefixes from nano to tera; bytes never go below one, seconds often do.
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""), (1e-3, "m"))
_SMALL = ((1e-6, "µ"), (1e-9, "n"))

#: The CSS class of every tick label, so a reader of the SVG (or a test) finds them.
TICK_CLASS = "tick"


def nice_ticks(top: float, most: int = 5) -> list[float]:
    """Ticks from 0 to the first round value at or above ``top``, at most ``most`` + 1 of
    them. A ``top`` that is not a positive finite number gives the axis 0..1."""
    if not math.isfinite(top) or top <= 0:
        top = 1.0
    rough = top / max(1, most)
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1.0, 2.0, 5.0, 10.0) if m * power >= rough * (1 - 1e-9))
    count = math.ceil(top / step - 1e-9)
    return [i * step for i in range(count + 1)]


def si(value: float, unit: str) -> str:
    """``value`` with an SI prefix and ``unit``: ``1.5 GB/s``, ``200 ms``, ``0 B``. Bytes
    take no prefix below one (``0.5 B/s``)."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g} {unit}".rstrip()
    # No millibytes: a fraction of a byte is written as one.
    prefixes = _PREFIXES[:-1] if unit.startswith("B") else _PREFIXES + _SMALL
    size, prefix = next(((s, p) for s, p in prefixes if abs(value) >= s * (1 - 1e-9)), prefixes[-1])
    scaled = value / size
    text = f"{scaled:.3g}" if abs(scaled) < 1000 else f"{scaled:.0f}"
    return f"{text} {prefix}{unit}".rstrip()


def value_axis(
    ticks: list[float], unit: str, x: float, y: float, width: float, height: float
) -> list[str]:
    """SVG elements of a value axis on the left edge of the plot at (``x``, ``y``) sized
    ``width`` × ``height``: a grid line and a right-aligned label per tick, 0 at the bottom
    and ``ticks[-1]`` at the top."""
    top = ticks[-1] if ticks and ticks[-1] > 0 else 1.0
    out = [f'<line x1="{x}" y1="{y}" x2="{x}" y2="{y + height}" stroke="#333"/>']
    for tick in ticks:
        at = y + height - tick / top * height
        out.append(
            f'<line x1="{x - 4}" y1="{at:.1f}" x2="{x + width}" y2="{at:.1f}"'
            f' stroke="#ddd" stroke-width="0.5"/>'
        )
        out.append(
            f'<text class="{TICK_CLASS}" x="{x - 6}" y="{at + 4:.1f}" text-anchor="end"'
            f' font-size="10">{html.escape(si(tick, unit))}</text>'
        )
    return out


def scale(value: float, ticks: list[float], height: float) -> float:
    """The height a ``value`` takes on an axis of ``ticks`` drawn ``height`` high."""
    top = ticks[-1] if ticks and ticks[-1] > 0 else 1.0
    return max(0.0, min(value, top)) / top * height
