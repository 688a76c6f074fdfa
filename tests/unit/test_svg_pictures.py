"""The SVG pictures read: value axes with round ticks, numbers and units on the job report's
timeline and the collective charts, checked by parsing the SVG, and each picture drawn by a
real renderer (librsvg's ``rsvg-convert``) to catch malformed output."""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodescope.collectives import analyze_files
from nodescope.collectives.render import render_svg as collectives_svg
from nodescope.svgaxis import TICK_CLASS, nice_ticks, si
from nodescope_exporters.reports import render_svg as report_svg
from nodescope_exporters.reports import series_unit, tick_duration, time_ticks
from tests.conftest import FIXTURES

SVG = "{http://www.w3.org/2000/svg}"
KINETO = sorted((FIXTURES / "torch-traces").glob("rank*.json"))
PREFIX = {"T": 1e12, "G": 1e9, "M": 1e6, "k": 1e3, "": 1.0, "m": 1e-3, "µ": 1e-6, "n": 1e-9}
LABEL = re.compile(r"^(-?[0-9.]+(?:e[+-]?\d+)?) ([TGMkmµn]?)(B/s|B|s)$")


def value_of(label: str) -> tuple[float, str]:
    """``"1.5 GB/s"`` as (1.5e9, "B/s"); fails the test on a label that is not one."""
    match = LABEL.match(label)
    assert match, f"tick label without a number and unit: {label!r}"
    return float(match.group(1)) * PREFIX[match.group(2)], match.group(3)


def tick_labels(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    return [t.text or "" for t in root.iter(f"{SVG}text") if t.get("class") == TICK_CLASS]


def axes(labels: list[str]) -> list[list[tuple[float, str]]]:
    """The tick labels grouped into axes: each axis counts up from 0."""
    groups: list[list[tuple[float, str]]] = []
    for label in labels:
        value = value_of(label)
        if value[0] == 0 or not groups:
            groups.append([value])
        else:
            groups[-1].append(value)
    return groups


def rendered(svg: str, tmp_path: Path, name: str) -> Path:
    """``svg`` drawn into a PNG by rsvg-convert; the PNG is checked to be a real picture."""
    tool = shutil.which("rsvg-convert")
    if tool is None:
        pytest.fail("rsvg-convert is not installed (scripts/test.sh installs librsvg2-bin)")
    source, png = tmp_path / f"{name}.svg", tmp_path / f"{name}.png"
    source.write_text(svg)
    proc = subprocess.run(
        [tool, "--format=png", "-o", str(png), str(source)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    root = ET.fromstring(svg)
    assert (width, height) == (int(root.get("width", 0)), int(root.get("height", 0)))
    assert distinct_pixels(data) > 20, "the picture is (nearly) one colour"
    return png


def distinct_pixels(png: bytes) -> int:
    """How many distinct byte values the image data holds: a blank page has very few."""
    at, idat = 8, b""
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind = png[at + 4 : at + 8]
        if kind == b"IDAT":
            idat += png[at + 8 : at + 8 + length]
        at += 12 + length
    return len(set(zlib.decompress(idat)))


# ---------------------------------------------------------------------------------------------
# The axis helpers


@given(st.floats(min_value=1e-12, max_value=1e15, allow_nan=False))
def test_ticks_are_round_and_cover_the_data(top: float) -> None:
    ticks = nice_ticks(top, 4)
    assert ticks[0] == 0 and ticks[-1] >= top * (1 - 1e-9)
    assert 2 <= len(ticks) <= 5
    step = ticks[1]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert any(math.isclose(mantissa, m) for m in (1.0, 2.0, 5.0, 10.0))
    # No tick is wasted: the one below the top is under the data.
    assert ticks[-2] < top


def test_ticks_of_nothing_are_zero_to_one() -> None:
    for top in (0.0, -3.0, math.nan, math.inf):
        assert nice_ticks(top) == [0.0, 0.2, 0.4, 0.6000000000000001, 0.8, 1.0]


def test_si_labels() -> None:
    assert si(0, "B") == "0 B"
    assert si(1.5e9, "B/s") == "1.5 GB/s"
    assert si(2e8, "B") == "200 MB"
    assert si(0.0002, "s") == "200 µs"
    assert si(0.25, "s") == "250 ms"
    assert si(5, "s") == "5 s"
    assert si(3e15, "B") == "3000 TB"
    assert si(0.5, "B/s") == "0.5 B/s"


def test_series_units_come_from_the_names() -> None:
    assert series_unit("gpu_pcie_bytes_per_second") == ("gpu pcie", "B/s")
    assert series_unit("memory_bytes") == ("memory", "B")
    assert series_unit("bytes") == ("bytes", "")


def test_time_ticks_are_round_durations() -> None:
    assert time_ticks(60.0) == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert time_ticks(3 * 3600.0)[1] == 1800.0
    assert len(time_ticks(40 * 86400.0)) <= 9
    assert [tick_duration(s) for s in (0, 15, 90, 300, 3600, 5400)] == [
        "0 s",
        "15 s",
        "1 min 30 s",
        "5 min",
        "1 h",
        "1 h 30 min",
    ]


# ---------------------------------------------------------------------------------------------
# The job report


def report_document() -> dict[str, Any]:
    pcie = [0.0, 4.2e9, 12.3e9, None, 7.0e9]
    memory = [1e9, 2.5e9, 31.7e9, 30e9, 29e9]
    return {
        "job_id": "42",
        "start": 1000.0,
        "end": 1600.0,
        "duration_seconds": 600.0,
        "timeline": {
            "t": [1000.0, 1150.0, 1300.0, 1450.0, 1600.0],
            "series": {"gpu_pcie_bytes_per_second": pcie, "memory_bytes": memory},
        },
        "findings": [
            {"kind": "job_cgroup_escape", "severity": "warning", "first": 1100.0, "last": 1200.0}
        ],
        "contention": [],
    }


def test_report_panels_have_value_axes_in_their_units(tmp_path: Path) -> None:
    svg = report_svg(report_document())
    labels = tick_labels(svg)
    value_ticks = [label for label in labels if not label.startswith("+")]
    pcie_axis, memory_axis = axes(value_ticks)  # panels in name order: gpu_pcie, memory
    assert {unit for _, unit in pcie_axis} == {"B/s"}
    assert {unit for _, unit in memory_axis} == {"B"}
    assert pcie_axis[-1][0] >= 12.3e9 and pcie_axis[-2][0] < 12.3e9
    assert memory_axis[-1][0] >= 31.7e9 and memory_axis[-2][0] < 31.7e9
    texts = [t.text or "" for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert "max 12.3 GB/s" in texts and "max 31.7 GB" in texts
    assert "gpu pcie (B/s)" in texts and "memory (B)" in texts
    # The time axis: round steps since the start over the job's ten minutes.
    time_labels = [label for label in labels if label.startswith("+")]
    assert time_labels[0] == "+0 s" and time_labels[-1] == "+10 min"
    rendered(svg, tmp_path, "report")


def test_report_lines_stay_inside_their_axes() -> None:
    root = ET.fromstring(report_svg(report_document()))
    panels = [
        r for r in root.iter(f"{SVG}rect") if r.get("fill") == "#f7f7f7"
    ]  # one framed plot per series
    lines = list(root.iter(f"{SVG}polyline"))
    assert len(panels) == len(lines) == 2
    for panel, line in zip(panels, lines, strict=True):
        top = float(panel.get("y", 0))
        bottom = top + float(panel.get("height", 0))
        ys = [float(p.split(",")[1]) for p in (line.get("points") or "").split()]
        assert all(top <= y <= bottom for y in ys)


def test_an_empty_report_still_draws(tmp_path: Path) -> None:
    svg = report_svg({"job_id": "7", "start": 5.0, "end": 5.0})
    assert tick_labels(svg) == ["+0 s"]
    rendered(svg, tmp_path, "empty-report")


# ---------------------------------------------------------------------------------------------
# The collective charts


def test_collective_charts_have_byte_and_time_axes(tmp_path: Path) -> None:
    analysis = analyze_files(KINETO)
    svg = collectives_svg(analysis)
    groups = axes(tick_labels(svg))
    assert len(groups) == 2 * len(analysis.kinds)
    for kind, bytes_axis, wait_axis in zip(analysis.kinds, groups[0::2], groups[1::2], strict=True):
        assert {unit for _, unit in bytes_axis} == {"B"}
        assert {unit for _, unit in wait_axis} == {"s"}
        most_bytes = max(max(r.send_bytes or 0, r.recv_bytes or 0) for r in kind.ranks)
        most_wait = max(r.wait_ns for r in kind.ranks) / 1e9
        assert bytes_axis[-1][0] >= most_bytes * (1 - 1e-9)
        assert wait_axis[-1][0] >= most_wait * (1 - 1e-9)
        # Round, not padded: the tick below the top is under the largest bar.
        assert bytes_axis[-2][0] < most_bytes and wait_axis[-2][0] < most_wait
    png = rendered(svg, tmp_path, "collectives")
    assert png.stat().st_size > 5000


def test_one_rank_of_four_says_which_are_missing(tmp_path: Path) -> None:
    svg = collectives_svg(analyze_files(KINETO[:1]))
    texts = [t.text or "" for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert any("collectives of 1 rank of world size 4" in t for t in texts)
    assert any("3 of 4 ranks have no trace: 1-3" in t for t in texts)
    rendered(svg, tmp_path, "one-rank")


def test_a_report_with_values_that_are_not_numbers_draws_gaps(tmp_path: Path) -> None:
    document = report_document()
    document["timeline"]["series"]["memory_bytes"] = [1e9, "x", None, float("nan"), True]
    document["timeline"]["series"]["gpu_pcie_bytes_per_second"] = "not a list"
    svg = report_svg(document)
    memory_axis = axes([label for label in tick_labels(svg) if not label.startswith("+")])[-1]
    assert memory_axis[-1] == (1e9, "B")
    # The empty series gets the axis 0..1 in its unit.
    assert "0.5 B/s" in tick_labels(svg)
    rendered(svg, tmp_path, "hostile-report")
