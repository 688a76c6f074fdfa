"""The simulated node's processes and cgroups: a pure cgroup v2 hierarchy
(Documentation/admin-guide/cgroup-v2.rst) with systemd's slices and Slurm's cgroup/v2 job
layout (docs/datasources.md §5), ``cgroup.{controllers,subtree_control,type,events,procs,
threads}``, ``memory.*``, ``cpu.stat``, ``io.stat``, ``pids.*`` and the pressure files; the
processes under ``proc/<pid>`` and their threads (fs/proc/array.c), and the ``proc/`` files
that list them or the node (``uptime``, ``diskstats``, ``locks``, ``mounts``, the daemon's
``mountstats``, ``net/snmp``). A process that exits leaves its cgroup."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nodescope.sim.node_base import CLK_TCK, PAGE, NodePart
from nodescope.sim.scenario import Job, ProcessSpec

#: Controllers of the root cgroup of a typical systemd host.
ROOT_CONTROLLERS = "cpuset cpu io memory hugetlb pids rdma misc"
CHILD_CONTROLLERS = "cpuset cpu io memory pids"

_PF_KTHREAD = 0x00200000
_PF_USER = 0x00400100
_ZERO_PSI = "".join(
    f"{kind} avg10=0.00 avg60=0.00 avg300=0.00 total=0\n" for kind in ("some", "full")
)


@dataclass
class Task:
    tid: int
    comm: str
    state: str
    wchan: str
    #: seconds of CPU per second of this thread
    cpu_share: float = 0.0
    utime: float = 0.0  # ticks
    stime: float = 0.0
    #: the cgroup the thread sits in when it is not its process's (``thread_cgroups``)
    cgroup: str | None = None


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    cgroup: str
    environ: bytes
    tasks: list[Task]
    rss_bytes: int
    kernel: bool = False
    job: Job | None = None
    spec: ProcessSpec | None = None
    replica: int = 0
    gpu: int | None = None
    starttime: int = 0
    cpu_percent: float = 0.0
    #: how many of its threads sit in another cgroup (``thread_cgroups``)
    placed: int = 0


@dataclass
class CgroupDir:
    path: str
    children: list[str] = field(default_factory=list)
    procs: list[int] = field(default_factory=list)
    memory_max: int | None = None
    events: dict[str, float] = field(default_factory=dict)
    #: threads placed here whose processes live in another cgroup, as (pid, tid)
    threads: list[tuple[int, int]] = field(default_factory=list)
    #: a threaded cgroup (``cgroup.type`` ``threaded``): it holds threads, never processes
    threaded: bool = False


#: systemd units of a GPU training node: (unit, comm, processes, threads per process)
_SERVICES: tuple[tuple[str, str, int, int], ...] = (
    ("systemd-journald.service", "systemd-journal", 1, 1),
    ("systemd-udevd.service", "systemd-udevd", 1, 1),
    ("systemd-logind.service", "systemd-logind", 1, 1),
    ("dbus.service", "dbus-daemon", 1, 1),
    ("ssh.service", "sshd", 1, 1),
    ("cron.service", "cron", 1, 1),
    ("rsyslog.service", "rsyslogd", 1, 4),
    ("chrony.service", "chronyd", 1, 1),
    ("munge.service", "munged", 1, 4),
    ("slurmd.service", "slurmd", 1, 3),
    ("nvidia-persistenced.service", "nvidia-persiste", 1, 1),
    ("nvidia-fabricmanager.service", "nv-fabricmanage", 1, 12),
    ("nvidia-dcgm.service", "nv-hostengine", 1, 24),
    ("containerd.service", "containerd", 1, 40),
    ("irqbalance.service", "irqbalance", 1, 2),
    ("lldpd.service", "lldpd", 2, 1),
    ("rpcbind.service", "rpcbind", 1, 1),
    ("rpc-gssd.service", "rpc.gssd", 1, 2),
    ("nfs-idmapd.service", "rpc.idmapd", 1, 1),
    ("node-exporter.service", "node_exporter", 1, 8),
    ("nodescope.service", "nodescope", 1, 3),
    ("opensm.service", "opensm", 1, 6),
    ("getty@tty1.service", "agetty", 1, 1),
    ("polkit.service", "polkitd", 1, 3),
    ("systemd-networkd.service", "systemd-network", 1, 1),
)
_KTHREAD_NAMES = (
    "kworker/{c}:0",
    "kworker/{c}:1H",
    "ksoftirqd/{c}",
    "migration/{c}",
    "cpuhp/{c}",
    "rcu_preempt",
    "kcompactd{n}",
    "nvme-wq",
    "ib-comp-wq",
    "irq/{i}-mlx5_comp{c}",
    "nv_queue",
    "kswapd{n}",
)
SLURM_SCOPE = "/system.slice/slurmstepd.scope"


def _proc_stat(proc: Proc, task: Task | None, threads: int, utime: float, stime: float) -> str:
    """One ``/proc/<pid>/stat`` or ``task/<tid>/stat`` line: 52 fields (fs/proc/array.c
    ``do_task_stat``); the comm is in parentheses and may hold spaces."""
    pid = proc.pid if task is None else task.tid
    head = proc.tasks[0]
    state = head.state if task is None else task.state
    comm = proc.comm if task is None else task.comm
    rss_pages = proc.rss_bytes // PAGE
    flags = _PF_KTHREAD if proc.kernel else _PF_USER
    vsize = 0 if proc.kernel else proc.rss_bytes * 4 + 200 * 2**20
    processor = pid % 224
    fields: list[int | str] = [
        pid, f"({comm})", state, proc.ppid, proc.pid, proc.pid if proc.kernel else 1, 0, -1,
        flags, 1000 + proc.pid % 997, 0, proc.pid % 7, 0, int(utime), int(stime), 0, 0,
        20, 0, threads, 0, proc.starttime, vsize, rss_pages, 18446744073709551615,
        1 if not proc.kernel else 0, 1 if not proc.kernel else 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 17, processor, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ]  # fmt: skip
    return " ".join(str(f) for f in fields) + "\n"


#: ``io.stat`` keys of one device (block/blk-cgroup.c).
_IO_FIELDS = ("rbytes", "wbytes", "rios", "wios", "dbytes", "dios")


_CPU_THROTTLE_FIELDS = ("nr_periods", "nr_throttled", "throttled_usec", "nr_bursts", "burst_usec")


def _memory_events(events: Mapping[str, float]) -> str:
    names = ("low", "high", "max", "oom", "oom_kill", "oom_group_kill")
    return "".join(f"{name} {int(events.get(name, 0.0))}\n" for name in names)


def _memory_stat(current: int) -> str:
    anon = current * 8 // 10
    file = current - anon
    return (
        f"anon {anon}\nfile {file}\nkernel {current // 50}\nsock 0\nshmem 0\n"
        f"file_dirty 0\nfile_writeback 0\npgfault {current // PAGE}\npgmajfault 0\n"
    )


def _limit(value: int | None) -> str:
    return "max\n" if value is None else f"{value}\n"


class ProcessesPart(NodePart):
    """The processes, their threads and their cgroups on the node, and the ``proc/`` files."""

    def build_processes(self) -> None:
        node = self.node
        hw = node.hardware
        next_pid = 1
        boot_ticks = 0

        def cgroup(path: str) -> CgroupDir:
            found = node.cgroups.get(path)
            if found is None:
                found = CgroupDir(path)
                node.cgroups[path] = found
                if path != "/":
                    parent = path.rsplit("/", 1)[0] or "/"
                    cgroup(parent).children.append(path)
            return found

        cgroup("/")

        def add(
            comm: str,
            cg: str,
            *,
            threads: Sequence[tuple[str, int]] = (),
            kernel: bool = False,
            ppid: int = 1,
            cmdline: str | None = None,
            environ: Mapping[str, str] | None = None,
            rss: int = 12 * 2**20,
            state: str = "S",
            wchan: str = "do_epoll_wait",
        ) -> Proc:
            nonlocal next_pid
            pid = next_pid
            next_pid += 1
            tasks = [Task(pid, comm, state, wchan)]
            for name, n in threads:
                for _ in range(n):
                    tasks.append(Task(next_pid, name, "S", "futex_wait_queue"))
                    next_pid += 1
            env = b"".join(f"{k}={v}\0".encode() for k, v in (environ or {}).items())
            proc = Proc(
                pid=pid,
                ppid=ppid,
                comm=comm,
                cmdline="" if kernel else (cmdline or comm),
                cgroup=cg,
                environ=env,
                tasks=tasks,
                rss_bytes=0 if kernel else rss,
                kernel=kernel,
                starttime=boot_ticks + pid,
            )
            node.procs[pid] = proc
            cgroup(cg).procs.append(pid)
            return proc

        budget = hw.os.background_processes
        base_env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
        if budget > 0:
            add("systemd", "/init.scope", cmdline="/sbin/init", environ=base_env, rss=14 * 2**20)
        if budget > 1:
            add("kthreadd", "/", kernel=True, ppid=0, state="S", wchan="kthreadd")
        made = min(budget, 2)
        for unit, comm, count, nthreads in _SERVICES:
            for _ in range(count):
                if made >= budget:
                    break
                extra = [(comm, nthreads - 1)] if nthreads > 1 else []
                proc = add(comm, f"/system.slice/{unit}", threads=extra, environ=base_env)
                if unit == "nodescope.service":
                    node.daemon_pid = proc.pid
                made += 1
        sessions = 0
        while made < budget and sessions < 4:
            uid = 1001 + sessions
            scope = f"/user.slice/user-{uid}.slice/session-{sessions + 3}.scope"
            for comm in ("sshd", "bash", "tmux: server", "top"):
                if made >= budget:
                    break
                add(comm, scope, environ={**base_env, "USER": f"user{uid}"}, rss=6 * 2**20)
                made += 1
            sessions += 1
        cpus = hw.cpu.cpu_count
        i = 0
        while made < budget:
            pattern = _KTHREAD_NAMES[i % len(_KTHREAD_NAMES)]
            name = pattern.format(c=(i // len(_KTHREAD_NAMES)) % cpus, n=i % 2, i=100 + i)[:15]
            add(name, "/", kernel=True, ppid=2, state="I" if "kworker" in name else "S", wchan="0")
            made += 1
            i += 1

        for spec in hw.os.system_processes:
            procs = []
            for replica in range(spec.count):
                proc = add(
                    spec.comm,
                    spec.cgroup,
                    threads=spec.threads,
                    kernel=spec.kernel,
                    ppid=2 if spec.kernel else 1,
                    cmdline=spec.cmdline,
                    environ=None if spec.kernel else base_env,
                    rss=spec.rss_bytes or 0,
                    state=spec.state,
                    wchan=spec.wchan,
                )
                for task in proc.tasks:
                    task.state, task.wchan = spec.state, spec.wchan
                proc.spec, proc.replica = spec, replica
                proc.cpu_percent = spec.cpu_percent
                procs.append(proc)
            node.by_key[spec.key] = procs
        for job in node.scenario.jobs:
            next_pid = (next_pid // 1000 + 1) * 1000
            self.add_job(job, add, cgroup)
        for job in node.scenario.jobs:
            node.cgroups[f"{SLURM_SCOPE}/job_{job.id}"].memory_max = job.memory_max_job
            node.cgroups[
                f"{SLURM_SCOPE}/job_{job.id}/step_{job.step}"
            ].memory_max = job.memory_max_step
        if not node.daemon_pid:
            node.daemon_pid = (
                1 if node.procs else add("nodescope", "/system.slice/nodescope.service").pid
            )

    def add_job(self, job: Job, add: Any, cgroup: Any) -> None:
        node = self.node
        job_cg = f"{SLURM_SCOPE}/job_{job.id}"
        if node.scenario.jobs and f"{SLURM_SCOPE}/system" not in node.cgroups:
            add("slurmstepd", f"{SLURM_SCOPE}/system", cmdline="slurmstepd: [infinity]")
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "USER": job.user,
            "HOME": f"/home/{job.user}",
            "SLURM_JOB_ID": str(job.id),
            "SLURM_JOB_USER": job.user,
            "SLURM_JOB_UID": str(job.uid),
        }
        if job.gpus:
            # Slurm sets the job's global GPU indices in the batch environment.
            env["SLURM_JOB_GPUS"] = ",".join(str(g) for g in job.gpus)
        for step in ("extern", "batch", job.step):
            add(
                "slurmstepd",
                f"{job_cg}/step_{step}/slurm",
                threads=[("slurmstepd", 4)],
                cmdline=f"slurmstepd: [{job.id}.{step}]",
                rss=24 * 2**20,
            )
        add(
            "sleep",
            f"{job_cg}/step_extern/user/task_special",
            cmdline="sleep 100000000",
            environ=env,
            rss=2**20,
            wchan="hrtimer_nanosleep",
        )
        add(
            "bash",
            f"{job_cg}/step_batch/user/task_0",
            cmdline=f"/bin/bash /var/spool/slurmd/job{job.id}/slurm_script",
            environ=env,
            rss=4 * 2**20,
            wchan="do_wait",
        )
        # Processes without their own rss share what the job's memory.current leaves.
        fixed = sum(p.count * p.rss_bytes for p in job.processes if p.rss_bytes is not None)
        weight = sum(p.count for p in job.processes if p.rss_bytes is None) or 1
        share = max(0, job.memory_current_bytes - fixed) // weight
        for spec in job.processes:
            procs: list[Proc] = []
            for replica in range(spec.count):
                gpu = job.gpus[replica] if spec.gpu == -1 else spec.gpu
                if spec.cgroup == "task":
                    # Ranks have a task each; helpers share them round-robin.
                    cg = f"{job_cg}/step_{job.step}/user/task_{replica % max(1, len(job.gpus))}"
                elif spec.cgroup == "batch":
                    cg = f"{job_cg}/step_batch/user/task_0"
                elif spec.cgroup == "extern":
                    cg = f"{job_cg}/step_extern/user/task_special"
                else:
                    cg = spec.cgroup
                environ = {
                    **env,
                    "SLURM_STEP_ID": job.step,
                    "SLURM_PROCID": str(replica),
                    "SLURM_LOCALID": str(replica),
                }
                if gpu is not None:
                    environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
                elif job.gpus:
                    environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in job.gpus)
                if job.nics:
                    environ["NCCL_IB_HCA"] = ",".join(job.nics)
                environ.update(dict(spec.environ))
                proc = add(
                    spec.comm,
                    cg,
                    threads=spec.threads,
                    cmdline=spec.cmdline,
                    environ=environ,
                    rss=share if spec.rss_bytes is None else spec.rss_bytes,
                    state=spec.state,
                    wchan=spec.wchan,
                )
                for task in proc.tasks:
                    task.state, task.wchan = spec.state, spec.wchan
                self.place_threads(proc, spec, cgroup)
                proc.job, proc.spec, proc.replica, proc.gpu = job, spec, replica, gpu
                proc.cpu_percent = spec.cpu_percent
                procs.append(proc)
            node.by_key[spec.key] = procs
        cgroup(job_cg)

    def place_threads(
        self, proc: Proc, spec: ProcessSpec, cgroup: Callable[[str], CgroupDir]
    ) -> None:
        """Move the threads ``thread_cgroups`` names into their cgroup: a threaded cgroup,
        below the process's own for a relative path (its threaded subtree) or elsewhere for
        an absolute one, whose ``cgroup.threads`` lists them and not the process's."""
        placed = dict(spec.thread_cgroups)
        for task in proc.tasks[1:]:
            where = placed.get(task.comm)
            if where is None:
                continue
            path = where if where.startswith("/") else f"{proc.cgroup}/{where}"
            target = cgroup(path)
            target.threaded = True
            target.threads.append((proc.pid, task.tid))
            task.cgroup = path
            proc.placed += 1

    def subtree(self, path: str) -> Iterable[CgroupDir]:
        node = self.node
        stack = [path]
        while stack:
            cg = node.cgroups[stack.pop()]
            yield cg
            stack.extend(cg.children)

    def write_cgroups(self, initial: bool = False) -> None:
        node = self.node
        files = node.files
        base = node.roots.cgroupfs
        dirty, node.dirty_cgroups = node.dirty_cgroups, set()
        # Totals over each subtree, children before parents.
        order = sorted(node.cgroups, key=lambda p: p.count("/") if p != "/" else 0, reverse=True)
        memory: dict[str, int] = {}
        usage: dict[str, float] = {}
        tasks: dict[str, int] = {}
        events: dict[str, dict[str, float]] = {}
        for path in order:
            cg = node.cgroups[path]
            procs = [node.procs[pid] for pid in cg.procs]
            memory[path] = sum(p.rss_bytes for p in procs) + sum(memory[c] for c in cg.children)
            usage[path] = sum(
                (t.utime + t.stime) * (1_000_000 / CLK_TCK) for p in procs for t in p.tasks
            ) + sum(usage[c] for c in cg.children)
            own_threads = sum(len(p.tasks) - p.placed for p in procs)
            placed = sum(1 for pid, _ in cg.threads if pid in node.procs) if cg.threads else 0
            tasks[path] = own_threads + placed + sum(tasks[c] for c in cg.children)
            merged = dict(cg.events)
            for child in cg.children:
                for key, value in events[child].items():
                    merged[key] = merged.get(key, 0.0) + value
            events[path] = merged
        for path, cg in node.cgroups.items():
            directory = base if path == "/" else base / path.lstrip("/")
            root = path == "/"
            used = int(usage[path])
            user = int(used * 0.9)
            cpu_stat = f"usage_usec {used}\nuser_usec {user}\nsystem_usec {used - user}\n"
            if not root:  # the cpu controller's throttling fields
                cpu_stat += "".join(f"{k} 0\n" for k in _CPU_THROTTLE_FIELDS)
            files.write(directory / "cpu.stat", cpu_stat)
            if not root:
                files.write(directory / "memory.events", _memory_events(events[path]))
                files.write(directory / "memory.events.local", _memory_events(cg.events))
            if path in node.psi_paths:
                for resource in ("cpu", "memory", "io"):
                    files.write(directory / f"{resource}.pressure", self.pressure(path, resource))
            if path in node.io_paths:
                files.write(directory / "io.stat", self.io_stat(path))
            if not initial and path not in dirty:
                continue
            procs = [node.procs[pid] for pid in cg.procs]
            if not cg.threaded:
                # A threaded cgroup refuses to list processes (EOPNOTSUPP): no file to read.
                files.write(directory / "cgroup.procs", "".join(f"{p.pid}\n" for p in procs))
            own = [t.tid for p in procs for t in p.tasks if not p.placed or t.cgroup is None]
            here = [tid for pid, tid in cg.threads if pid in node.procs]
            files.write(directory / "cgroup.threads", "".join(f"{tid}\n" for tid in own + here))
            files.write(
                directory / "cgroup.subtree_control",
                f"{CHILD_CONTROLLERS}\n" if cg.children else "\n",
            )
            files.write(
                directory / "cgroup.stat",
                f"nr_descendants {len(list(self.subtree(path))) - 1}\nnr_dying_descendants 0\n",
            )
            if initial:
                if path not in node.io_paths:
                    files.write(directory / "io.stat", "")
                if path not in node.psi_paths:
                    for kind in ("cpu", "memory", "io"):
                        files.write(directory / f"{kind}.pressure", _ZERO_PSI)
            if root:
                files.write(directory / "cgroup.controllers", f"{ROOT_CONTROLLERS}\n")
                files.write(directory / "memory.stat", _memory_stat(memory[path]))
                continue
            files.write(directory / "cgroup.controllers", f"{CHILD_CONTROLLERS}\n")
            files.write(directory / "cgroup.type", f"{self.cgroup_type(cg)}\n")
            files.write(
                directory / "cgroup.events", f"populated {1 if tasks[path] else 0}\nfrozen 0\n"
            )
            files.write(directory / "memory.current", f"{memory[path]}\n")
            files.write(directory / "memory.peak", f"{memory[path]}\n")
            files.write(directory / "memory.max", _limit(cg.memory_max))
            files.write(directory / "memory.high", "max\n")
            files.write(directory / "memory.stat", _memory_stat(memory[path]))
            files.write(directory / "pids.current", f"{tasks[path]}\n")
            files.write(directory / "pids.max", "max\n")

    def cgroup_type(self, cg: CgroupDir) -> str:
        """``threaded`` for a cgroup of threads, ``domain threaded`` for the root of a
        threaded subtree (a process's cgroup with threaded cgroups below it), else
        ``domain`` (Documentation/admin-guide/cgroup-v2.rst, "Threads")."""
        node = self.node
        if cg.threaded:
            return "threaded"
        if any(node.cgroups[c].threaded for c in cg.children):
            return "domain threaded"
        return "domain"

    def pressure(self, path: str, resource: str) -> str:
        """``<resource>.pressure`` (kernel/sched/psi.c ``psi_show``): the share of time some or
        all of the cgroup's tasks stalled, averaged over 10, 60 and 300 s, and the total
        stall in microseconds."""
        node = self.node
        averages = node.psi_avg.get((path, resource), (0.0,) * 6)
        lines = []
        for i, kind in enumerate(("some", "full")):
            avg10, avg60, avg300 = averages[3 * i : 3 * i + 3]
            total = int(node.acc.get(("psi", path, resource, kind), 0.0))
            lines.append(
                f"{kind} avg10={avg10:.2f} avg60={avg60:.2f} avg300={avg300:.2f} total={total}\n"
            )
        return "".join(lines)

    def io_stat(self, path: str) -> str:
        """``io.stat`` (block/blk-cgroup.c ``blkcg_print_one_stat``): one line per device the
        cgroup's tasks did I/O on, bytes and requests since the cgroup was made."""
        node = self.node
        lines = []
        for drive in node.hardware.nvme:
            values = [int(node.acc.get(("io", path, drive.disk, f), 0.0)) for f in _IO_FIELDS]
            if any(values):
                named = " ".join(f"{f}={v}" for f, v in zip(_IO_FIELDS, values, strict=True))
                lines.append(f"{drive.major}:{drive.minor} {named}\n")
        return "".join(lines)

    def write_process(self, proc: Proc, initial: bool) -> None:
        node = self.node
        files = node.files
        directory = node.roots.procfs / str(proc.pid)
        threads = len(proc.tasks)
        utime = sum(t.utime for t in proc.tasks)
        stime = sum(t.stime for t in proc.tasks)
        files.write(directory / "stat", _proc_stat(proc, None, threads, utime, stime))
        files.write(directory / "wchan", proc.tasks[0].wchan)
        for task in proc.tasks:
            task_dir = directory / "task" / str(task.tid)
            files.write(task_dir / "stat", _proc_stat(proc, task, threads, task.utime, task.stime))
            files.write(task_dir / "wchan", task.wchan)
            if initial:
                files.write(task_dir / "comm", f"{task.comm}\n")
                if proc.job is not None:
                    # Where each thread of a job process sits (what the jobs source reads of
                    # a thread missing from the job's cgroup.threads).
                    files.write(task_dir / "cgroup", f"0::{task.cgroup or proc.cgroup}\n")
        if initial:
            files.write(directory / "comm", f"{proc.comm}\n")
            files.write(
                directory / "cmdline",
                b"" if proc.kernel else proc.cmdline.replace(" ", "\0").encode() + b"\0",
            )
            files.write(directory / "cgroup", f"0::{proc.cgroup}\n")
            files.write(directory / "environ", proc.environ)

    def write_processes(self, initial: bool = False) -> None:
        node = self.node
        for proc in node.procs.values():
            self.write_process(proc, initial)
        if initial:
            node.files.symlink(node.roots.procfs / "self", node.roots.procfs / str(node.daemon_pid))
            node.files.symlink(node.roots.procfs / "mounts", node.roots.procfs / "self" / "mounts")

    def write_proc_files(self) -> None:
        node = self.node
        procfs = node.roots.procfs
        files = node.files
        uptime = node.hardware.os.uptime_seconds + node.t
        idle = uptime * node.hardware.cpu.cpu_count * 0.9
        files.write(procfs / "uptime", f"{uptime:.2f} {idle:.2f}\n")
        files.write(procfs / "diskstats", node.disks.diskstats())
        files.write(procfs / "locks", self.locks())
        daemon = procfs / str(node.daemon_pid)
        files.write(daemon / "mountstats", node.disks.mountstats())
        files.write(daemon / "mounts", node.disks.mounts())
        files.write(daemon / "mountinfo", node.disks.mountinfo())
        files.write(procfs / "net" / "snmp", node.network.snmp())
        load = sum(p.cpu_percent for p in node.procs.values()) / 100.0
        last_pid = max(node.procs, default=1)
        files.write(
            procfs / "loadavg",
            f"{load:.2f} {load:.2f} {load:.2f} 3/{len(node.procs)} {last_pid}\n",
        )

    def locks(self) -> str:
        node = self.node
        lines = [
            f"1: FLOCK  ADVISORY  WRITE {node.daemon_pid} 00:19:1042 0 EOF\n",
            "2: POSIX  ADVISORY  WRITE 1 00:19:1 0 EOF\n",
        ]
        number = 3
        for activity in node.active("lock", node.t):
            mount = node.hardware.mount(activity.get("mount"))
            device = f"{mount.major:02x}:{mount.minor:02x}:{activity.get('inode')}"
            lock_type = activity.get("type")
            holders = self.refs(activity.get("holder"))
            if not holders:
                continue
            lines.append(
                f"{number}: POSIX  ADVISORY  {lock_type} {holders[0].pid} {device} 0 EOF\n"
            )
            for ref in activity.get("waiters"):
                for waiter in self.refs(ref):
                    lines.append(
                        f"{number}: -> POSIX  ADVISORY  {lock_type} {waiter.pid} {device} 0 EOF\n"
                    )
            number += 1
        return "".join(lines)

    def refs(self, ref: str) -> list[Proc]:
        """The processes ``key`` or ``key#replica`` names that have not exited."""
        node = self.node
        key, _, replica = ref.partition("#")
        procs = node.by_key.get(key, [])
        named = procs if not replica else [procs[int(replica)]]
        return [p for p in named if p.pid in node.procs]

    def exit_process(self, proc: Proc) -> None:
        """The process and its threads are gone: its ``/proc`` directory, its place in its
        cgroup (which no longer counts its memory and tasks) and its NVML compute process."""
        node = self.node
        del node.procs[proc.pid]
        node.dirty_pids.discard(proc.pid)
        node.overridden.discard(proc.pid)
        cg = node.cgroups[proc.cgroup]
        cg.procs.remove(proc.pid)
        # Its cgroup and those its threads were placed in, with their ancestors.
        for path in {proc.cgroup, *(t.cgroup for t in proc.tasks if t.cgroup is not None)}:
            while True:
                node.dirty_cgroups.add(path)
                if path == "/":
                    break
                path = path.rsplit("/", 1)[0] or "/"
        node.files.remove_tree(node.roots.procfs / str(proc.pid))
        if proc.gpu is not None:
            node.gpu_processes[proc.gpu] = tuple(
                entry for entry in node.gpu_processes[proc.gpu] if entry[0] != proc.pid
            )
