"""The records of the ``sxid`` source: NVSwitch SXids counted from the kernel log.

The ``nvidia-nvswitch`` driver reports an NVSwitch error only as a kernel-log line, an
*SXid* (``nvidia-nvswitch3: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 30 sourcetrack
timeout error``). ``sources/sxid.py`` reads ``/dev/kmsg`` and counts them per switch, code
and link since it started; the ``sxids`` detector (``detectors/sxids.py``) reports the counts
that grew. docs/sxid.md describes the format and the findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nodescope.model.skips import NOTHING_SKIPPED, Skipped
from nodescope.model.source_key import SourceKey

#: Characters of the driver's text kept per count: enough to name the error
#: (``Link 30 sourcetrack timeout error``), never a whole hostile line.
MESSAGE_CHARS = 160


@dataclass(frozen=True, slots=True)
class SxidCount:
    """The SXids of one NVSwitch, code and link since the source started.

    ``nvswitch``: the switch's PCI address in the sysfs form (``0000:05:00.0``); ``device``:
    the driver's name for it (``nvswitch3``) in the latest line; ``fatal``: the driver's word
    (``Fatal`` / ``Non-fatal``), ``None`` where the line says neither; ``link``: the NVLink
    port the line names, ``None`` where it names none; ``message``: the driver's text after
    the code in the latest line, cut to :data:`MESSAGE_CHARS`.
    """

    nvswitch: str
    device: str
    sxid: int
    fatal: bool | None
    link: int | None
    count: int
    message: str


@dataclass(frozen=True, slots=True)
class ProcessEnd:
    """A process the kernel log says the kernel ended: killed by a signal it did not handle
    (its ``segfault at`` or ``traps:`` report) or by the OOM killer. Read only from the
    kernel's own records in their exact form (``sources/process_ends.py``); ``comm`` is the
    kernel's name of the task (at most 15 characters), ``signal`` the signal it was sent
    (``SIGSEGV``), ``cause`` the kernel's words for why (``segfault``, ``OOM-killed``) and
    ``kernel_usec`` the record's µs since boot where the record stated them."""

    pid: int
    comm: str
    signal: str
    cause: str
    kernel_usec: int | None = None


@dataclass(frozen=True, slots=True)
class SxidData:
    """One read of the kernel log.

    ``counts`` hold every SXid since the source started (the first read counts what the
    kernel's ring buffer still held). ``dropped``: SXids not counted since the source started
    because the table of (switch, code, link) keys was full; ``lost``: times the kernel
    reported records overwritten before they were read; ``behind``: this read stopped at its
    byte bound with records still waiting (the next read goes on from there).
    """

    counts: tuple[SxidCount, ...]
    dropped: int = 0
    lost: int = 0
    behind: bool = False
    #: the latest processes the kernel log says the kernel ended, oldest first (bounded)
    ended: tuple[ProcessEnd, ...] = ()
    #: process ends no longer kept since the source started, the oldest dropped for newer
    ended_dropped: int = 0
    #: kernel-log lines of this run skipped as malformed or not the kernel's own
    skipped: Skipped = field(default=NOTHING_SKIPPED, compare=False)


#: The ``sxid`` source's records: NVSwitch SXids from the kernel log.
SXID = SourceKey("sxid", SxidData)
