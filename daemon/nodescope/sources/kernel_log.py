"""The line forms of the kernel log, and which of its records a driver can have written.

The NVIDIA drivers report Xids (``nvidia``) and SXids (``nvidia-nvswitch``) only as kernel-log
lines, and the kernel log also holds text any user chooses: a record written to ``/dev/kmsg``
from user space, the file name of a crashing binary in the kernel's own ``segfault at``
record (facility 0, ``KERN_INFO``: ``name[pid]: segfault at 0 ip … in <file name>[…]``),
the option a user passed to ``mount`` in a file system's ``Bad value for '…'`` error. So a
driver's record is trusted only in the driver's exact form, anchored at the start of the
message (never found somewhere inside it), and with the priority the kernel gives the
driver's ``printk``:

* the facility is 0 (the kernel's): ``devkmsg_write`` (``kernel/printk/printk.c``) gives
  every record written to ``/dev/kmsg`` from user space a non-zero facility, 1 (``LOG_USER``)
  unless the writer named another one, "to be able to reliably distinguish kernel-generated
  messages from userspace-injected ones";
* the level is :data:`DRIVER_MAX_LEVEL` (``KERN_WARNING``) or more severe: the drivers print
  their Xid and SXid lines at ``KERN_ERR`` (``os_log_error`` in the GPU driver's
  ``os-interface.c``, ``nvswitch_os_print`` for ``NVSWITCH_DBG_LEVEL_ERROR``), and a
  ``printk`` without a level gets the default message level, ``KERN_WARNING``. The kernel's
  segfault report is ``KERN_INFO`` and is refused for its level alone.

``/dev/kmsg`` records are ``prio,seq,usec,flags;text`` (``Documentation/ABI/testing/dev-kmsg``),
followed by dictionary lines that start with a space. Captures and tests also hold ``dmesg``
output (``[  269.517039] text``, ``[Sun Feb 23 16:24:18 2025] text``, ``<3>[ 12.0] text``) and
journal lines (``Jan 18 11:38:05 host kernel: text``); those carry no facility (only the
``<prio>`` form does), and only the daemon's own reads of ``/dev/kmsg`` are trusted to prove one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The least severe level a driver's Xid or SXid record has: ``KERN_WARNING`` (4), the
#: default message level of a ``printk`` without one; the drivers print at ``KERN_ERR`` (3).
DRIVER_MAX_LEVEL = 4

#: Why a line was refused before its text was read (the parsers add their source's name).
REFUSED_NOT_KERNEL = "not_from_kernel"
REFUSED_LEVEL = "not_driver_level"

_KMSG_PREFIX_RE = re.compile(r"([0-9]{1,3}),([0-9]{1,20}),([0-9]{1,20}),[^;]{0,32};")
#: ``dmesg -r`` and syslog put the priority in angle brackets; a time stamp may follow.
_SYSLOG_PREFIX_RE = re.compile(r"<([0-9]{1,3})>(?:\[[^\]]{1,40}\] ?)?")
#: A journal line of the kernel's transport (``short`` output), maybe with a time stamp.
_JOURNAL_PREFIX_RE = re.compile(
    r"[A-Z][a-z]{2} [ 0-9][0-9] [0-9]{2}:[0-9]{2}:[0-9]{2} [^ ]{1,255} kernel: "
    r"(?:\[[^\]]{1,40}\] ?)?"
)
#: ``dmesg``'s time stamp: seconds since boot, or ``--ctime``'s date.
_STAMP_PREFIX_RE = re.compile(r"\[[^\]]{1,40}\] ?")
#: A ``/dev/kmsg`` dictionary line (`` SUBSYSTEM=pci``): part of the record above it.
_KMSG_DICT_RE = re.compile(r" [A-Za-z0-9_]+=")


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line of a kernel log, its prefix taken off.

    ``priority`` is the record's ``facility << 3 | level`` where the line states one;
    ``sequence`` and ``usec`` are the ``/dev/kmsg`` record's sequence number and µs since
    boot."""

    message: str
    priority: int | None = None
    sequence: int | None = None
    usec: int | None = None


def is_dictionary_line(line: str) -> bool:
    """A ``/dev/kmsg`` dictionary line (`` KEY=value``): no record of its own."""
    return _KMSG_DICT_RE.match(line) is not None


def split_line(line: str) -> LogLine:
    """``line`` as a :class:`LogLine`: the message after whichever prefix the line has."""
    match = _KMSG_PREFIX_RE.match(line)
    if match is not None:
        return LogLine(
            line[match.end() :], int(match.group(1)), int(match.group(2)), int(match.group(3))
        )
    match = _SYSLOG_PREFIX_RE.match(line)
    if match is not None:
        return LogLine(line[match.end() :], int(match.group(1)))
    match = _JOURNAL_PREFIX_RE.match(line) or _STAMP_PREFIX_RE.match(line)
    return LogLine(line if match is None else line[match.end() :])


def printable(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, control characters replaced: a driver's text
    ends up in an alert's one-line message."""
    cut = text[:limit]
    return cut if cut.isprintable() else "".join(c if c.isprintable() else "?" for c in cut)


def refusal(priority: int | None) -> str | None:
    """Why a record of ``priority`` cannot be a driver's Xid or SXid (:data:`REFUSED_NOT_KERNEL`,
    :data:`REFUSED_LEVEL`), or ``None`` where it can (or the line states no priority)."""
    if priority is None:
        return None
    if priority >> 3 != 0:
        return REFUSED_NOT_KERNEL
    if priority & 7 > DRIVER_MAX_LEVEL:
        return REFUSED_LEVEL
    return None


__all__ = [
    "DRIVER_MAX_LEVEL",
    "REFUSED_LEVEL",
    "REFUSED_NOT_KERNEL",
    "LogLine",
    "is_dictionary_line",
    "printable",
    "refusal",
    "split_line",
]
