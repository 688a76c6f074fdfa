"""NVLink counters served by the ``nvlink_counter`` kernel module.

Reads ``<roots.dev>/nvlink_stats``: the module's character device when it is loaded (a fresh
snapshot with ``pread`` at offset 0), or a regular file in the same ABI — a captured snapshot
or the one the simulated node writes with :func:`nodescope.kmod_abi.write_snapshot`. The ABI
is ``kmod/include/uapi/linux/nvlink_counter.h`` (see :mod:`nodescope.kmod_abi`).

The source keeps the device open between runs on purpose: the module's window statistics
(per-sample maxima, histograms, samples over threshold) cover the time since this open
file's previous read, i.e. since the source's previous run. A daemon holding the device open
makes ``rmmod`` fail with EBUSY (the module cannot go away under a reader).

An open the module refuses — every file it allows is taken (EBUSY), a per-user limit or this
process's own (EMFILE), or the node's permissions (EACCES, EPERM) — raises
:class:`~nodescope.kmod_abi.DeviceRefused`, whose message says which: the source is down for
that run with that reason, holds nothing, and opens the device again on its next run. The
module keeps open files for root alone (``root_reserve``), so other users cannot keep the
daemon out: a refusal means the node's permissions or root's own readers holding every file.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from nodescope.fileio import FileKind, read_bytes
from nodescope.kmod_abi import (
    ABI_MAJOR,
    SNAPSHOT_MAX,
    UTIL_ONE,
    Device,
    NvlcSnapshot,
    parse_snapshot,
)
from nodescope.model.counters import counter_rate
from nodescope.roots import Roots
from nodescope.sources.base import Source

NAME = "nvlink_kmod"
DEVICE_NAME = "nvlink_stats"


@dataclass(frozen=True, slots=True)
class NvlinkKmodData:
    """What ``<dev>/nvlink_stats`` held: ``kind`` is ``device`` (the module), ``file`` (a
    snapshot file) or ``absent`` (then ``snapshot`` is None and NVLink figures come from NVML
    alone)."""

    path: str
    kind: str
    snapshot: NvlcSnapshot | None

    @property
    def serving(self) -> bool:
        return self.snapshot is not None and bool(self.snapshot.records)


#: A snapshot file (a capture, the simulated node's) holds at most what the device hands out.
SNAPSHOT_FILE = FileKind("nvlink_counter snapshot file", SNAPSHOT_MAX)


def read_snapshot_file(path: Path) -> NvlcSnapshot:
    """A snapshot file (capture or simulated node) in the module's ABI."""
    return parse_snapshot(read_bytes(path, SNAPSHOT_FILE), str(path))


class NvlinkKmodSource:
    name = NAME

    def __init__(self) -> None:
        self._device: Device | None = None
        self._ident: tuple[int, int] | None = None

    def collect(self, roots: Roots) -> NvlinkKmodData:
        path = roots.dev / DEVICE_NAME
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            self.close()
            return NvlinkKmodData(str(path), "absent", None)
        if not stat.S_ISCHR(st.st_mode):
            self.close()
            return NvlinkKmodData(str(path), "file", read_snapshot_file(path))
        ident = (st.st_rdev, st.st_ino)
        if self._device is None or self._ident != ident:
            self.close()
            device = Device(path)
            try:
                try:
                    version = device.version()
                except OSError as exc:
                    raise RuntimeError(
                        f"{path}: not the nvlink_counter module (GET_VERSION failed: "
                        f"{errno.errorcode.get(exc.errno or 0, exc.errno)})"
                    ) from exc
                if version.abi_version >> 16 != ABI_MAJOR:
                    raise RuntimeError(f"{path}: module ABI {version.abi_version:#x} unsupported")
            except BaseException:
                device.close()
                raise
            self._device, self._ident = device, ident
        try:
            data = self._device.read_bytes()
        except OSError:
            self.close()
            raise
        return NvlinkKmodData(str(path), "device", parse_snapshot(data, str(path)))

    def close(self) -> None:
        if self._device is not None:
            self._device.close()
        self._device = None
        self._ident = None


def make_source() -> Source:
    return NvlinkKmodSource()


# --------------------------------------------------------------------------------------------
# Rates


@dataclass(frozen=True, slots=True)
class LinkRates:
    """Figures of one link between two reads.

    Rates are averages over the interval; ``window_*`` figures are the module's per-sample
    statistics over the same interval (the kernel sampled every ``period_ns``). Utilisation is
    a fraction of the link's capacity per direction (the larger of TX and RX); stall rates are
    stall cycles per microsecond.
    """

    device: int
    link: int
    tx_bytes_per_second: float | None
    rx_bytes_per_second: float | None
    stall_cycles_per_microsecond: float | None
    replay_errors_per_second: float | None
    crc_errors_per_second: float | None
    utilisation: float | None
    window_samples: int
    window_max_utilisation: float
    window_max_stall_cycles_per_microsecond: int
    window_stall_over_threshold_ratio: float | None
    window_utilisation_over_threshold_ratio: float | None
    device_gone: bool


@dataclass(frozen=True, slots=True)
class NvlinkKmodRates:
    seconds: float
    samples_per_second: float | None
    missed_ticks: int
    links: tuple[LinkRates, ...]


def interval_seconds(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> float:
    """The time between two snapshots: the module's sample timestamps when they are usable
    (they date the counters exactly), else the reader's measured ``seconds``."""
    if cur.header.timestamp_ns > prev.header.timestamp_ns > 0:
        return (cur.header.timestamp_ns - prev.header.timestamp_ns) / 1e9
    return seconds


def snapshot_rates(prev: NvlcSnapshot, cur: NvlcSnapshot, seconds: float) -> NvlinkKmodRates:
    """Pure: per-link rates and window figures from two snapshots of one reader."""
    secs = interval_seconds(prev, cur, seconds)
    before = {(r.device, r.link): r for r in prev.records}
    links: list[LinkRates] = []
    for r in cur.records:
        p = before.get((r.device, r.link))
        if p is None:
            tx = rx = stall = replay = crc = None
        else:
            tx, rx, stall, replay, crc = (
                counter_rate(a, b, secs) for a, b in zip(p.counters, r.counters, strict=True)
            )
        util = None
        if tx is not None and rx is not None and r.capacity_bps > 0:
            util = max(tx, rx) / r.capacity_bps
        ws = r.window_samples
        links.append(
            LinkRates(
                device=r.device,
                link=r.link,
                tx_bytes_per_second=tx,
                rx_bytes_per_second=rx,
                stall_cycles_per_microsecond=None if stall is None else stall / 1e6,
                replay_errors_per_second=replay,
                crc_errors_per_second=crc,
                utilisation=util,
                window_samples=ws,
                window_max_utilisation=r.window_max_util / UTIL_ONE,
                window_max_stall_cycles_per_microsecond=r.window_max_stall,
                window_stall_over_threshold_ratio=r.window_over_stall / ws if ws else None,
                window_utilisation_over_threshold_ratio=r.window_over_util / ws if ws else None,
                device_gone=r.device_gone,
            )
        )
    samples = None
    if cur.header.sequence >= prev.header.sequence and secs > 0:
        samples = (cur.header.sequence - prev.header.sequence) / secs
    missed = max(0, cur.header.window_ticks - cur.header.window_samples)
    return NvlinkKmodRates(secs, samples, missed, tuple(links))


def link_rates(prev: NvlinkKmodData, cur: NvlinkKmodData, seconds: float) -> NvlinkKmodRates | None:
    """The deriver of this source (``derive.DERIVERS``). A snapshot file read twice before it
    was rewritten (same sequence and sample time) has no new samples: no rates, not zeros."""
    if prev.snapshot is None or cur.snapshot is None:
        return None
    p, c = prev.snapshot.header, cur.snapshot.header
    if c.timestamp_ns and (p.sequence, p.timestamp_ns) == (c.sequence, c.timestamp_ns):
        return None
    return snapshot_rates(prev.snapshot, cur.snapshot, seconds)
