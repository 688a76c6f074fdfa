"""Block I/O: per-disk counters, ``iostat -dxm`` figures and the NVMe namespace → PCI mapping.

Reads:

* ``/proc/diskstats`` — one line per block device: ``major minor name`` and 11, 15 or 17 counters
  (14, 18 or 20 tokens). Defined by ``diskstats_show()`` in the kernel's ``block/genhd.c`` and
  ``Documentation/admin-guide/iostats.rst``. Sectors are always 512 bytes (``SECTOR_SHIFT``);
  the millisecond fields are u64 nanoseconds cast to ``unsigned int``, so they wrap at 2^32 ms
  (about 49.7 days); field 9 (requests in flight) is a gauge, not a counter.
* ``/proc/uptime`` — seconds since boot: the interval of sysstat's "since boot" report.
* ``/sys/block`` — one entry per whole disk; partitions are not listed there, so a line of
  /proc/diskstats is a whole disk exactly when ``/sys/block/<name>`` exists (a ``/`` in a
  device name, e.g. ``cciss/c0d0``, is ``!`` in sysfs).
* NVMe (``drivers/nvme/host/core.c``, ``multipath.c``, ``pci.c``): without native multipath,
  ``/sys/block/nvme<c>n<n>/device`` is the controller ``nvme<c>`` whose ``device`` link is the PCI
  function. With native multipath the disk ``nvme<s>n<n>`` hangs off the virtual
  ``nvme-subsys<s>`` (the number is the subsystem's, not a controller's); its controllers are the
  ``nvme<c>`` entries of ``/sys/class/nvme-subsystem/nvme-subsys<s>``, each with an ``address``
  (the BDF for PCIe) and hidden per-path disks ``nvme<s>c<c>n<n>``.

The ``iostat -dxm`` columns follow sysstat 12.6 (``iostat.c`` ``write_ext_stat()``,
``rd_stats.c`` ``compute_ext_disk_stats()``) formula for formula; see :func:`iostat_figures`.
The records and the figures are declared in :mod:`nodescope.model.disks`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from nodescope.errors import ParseError
from nodescope.fileio import PROC_TABLE, SYSFS_ATTRIBUTE
from nodescope.model.disks import (
    COUNT_FIELD_BITS,
    COUNTER_FIELDS,
    DISKS,
    IOSTAT_COLUMNS,
    MS_FIELD_BITS,
    SECTOR_BYTES,
    DisksData,
    DiskStat,
    IostatFigures,
    IostatReport,
    NvmeNamespace,
    NvmePath,
    disk_figures,
    iostat_figures,
    since_boot,
)
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_optional, read_strip, read_text
from nodescope.sources.spec import SourceSpec

SOURCE_NAME = DISKS.name

_NUMBER = re.compile(r"[0-9]+")
_BDF = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_NVME_DISK = re.compile(r"^nvme(\d+)n(\d+)$")
_NVME_CONTROLLER = re.compile(r"^nvme(\d+)$")
_NVME_SUBSYSTEM = re.compile(r"^nvme-subsys(\d+)$")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a /proc/diskstats line with the wrong number of fields or a field that is not a number
SKIP_LINE_UNPARSABLE = "diskstats_line_unparsable"
#: /proc/uptime that does not read as two numbers: the since-boot figures go without it
SKIP_UPTIME_UNPARSABLE = "uptime_unparsable"


class Uptime(NamedTuple):
    """/proc/uptime: seconds since boot and idle seconds summed over CPUs."""

    seconds: float
    idle_seconds: float


# ----------------------------------------------------------------------------------------------
# Parsers (pure)


def _int_token(token: str, what: str, source: str, line: int) -> int:
    if not _NUMBER.fullmatch(token):
        raise ParseError(source, f"{what}: expected a non-negative integer, got {token!r}", line)
    # Every field is at most 64 bits; checking the length first also keeps int() away from
    # Python's limit on digits.
    if len(token) > 20 or int(token) >= 1 << COUNT_FIELD_BITS:
        raise ParseError(source, f"{what}: {token[:24]!r} does not fit in 64 bits", line)
    return int(token)


def parse_diskstat_line(raw: str, source: str = "/proc/diskstats", lineno: int = 1) -> DiskStat:
    """One line of /proc/diskstats; :class:`ParseError` naming the line when it is malformed.

    Accepts the 14-token (before 4.18), 18-token (discards, 4.18+) and 20-token (flushes, 5.5+)
    forms; more than 20 tokens is read as a 20-token line from a newer kernel.
    """
    tokens = raw.split()
    n = len(tokens)
    if n not in (14, 18) and n < 20:
        raise ParseError(source, f"expected 14, 18 or 20 fields, got {n}", lineno)
    major = _int_token(tokens[0], "major", source, lineno)
    minor = _int_token(tokens[1], "minor", source, lineno)
    name = tokens[2]
    count = 17 if n >= 20 else n - 3
    values = [
        _int_token(tok, COUNTER_FIELDS[i], source, lineno)
        for i, tok in enumerate(tokens[3 : 3 + count])
    ]
    kwargs = dict(zip(COUNTER_FIELDS, values, strict=False))
    return DiskStat(major, minor, name, **kwargs)


def parse_diskstats(
    text: str, source: str = "/proc/diskstats", tally: SkipTally | None = None
) -> tuple[DiskStat, ...]:
    """Every well-formed line of /proc/diskstats, in file order (see
    :func:`parse_diskstat_line`). Blank lines are passed over; a malformed line is left out
    and counted in ``tally``, so one odd line never hides the other disks."""
    records: list[DiskStat] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw or raw.isspace():
            continue
        try:
            records.append(parse_diskstat_line(raw, source, lineno))
        except ParseError as exc:
            if tally is not None:
                tally.skip(SKIP_LINE_UNPARSABLE, str(exc))
    return tuple(records)


def parse_uptime(text: str, source: str = "/proc/uptime") -> Uptime:
    """``<seconds since boot> <idle seconds>`` (``fs/proc/uptime.c``), both with two decimals."""
    tokens = text.split()
    if len(tokens) != 2:
        raise ParseError(source, f"expected 2 fields, got {len(tokens)}", 1)
    values: list[float] = []
    for token, what in zip(tokens, ("uptime", "idle time"), strict=True):
        if not re.fullmatch(r"[0-9]+(\.[0-9]+)?", token):
            raise ParseError(source, f"{what}: expected seconds, got {token!r}", 1)
        value = float(token)
        if not math.isfinite(value):
            raise ParseError(source, f"{what}: {token!r} is not a finite number", 1)
        values.append(value)
    return Uptime(values[0], values[1])


def select_whole_disks(
    stats: Iterable[DiskStat], block_entries: Collection[str]
) -> tuple[DiskStat, ...]:
    """The whole disks among ``stats``, sorted by name.

    ``block_entries`` is the listing of /sys/block. Loop, ram and zram devices that have never
    completed a request are left out: every host carries several (the kernel pre-creates
    loop0-7) and they would only add series of zeros; one that does I/O (a mounted image, zram
    swap) is kept from its first request on.
    """
    wanted = set(block_entries)
    chosen = [
        s
        for s in stats
        if s.name.replace("/", "!") in wanted and not (s.virtual and s.idle_since_boot)
    ]
    return tuple(sorted(chosen, key=lambda s: s.name))


# ----------------------------------------------------------------------------------------------
# NVMe mapping (IO, read rarely)


def _pci_function(path: Path) -> str | None:
    """The BDF ``path`` resolves to, when it is a PCI function."""
    name = Path(os.path.realpath(path)).name
    return name if _BDF.match(name) else None


def _controller_path(controller_dir: Path, name: str) -> NvmePath:
    address = read_strip(controller_dir / "address", SYSFS_ATTRIBUTE)
    transport = read_strip(controller_dir / "transport", SYSFS_ATTRIBUTE)
    pci = None
    if (controller_dir / "device").exists():
        pci = _pci_function(controller_dir / "device")
    if pci is None and address is not None and _BDF.match(address):
        pci = address
    return NvmePath(controller=name, transport=transport, address=address, pci_address=pci)


def _numbered(entries: Iterable[str], pattern: re.Pattern[str]) -> list[str]:
    """The entries matching ``pattern`` in the order of their number (nvme2 before nvme10)."""
    numbered: list[tuple[int, str]] = []
    for entry in entries:
        m = pattern.match(entry)
        if m is not None:
            numbered.append((int(m.group(1)), entry))
    return [entry for _, entry in sorted(numbered)]


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def read_nvme_namespace(roots: Roots, disk: str) -> NvmeNamespace | None:
    """The controller(s) behind NVMe disk ``disk``, or ``None`` when it is not an NVMe disk."""
    m = _NVME_DISK.match(disk)
    if m is None:
        return None
    link = roots.sysfs / "block" / disk / "device"
    if not link.exists():
        return None
    parent = Path(os.path.realpath(link))
    if _NVME_CONTROLLER.match(parent.name):
        return NvmeNamespace(disk, None, (_controller_path(parent, parent.name),))
    if not _NVME_SUBSYSTEM.match(parent.name):
        return None
    subsystem = parent.name
    class_dir = roots.sysfs / "class" / "nvme-subsystem" / subsystem
    base = class_dir if class_dir.is_dir() else parent
    controllers = _numbered(_listdir(base), _NVME_CONTROLLER)
    # Keep the controllers that carry this namespace: each has a hidden path disk
    # nvme<subsys>c<ctrl>n<ns>. Without any (an older kernel), every controller is a path.
    sub_no, ns_no = m.group(1), m.group(2)
    carrying = [
        c
        for c in controllers
        if (base / c / f"nvme{sub_no}c{c.removeprefix('nvme')}n{ns_no}").exists()
    ]
    chosen = carrying or controllers
    return NvmeNamespace(disk, subsystem, tuple(_controller_path(base / c, c) for c in chosen))


def read_nvme_map(roots: Roots, disks: Iterable[str]) -> tuple[NvmeNamespace, ...]:
    found = (read_nvme_namespace(roots, d) for d in disks)
    return tuple(ns for ns in found if ns is not None)


# ----------------------------------------------------------------------------------------------
# Reader and source


def read_block_entries(roots: Roots) -> frozenset[str]:
    return frozenset(_listdir(roots.sysfs / "block"))


def read_uptime(roots: Roots, tally: SkipTally | None = None) -> float | None:
    """Seconds since boot; ``None`` when /proc/uptime is absent or (counted) malformed: it
    only serves the since-boot figures, the disks are read without it."""
    path = roots.procfs / "uptime"
    text = read_optional(path, PROC_TABLE)
    if text is None:
        return None
    try:
        return parse_uptime(text, str(path)).seconds
    except ParseError as exc:
        if tally is not None:
            tally.skip(SKIP_UPTIME_UNPARSABLE, str(exc))
        return None


def read_disks(roots: Roots, nvme: tuple[NvmeNamespace, ...] | None = None) -> DisksData:
    """Read /proc/diskstats, /sys/block and /proc/uptime; map NVMe disks unless ``nvme`` (a
    mapping read earlier for the same disks) is given. Only a /proc/diskstats that cannot be
    read at all raises; malformed lines are skipped and counted in ``skipped``."""
    path = roots.procfs / "diskstats"
    tally = SkipTally()
    stats = parse_diskstats(read_text(path, PROC_TABLE), str(path), tally)
    whole = select_whole_disks(stats, read_block_entries(roots))
    if nvme is None:
        nvme = read_nvme_map(roots, (d.name for d in whole))
    uptime = read_uptime(roots, tally)
    return DisksData(disks=whole, nvme=nvme, uptime_seconds=uptime, skipped=tally.freeze())


class DisksSource:
    """The ``disks`` source. The NVMe mapping is read again only when the set of whole disks (or
    the roots) changes: a hot-plugged or removed drive changes the set, nothing else moves it."""

    name = SOURCE_NAME

    def __init__(self) -> None:
        self._key: tuple[Roots, frozenset[str]] | None = None
        self._nvme: tuple[NvmeNamespace, ...] = ()
        self.mapping_reads = 0

    def collect(self, roots: Roots) -> DisksData:
        data = read_disks(roots, nvme=())
        key = (roots, frozenset(d.name for d in data.disks))
        if key != self._key:
            self._nvme = read_nvme_map(roots, (d.name for d in data.disks))
            self._key = key
            self.mapping_reads += 1
        return replace(data, nvme=self._nvme)

    def close(self) -> None:
        self._key = None
        self._nvme = ()


def make_source() -> DisksSource:
    return DisksSource()


SPEC = SourceSpec(
    name="disks",
    default_interval=1.0,
    help="/proc/diskstats (iostat -dxm figures) and NVMe namespace to PCI mapping from /sys/block",
    build=lambda inputs: make_source(),
    rates=lambda derived: derived.disk_rates,
    metric_area="nodescope_exporters.disk_metrics",
    sim_parts=frozenset({"proc_files"}),
)


__all__ = [
    "COUNTER_FIELDS",
    "COUNT_FIELD_BITS",
    "IOSTAT_COLUMNS",
    "MS_FIELD_BITS",
    "SECTOR_BYTES",
    "SKIP_LINE_UNPARSABLE",
    "SKIP_UPTIME_UNPARSABLE",
    "SOURCE_NAME",
    "DiskStat",
    "DisksData",
    "DisksSource",
    "IostatFigures",
    "IostatReport",
    "NvmeNamespace",
    "NvmePath",
    "Uptime",
    "disk_figures",
    "iostat_figures",
    "make_source",
    "parse_diskstat_line",
    "parse_diskstats",
    "parse_uptime",
    "read_block_entries",
    "read_disks",
    "read_nvme_map",
    "read_nvme_namespace",
    "read_uptime",
    "select_whole_disks",
    "since_boot",
]
