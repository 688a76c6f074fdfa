"""The figures of nodescope's own processes, for its self-metrics: CPU time, memory,
descriptors, threads and start time, read with psutil.

Per process, psutil reads ``/proc/<pid>/stat`` (CPU time, start time), ``statm`` (RSS,
virtual size), ``status`` (threads), lists ``fd/``, and reads ``smaps_rollup`` (Linux 4.14)
for PSS; the descriptor limit comes from ``/proc/<pid>/limits`` (proc(5)), as Prometheus's
process collectors read it, because psutil's ``rlimit`` is ``prlimit(2)``, which on a
process of another user needs CAP_SYS_RESOURCE: a serving process started by root becomes
``nobody``, and the systemd unit grants no such capability. Its descriptors and memory map
stay readable to the root daemon (the map through the unit's CAP_SYS_PTRACE, as the serving
process is not dumpable); a figure refused anyway is left out, not the process.

These are the real ``/proc`` of the running processes, never the ``--procfs`` root: that root
may be a fixture tree or a simulated node, while the daemon itself always runs here.

What it costs, measured in a process that imported the daemon's modules (32 MiB RSS, 206
mappings; best of 10 runs of 1,000 calls on a shared 2-core machine): 49 µs a cycle for the
daemon alone, 95 µs with the serving process; reading PSS as well on every call makes it
270 µs. ``smaps_rollup`` walks every mapping's page tables, under the process's memory-map
lock, so its cost grows with the process; PSS is read every :data:`PSS_EVERY_SECONDS` per
process, the rest every cycle.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from nodescope import fileio
from nodescope.model.process import PSS_EVERY_SECONDS, ProcessFigures, ProcessRole

#: The row of /proc/<pid>/limits that holds RLIMIT_NOFILE.
MAX_OPEN_FILES = "Max open files"


def parse_max_open_files(text: str) -> int | None:
    """The soft limit of the "Max open files" row of ``/proc/<pid>/limits``; ``None`` when
    it is unlimited or the row is missing.

    The file is a table (fs/proc/base.c ``proc_pid_limits``): a header, then one row per
    limit, its name padded with spaces, then the soft and hard limits ("unlimited" or a
    number) and the units.
    """
    for line in text.splitlines():
        if line.startswith(MAX_OPEN_FILES):
            soft = line.removeprefix(MAX_OPEN_FILES).split()[0]
            return int(soft) if soft.isdigit() else None
    return None


@dataclass
class _PssReading:
    pid: int
    at: float
    pss_bytes: int | None


class ProcessMeter:
    """Measures the daemon (this process) and, when given its pid, the serving process.

    Holds one ``psutil.Process`` per role (psutil keeps what does not change, the start time,
    in it) and each role's last PSS reading, so PSS is read on its own cadence; a new serving
    process (another pid) is measured in full at once.
    """

    def __init__(
        self,
        pss_every: float = PSS_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pss_every = pss_every
        self._clock = clock
        self._processes: dict[ProcessRole, psutil.Process] = {"daemon": psutil.Process()}
        self._pss: dict[ProcessRole, _PssReading] = {}

    def measure(self, serving_pid: int | None = None) -> tuple[ProcessFigures, ...]:
        """The daemon's figures and the serving process's (when ``serving_pid`` is given);
        a process that cannot be read now (it exited, a restart is under way) is left out."""
        roles: list[tuple[ProcessRole, int]] = [("daemon", os.getpid())]
        if serving_pid is not None:
            roles.append(("serving", serving_pid))
        else:
            self._processes.pop("serving", None)
        measured = []
        for role, pid in roles:
            try:
                measured.append(self._measure(role, pid))
            except psutil.Error:
                # Gone, a zombie before it is reaped, or not readable at all: no figures
                # rather than wrong ones; the next cycle tries again.
                self._processes.pop(role, None)
                self._pss.pop(role, None)
        return tuple(measured)

    def _process(self, role: ProcessRole, pid: int) -> psutil.Process:
        process = self._processes.get(role)
        if process is None or process.pid != pid:
            process = self._processes[role] = psutil.Process(pid)
        return process

    def _measure(self, role: ProcessRole, pid: int) -> ProcessFigures:
        process = self._process(role, pid)
        with process.oneshot():
            cpu = process.cpu_times()
            memory = process.memory_info()
            threads = process.num_threads()
            start = process.create_time()
        return ProcessFigures(
            role=role,
            pid=pid,
            cpu_seconds=cpu.user + cpu.system,
            resident_bytes=memory.rss,
            virtual_bytes=memory.vms,
            threads=threads,
            start_time_seconds=start,
            open_fds=_optional(process.num_fds),
            max_fds=_max_open_files(pid),
            pss_bytes=self._pss_bytes(role, process),
        )

    def _pss_bytes(self, role: ProcessRole, process: psutil.Process) -> int | None:
        now = self._clock()
        last = self._pss.get(role)
        if last is not None and last.pid == process.pid and now - last.at < self._pss_every:
            return last.pss_bytes
        # A reading that failed (no privilege to walk the other process's map) is kept as
        # one too, so it is not retried every cycle either.
        pss = _optional(lambda: process.memory_full_info().pss)
        self._pss[role] = _PssReading(process.pid, now, pss)
        return pss


def _optional(read: Callable[[], int]) -> int | None:
    """A figure that needs more privilege than /proc/<pid>/stat: ``None`` when refused."""
    try:
        return read()
    except psutil.AccessDenied:
        return None


def _max_open_files(pid: int) -> int | None:
    text = fileio.read_optional(f"/proc/{pid}/limits", fileio.PROC_PROCESS)
    return None if text is None else parse_max_open_files(text)
