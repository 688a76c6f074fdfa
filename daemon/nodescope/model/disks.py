"""The records of the ``disks`` source: per-disk /proc/diskstats counters, the NVMe
namespace → PCI mapping, and the ``iostat -dxm`` figures of two samples.

``sources/diskstats.py`` reads them (``diskstats_show()`` in ``block/genhd.c``,
``Documentation/admin-guide/iostats.rst``). Sectors are always 512 bytes; the millisecond
fields wrap at 2^32 ms; field 9 (requests in flight) is a gauge. The ``iostat -dxm`` columns
follow sysstat 12.6 (``iostat.c`` ``write_ext_stat()``, ``rd_stats.c``
``compute_ext_disk_stats()``) formula for formula; see :func:`iostat_figures`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

from nodescope.model.counters import counter_delta
from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

# Devices the kernel makes of memory or files rather than storage hardware: every host has a
# handful (loop0-7, zram0, ram0-15), and one with snaps or images can have dozens of loops.
_VIRTUAL_NAME = re.compile(r"^(loop|ram|zram)\d+$")

#: Bytes per /proc/diskstats sector, whatever the device's logical block size.
SECTOR_BYTES = 512

#: Width of the millisecond fields (``unsigned int`` in ``diskstats_show()``).
MS_FIELD_BITS = 32
#: Width of the request and sector counts (``unsigned long`` / u64 on 64-bit kernels).
COUNT_FIELD_BITS = 64


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
    def virtual_kind(self) -> str | None:
        """``loop``, ``ram`` or ``zram`` for a virtual device, ``None`` for storage hardware."""
        match = _VIRTUAL_NAME.match(self.name)
        return match.group(1) if match else None

    @property
    def virtual(self) -> bool:
        """A loop, ram or zram device, not storage hardware."""
        return self.virtual_kind is not None

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


#: The ``disks`` source's records: the node's whole disks.
DISKS = SourceKey("disks", DisksData)
