"""The job a hook names, from the hook's environment or from a request on the socket.

Every field of a request is bounded (:meth:`JobRequest.from_request`): a job id of at most ten
digits, names of at most :data:`MAX_NAME_LENGTH` printable characters, GPU indices among the
node's GPUs, a node name as slurm.conf allows one; the epilog's own list of GPU holders
(:func:`holders_of`) likewise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nodescope.hooks.transport import Request
from nodescope.model.job_records import parse_gpu_list
from nodescope.slurm_names import NODE_NAME

#: Bounds of a request's fields: Slurm job ids are 32-bit numbers; user names are at most
#: LOGIN_NAME_MAX; the GPU list cannot be longer than the node's GPUs, and where the node's
#: GPUs are not known (no NVML, no /dev/nvidia<N>) no index reaches MAX_GPU_INDEX.
MAX_JOB_ID_DIGITS = 10
MAX_NAME_LENGTH = 256
MAX_EXIT_CODE_LENGTH = 32
MAX_GPU_INDEX = 256
MAX_HOLDERS = 1024


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A job as the hook environment describes it (``SLURM_JOB_ID``, ``SLURM_JOB_UID``, …)."""

    job_id: str
    uid: int | None = None
    user: str | None = None
    partition: str | None = None
    gpus: tuple[int, ...] = ()
    exit_code: str | None = None
    #: The Slurm node the hook runs for (``SLURMD_NODENAME``): the name the daemon gives
    #: scontrol when it drains the node during the job.
    node: str | None = None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> JobRequest:
        job_id = env.get("SLURM_JOB_ID", "")
        if not _is_job_id(job_id):
            raise ValueError(f"SLURM_JOB_ID is not a job id: {job_id!r}")
        uid_text = env.get("SLURM_JOB_UID", "")
        node = env.get("SLURMD_NODENAME", "")
        try:
            gpus = parse_gpu_list(env.get("SLURM_JOB_GPUS", ""))
        except ValueError:
            gpus = ()
        return cls(
            job_id=job_id,
            uid=int(uid_text) if uid_text.isdigit() and uid_text.isascii() else None,
            user=env.get("SLURM_JOB_USER") or None,
            partition=env.get("SLURM_JOB_PARTITION") or None,
            gpus=gpus,
            exit_code=env.get("SLURM_JOB_EXIT_CODE") or None,
            node=node if NODE_NAME.fullmatch(node) else None,
        )

    @classmethod
    def from_request(
        cls, request: Mapping[str, Any], node_gpus: frozenset[int] | None = None
    ) -> JobRequest:
        """The job a hook request names, every field bounded; ``ValueError`` names the
        field. ``node_gpus``: the node's GPU indices, when known; ``gpus`` must be among
        them (otherwise below :data:`MAX_GPU_INDEX`)."""
        job_id = request.get("job_id")
        if not _is_job_id(job_id):
            raise ValueError(f"job_id: not a job id: {_shown(job_id)}")
        assert isinstance(job_id, str)
        uid = request.get("uid")
        if uid is not None and not (is_int(uid) and 0 <= uid < 1 << 32):
            raise ValueError(f"uid: not a user id: {_shown(uid)}")
        gpus = request.get("gpus") or []
        limit = len(node_gpus) if node_gpus is not None else MAX_GPU_INDEX
        if not isinstance(gpus, list) or len(gpus) > limit:
            raise ValueError(f"gpus: expected a list of at most {limit} GPU indices")
        for gpu in gpus:
            if not (is_int(gpu) and 0 <= gpu < MAX_GPU_INDEX):
                raise ValueError(f"gpus: not a GPU index: {_shown(gpu)}")
            if node_gpus is not None and gpu not in node_gpus:
                known = ",".join(str(g) for g in sorted(node_gpus)) or "none"
                raise ValueError(f"gpus: {gpu} is not a GPU of this node (GPUs: {known})")

        def text(key: str, longest: int) -> str | None:
            value = request.get(key)
            if value is None or value == "":
                return None
            if not isinstance(value, str) or len(value) > longest or not value.isprintable():
                raise ValueError(f"{key}: expected printable text of at most {longest} characters")
            return value

        node = request.get("node")
        if node is not None and not (isinstance(node, str) and NODE_NAME.fullmatch(node)):
            raise ValueError(f"node: not a Slurm node name: {_shown(node)}")
        return cls(
            job_id=job_id,
            uid=uid,
            user=text("user", MAX_NAME_LENGTH),
            partition=text("partition", MAX_NAME_LENGTH),
            gpus=tuple(sorted(set(gpus))),
            exit_code=text("exit_code", MAX_EXIT_CODE_LENGTH),
            node=node,
        )

    def as_request(self) -> Request:
        return {
            "job_id": self.job_id,
            "uid": self.uid,
            "user": self.user,
            "partition": self.partition,
            "gpus": list(self.gpus),
            "exit_code": self.exit_code,
            "node": self.node,
        }


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_job_id(value: Any) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_JOB_ID_DIGITS
        and value.isascii()
        and value.isdigit()
    )


def _shown(value: Any) -> str:
    """A value for an error message, cut short: the request may be hostile."""
    return repr(value)[:40]


def holders_of(value: Any) -> list[dict[str, Any]]:
    """The epilog's own finding of GPU holders, bounded and typed."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_HOLDERS:
        raise ValueError(f"gpu_holders: expected a list of at most {MAX_HOLDERS}")
    out = []
    for holder in value:
        if not isinstance(holder, dict):
            raise ValueError("gpu_holders: expected objects")
        pid, gpu, comm = holder.get("pid"), holder.get("gpu"), holder.get("comm")
        if not (isinstance(pid, int) and isinstance(gpu, int)) or not (
            is_int(pid) and 0 < pid < 1 << 32 and is_int(gpu) and 0 <= gpu < MAX_GPU_INDEX
        ):
            raise ValueError("gpu_holders: pid and gpu must be numbers in range")
        if comm is not None and not (isinstance(comm, str) and len(comm) <= MAX_NAME_LENGTH):
            raise ValueError("gpu_holders: comm must be short text")
        out.append({"pid": pid, "gpu": gpu, "comm": comm})
    return out
