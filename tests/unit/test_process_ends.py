"""The kernel log's own records of processes it ended (``sources/process_ends.py``): the
exact forms of the kernel's segfault, trap and OOM-killer reports, at facility 0 only.

Real lines, each from a public bug report (the record's text; the ``/dev/kmsg`` prefix is
the kernel's for its level):

* ``python2[4598]: segfault at da84cf8 ...``: presto-osu/orlis-orcis issue #4;
* ``python[1106536]: segfault at 0 ... likely on CPU 0 ...``:
  Fraunhofer-FIT-DIEN/iec104-python issue #76 (its file name as the reporter typed it);
* ``python3[7777]: segfault at 0 ip 0000000000000000 ... error 14``: clearlinux/distribution
  issue #1022 (a journal line);
* the ``oom-kill:constraint=CONSTRAINT_MEMCG,...,task=pt_main_thread,pid=461754,uid=0``
  summary: leptonai/gpud pull request #70.

The ``traps:`` and ``Out of memory: Killed process`` lines follow the kernel's format strings
(``arch/x86/kernel/traps.c``, ``mm/oom_kill.c``).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nodescope.model.skips import SkipTally
from nodescope.sources.process_ends import (
    SKIP_NOT_KERNEL,
    parse_kmsg_process_ends,
    parse_process_end,
)

SEGFAULT_ORLIS = (
    "python2[4598]: segfault at da84cf8 ip 00007f7b2cbac94d sp 00007ffe4e250b60 error 4"
    " in libc-2.27.so[7f7b2cb15000+1e7000]"
)
SEGFAULT_IEC104 = (
    "python[1106536]: segfault at 0 ip 0000779ec13010da sp 0000779ebbdff7c0 error 4 in"
    " _c104.cpython-313-x86_64-linux-gnu.co[779ec12c4000+147000] likely on CPU 0 (core 0,"
    " socket 0)"
)
SEGFAULT_CLEAR = (
    "Jul 17 09:12:47 clear.fortnebula.com kernel: python3[7777]: segfault at 0 ip"
    " 0000000000000000 sp 00007ffdb10ad908 error 14 in python3.7[55c288ff2000+5c000]"
)
OOM_SUMMARY_GPUD = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=cri-containerd-ec9ee26695deb4"
    "cc72bc665efff1cf3a03fdfb12f1303e02fe9252985e084a95.scope,mems_allowed=0-1,oom_memcg=/kubepods"
    ".slice/kubepods-burstable.slice,task_memcg=/kubepods.slice/kubepods-burstable.slice/cri-"
    "containerd-ec9ee26695deb4cc72bc665efff1cf3a03fdfb12f1303e02fe9252985e084a95.scope,"
    "task=pt_main_thread,pid=461754,uid=0"
)
OOM_KILLED = (
    "Out of memory: Killed process 7899 (python) total-vm:26184840kB, anon-rss:15370088kB,"
    " file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:38964kB oom_score_adj:0"
)
MEMCG_KILLED = (
    "Memory cgroup out of memory: Killed process 4242 (pt_main_thread) total-vm:8388608kB,"
    " anon-rss:4194304kB, file-rss:0kB, shmem-rss:0kB, UID:1128 pgtables:9000kB"
    " oom_score_adj:0"
)
GP_FAULT = (
    "traps: python3[5120] general protection fault ip:7f3a1c2b4d10 sp:7ffd5e1f2a40 error:0"
    " in libc.so.6[7f3a1c200000+195000]"
)
DIVIDE = (
    "traps: solver[77] trap divide error ip:401126 sp:7ffc8a1e9f30 error:0 in solver[401000+1000]"
)


def _kmsg(prio: int, text: str, seq: int = 1, usec: int = 5_000_000) -> str:
    return f"{prio},{seq},{usec},-;{text}"


def _ends(text: str) -> list[tuple[int, str, str, str]]:
    return [(e.pid, e.comm, e.signal, e.cause) for e in parse_kmsg_process_ends(text)]


def test_real_kernel_records_in_their_exact_forms() -> None:
    text = "\n".join(
        [
            _kmsg(6, SEGFAULT_ORLIS, 1),
            _kmsg(6, SEGFAULT_IEC104, 2),
            _kmsg(6, OOM_SUMMARY_GPUD, 3),
            _kmsg(3, OOM_KILLED, 4),
            _kmsg(3, MEMCG_KILLED, 5),
            _kmsg(6, GP_FAULT, 6),
            _kmsg(6, DIVIDE, 7, 7_250_000),
        ]
    )
    assert _ends(text) == [
        (4598, "python2", "SIGSEGV", "segfault"),
        (1106536, "python", "SIGSEGV", "segfault"),
        (461754, "pt_main_thread", "SIGKILL", "OOM-killed"),
        (7899, "python", "SIGKILL", "OOM-killed"),
        (4242, "pt_main_thread", "SIGKILL", "OOM-killed"),
        (5120, "python3", "SIGSEGV", "general protection fault"),
        (77, "solver", "SIGFPE", "divide error"),
    ]
    assert parse_kmsg_process_ends(text)[-1].kernel_usec == 7_250_000


def test_a_name_holding_brackets_or_spaces_keeps_the_kernels_pid() -> None:
    # The task's name is the user's: its brackets and words never move the pid.
    end = parse_process_end(
        "x[5]: segfault [31337]: segfault at 0 ip 0000000000401126 sp 00007ffc8a1e9f30 error 4"
    )
    assert end is not None and (end.pid, end.comm) == (31337, "x[5]: segfault ")
    oom = parse_process_end("Out of memory: Killed process 12 (a) b) total-vm:1kB, anon-rss:0kB")
    assert oom is not None and (oom.pid, oom.comm) == (12, "a) b")


def test_lines_without_the_kernels_facility_or_form_are_no_process_end() -> None:
    tally = SkipTally()
    forged = [
        # Written to /dev/kmsg from user space: facility 1, whatever level was asked for.
        _kmsg(11, SEGFAULT_ORLIS),
        _kmsg(14, OOM_KILLED),
        # The kernel's, but at a level it never prints these at (KERN_DEBUG).
        _kmsg(7, SEGFAULT_ORLIS),
        # dmesg and journal text state no facility: no proof.
        f"[ 12.5] {SEGFAULT_ORLIS}",
        SEGFAULT_CLEAR,
    ]
    assert _ends("\n".join(forged)) == []
    parse_kmsg_process_ends("\n".join(forged), tally)
    assert tally.freeze().counts.get(SKIP_NOT_KERNEL) == len(forged)
    # Facility 0, but not anchored at the message's start, or not the exact form.
    wrong = [
        _kmsg(6, f"kernel said: {SEGFAULT_ORLIS}"),
        _kmsg(6, "python2[4598]: segfault at zz ip 1 sp 2 error 4"),
        _kmsg(6, "python2[]: segfault at 0 ip 1 sp 2 error 4"),
        _kmsg(6, "averyveryverylongname[4598]: segfault at 0 ip 1 sp 2 error 4"),
        _kmsg(6, "traps: python3[5120] general protection fault"),
        _kmsg(3, "Out of memory: Killed process x (python) total-vm:1kB, anon-rss:0kB"),
        _kmsg(6, "oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=7899"),
        # A dictionary line under a record is no record of its own.
        f" SUBSYSTEM={SEGFAULT_ORLIS}",
    ]
    assert _ends("\n".join(wrong)) == []


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_never_raises_and_keeps_only_short_names_and_facility_zero(text: str) -> None:
    for end in parse_kmsg_process_ends(text):
        assert 0 <= end.pid < 10**10
        assert len(end.comm) <= 15 and end.comm.isprintable()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 255),
    st.text(min_size=1, max_size=15).filter(lambda c: "\n" not in c),
    st.integers(1, 4_194_304),
)
def test_a_record_of_any_name_is_read_only_at_facility_zero(prio: int, comm: str, pid: int) -> None:
    line = _kmsg(
        prio, f"{comm}[{pid}]: segfault at 0 ip 0000000000401126 sp 00007ffc8a1e9f30 error 4"
    )
    ends = parse_kmsg_process_ends(line)
    if prio >> 3 != 0 or prio & 7 > 6:
        assert ends == ()
    elif comm.isprintable() and "\r" not in comm:
        assert [(e.pid, e.comm) for e in ends] == [(pid, comm)]
