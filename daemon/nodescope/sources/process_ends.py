"""Processes the kernel ended, from the kernel log's own records.

The node agent is not the parent of a job's processes, so it never sees their exit status;
the kernel logs some deaths itself, at facility 0, in exact forms:

* a fatal page fault (``show_signal_msg``, ``arch/x86/mm/fault.c``, ``KERN_INFO``)::

      <comm>[<pid>]: segfault at <addr> ip <ip> sp <sp> error <code> in <file>[<base>+<size>]

* a fatal trap (``show_signal``/``do_trap``, ``arch/x86/kernel/traps.c``, ``pr_info`` with
  the ``traps: `` prefix)::

      traps: <comm>[<pid>] general protection fault ip:<ip> sp:<sp> error:<code> in ...
      traps: <comm>[<pid>] trap divide error ip:<ip> sp:<sp> error:<code> in ...

* the OOM killer (``__oom_kill_process`` and ``dump_oom_summary``, ``mm/oom_kill.c``,
  ``KERN_ERR`` and ``KERN_INFO``)::

      Out of memory: Killed process <pid> (<comm>) total-vm:<n>kB, anon-rss:...
      Memory cgroup out of memory: Killed process <pid> (<comm>) total-vm:<n>kB, ...
      oom-kill:constraint=<c>,nodemask=...,task=<comm>,pid=<pid>,uid=<uid>

A user chooses a process's name (and a crashing binary's file name sits inside the segfault
record), and a write to ``/dev/kmsg`` from user space gets a non-zero facility
(``devkmsg_write``, ``kernel/printk/printk.c``). So a record is read only where it states
facility 0, its message *starts* with one of these forms and the name fits the kernel's
``TASK_COMM_LEN`` (15 characters): a line without a stated priority (``dmesg`` text) is no
proof and is passed over. The pid comes from the kernel's own digits, and a reader names a
departed process only where pid *and* name both match.
"""

from __future__ import annotations

import re

from nodescope.model.skips import SkipTally
from nodescope.model.sxid import ProcessEnd
from nodescope.sources.kernel_log import is_dictionary_line, printable, split_line

#: The kernel's longest task name (``TASK_COMM_LEN`` less its NUL).
COMM_CHARS = 15
#: The least severe level of these records: ``KERN_INFO`` (6).
MAX_LEVEL = 6

#: Skip reasons (``nodescope_source_records_skipped_total{source="sxid",reason}``).
SKIP_NOT_KERNEL = "process_end_not_from_kernel"
SKIP_UNPARSABLE = "process_end_unparsable"

_HEX = r"[0-9a-f]{1,16}"
_SEGFAULT_RE = re.compile(
    rf"(.{{1,{COMM_CHARS}}}?)\[([0-9]{{1,10}})\]: segfault at {_HEX} ip {_HEX} sp {_HEX}"
    rf" error {_HEX}(?: .*)?",
    re.DOTALL,
)
#: ``traps:`` reports: the kernel's description and the signal ``do_trap`` sends for it.
_TRAPS = {
    "general protection fault": ("SIGSEGV", "general protection fault"),
    "trap divide error": ("SIGFPE", "divide error"),
    "trap invalid opcode": ("SIGILL", "invalid opcode"),
}
_TRAP_RE = re.compile(
    rf"traps: (.{{1,{COMM_CHARS}}}?)\[([0-9]{{1,10}})\] ({'|'.join(_TRAPS)})"
    rf" ip:{_HEX} sp:{_HEX} error:{_HEX}(?: .*)?",
    re.DOTALL,
)
_OOM_RE = re.compile(
    rf"(?:Out of memory|Memory cgroup out of memory): Killed process ([0-9]{{1,10}})"
    rf" \((.{{0,{COMM_CHARS}}}?)\) total-vm:[0-9]{{1,20}}kB,.*",
    re.DOTALL,
)
_OOM_SUMMARY_RE = re.compile(
    rf"oom-kill:constraint=[A-Z_]{{1,32}},.*,task=(.{{0,{COMM_CHARS}}}),pid=([0-9]{{1,10}}),"
    r"uid=[0-9]{1,10}",
    re.DOTALL,
)
#: Words a line must hold to be looked at: most kernel-log lines are none of these.
_HINTS = ("segfault at ", "traps: ", "Killed process ", "oom-kill:")


def parse_process_end(message: str) -> ProcessEnd | None:
    """The process end ``message`` (a kernel record's text, prefix taken off) reports in its
    exact form, or ``None``."""
    match = _SEGFAULT_RE.fullmatch(message)
    if match is not None:
        return ProcessEnd(int(match.group(2)), match.group(1), "SIGSEGV", "segfault")
    match = _TRAP_RE.fullmatch(message)
    if match is not None:
        signal, cause = _TRAPS[match.group(3)]
        return ProcessEnd(int(match.group(2)), match.group(1), signal, cause)
    match = _OOM_RE.fullmatch(message)
    if match is not None:
        return ProcessEnd(int(match.group(1)), match.group(2), "SIGKILL", "OOM-killed")
    match = _OOM_SUMMARY_RE.fullmatch(message)
    if match is not None:
        return ProcessEnd(int(match.group(2)), match.group(1), "SIGKILL", "OOM-killed")
    return None


def parse_kmsg_process_ends(
    text: str, tally: SkipTally | None = None, max_line: int = 16384
) -> tuple[ProcessEnd, ...]:
    """The process ends of ``/dev/kmsg`` records in ``text``. A line that holds one of the
    forms' words but states no facility 0 at a level up to ``KERN_INFO`` is skipped and
    counted; one of the kernel's that is in none of the forms is passed over (the words
    occur in other records too). Never raises on any text."""
    tally = SkipTally() if tally is None else tally
    found: list[ProcessEnd] = []
    for line in text.split("\n"):
        if not any(hint in line for hint in _HINTS) or is_dictionary_line(line):
            continue
        if len(line) > max_line:
            tally.skip(SKIP_UNPARSABLE, line)
            continue
        parts = split_line(line.rstrip("\r"))
        priority = parts.priority
        if priority is None or priority >> 3 != 0 or priority & 7 > MAX_LEVEL:
            tally.skip(SKIP_NOT_KERNEL, line)
            continue
        end = parse_process_end(parts.message)
        if end is None:
            continue
        found.append(
            ProcessEnd(
                end.pid,
                printable(end.comm, COMM_CHARS),
                end.signal,
                end.cause,
                parts.usec,
            )
        )
    return tuple(found)


__all__ = [
    "COMM_CHARS",
    "MAX_LEVEL",
    "SKIP_NOT_KERNEL",
    "SKIP_UNPARSABLE",
    "parse_kmsg_process_ends",
    "parse_process_end",
]
