"""NVSwitch SXids from the kernel log (``/dev/kmsg``).

The ``nvidia-nvswitch`` driver reports NVSwitch errors in the kernel log only. Its macro
``NVSWITCH_PRINT_SXID`` (open-gpu-kernel-modules
``src/common/nvswitch/kernel/inc/common_nvswitch.h``) prints::

    "nvidia-%s: SXid (PCI:" NVLINK_PCI_DEV_FMT "): %05d, " fmt

with the device's name (``nvswitch3``), its address as ``%04x:%02x:%02x.%x`` and the SXid
code; ``fmt`` is usually ``Fatal, Link %02d <what>`` or ``Non-fatal, Link %02d <what>``, and
some codes print neither word nor link (``26007, SOE EXTERR``). After an error's first line
the driver dumps its log entry with the same prefix (``_nvswitch_dump_error_entry``,
``error_nvswitch.c``): ``Severity %d Engine instance %02d Sub-engine instance %02d`` and
``Data {0x%08x, ...}`` lines. Those continue the error above them and are not counted.

``/dev/kmsg`` records are ``prio,seq,usec,flags;text`` followed by `` KEY=VALUE`` lines that
start with a space (``Documentation/ABI/testing/dev-kmsg``). ``prio`` is ``facility << 3 |
level``; the kernel gives every record written to ``/dev/kmsg`` from user space a non-zero
facility (``devkmsg_write``, ``kernel/printk/printk.c``: "to be able to reliably distinguish
kernel-generated messages from userspace-injected ones"), so an SXid record with a facility
is a forgery and is skipped. The kernel itself also writes text a user chose at facility 0
(the file name of a crashing binary in its ``segfault at`` report, a mount option in a file
system's error): an SXid is read only where the driver's exact line starts the message, at a
level the driver prints it at (:mod:`nodescope.sources.kernel_log`), and counted only for an
address that is an NVSwitch of this node in sysfs (:func:`is_nvswitch`; any other is skipped
as ``sxid_unknown_nvswitch``, so no invented address makes a series).
:func:`parse_kmsg_sxid` reads that form and plain ``dmesg`` or journal lines alike (tests,
captures, the simulated node's regular file).

The source reads what arrived since its last run, without blocking and about
:data:`MAX_READ_BYTES` per run at most (a flood of kernel messages waits for the next run instead of
stalling the cycle), and counts per (switch, code, link) at most :data:`MAX_KEYS` keys; an
SXid of a key past that bound is counted as dropped. The records are declared in
:mod:`nodescope.model.sxid`; docs/sxid.md describes the findings.
"""

from __future__ import annotations

import errno
import os
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from nodescope.model.skips import SkipTally
from nodescope.model.sxid import MESSAGE_CHARS, SXID, ProcessEnd, SxidCount, SxidData
from nodescope.roots import Roots
from nodescope.sources.kernel_log import (
    REFUSED_NOT_KERNEL,
    is_dictionary_line,
    printable,
    refusal,
    split_line,
)
from nodescope.sources.nvml import KmsgReader
from nodescope.sources.process_ends import parse_kmsg_process_ends
from nodescope.sources.spec import SourceSpec

NAME = SXID.name

#: Bytes read from the kernel log per run at most: about 7,000 records of a flood, a few
#: milliseconds of parsing; what is left is read on the next run.
MAX_READ_BYTES = 1 << 20
#: Bytes of one ``read``: a ``/dev/kmsg`` read returns one whole record and fails with
#: ``EINVAL`` on a buffer too small for it; the kernel's largest record
#: (``CONSOLE_EXT_LOG_MAX``, ``include/linux/printk.h``) is 8 KiB.
READ_CHUNK = 8192
#: A line longer than this is no kernel record: a partial line this long is dropped, and an
#: SXid line this long is skipped.
MAX_LINE_BYTES = 16384
#: (switch, code, link) keys counted at most: four NVSwitches of 64 ports with a few codes
#: each fit many times over, and a flood of distinct forged keys cannot grow memory.
MAX_KEYS = 2048
#: Process ends (``sources/process_ends.py``) kept, the latest: a departed rank is looked up
#: within minutes of its end, and a crash loop of many processes cannot grow memory.
MAX_ENDS = 256

#: What sysfs says of an NVSwitch: NVIDIA's vendor id and the bridge class ``0x0680``.
NVIDIA_VENDOR = b"0x10de"
NVSWITCH_CLASS = b"0x0680"

#: Skip reasons (``nodescope_source_records_skipped_total{source="sxid",reason}``).
SKIP_UNPARSABLE = "sxid_unparsable"
SKIP_NOT_KERNEL = "sxid_not_from_kernel"
SKIP_TOO_LONG = "sxid_line_too_long"
#: A kernel record at a level the driver never prints an SXid at (the kernel's segfault
#: report of a binary whose file name holds an SXid line, for one).
SKIP_LEVEL = "sxid_not_driver_level"
#: An SXid line in the driver's form for an address that is no NVSwitch of this node.
SKIP_UNKNOWN_NVSWITCH = "sxid_unknown_nvswitch"

#: The driver's line, anchored at the start of the message: ``nvidia-`` and the device's name,
#: ``SXid (PCI:`` and the address as ``%04x:%02x:%02x.%x``, the code as ``%05d`` and ``, ``.
_SXID_RE = re.compile(
    r"nvidia-(nvswitch[0-9]{1,3}): SXid \(PCI:([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})"
    r"\.([0-7])\): ([0-9]{5,6}), (.*)"
)
_SEVERITY_RE = re.compile(r"(Fatal|Non-fatal)(?:,[ \t]*|$)", re.IGNORECASE)
_LINK_RE = re.compile(r"Link[ \t]+([0-9]{1,3})\b[ \t]*")
#: How the driver's log-entry dump continues an SXid (``_nvswitch_dump_error_entry``).
_CONTINUATIONS = ("Severity ", "Data {")


@dataclass(frozen=True, slots=True)
class KernelSxid:
    """One SXid line of the kernel log (not a continuation line)."""

    line: int
    device: str
    nvswitch: str
    sxid: int
    fatal: bool | None
    link: int | None
    message: str
    #: /dev/kmsg sequence number and µs since boot, when the text was /dev/kmsg records
    sequence: int | None = None
    kernel_usec: int | None = None


def is_nvswitch(roots: Roots, bdf: str) -> bool:
    """Whether ``bdf`` is an NVSwitch of this node: a PCI function in sysfs of NVIDIA's vendor
    id and of the bridge class ``0x0680`` (docs/datasources.md). Asked only for an SXid line
    that passed every other check, so a few small reads at most per run."""
    device = roots.sysfs / "bus" / "pci" / "devices" / bdf
    try:
        vendor = (device / "vendor").read_bytes()[:16].strip()
        klass = (device / "class").read_bytes()[:16].strip()
    except (OSError, ValueError):
        return False
    return vendor == NVIDIA_VENDOR and klass[:6] == NVSWITCH_CLASS


def parse_kmsg_sxid(text: str, tally: SkipTally | None = None) -> tuple[KernelSxid, ...]:
    """The SXid lines of a kernel log: ``/dev/kmsg`` records, ``dmesg`` output (with or
    without ``[timestamp]`` or ``<prio>``) or journal lines. Other lines and the driver's
    continuation lines are passed over. A line that mentions an SXid is one only where its
    message *starts* with the driver's exact form (:mod:`nodescope.sources.kernel_log`): one
    that does not, is longer than any kernel record, was written from user space or has a
    level the driver never prints it at is skipped and counted in ``tally``. Never raises on
    any text."""
    tally = SkipTally() if tally is None else tally
    found: list[KernelSxid] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if "SXid (" not in line or is_dictionary_line(line):
            continue
        if len(line) > MAX_LINE_BYTES:
            tally.skip(SKIP_TOO_LONG, line)
            continue
        parts = split_line(line.rstrip("\r"))
        refused = refusal(parts.priority)
        if refused is not None:
            tally.skip(SKIP_NOT_KERNEL if refused == REFUSED_NOT_KERNEL else SKIP_LEVEL, line)
            continue
        match = _SXID_RE.fullmatch(parts.message)
        if match is None:
            tally.skip(SKIP_UNPARSABLE, line)
            continue
        device, domain, bus, slot, function, code, rest = match.groups()
        if int(slot, 16) > 0x1F:  # a PCI device number has five bits
            tally.skip(SKIP_UNPARSABLE, line)
            continue
        rest = (rest or "").strip()
        if rest.startswith(_CONTINUATIONS):
            continue
        fatal: bool | None = None
        severity = _SEVERITY_RE.match(rest)
        if severity is not None:
            fatal = severity.group(1).lower() == "fatal"
            rest = rest[severity.end() :]
        link: int | None = None
        link_match = _LINK_RE.match(rest)
        if link_match is not None:
            link = int(link_match.group(1))
            rest = rest[link_match.end() :]
        found.append(
            KernelSxid(
                line=number,
                device=device,
                nvswitch=f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.{function}",
                sxid=int(code),
                fatal=fatal,
                link=link,
                message=printable(rest.strip(), MESSAGE_CHARS),
                sequence=parts.sequence,
                kernel_usec=parts.usec,
            )
        )
    return tuple(found)


class BoundedKmsgReader(KmsgReader):
    """:class:`KmsgReader` with bounds: a call stops reading once ``max_bytes`` were read
    (one chunk past it at most) and no partial line is kept past ``max_line`` bytes. It
    counts the times the kernel overwrote records before they were read (``EPIPE``: reading
    goes on) and the over-long lines it dropped."""

    def __init__(
        self, path: Path, max_bytes: int = MAX_READ_BYTES, max_line: int = MAX_LINE_BYTES
    ) -> None:
        super().__init__(path)
        self.max_bytes = max_bytes
        self.max_line = max_line
        #: times the kernel said records were lost, since the reader was made
        self.lost = 0
        #: partial lines dropped as longer than ``max_line``; the owner takes and zeroes it
        self.long_lines = 0
        #: the last call stopped at ``max_bytes`` with data maybe still waiting
        self.behind = False
        # Within a dropped over-long line: what comes up to its newline is dropped too.
        self._discarding = False

    def read_new(self) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        chunks: list[bytes] = []
        size = 0
        self.behind = True
        # EPIPE reads return nothing; the bound on calls keeps a kernel that kept answering
        # EPIPE from holding the cycle.
        for _ in range(self.max_bytes // 64 + 1):
            if size >= self.max_bytes:
                break
            try:
                # Always a whole chunk: a /dev/kmsg record does not fit a smaller buffer.
                chunk = os.read(self._fd, READ_CHUNK)
            except BlockingIOError:
                self.behind = False
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    self.lost += 1
                    continue
                raise
            if not chunk:
                self.behind = False
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
        if self._discarding:
            end = data.find(b"\n")
            data = b"" if end < 0 else data[end + 1 :]
            self._discarding = end < 0
        complete, _, tail = (self._tail + data).rpartition(b"\n")
        if len(tail) > self.max_line:
            self.long_lines += 1
            tail = b""
            self._discarding = True
        self._tail = tail
        return complete.decode("utf-8", errors="replace")


class _Entry:
    """The running count of one (switch, code, link) key and its latest line."""

    __slots__ = ("count", "device", "fatal", "message")

    def __init__(self, record: KernelSxid) -> None:
        self.count = 0
        self.device = record.device
        self.fatal = record.fatal
        self.message = record.message


_Key = tuple[str, int, int | None]


class SxidSource:
    """Counts the SXids of the kernel log since it started (``name`` ``sxid``).

    A failed read closes the kernel log and raises (the source is down); the next run opens
    it again and passes over the ``/dev/kmsg`` records it had already counted, by their
    sequence numbers."""

    name = NAME

    def __init__(
        self,
        max_read_bytes: int = MAX_READ_BYTES,
        max_keys: int = MAX_KEYS,
        max_line: int = MAX_LINE_BYTES,
        max_ends: int = MAX_ENDS,
    ) -> None:
        self.max_read_bytes = max_read_bytes
        self.max_keys = max_keys
        self.max_line = max_line
        self._reader: BoundedKmsgReader | None = None
        self._counts: dict[_Key, _Entry] = {}
        self._dropped = 0
        self._lost = 0
        # The kernel-log pass also keeps the processes the kernel says it ended (one read of
        # /dev/kmsg for both): the latest, the oldest dropped and counted.
        self._ends: deque[ProcessEnd] = deque(maxlen=max(1, max_ends))
        self._ends_seen = 0
        self._ends_last_usec: int | None = None
        self._last_sequence: int | None = None
        # After a reopen, /dev/kmsg hands out its whole ring buffer again: records up to
        # this sequence number were counted before.
        self._resume_after: int | None = None

    def _count(self, record: KernelSxid) -> None:
        if record.sequence is not None:
            if self._resume_after is not None:
                if record.sequence <= self._resume_after:
                    return
                self._resume_after = None
            self._last_sequence = record.sequence
        key = (record.nvswitch, record.sxid, record.link)
        entry = self._counts.get(key)
        if entry is None:
            if len(self._counts) >= self.max_keys:
                self._dropped += 1
                return
            entry = self._counts[key] = _Entry(record)
        entry.count += 1
        entry.device, entry.fatal, entry.message = record.device, record.fatal, record.message

    def collect(self, roots: Roots) -> SxidData:
        reader = self._reader
        if reader is None:
            reader = self._reader = BoundedKmsgReader(
                roots.dev / "kmsg", self.max_read_bytes, self.max_line
            )
            self._resume_after = self._last_sequence
        try:
            text = reader.read_new()
        except OSError:
            self._forget_reader()
            raise
        tally = SkipTally()
        self._keep_ends(parse_kmsg_process_ends(text, tally, self.max_line))
        for record in parse_kmsg_sxid(text, tally):
            # Only an address that is an NVSwitch of this node makes a count (and series).
            if is_nvswitch(roots, record.nvswitch):
                self._count(record)
            else:
                tally.skip(SKIP_UNKNOWN_NVSWITCH, record.nvswitch)
        if reader.long_lines:
            for _ in range(reader.long_lines):
                tally.skip(SKIP_TOO_LONG, str(reader.path))
            reader.long_lines = 0
        counts = tuple(
            SxidCount(bdf, e.device, code, e.fatal, link, e.count, e.message)
            for (bdf, code, link), e in sorted(
                self._counts.items(),
                key=lambda kv: (kv[0][0], kv[0][1], -1 if kv[0][2] is None else kv[0][2]),
            )
        )
        return SxidData(
            counts=counts,
            dropped=self._dropped,
            lost=self._lost + reader.lost,
            behind=reader.behind,
            ended=tuple(self._ends),
            ended_dropped=self._ends_seen - len(self._ends),
            skipped=tally.freeze(),
        )

    def _keep_ends(self, ends: tuple[ProcessEnd, ...]) -> None:
        for end in ends:
            # A reopened /dev/kmsg hands out its ring buffer again: a record no later than
            # the last one kept was kept before.
            last = self._ends_last_usec
            if (
                end.kernel_usec is not None
                and last is not None
                and (end.kernel_usec < last or end in self._ends)
            ):
                continue
            if end.kernel_usec is not None:
                self._ends_last_usec = end.kernel_usec
            self._ends.append(end)
            self._ends_seen += 1

    def _forget_reader(self) -> None:
        if self._reader is not None:
            self._lost += self._reader.lost
            self._reader.close()
            self._reader = None

    def close(self) -> None:
        self._forget_reader()


def make_source() -> SxidSource:
    return SxidSource()


SPEC = SourceSpec(
    name="sxid",
    default_interval=5.0,
    help="NVSwitch SXids (nvidia-nvswitch errors) counted from the kernel log, /dev/kmsg",
    build=lambda inputs: make_source(),
    rates=None,
    metric_area="nodescope_exporters.event_metrics",
    # The kernel log is appended to when the timeline's events fire, at every move.
    sim_parts=frozenset(),
)


__all__ = [
    "MAX_ENDS",
    "MAX_KEYS",
    "MAX_LINE_BYTES",
    "MAX_READ_BYTES",
    "NAME",
    "SKIP_LEVEL",
    "SKIP_NOT_KERNEL",
    "SKIP_TOO_LONG",
    "SKIP_UNKNOWN_NVSWITCH",
    "SKIP_UNPARSABLE",
    "BoundedKmsgReader",
    "KernelSxid",
    "SxidSource",
    "is_nvswitch",
    "make_source",
    "parse_kmsg_sxid",
]
