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

The records and their rates are declared in :mod:`nodescope.model.nvlink_kmod`; this module
names them too, for the code that builds and tests the source.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from nodescope.fileio import FileKind, read_bytes
from nodescope.kmod_abi import ABI_MAJOR, SNAPSHOT_MAX, Device, parse_snapshot
from nodescope.model.nvlink_kmod import (
    NVLINK_KMOD,
    LinkRates,
    NvlcSnapshot,
    NvlinkKmodData,
    NvlinkKmodRates,
    interval_seconds,
    link_rates,
    snapshot_rates,
)
from nodescope.roots import Roots
from nodescope.sources.base import Source
from nodescope.sources.spec import SourceSpec

NAME = NVLINK_KMOD.name
DEVICE_NAME = "nvlink_stats"


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


SPEC = SourceSpec(
    name="nvlink_kmod",
    default_interval=1.0,
    help=(
        "NVLink counters, per-link maxima and per-device burst histograms from the"
        " nvlink_counter module"
    ),
    build=lambda inputs: make_source(),
    rates=lambda derived: derived.nvlink_rates,
    metric_area="nodescope_exporters.nvlink_metrics",
    sim_parts=frozenset({"nvlink_window"}),
)


__all__ = [
    "DEVICE_NAME",
    "NAME",
    "SNAPSHOT_FILE",
    "LinkRates",
    "NvlinkKmodData",
    "NvlinkKmodRates",
    "NvlinkKmodSource",
    "interval_seconds",
    "link_rates",
    "make_source",
    "read_snapshot_file",
    "snapshot_rates",
]
