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
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple

from nodescope.errors import ParseError
from nodescope.fileio import PROC_TABLE, SYSFS_ATTRIBUTE
from nodescope.model.counters import counter_delta
from nodescope.model.skips import NOTHING_SKIPPED, Skipped, SkipTally
from nodescope.roots import Roots
from nodescope.sources.base import read_optional, read_strip, read_text

SOURCE_NAME = "disks"

#: Bytes per /proc/diskstats sector, whatever the device's logical block size.
SECTOR_BYTES = 512

#: Width of the millisecond fields (``unsigned int`` in ``diskstats_show()``).
MS_FIELD_BITS = 32
#: Width of the request and sector counts (``unsigned long`` / u64 on 64-bit kernels).
COUNT_FIELD_BITS = 64

_NUMBER = re.compile(r"[0-9]+")
_BDF = re.compile(r"^[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
_NVME_DISK = re.compile(r"^nvme(\d+)n(\d+)$")
_NVME_CONTROLLER = re.compile(r"^nvme(\d+)$")
_NVME_SUBSYSTEM = re.compile(r"^nvme-subsys(\d+)$")
# Virtual devices that every host has a handful of (loop0-7, zram0, ram0-15) and that mostly
# never see I/O; see select_whole_disks.
_IDLE_VIRTUAL = re.compile(r"^(loop|ram|zram)\d+$")

# Reasons a record was skipped (nodescope_source_records_skipped_total{reason}).
#: a /proc/diskstats line with the wrong number of fields or a field that is not a number
SKIP_LINE_UNPARSABLE = "diskstats_line_unparsable"
#: /proc/uptime that does not read as two numbers: the since-boot figures go without it
SKIP_UPTIME_UNPARSABLE = "uptime_unparsable"


@dataclass(frozen=True, slots=True)
class DiskStat:
    """One line of /proc/diskstats, every field named (iostats.rst numbering in comments).

    Fields a kernel does not report are ``None``: discards arrived in 4.18, flushes in 5.5.
    """

    major: int
    minor: int
    name: str
    reads_completed: int  # 1
    reads_merged: int  # 2
    sectors_read: int  # 3
    read_ms: int  # 4
    writes_completed: int  # 5
    writes_merged: int  # 6
    sectors_written: int  # 7
    write_ms: int  # 8
    in_flight: int  # 9, a gauge
    io_ms: int  # 10, time the device had I/O in flight
    weighted_io_ms: int  # 11, sum of the time of every request
    discards_completed: int | None = None  # 12
    discards_merged: int | None = None  # 13
    sectors_discarded: int | None = None  # 14
    discard_ms: int | None = None  # 15
    flushes_completed: int | None = None  # 16
    flush_ms: int | None = None  # 17

    @property
    def bytes_read(self) -> int:
        return self.sectors_read * SECTOR_BYTES

    @property
    def bytes_written(self) -> int:
        return self.sectors_written * SECTOR_BYTES

    @property
    def bytes_discarded(self) -> int | None:
        return None if self.sectors_discarded is None else self.sectors_discarded * SECTOR_BYTES

    @property
    def idle_since_boot(self) -> bool:
        """No request of any kind completed since the device appeared."""
        return not (
            self.reads_completed
            or self.writes_completed
            or self.discards_completed
            or self.flushes_completed
        )


#: Names of the counter fields in file order (tokens 4 onwards).
COUNTER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(DiskStat))[3:]
_MS_FIELDS = frozenset({"read_ms", "write_ms", "io_ms", "weighted_io_ms", "discard_ms", "flush_ms"})


class Uptime(NamedTuple):
    """/proc/uptime: seconds since boot and idle seconds summed over CPUs."""

    seconds: float
    idle_seconds: float


@dataclass(frozen=True, slots=True)
class NvmePath:
    """One controller through which an NVMe namespace is reached."""

    controller: str  # "nvme3"
    transport: str | None  # "pcie", "tcp", "rdma", "fc", "loop"
    address: str | None  # the controller's ``address`` attribute as the kernel prints it
    pci_address: str | None  # the PCI function (BDF) of a PCIe controller


@dataclass(frozen=True, slots=True)
class NvmeNamespace:
    """An NVMe disk and the controller(s) behind it.

    ``subsystem`` is ``nvme-subsys<N>`` when native multipath owns the disk (then ``paths`` may
    hold several controllers), ``None`` when the disk hangs off one controller directly.
    """

    disk: str
    subsystem: str | None
    paths: tuple[NvmePath, ...]


@dataclass(frozen=True, slots=True)
class DisksData:
    """What the disks source read in one run: whole disks only (partitions repeat their disk's
    I/O), sorted by name, the NVMe mapping, and the uptime for since-boot figures."""

    disks: tuple[DiskStat, ...]
    nvme: tuple[NvmeNamespace, ...] = ()
    uptime_seconds: float | None = None
    #: lines of /proc/diskstats (and /proc/uptime) left out of this run as malformed
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)


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
        if s.name.replace("/", "!") in wanted
        and not (_IDLE_VIRTUAL.match(s.name) and s.idle_since_boot)
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


# ----------------------------------------------------------------------------------------------
# iostat -dxm figures (pure)


@dataclass(frozen=True, slots=True)
class IostatFigures:
    """The ``iostat -dxm`` columns of one disk over one interval.

    Units: ``*_s`` per second, ``*mb_s`` MB (2^20 bytes) per second, ``*_pct`` percent,
    ``*_await`` milliseconds, ``*areq_sz`` kB (2^10 bytes), ``aqu_sz`` requests. Discard and
    flush columns are ``None`` when the kernel does not report those fields (iostat prints 0).
    """

    device: str
    r_s: float
    rmb_s: float
    rrqm_s: float
    rrqm_pct: float
    r_await: float
    rareq_sz: float
    w_s: float
    wmb_s: float
    wrqm_s: float
    wrqm_pct: float
    w_await: float
    wareq_sz: float
    d_s: float | None
    dmb_s: float | None
    drqm_s: float | None
    drqm_pct: float | None
    d_await: float | None
    dareq_sz: float | None
    f_s: float | None
    f_await: float | None
    aqu_sz: float
    util_pct: float


@dataclass(frozen=True, slots=True)
class IostatReport:
    seconds: float
    devices: tuple[IostatFigures, ...]


#: ``iostat -dxm`` header → (IostatFigures attribute, key in ``iostat -o JSON``), in print order.
IOSTAT_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("r/s", "r_s", "r/s"),
    ("rMB/s", "rmb_s", "rMB/s"),
    ("rrqm/s", "rrqm_s", "rrqm/s"),
    ("%rrqm", "rrqm_pct", "rrqm"),
    ("r_await", "r_await", "r_await"),
    ("rareq-sz", "rareq_sz", "rareq-sz"),
    ("w/s", "w_s", "w/s"),
    ("wMB/s", "wmb_s", "wMB/s"),
    ("wrqm/s", "wrqm_s", "wrqm/s"),
    ("%wrqm", "wrqm_pct", "wrqm"),
    ("w_await", "w_await", "w_await"),
    ("wareq-sz", "wareq_sz", "wareq-sz"),
    ("d/s", "d_s", "d/s"),
    ("dMB/s", "dmb_s", "dMB/s"),
    ("drqm/s", "drqm_s", "drqm/s"),
    ("%drqm", "drqm_pct", "drqm"),
    ("d_await", "d_await", "d_await"),
    ("dareq-sz", "dareq_sz", "dareq-sz"),
    ("f/s", "f_s", "f/s"),
    ("f_await", "f_await", "f_await"),
    ("aqu-sz", "aqu_sz", "aqu-sz"),
    ("%util", "util_pct", "util"),
)


def _zero(stat: DiskStat) -> DiskStat:
    """``stat`` with every counter at zero (absent fields stay absent)."""
    zeros = {f: (None if getattr(stat, f) is None else 0) for f in COUNTER_FIELDS}
    return replace(stat, **zeros)  # type: ignore[arg-type]


def since_boot(cur: DisksData) -> DisksData:
    """An all-zero sample of the same disks: ``iostat_figures(since_boot(cur), cur, uptime)`` is
    iostat's first report, the averages since boot."""
    return replace(cur, disks=tuple(_zero(d) for d in cur.disks))


def _reinserted(p: DiskStat, c: DiskStat) -> bool:
    """sysstat's test for a device removed and plugged in again between two samples: fewer
    requests in total, and every sector count that was non-zero went down."""
    total_c = c.reads_completed + c.writes_completed + (c.discards_completed or 0)
    total_c += c.flushes_completed or 0
    total_p = p.reads_completed + p.writes_completed + (p.discards_completed or 0)
    total_p += p.flushes_completed or 0
    if total_c >= total_p:
        return False
    pairs = (
        (p.sectors_read, c.sectors_read),
        (p.sectors_written, c.sectors_written),
        (p.sectors_discarded or 0, c.sectors_discarded or 0),
    )
    return all(prev == 0 or cur < prev for prev, cur in pairs)


class _Deltas:
    """Increases between two samples of one disk, by field.

    Request and sector counts are 64-bit; the millisecond fields wrap at 2^32 and go through
    :func:`counter_delta` with 32 bits. A decrease that is not a wrap (a reset) counts as no
    increase, as sysstat clamps ``%util`` when ``io_ticks`` goes backwards.
    """

    def __init__(self, prev: DiskStat, cur: DiskStat) -> None:
        self.prev = prev
        self.cur = cur

    def __call__(self, field: str) -> int:
        p = getattr(self.prev, field)
        c = getattr(self.cur, field)
        if c is None:
            return 0
        if p is None:
            p = 0
        bits = MS_FIELD_BITS if field in _MS_FIELDS else COUNT_FIELD_BITS
        delta = counter_delta(p, c, bits)
        return 0 if delta is None else delta


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def disk_figures(prev: DiskStat, cur: DiskStat, seconds: float) -> IostatFigures:
    """iostat -dxm for one disk (sysstat 12.6 ``write_ext_stat``):

    ``r/s = Δreads/Δt``; ``rMB/s = Δsectors_read/Δt/2048``; ``rrqm/s = Δreads_merged/Δt``;
    ``%rrqm = Δmerged/(Δmerged+Δreads)*100``; ``r_await = Δread_ms/Δreads``;
    ``rareq-sz = Δsectors_read/Δreads/2`` (kB) — likewise for writes and discards;
    ``f/s = Δflushes/Δt``; ``f_await = Δflush_ms/Δflushes``;
    ``aqu-sz = Δweighted_io_ms/(Δt*1000)``; ``%util = Δio_ms/(Δt*1000)*100``.
    Ratios whose denominator is 0 are 0, as in sysstat.
    """
    if seconds <= 0:
        raise ValueError(f"interval must be positive, got {seconds}")
    if _reinserted(prev, cur):
        prev = _zero(cur)
    d = _Deltas(prev, cur)
    t = seconds

    reads, writes = d("reads_completed"), d("writes_completed")
    rmerged, wmerged = d("reads_merged"), d("writes_merged")
    rsect, wsect = d("sectors_read"), d("sectors_written")
    has_discards = cur.discards_completed is not None
    has_flushes = cur.flushes_completed is not None
    discards, dmerged, dsect = (
        d("discards_completed"),
        d("discards_merged"),
        d("sectors_discarded"),
    )
    flushes = d("flushes_completed")

    return IostatFigures(
        device=cur.name,
        r_s=reads / t,
        rmb_s=rsect / t / 2048,
        rrqm_s=rmerged / t,
        rrqm_pct=_ratio(rmerged * 100.0, rmerged + reads),
        r_await=_ratio(d("read_ms"), reads),
        rareq_sz=_ratio(rsect, reads) / 2,
        w_s=writes / t,
        wmb_s=wsect / t / 2048,
        wrqm_s=wmerged / t,
        wrqm_pct=_ratio(wmerged * 100.0, wmerged + writes),
        w_await=_ratio(d("write_ms"), writes),
        wareq_sz=_ratio(wsect, writes) / 2,
        d_s=discards / t if has_discards else None,
        dmb_s=dsect / t / 2048 if has_discards else None,
        drqm_s=dmerged / t if has_discards else None,
        drqm_pct=_ratio(dmerged * 100.0, dmerged + discards) if has_discards else None,
        d_await=_ratio(d("discard_ms"), discards) if has_discards else None,
        dareq_sz=_ratio(dsect, discards) / 2 if has_discards else None,
        f_s=flushes / t if has_flushes else None,
        f_await=_ratio(d("flush_ms"), flushes) if has_flushes else None,
        aqu_sz=d("weighted_io_ms") / (t * 1000),
        util_pct=d("io_ms") / (t * 1000) * 100,
    )


def iostat_figures(prev: DisksData, cur: DisksData, seconds: float) -> IostatReport:
    """The ``iostat -dxm`` figures of every whole disk present in both samples.

    A disk that appeared between the samples has no figures yet (sysstat would average its
    counters since boot over the interval).
    """
    previous = {d.name: d for d in prev.disks}
    out = [disk_figures(previous[c.name], c, seconds) for c in cur.disks if c.name in previous]
    return IostatReport(seconds=seconds, devices=tuple(out))
