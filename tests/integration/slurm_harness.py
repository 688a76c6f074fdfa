"""A single-node Slurm cluster on 127.0.0.1 for tests: munged, slurmctld and slurmd.

Debian's slurm-wlm (22.05) and munge, started by hand with a config directory of our own:
non-default ports, state and logs under a temp
directory, fake GPUs through GRES on ``mknod`` character devices (``gres.conf`` rejects
regular files and sets no GPU variables for them), ``PrologFlags=Alloc`` so the prolog runs
when the job is allocated, and ``proctrack/cgroup`` + ``task/cgroup`` with
``CgroupPlugin=cgroup/v1`` so that jobs get the v1 layout
``<controller>/slurm/uid_<uid>/job_<id>/step_<s>/task_<n>`` (cgroup/v2 cannot run on a hybrid
host). Every daemon is stopped by its PID in :meth:`SlurmCluster.stop`, in the order that lets
each one finish cleanly: jobs first, then slurmd, slurmctld and munged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import free_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "srun")
SBIN = (Path("/usr/sbin"), Path("/usr/bin"))


def find_binary(name: str) -> str | None:
    for directory in SBIN:
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if find_binary(name) is None]


def skip_reason() -> str | None:
    """Why a single-node cluster cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "Slurm daemons need root"
    missing = missing_binaries()
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: slurm-wlm munge)"
    for controller in ("memory", "freezer"):
        if not (Path("/sys/fs/cgroup") / controller / "cgroup.procs").exists():
            return f"no cgroup v1 {controller} hierarchy for Slurm's cgroup/v1"
    return None


def _read_pid(path: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        if text.isdigit():
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(f"no pid in {path} after {timeout}s")


def _pairs(record: str) -> dict[str, str]:
    """A one-line Slurm record (``scontrol show … -o``, a jobcomp/filetxt line) as its
    ``key=value`` pairs; values hold no spaces there, but for a node's Reason (see node_info)."""
    pairs: dict[str, str] = {}
    for part in record.split():
        key, _, value = part.partition("=")
        pairs[key] = value
    return pairs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie child of ours still answers kill(0): reap it if it is one.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        stat = Path(f"/proc/{pid}/stat")
        try:
            return stat.read_text().split(") ", 1)[1][0] != "Z"
        except (OSError, IndexError):
            return False


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait up to ``timeout``, then SIGKILL."""
    if not _alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.05)


@dataclass
class SlurmCluster:
    """One node named after this host, ``gpus`` fake GPUs, hooks ``prolog``/``epilog``."""

    workdir: Path
    gpus: int = 2
    prolog: str | None = None
    epilog: str | None = None
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    pids: dict[str, int] = field(default_factory=dict)
    #: Nodes that only exist in slurm.conf (no slurmd: Slurm holds them DOWN), members of the
    #: partition too: a partition of several nodes on one host.
    extra_nodes: tuple[str, ...] = ()
    #: More slurm.conf lines (``HealthCheckProgram=...``), written before the node lines.
    extra_config: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.etc = self.workdir / "etc"
        self.state = self.workdir / "state"
        self.spool = self.workdir / "spool"
        self.log = self.workdir / "log"
        self.run = self.workdir / "run"
        self.dev = self.workdir / "dev"
        self.munge_dir = self.workdir / "munge"
        self.slurm_conf = self.etc / "slurm.conf"
        self.jobcomp_log = self.log / "jobcomp.log"
        self.munge_socket = self.munge_dir / "munge.socket.2"
        self.ctld_port = free_port()
        self.slurmd_port = free_port()
        # Where the extra nodes' slurmd would listen and none does. On slurmd's own port, the
        # one slurmd on 127.0.0.0/8 would answer for them too: three health checks every
        # interval, all run here as this node's.
        self.absent_port = free_port()

    # -- configuration -------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, squeue, scontrol)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.slurm_conf)
        return env

    def gpu_devices(self) -> list[Path]:
        return [self.dev / f"nvidia{i}" for i in range(self.gpus)]

    def write_config(self) -> None:
        for directory in (self.etc, self.state, self.spool, self.log, self.run, self.dev):
            directory.mkdir(parents=True, exist_ok=True)
        # munged insists on a socket directory that others can enter but not write.
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.munge_dir, 0o755)
        for index, path in enumerate(self.gpu_devices()):
            if not path.exists():
                os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))
        lines = [
            "ClusterName=nodescopetest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.state}",
            f"SlurmdSpoolDir={self.spool}",
            f"SlurmctldPidFile={self.run}/slurmctld.pid",
            f"SlurmdPidFile={self.run}/slurmd.pid",
            f"SlurmctldLogFile={self.log}/slurmctld.log",
            f"SlurmdLogFile={self.log}/slurmd.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/cgroup",
            "TaskPlugin=task/cgroup",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            # Each ended job's final state, kept after MinJobAge lets slurmctld forget it: a
            # test polling a loaded machine can miss the short window where scontrol shows it.
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp_log}",
            "MpiDefault=none",
            "ReturnToService=2",
            "GresTypes=gpu",
            "PrologFlags=Alloc",
            "KillWait=2",
            "MinJobAge=2",
            "InactiveLimit=0",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            "SchedulerParameters=sched_interval=1",
        ]
        if self.prolog:
            lines.append(f"Prolog={self.prolog}")
        if self.epilog:
            lines.append(f"Epilog={self.epilog}")
        lines.extend(self.extra_config)
        cpus = os.cpu_count() or 1
        lines += [
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1024"
            f" Gres=gpu:{self.gpus} State=UNKNOWN",
            *(
                f"NodeName={name} NodeAddr=127.0.0.2 Port={self.absent_port} CPUs=1"
                " RealMemory=100 State=DOWN"
                for name in self.extra_nodes
            ),
            f"PartitionName=test Nodes={','.join((self.node, *self.extra_nodes))} Default=YES"
            " MaxTime=10 State=UP",
        ]
        self.slurm_conf.write_text("\n".join(lines) + "\n")
        files = ",".join(str(p) for p in self.gpu_devices())
        (self.etc / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu File={files}\n"
        )
        (self.etc / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=yes\n"
            "ConstrainDevices=yes\n"
        )

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> None:
        self.write_config()
        key = self.munge_dir / "munge.key"
        if not key.exists():
            subprocess.run(
                [find_binary("mungekey") or "mungekey", "--create", f"--keyfile={key}"],
                check=True,
                capture_output=True,
            )
            os.chmod(key, 0o600)
        munged = find_binary("munged") or "munged"
        subprocess.run(
            [
                munged,
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--log-file={self.munge_dir / 'munged.log'}",
                f"--pid-file={self.munge_dir / 'munged.pid'}",
                f"--seed-file={self.munge_dir / 'munged.seed'}",
                "--force",
            ],
            check=True,
            capture_output=True,
        )
        self.pids["munged"] = _read_pid(self.munge_dir / "munged.pid", timeout)
        env = self.env
        subprocess.run(
            [find_binary("slurmctld") or "slurmctld", "-i", "-f", str(self.slurm_conf)],
            check=True,
            env=env,
            capture_output=True,
        )
        self.pids["slurmctld"] = _read_pid(self.run / "slurmctld.pid", timeout)
        subprocess.run(
            [find_binary("slurmd") or "slurmd", "-f", str(self.slurm_conf)],
            check=True,
            env=env,
            capture_output=True,
        )
        self.pids["slurmd"] = _read_pid(self.run / "slurmd.pid", timeout)
        self.wait_node_state(("IDLE",), timeout)

    def stop(self) -> None:
        """Wait for the queue to drain (cancelling what is left), then stop the daemons."""
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"]):
            self.scontrol_quiet(["scancel", "--quiet", "-u", "root"])
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.queue():
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                stop_pid(pid)
        self._remove_cgroups()

    def _remove_cgroups(self) -> None:
        """Slurm's cgroup/v1 leaves its empty ``slurm_<node>`` directories behind."""
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / f"slurm_{self.node}"
            if not top.is_dir() or (hierarchy / "cgroup.controllers").exists():
                continue
            for current, _, _ in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(current)  # only empty cgroups go; busy ones stay

    # -- clients -------------------------------------------------------------------------
    def client(
        self, argv: list[str], timeout: float = 15.0, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        binary = find_binary(argv[0]) or argv[0]
        return subprocess.run(
            [binary, *argv[1:]],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def scontrol_quiet(self, argv: list[str]) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.client(argv, timeout=10)

    def queue(self) -> list[str]:
        result = self.client(["squeue", "-h", "-o", "%i %T"])
        return [line for line in result.stdout.splitlines() if line.strip()]

    def sbatch(self, args: list[str], script: str) -> str:
        result = self.client(["sbatch", "--parsable", *args, "--wrap", script])
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr}")
        return result.stdout.strip().split(";")[0]

    def node_info(self, node: str | None = None) -> dict[str, str]:
        """``scontrol show node -o`` as key=value pairs (Reason may hold spaces: it is last)."""
        out = self.client(["scontrol", "show", "node", "-o", node or self.node]).stdout.strip()
        info: dict[str, str] = {}
        reason_at = out.find(" Reason=")
        if reason_at >= 0:
            info["Reason"] = out[reason_at + len(" Reason=") :].strip()
            out = out[:reason_at]
        info.update(_pairs(out))
        return info

    def wait_node_state(self, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.node_info()
            state = info.get("State", "")
            if any(s in state.split("+") for s in states):
                return info
            time.sleep(0.2)
        raise TimeoutError(f"node not in {states} after {timeout}s: {info}; {self.logs()}")

    def job_state(self, job: str) -> str:
        """The job's state from slurmctld, or from the completion log once slurmctld has
        forgotten it; "GONE" only when neither knows it, "" when slurmctld did not answer."""
        try:
            result = self.client(["scontrol", "show", "job", "-o", job])
        except subprocess.TimeoutExpired:
            return ""
        state = _pairs(result.stdout).get("JobState", "")
        if state:
            return state
        if "Invalid job id" not in result.stderr:
            return ""
        ended = self.ended_state(job)
        return ended or "GONE"

    def ended_state(self, job: str) -> str:
        """The last state jobcomp/filetxt recorded for the job ("" when none)."""
        try:
            lines = self.jobcomp_log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        state = ""
        for line in lines:
            record = _pairs(line)
            if record.get("JobId") == job:
                state = record.get("JobState", "")
        return state

    def wait_job_done(self, job: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job} still {state} after {timeout}s; {self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.log / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-30:]))
        return "\n".join(parts)
