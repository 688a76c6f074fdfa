"""The ``nvml`` source's Xid reader: Xid critical errors counted per GPU, from an NVML event
set waited on in a thread of its own, or from the driver's lines in the kernel log
(``/dev/kmsg``) where no GPU delivers them as events (:mod:`nodescope.sources.nvml` says how
each is read and trusted).
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections import Counter as _Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from nodescope.model.nvml import XID_SOURCE_EVENTS, XID_SOURCE_KMSG, LostGpu, XidCount
from nodescope.model.skips import SkipTally
from nodescope.roots import Roots
from nodescope.sources.kernel_log import (
    REFUSED_NOT_KERNEL,
    is_dictionary_line,
    printable,
    refusal,
    split_line,
)
from nodescope.sources.nvml_device import (
    Gpu,
    NvmlAdapter,
    error_name,
    handle_address,
    log,
    sysfs_pci_address,
)

#: Longest ``nvmlEventSetWait`` of the Xid thread, in ms. The wait returns at once when an
#: event arrives, so this bounds only how often the thread wakes with nothing to do (a timeout)
#: and how long the source's close may wait for it. Each timeout is a thread wake-up
#: and a raised ``NVMLError_Timeout``, about 160 µs of CPU measured in a virtual machine: at
#: 200 ms the idle thread cost 0.8 ms of CPU a second on the simulated HGX node, as much as a
#: whole per-cycle source; at 2 s a tenth of that, and a close (daemon stop, NVML gone) waits
#: at most 2.5 s.
EVENT_WAIT_MS = 2000


@dataclass(frozen=True, slots=True)
class KernelXid:
    """One ``NVRM: Xid`` line of the kernel log."""

    line: int
    pci_address: str
    xid: int
    pid: int | None
    process: str | None
    message: str
    #: /dev/kmsg sequence number and µs since boot, when the text was /dev/kmsg records
    sequence: int | None
    kernel_usec: int | None


#: The driver's line (``kernel_rc.c``), anchored at the start of the message: ``NVRM: Xid
#: (PCI:`` and the address as ``%04x:%02x:%02x``, MIG's ``GPU-I:``/``GPU-C:`` ids, the Xid,
#: ``pid=`` (a number or ``'<unknown>'``), ``name=`` (drivers before R525 print none) and
#: the driver's text.
_XID_RE = re.compile(
    r"NVRM: Xid \(PCI:([0-9a-f]{4,8}):([0-9a-f]{2}):([0-9a-f]{2})(?:\.([0-7]))?"
    r"(?: GPU-I:[0-9a-f]{1,2})?(?: GPU-C:[0-9a-f]{1,2})?\): ([0-9]{1,3}), "
    r"pid=([0-9]{1,10}|'[0-9]{1,10}'|'<unknown>'|<unknown>), "
    r"(?:name=(.{0,16}?), )?(.*)"
)
#: Skip reasons of the kernel-log Xids (``nodescope_source_records_skipped_total{source="nvml"}``).
SKIP_XID_UNPARSABLE = "xid_unparsable"
SKIP_XID_NOT_KERNEL = "xid_not_from_kernel"
SKIP_XID_LEVEL = "xid_not_driver_level"
SKIP_XID_TOO_LONG = "xid_line_too_long"
SKIP_XID_UNKNOWN_GPU = "xid_unknown_gpu"
#: A line longer than this is no kernel record (``CONSOLE_EXT_LOG_MAX`` is 8 KiB).
MAX_XID_LINE = 16384
#: Characters of the driver's text (and of a process name) kept per Xid: it may reach a
#: message, never a whole hostile line.
XID_TEXT_CHARS = 160


def parse_kmsg_xid(text: str, tally: SkipTally | None = None) -> tuple[KernelXid, ...]:
    """The ``NVRM: Xid`` records of a kernel log: ``/dev/kmsg`` records, ``dmesg`` output
    (with or without ``[timestamp]``) or journal lines. Other lines are passed over. A line
    that mentions an Xid is one only where its message *starts* with the driver's exact form
    (:mod:`nodescope.sources.kernel_log`): one that does not, is longer than any kernel
    record, was written from user space or has a level the driver never prints it at is
    skipped and counted in ``tally``. Never raises on any text."""
    tally = SkipTally() if tally is None else tally
    found: list[KernelXid] = []
    for number, line in enumerate(text.split("\n"), start=1):
        if "NVRM: Xid" not in line or is_dictionary_line(line):
            continue
        if len(line) > MAX_XID_LINE:
            tally.skip(SKIP_XID_TOO_LONG, line)
            continue
        parts = split_line(line.rstrip("\r"))
        refused = refusal(parts.priority)
        if refused is not None:
            tally.skip(
                SKIP_XID_NOT_KERNEL if refused == REFUSED_NOT_KERNEL else SKIP_XID_LEVEL, line
            )
            continue
        match = _XID_RE.fullmatch(parts.message)
        if match is None or int(match.group(3), 16) > 0x1F:  # a device number has five bits
            tally.skip(SKIP_XID_UNPARSABLE, line)
            continue
        domain, bus, device, function, xid, pid, name, rest = match.groups()
        process = None if name is None or name.strip() in ("", "<unknown>") else name.strip()
        found.append(
            KernelXid(
                line=number,
                pci_address=sysfs_pci_address(
                    int(domain, 16), int(bus, 16), int(device, 16), int(function or 0)
                ),
                xid=int(xid),
                pid=int(pid.strip("'")) if pid.strip("'").isdigit() else None,
                process=None if process is None else printable(process, XID_TEXT_CHARS),
                message=printable(rest.strip(), XID_TEXT_CHARS),
                sequence=parts.sequence,
                kernel_usec=parts.usec,
            )
        )
    return tuple(found)


class KmsgReader:
    """Reads the records appended to ``/dev/kmsg`` since the last call, without blocking.

    ``/dev/kmsg`` returns one record per ``read`` and ``EAGAIN`` when none is left (so
    :func:`sources.base.read_text` does not fit); ``EPIPE`` means records were overwritten
    before we read them, and reading goes on. The first call returns what the ring buffer
    still holds, so Xids from before the daemon started are counted once. A regular file
    (the simulated node's) is read to its end and then followed.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._tail = b""

    def read_new(self) -> str:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        chunks: list[bytes] = [self._tail]
        for _ in range(100_000):
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue
                raise
            if not chunk:
                break
            chunks.append(chunk)
        # Keep a partial last line (a file still being written) for the next call.
        complete, _, self._tail = b"".join(chunks).rpartition(b"\n")
        return complete.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class XidReader:
    """Counts the Xids of the GPUs NVML enumerated, from the event set while it delivers
    them, else from the kernel log. ``event_wait_ms`` bounds one wait of the event thread,
    and so how long :meth:`stop` waits for it; ``watch`` False leaves the event set alone."""

    def __init__(self, nvml: NvmlAdapter, *, event_wait_ms: int, watch: bool) -> None:
        self.nvml = nvml
        self.event_wait_ms = event_wait_ms
        self.watch = watch
        self._lock = threading.Lock()
        self._counts: _Counter[tuple[int | None, str, int]] = _Counter()
        self._source: str | None = None
        self._watcher: _XidWatcher | None = None
        self._kmsg: KmsgReader | None = None

    def start(self, gpus: Iterable[Gpu]) -> None:
        """Start waiting on the event set for ``gpus``, unless already waiting."""
        if not self.watch or self._watcher is not None:
            return
        targets = [(g.index, g.handle, g.address, g.pci_address) for g in gpus]
        self._watcher = _XidWatcher(self, targets)
        self._watcher.start()

    def stop(self) -> None:
        watcher = self._watcher
        if watcher is None:
            return
        watcher.stop.set()
        watcher.join(timeout=self.event_wait_ms / 1000.0 + 0.5)
        if watcher.is_alive():
            log.warning("source=nvml xid_thread=still_running")
        self._watcher = None

    def teardown(self) -> None:
        """NVML went away: the event set is gone with it (the counts stay)."""
        self.stop()
        with self._lock:
            if self._source == XID_SOURCE_EVENTS:
                self._source = None

    def close(self) -> None:
        self.stop()
        if self._kmsg is not None:
            self._kmsg.close()
            self._kmsg = None

    def count(self, gpu: int | None, pci_address: str, xid: int) -> None:
        with self._lock:
            self._counts[(gpu, pci_address, xid)] += 1

    def set_source(self, source: str | None) -> None:
        with self._lock:
            self._source = source

    def read(
        self, roots: Roots, gpus: Iterable[Gpu], lost: Iterable[LostGpu], tally: SkipTally
    ) -> tuple[str | None, tuple[XidCount, ...]]:
        """Where the Xids come from now and every count so far; reads the kernel log first
        when no event set delivers them."""
        watcher = self._watcher
        if watcher is None or watcher.unsupported.is_set():
            # No NVML event set delivers Xids: the kernel log does, where it can be read.
            self.set_source(XID_SOURCE_KMSG if self._read_kmsg(roots, gpus, lost, tally) else None)
        with self._lock:
            return self._source, tuple(
                XidCount(gpu, pci, xid, count)
                for (gpu, pci, xid), count in sorted(
                    self._counts.items(), key=lambda kv: (kv[0][1], kv[0][2])
                )
            )

    def _read_kmsg(
        self, roots: Roots, gpus: Iterable[Gpu], lost: Iterable[LostGpu], tally: SkipTally
    ) -> bool:
        """Count the Xids of the kernel-log records that arrived since the last call; an Xid
        line for an address that is no GPU NVML enumerated (or lost) is skipped and counted
        in ``tally``, never a count of its own, so no invented address makes a series."""
        if self._kmsg is None:
            self._kmsg = KmsgReader(roots.dev / "kmsg")
        try:
            text = self._kmsg.read_new()
        except OSError as exc:
            log.debug("source=nvml kmsg_error=%r", error_name(exc))
            self._kmsg.close()
            self._kmsg = None
            return False
        if "NVRM: Xid" not in text:
            return True
        by_address = {g.pci_address: g.index for g in gpus}
        by_address.update({gone.pci_address: gone.gpu for gone in lost})
        for record in parse_kmsg_xid(text, tally):
            if record.pci_address not in by_address:
                tally.skip(SKIP_XID_UNKNOWN_GPU, record.pci_address)
                continue
            self.count(by_address[record.pci_address], record.pci_address, record.xid)
        return True


class _XidWatcher(threading.Thread):
    """Waits on an NVML event set and counts Xid critical errors into its reader.

    ``unsupported`` is set when no GPU can deliver Xid events (the source then reads the
    kernel log). The set is created, used and freed in this thread.
    """

    def __init__(
        self, reader: XidReader, targets: Iterable[tuple[int, Any, int | None, str]]
    ) -> None:
        super().__init__(name="nodescope-nvml-xid", daemon=True)
        self.reader = reader
        self.targets = list(targets)
        self.stop = threading.Event()
        self.unsupported = threading.Event()

    def run(self) -> None:
        nvml = self.reader.nvml
        xid_bit = int(pynvml.nvmlEventTypeXidCriticalError)
        try:
            event_set = nvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.info("source=nvml xid_events=unavailable error=%r", error_name(exc))
            self.unsupported.set()
            return
        try:
            by_address: dict[int, tuple[int, str]] = {}
            for index, handle, address, pci in self.targets:
                try:
                    if not int(nvml.nvmlDeviceGetSupportedEventTypes(handle)) & xid_bit:
                        continue
                    nvml.nvmlDeviceRegisterEvents(handle, xid_bit, event_set)
                except pynvml.NVMLError as exc:
                    log.info("source=nvml gpu=%d xid_events=unavailable error=%r", index, exc)
                    continue
                if address is not None:
                    by_address[address] = (index, pci)
            if not by_address:
                self.unsupported.set()
                return
            self.reader.set_source(XID_SOURCE_EVENTS)
            while not self.stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait(event_set, self.reader.event_wait_ms)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as exc:
                    # Wait can fail transiently (a GPU lost, an interrupted wait): pause
                    # rather than spin, and stop promptly on close.
                    log.debug("source=nvml xid_wait_error=%r", error_name(exc))
                    self.stop.wait(0.5)
                    continue
                if not int(data.eventType) & xid_bit:
                    continue
                target = by_address.get(handle_address(data.device) or -1)
                if target is None:
                    continue
                self.reader.count(target[0], target[1], int(data.eventData))
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except pynvml.NVMLError as exc:
                log.debug("source=nvml event_set_free_error=%r", error_name(exc))
