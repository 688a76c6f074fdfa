"""The ABI of the ``nvlink_counter`` kernel module (``/dev/nvlink_stats``) for Python.

One source of truth: the module's uapi header ``kmod/include/uapi/linux/nvlink_counter.h``
(shipped in the package as ``nodescope/data/nvlink_counter.h``). Its declarations reach cffi
through :mod:`nodescope._nvlink_counter_cffi`, generated from the header by
:mod:`nodescope.kmod_abi_build` (out-of-line ABI mode, so no C parser is loaded at import; a
test fails when the generated module is stale); the ioctl numbers are computed from its
``_IO*`` macros with the kernel's ``_IOC`` encoding (``include/uapi/asm-generic/ioctl.h``). A
test compiles the same header with gcc and compares every size and offset with cffi's.

Parts:

* :func:`parse_snapshot` — pure: the bytes of one snapshot (a ``read()`` of the device, a
  captured file, the simulated node's file) to typed records. Steps by the sizes in the header,
  so tails added by newer modules are skipped. Bad input raises :class:`ParseError` only.
  The header is unpacked with a :class:`struct.Struct` whose format is derived from cffi's
  layout of the structs; the records are taken as columns (:class:`NvlcRecords`), each a
  strided slice of the bytes at the offsets cffi gives (a daemon reads 144 records every
  second; cffi field access per value costs ten times as much).
* :func:`encode_snapshot` / :func:`write_snapshot` — the same ABI written out (the simulated
  node's snapshot file; atomic rename).
* :class:`Device` — the character device: ``GET_VERSION``, a fresh snapshot with ``pread`` at
  offset 0, and the configuration ioctls (``CAP_SYS_ADMIN``), with cffi structs. An open the
  module or the node's permissions refuse raises :class:`DeviceRefused`, which says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import stat
import struct
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from nodescope._nvlink_counter_cffi import ffi
from nodescope.errors import ParseError

# Re-exported (the ``as`` names): the header's path and how it is read belong to the ABI's
# public face, and so do the records it decodes into, which the model declares so that
# readers of snapshots need not load these declarations.
from nodescope.kmod_abi_build import HEADER_PATH as HEADER_PATH
from nodescope.kmod_abi_build import IoctlDef as IoctlDef
from nodescope.kmod_abi_build import split_header as split_header
from nodescope.model import nvlink_kmod as records
from nodescope.model.nvlink_kmod import COUNTER_NAMES as COUNTER_NAMES
from nodescope.model.nvlink_kmod import SOURCE_NAMES as SOURCE_NAMES
from nodescope.model.nvlink_kmod import NvlcHeader as NvlcHeader
from nodescope.model.nvlink_kmod import NvlcRecord as NvlcRecord
from nodescope.model.nvlink_kmod import NvlcRecords as NvlcRecords
from nodescope.model.nvlink_kmod import NvlcSnapshot as NvlcSnapshot

_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_DIRS = {"": 0, "W": 1, "R": 2, "WR": 3}  # _IOC_NONE, _IOC_WRITE, _IOC_READ


def ioc(direction: int, type_: int, nr: int, size: int) -> int:
    """The kernel's ``_IOC(dir, type, nr, size)``."""
    if size >= 1 << _IOC_SIZEBITS:
        raise ValueError(f"ioctl argument of {size} bytes does not fit the size field")
    return (
        (direction << _IOC_DIRSHIFT)
        | (type_ << _IOC_TYPESHIFT)
        | (nr << _IOC_NRSHIFT)
        | (size << _IOC_SIZESHIFT)
    )


HEADER_TEXT = HEADER_PATH.read_text(encoding="utf-8")
CDEF, IOCTL_DEFS = split_header(HEADER_TEXT)
# Integer #defines are read through a library handle; libc is always there.
lib: Any = ffi.dlopen(None)

MAGIC: int = lib.NVLC_MAGIC
ABI_VERSION: int = lib.NVLC_ABI_VERSION
ABI_MAJOR: int = lib.NVLC_ABI_MAJOR
MAX_LINKS: int = lib.NVLC_MAX_LINKS
HIST_BUCKETS: int = lib.NVLC_HIST_BUCKETS
NUM_COUNTERS: int = lib.NVLC_NUM_COUNTERS
UTIL_ONE: int = lib.NVLC_UTIL_ONE
HEADER_SIZE: int = ffi.sizeof("struct nvlc_header")
RECORD_SIZE: int = ffi.sizeof("struct nvlc_record")
SNAPSHOT_MAX = HEADER_SIZE + MAX_LINKS * RECORD_SIZE


def _ioctl_number(d: IoctlDef) -> int:
    size = ffi.sizeof(f"struct {d.struct}") if d.struct else 0
    return ioc(_IOC_DIRS[d.direction], lib.NVLC_IOC_MAGIC, d.nr, size)


IOCTLS: dict[str, int] = {d.name: _ioctl_number(d) for d in IOCTL_DEFS}


def struct_fields(name: str) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every field of ``struct <name>`` as cffi lays it out."""
    return [(n, f.offset, ffi.sizeof(f.type)) for n, f in ffi.typeof(f"struct {name}").fields]


# --------------------------------------------------------------------------------------------
# Typed records: declared in nodescope.model.nvlink_kmod, decoded and encoded here


def _check_record_values() -> None:
    """The records state the ABI values they use as plain numbers, so that their readers
    need not load these declarations; each must be the header's, or records would be built
    with wrong sizes and read with wrong flags or units."""
    defines = {
        "NVLC_MAGIC": records.MAGIC,
        "NVLC_ABI_VERSION": records.ABI_VERSION,
        "NVLC_NUM_COUNTERS": records.NUM_COUNTERS,
        "NVLC_HIST_BUCKETS": records.HIST_BUCKETS,
        "NVLC_UTIL_ONE": records.UTIL_ONE,
        "NVLC_HDR_DEVICE_GONE": records.HDR_DEVICE_GONE,
        "NVLC_HDR_THRESHOLD_EVENT": records.HDR_THRESHOLD_EVENT,
        "NVLC_LINK_DEVICE_GONE": records.LINK_DEVICE_GONE,
        "NVLC_LINK_COUNTER_SHIFT": records.LINK_COUNTER_SHIFT,
        **{f"NVLC_COUNTER_{name.upper()}": i for i, name in enumerate(records.COUNTER_NAMES)},
        **{f"NVLC_SOURCE_{name.upper()}": n for n, name in records.SOURCE_NAMES.items()},
    }
    # (what, the model's value, the header's)
    pairs: list[tuple[str, int, object]] = [
        (name, value, getattr(lib, name, None)) for name, value in defines.items()
    ]
    pairs += [
        ("len(COUNTER_NAMES)", len(records.COUNTER_NAMES), NUM_COUNTERS),
        ("sizeof(struct nvlc_header)", records.HEADER_SIZE, HEADER_SIZE),
        ("sizeof(struct nvlc_record)", records.RECORD_SIZE, RECORD_SIZE),
    ]
    differ = [
        f"{what}: {model} (header: {header})" for what, model, header in pairs if model != header
    ]
    if differ:
        raise RuntimeError(f"nodescope.model.nvlink_kmod differs from the header: {differ}")


_check_record_values()


class _Codec:
    """One struct of the header as a :class:`struct.Struct` and the dataclass it becomes.

    The format is built from cffi's layout (``offsetof``/``sizeof`` of every field, which the
    gcc test checks against the C compiler): ``uint32_t`` is ``I``, ``uint64_t`` ``Q``,
    arrays repeat their item, ``reserved*`` fields and any padding are pad bytes (skipped when
    read, zero when written). Native byte order, as the module writes it; no implicit
    alignment, so the offsets are exactly cffi's.
    """

    def __init__(self, cls: type[Any], name: str) -> None:
        self.cls = cls
        self.name = name
        parts: list[str] = []
        #: (field name, number of values: 0 for a scalar), in C order, reserved ones left out.
        layout: list[tuple[str, int]] = []
        #: (offset in the struct, size) of each unpacked value, in the format's order.
        self.values: list[tuple[int, int]] = []
        position = 0
        for field_name, f in ffi.typeof(f"struct {name}").fields:
            if f.offset > position:
                parts.append(f"{f.offset - position}x")
            size = ffi.sizeof(f.type)
            position = f.offset + size
            if field_name.startswith("reserved"):
                parts.append(f"{size}x")
                continue
            item = f.type.item if f.type.kind == "array" else f.type
            item_size = ffi.sizeof(item)
            code = {4: "I", 8: "Q"}[item_size]
            count = f.type.length if f.type.kind == "array" else 0
            parts.append(f"{count}{code}" if count else code)
            layout.append((field_name, count))
            self.values += [(f.offset + k * item_size, item_size) for k in range(count or 1)]
        total = ffi.sizeof(f"struct {name}")
        if total > position:
            parts.append(f"{total - position}x")
        self.format = "=" + "".join(parts)
        self.struct = struct.Struct(self.format)
        if self.struct.size != total:
            raise RuntimeError(f"struct {name}: format {self.format} is not {total} bytes")
        names = [f.name for f in dataclasses.fields(cls)]
        c_names = {n for n, _ in layout}
        if set(names) != c_names:
            differ = set(names) ^ c_names
            raise RuntimeError(f"{cls.__name__} fields differ from struct {name}: {differ}")
        #: Where each dataclass field sits in the flat sequence of unpacked values: an index,
        #: or a slice for an array.
        self.items: dict[str, int | slice] = {}
        index = 0
        for field_name, count in layout:
            self.items[field_name] = slice(index, index + count) if count else index
            index += count or 1
        self.counts = dict(layout)
        self.order = [n for n, _ in layout]

    def unpack_from(self, data: bytes | memoryview, offset: int = 0) -> Any:
        values = self.struct.unpack_from(data, offset)
        return self.cls(**{n: values[i] for n, i in self.items.items()})

    def columns(self, data: bytes, start: int, count: int, size: int) -> list[tuple[int, ...]]:
        """Each value of ``count`` structs of ``size`` bytes from ``start`` (a larger size
        steps over a newer minor version's tail), as one column per value in the format's
        order: ``columns[v][i]`` is value ``v`` of struct ``i``.

        Where every struct's values fall on whole 4- and 8-byte words (a size and a start
        that are multiples of 8, as this ABI's are), a column is one strided slice of the
        bytes viewed as words, taken in C; otherwise each struct is unpacked and transposed.
        """
        if count == 0:
            return [() for _ in self.values]
        if start % 8 == 0 and size % 8 == 0:
            region = memoryview(data)[start : start + count * size]
            words = {4: region.cast("I"), 8: region.cast("Q")}
            return [
                tuple(words[item][offset // item :: size // item].tolist())
                for offset, item in self.values
            ]
        unpack = self.struct.unpack_from
        return list(zip(*(unpack(data, start + i * size) for i in range(count)), strict=True))

    def pack(self, record: Any) -> bytes:
        values: list[int] = []
        for name in self.order:
            value = getattr(record, name)
            count = self.counts[name]
            if count:
                if len(value) != count:
                    raise ValueError(f"{self.name}.{name} takes {count} values, not {len(value)}")
                values.extend(value)
            else:
                values.append(value)
        try:
            return self.struct.pack(*values)
        except struct.error as exc:
            raise OverflowError(f"struct {self.name}: {exc}") from None


_HEADER = _Codec(NvlcHeader, "nvlc_header")
_RECORD = _Codec(NvlcRecord, "nvlc_record")


# --------------------------------------------------------------------------------------------
# Parsing and writing


def parse_snapshot(data: bytes, source: str = "<snapshot>") -> NvlcSnapshot:
    """One snapshot in the module's ABI to typed records.

    ``source`` names the input in errors. Newer minor versions are read (their larger header
    and record sizes are stepped over); another major version, a wrong magic, sizes smaller
    than this ABI's or data shorter than the header says raise :class:`ParseError`.
    """
    if len(data) < HEADER_SIZE:
        raise ParseError(source, f"{len(data)} bytes, shorter than a header ({HEADER_SIZE})")
    header: NvlcHeader = _HEADER.unpack_from(data)
    if header.magic != MAGIC:
        raise ParseError(source, f"bad magic {header.magic:#010x}, expected {MAGIC:#010x}")
    if header.abi_version >> 16 != ABI_MAJOR:
        raise ParseError(source, f"ABI version {header.abi_version:#x}: major {ABI_MAJOR} only")
    if header.header_size < HEADER_SIZE:
        raise ParseError(source, f"header_size {header.header_size} < {HEADER_SIZE}")
    size = header.record_size
    if size < RECORD_SIZE:
        raise ParseError(source, f"record_size {size} < {RECORD_SIZE}")
    count = header.record_count
    start = header.header_size
    need = start + count * size
    if len(data) < need:
        raise ParseError(
            source,
            f"{len(data)} bytes, header says {count} records of "
            f"{size} after {header.header_size}: {need}",
        )
    columns = _RECORD.columns(data, start, count, size)

    def one(name: str) -> tuple[int, ...]:
        return columns[cast(int, _RECORD.items[name])]

    def each(name: str) -> tuple[tuple[int, ...], ...]:
        return tuple(columns[cast(slice, _RECORD.items[name])])

    records = NvlcRecords(
        device=one("device"),
        link=one("link"),
        flags=one("flags"),
        capacity_bps=one("capacity_bps"),
        counters=each("counters"),
        samples=one("samples"),
        window_samples=one("window_samples"),
        window_max_delta=each("window_max_delta"),
        window_max_util=one("window_max_util"),
        window_max_stall=one("window_max_stall"),
        window_over_stall=one("window_over_stall"),
        window_over_util=one("window_over_util"),
        window_util_hist=each("window_util_hist"),
        window_stall_hist=each("window_stall_hist"),
        util_hist=each("util_hist"),
        stall_hist=each("stall_hist"),
    )
    return NvlcSnapshot(header, records)


def encode_snapshot(header: NvlcHeader, records: Sequence[NvlcRecord]) -> bytes:
    """The bytes the module would return for ``header`` and ``records``.

    ``magic``, ``abi_version``, ``header_size``, ``record_size`` and ``record_count`` are set
    from this ABI and ``records``, whatever ``header`` holds.
    """
    header = dataclasses.replace(
        header,
        magic=MAGIC,
        abi_version=ABI_VERSION,
        header_size=HEADER_SIZE,
        record_size=RECORD_SIZE,
        record_count=len(records),
    )
    return b"".join([_HEADER.pack(header), *(_RECORD.pack(r) for r in records)])


def write_snapshot(
    path: str | os.PathLike[str], header: NvlcHeader, records: Sequence[NvlcRecord]
) -> None:
    """Publish a snapshot file atomically (temporary file in the same directory, rename)."""
    target = Path(path)
    data = encode_snapshot(header, records)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --------------------------------------------------------------------------------------------
# The device


@dataclass(frozen=True, slots=True)
class Version:
    abi_version: int
    header_size: int
    record_size: int
    max_links: int
    hist_buckets: int
    num_counters: int


@dataclass(frozen=True, slots=True)
class Params:
    """Sampling period (ns), stall threshold (cycles per µs), utilisation threshold (1/65536)."""

    period_ns: int
    stall_threshold: int
    util_threshold: int


@dataclass(frozen=True, slots=True)
class SimLink:
    """One synthetic link (``struct nvlc_sim_link``); ``rate`` per second per counter."""

    device: int
    link: int
    capacity_bps: int
    rate: tuple[int, int, int, int, int]
    burst_period_ns: int = 0
    burst_len_ns: int = 0
    burst_pct: int = 100


@dataclass(frozen=True, slots=True)
class MmioLink:
    device: int
    link: int
    capacity_bps: int


@dataclass(frozen=True, slots=True)
class MmioReg:
    """One counter register of the operator's map (``struct nvlc_mmio_reg``)."""

    domain: int
    bus: int
    devfn: int
    bar: int
    offset: int
    width: int
    counter: int
    device: int
    link: int


def _array(struct: str, items: Sequence[Any]) -> Any:
    arr = ffi.new(f"struct {struct}[]", max(1, len(items)))
    for i, item in enumerate(items):
        for f in dataclasses.fields(item):
            value = getattr(item, f.name)
            if isinstance(value, tuple):
                for j, v in enumerate(value):
                    getattr(arr[i], f.name)[j] = v
            else:
                setattr(arr[i], f.name, value)
    return arr


class DeviceRefused(OSError):
    """Opening the device was refused; ``errno`` is the kernel's and the message says what it
    means for this device. Nothing is wrong with the reader: the same open may succeed later."""


#: What a refused open of ``/dev/nvlink_stats`` means. EBUSY and EMFILE are the module's
#: limits on open files (docs/kmod.md); EMFILE is also this process's own RLIMIT_NOFILE.
OPEN_REFUSALS: dict[int, str] = {
    errno.EBUSY: "every open file the module allows is taken (max_open in all; other users "
    "than root get all but root_reserve of them)",
    errno.EMFILE: "too many open files: this user's limit in the module (max_open_per_user) "
    "or this process's RLIMIT_NOFILE",
    errno.ENFILE: "the system's table of open files is full",
    errno.EACCES: "permission denied by the device node's mode, owner or group",
    errno.EPERM: "not permitted (a device cgroup or systemd's DeviceAllow= denies it)",
}


def open_device_fd(path: str) -> int:
    """A read-only descriptor of the character device at ``path``.

    ``O_NONBLOCK`` so that a FIFO planted at the path cannot hold the caller in ``open`` (the
    module's own reads never block); anything that is not a character device is refused with
    ENODEV before it is read. Refusals of the open raise :class:`DeviceRefused`.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        reason = OPEN_REFUSALS.get(exc.errno or 0)
        if reason is None:
            raise
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise DeviceRefused(exc.errno, f"{path}: open refused ({name}): {reason}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISCHR(mode):
        os.close(fd)
        raise OSError(errno.ENODEV, f"{path}: not a character device")
    return fd


class Device:
    """An open ``/dev/nvlink_stats``. Window statistics belong to this open file."""

    def __init__(self, path: str | os.PathLike[str] = "/dev/nvlink_stats") -> None:
        self.path = str(path)
        self.fd = open_device_fd(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ioctl(self, name: str, arg: Any = None) -> None:
        """Issue ioctl ``name`` with a cffi struct pointer (or nothing); OSError on failure."""
        if arg is None:
            fcntl.ioctl(self.fd, IOCTLS[name], 0)
            return
        buf = ffi.buffer(arg)
        fcntl.ioctl(self.fd, IOCTLS[name], buf, True)

    def read_bytes(self) -> bytes:
        return os.pread(self.fd, SNAPSHOT_MAX, 0)

    def snapshot(self) -> NvlcSnapshot:
        return parse_snapshot(self.read_bytes(), self.path)

    def version(self) -> Version:
        v = ffi.new("struct nvlc_version *")
        self.ioctl("NVLC_IOC_GET_VERSION", v)
        return Version(
            v.abi_version, v.header_size, v.record_size, v.max_links, v.hist_buckets,
            v.num_counters,
        )  # fmt: skip

    def params(self) -> Params:
        p = ffi.new("struct nvlc_params *")
        self.ioctl("NVLC_IOC_GET_PARAMS", p)
        return Params(p.period_ns, p.stall_threshold, p.util_threshold)

    def set_params(self, params: Params) -> None:
        p = ffi.new("struct nvlc_params *")
        p.period_ns, p.stall_threshold, p.util_threshold = (
            params.period_ns,
            params.stall_threshold,
            params.util_threshold,
        )
        self.ioctl("NVLC_IOC_SET_PARAMS", p)

    def set_sim(self, links: Sequence[SimLink]) -> None:
        arr = _array("nvlc_sim_link", links)
        cfg = ffi.new("struct nvlc_sim_config *")
        cfg.nlinks = len(links)
        cfg.links = int(ffi.cast("uintptr_t", arr))
        self.ioctl("NVLC_IOC_SET_SIM", cfg)

    def set_mmio(self, links: Sequence[MmioLink], regs: Sequence[MmioReg]) -> None:
        link_arr = _array("nvlc_mmio_link", links)
        reg_arr = _array("nvlc_mmio_reg", regs)
        cfg = ffi.new("struct nvlc_mmio_config *")
        cfg.nlinks, cfg.nregs = len(links), len(regs)
        cfg.links = int(ffi.cast("uintptr_t", link_arr))
        cfg.regs = int(ffi.cast("uintptr_t", reg_arr))
        self.ioctl("NVLC_IOC_SET_MMIO", cfg)

    def clear_source(self) -> None:
        self.ioctl("NVLC_IOC_CLEAR_SOURCE")


def record_key(records: Iterable[NvlcRecord]) -> dict[tuple[int, int], NvlcRecord]:
    """Records by (device, link)."""
    return {(r.device, r.link): r for r in records}
