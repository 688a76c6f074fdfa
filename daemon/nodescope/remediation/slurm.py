"""Slurm as the remediation sees it: nodes and partitions read with ``scontrol``, drains,
resumes and requeues made with it, every call bounded by a timeout.

Reads (Slurm 22.05 and later print the same layout):

* ``scontrol show node --oneliner [NAME]``: one line per node of ``Key=Value`` fields separated
  by single spaces. Values of a few keys hold spaces (``OS=Linux 6.1.0 #1 SMP ...``); those
  words carry no ``=`` of an upper-case key and continue the previous value. ``Reason=`` is
  always the last field and runs to the end of the line, followed by Slurm's
  `` [user@YYYY-MM-DDTHH:MM:SS]`` (who set it, when), which :func:`parse_nodes` splits off.
  ``State=`` is the base state and its flags joined by ``+`` (``IDLE+DRAIN``,
  ``DOWN+DRAIN+NOT_RESPONDING``, ``MIXED+DRAIN``); ``Partitions=`` a comma list.
* ``scontrol show partition --oneliner [NAME]``: likewise, ``PartitionName=`` first and
  ``TotalNodes=`` the node count (every member, down or not).
* ``sinfo -R -h -N -o "%N|%E"``: what an operator reads in ``sinfo -R``, one line per node.

The parsers are pure and take any text: a line they cannot read is skipped and counted in
:attr:`Parsed.skipped`, never raised. ``scontrol`` is run with the node's ``SLURM_CONF`` (the
environment is passed through) and without a shell.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from nodescope.remediation.policy import NodeView, PartitionLoad, is_nodescope_reason
from nodescope.slurm_names import JOB_ID, NODE_NAME

T = TypeVar("T")

#: Output of one scontrol call read at most: a cluster of 10 000 nodes prints about 12 MB.
MAX_OUTPUT = 32 << 20
#: A field name as scontrol prints it: ``NodeName``, ``CfgTRES``, ``LastBusyTime``,
#: ``AllocTRES``, ``CurrentWatts``, ``ExtSensorsJoules``, ``Mcs_label``.
_FIELD = re.compile(r"[A-Z][A-Za-z0-9_]*=")
#: Slurm's suffix to a reason: who set it and when.
_REASON_SUFFIX = re.compile(r"\s*\[[^\[\]@]*@[0-9T:\-]+\]\s*$")
#: Slurm states that mean the node takes no new job because it is drained or draining.
DRAIN_FLAGS = frozenset({"DRAIN", "DRAINED", "DRAINING"})


@dataclass(frozen=True, slots=True)
class Parsed(Generic[T]):
    """What a parser read, and how many lines it could not."""

    items: tuple[T, ...]
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    state: str
    flags: frozenset[str]
    reason: str | None
    partitions: tuple[str, ...]
    hostname: str = ""

    @property
    def drained(self) -> bool:
        return bool(self.flags & DRAIN_FLAGS)


@dataclass(frozen=True, slots=True)
class SlurmPartition:
    name: str
    total_nodes: int
    fields: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


def split_fields(line: str) -> dict[str, str] | None:
    """A ``--oneliner`` line as a mapping, or ``None`` when it does not start with a field.
    ``Reason=`` takes the rest of the line."""
    line = line.rstrip("\r\n")
    if not line or _FIELD.match(line) is None or not line.isprintable():
        return None
    fields: dict[str, str] = {}
    reason_at = line.find(" Reason=")
    if reason_at >= 0:
        fields["Reason"] = line[reason_at + len(" Reason=") :]
        line = line[:reason_at]
    current: str | None = None
    for word in line.split(" "):
        match = _FIELD.match(word)
        if match is not None:
            current = word[: match.end() - 1]
            fields.setdefault(current, word[match.end() :])
        elif current is not None and word:
            fields[current] += " " + word
    return fields


def strip_reason(raw: str | None) -> str | None:
    """A reason without Slurm's ``[user@time]`` suffix; ``None`` for none (``(null)``)."""
    if raw is None:
        return None
    text = _REASON_SUFFIX.sub("", raw).strip()
    return None if text in ("", "(null)", "none") else text


def _parse_lines(text: str, read: Callable[[str], T | None]) -> Parsed[T]:
    """What ``read`` makes of each line of ``text`` that is not blank; a line it gives
    ``None`` for is counted as skipped."""
    items: list[T] = []
    skipped = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        item = read(line)
        if item is None:
            skipped += 1
        else:
            items.append(item)
    return Parsed(tuple(items), skipped)


def _node(line: str) -> SlurmNode | None:
    fields = split_fields(line)
    name = fields.get("NodeName", "") if fields else ""
    state = fields.get("State", "") if fields else ""
    if fields is None or not NODE_NAME.fullmatch(name) or not state:
        return None
    parts = [p for p in state.rstrip("*~#!%$@^-").split("+") if p]
    partitions = fields.get("Partitions", "")
    return SlurmNode(
        name=name,
        state=parts[0] if parts else state,
        flags=frozenset(parts),
        reason=strip_reason(fields.get("Reason")),
        partitions=tuple(p for p in partitions.split(",") if p and p != "(null)"),
        hostname=fields.get("NodeHostName", ""),
    )


def parse_nodes(text: str) -> Parsed[SlurmNode]:
    """``scontrol show node --oneliner`` output."""
    return _parse_lines(text, _node)


def _partition(line: str) -> SlurmPartition | None:
    fields = split_fields(line)
    name = fields.get("PartitionName", "") if fields else ""
    total = fields.get("TotalNodes", "") if fields else ""
    if fields is None or not NODE_NAME.fullmatch(name) or not re.fullmatch(r"[0-9]{1,9}", total):
        return None
    return SlurmPartition(name, int(total), fields)


def parse_partitions(text: str) -> Parsed[SlurmPartition]:
    """``scontrol show partition --oneliner`` output."""
    return _parse_lines(text, _partition)


def _sinfo_reason(line: str) -> tuple[str, str] | None:
    name, sep, reason = line.partition("|")
    name = name.strip()
    if not sep or not NODE_NAME.fullmatch(name) or not line.isprintable():
        return None
    return (name, reason.strip())


def parse_sinfo_reasons(text: str) -> Parsed[tuple[str, str]]:
    """``sinfo -R -h -N -o "%N|%E"`` output: (node, reason) pairs."""
    return _parse_lines(text, _sinfo_reason)


def node_named(nodes: Iterable[SlurmNode], hostnames: Sequence[str]) -> str | None:
    """The Slurm node of this host: the first of ``hostnames`` (the host's short and full
    names) that is a ``NodeName``, else one whose ``NodeHostName`` it is."""
    listed = list(nodes)
    for host in hostnames:
        for node in listed:
            if node.name == host:
                return node.name
    for host in hostnames:
        for node in listed:
            if node.hostname == host:
                return node.name
    return None


def node_view(
    name: str, nodes: Iterable[SlurmNode], partitions: Iterable[SlurmPartition]
) -> NodeView | None:
    """The node as the policy needs it: its drain, and for each of its partitions the member
    count and how many of the other members are drained with a nodescope reason. ``None``
    when Slurm does not list the node."""
    all_nodes = list(nodes)
    me = next((n for n in all_nodes if n.name == name), None)
    if me is None:
        return None
    totals = {p.name: p.total_nodes for p in partitions}
    loads = []
    for part in me.partitions:
        members = [n for n in all_nodes if part in n.partitions]
        drained = sum(
            1 for n in members if n.name != name and n.drained and is_nodescope_reason(n.reason)
        )
        loads.append(PartitionLoad(part, max(totals.get(part, 0), len(members)), drained))
    return NodeView(name, me.drained, me.reason if me.drained else None, tuple(loads))


# ---------------------------------------------------------------------------------------------
# Running scontrol


#: Job states after which a job never runs again on its nodes (``scontrol show job``'s
#: ``JobState``, Slurm's ``job_state_string``).
ENDED_JOB_STATES = frozenset(
    {
        "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
        "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT",
    }
)  # fmt: skip


class SlurmError(Exception):
    """scontrol could not be run, did not finish in time, or said no."""


@dataclass(frozen=True, slots=True)
class Scontrol:
    """``scontrol`` at an absolute path (hooks run with no PATH), each call bounded by
    ``timeout`` seconds; ``env`` is the environment it runs with (``None``: this process's)."""

    path: str
    timeout: float = 10.0
    env: Mapping[str, str] | None = None

    def run(self, args: Sequence[str]) -> str:
        try:
            result = subprocess.run(
                [self.path, *args],
                capture_output=True,
                timeout=self.timeout,
                check=False,
                env=None if self.env is None else dict(self.env),
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(f"scontrol {args[0]} did not answer in {self.timeout:g} s") from None
        except OSError as exc:
            raise SlurmError(f"cannot run {self.path}: {exc.strerror or exc}") from None
        out = result.stdout[:MAX_OUTPUT].decode("utf-8", "replace")
        if result.returncode != 0:
            err = result.stderr[:500].decode("utf-8", "replace").strip().replace("\n", " ")
            raise SlurmError(f"scontrol {' '.join(args[:2])}: exit {result.returncode}: {err}")
        return out

    def nodes(self, name: str | None = None) -> Parsed[SlurmNode]:
        return parse_nodes(self.run(["show", "node", "--oneliner", *([name] if name else [])]))

    def partitions(self) -> Parsed[SlurmPartition]:
        return parse_partitions(self.run(["show", "partition", "--oneliner"]))

    def view(self, name: str) -> tuple[NodeView | None, int]:
        """The node as the policy sees it, and the lines of Slurm's output skipped."""
        nodes = self.nodes()
        parts = self.partitions()
        return node_view(name, nodes.items, parts.items), nodes.skipped + parts.skipped

    def drain(self, node: str, reason: str) -> None:
        self._update(node, "state=drain", f"reason={reason}")

    def resume(self, node: str) -> None:
        self._update(node, "state=resume")

    def job_active(self, job: str) -> bool:
        """Whether Slurm still knows ``job`` as not ended (``scontrol show job``): ``False``
        when it answers that the id is invalid (an ended job is purged after ``MinJobAge``)
        or shows only ended states; :class:`SlurmError` when it gives no answer."""
        if not JOB_ID.fullmatch(job):
            raise SlurmError(f"not a job id: {job[:40]!r}")
        try:
            out = self.run(["show", "job", "--oneliner", job])
        except SlurmError as exc:
            if "Invalid job id" in str(exc):
                return False
            raise
        states = {
            token.partition("=")[2]
            for line in out.splitlines()
            for token in line.split()
            if token.startswith("JobState=")
        }
        if not states:
            raise SlurmError(f"scontrol show job {job}: no JobState in the answer")
        return not states <= ENDED_JOB_STATES

    def requeue(self, job: str) -> None:
        if not JOB_ID.fullmatch(job):
            raise SlurmError(f"not a job id: {job[:40]!r}")
        self.run(["requeue", job])

    def _update(self, node: str, *settings: str) -> None:
        if not NODE_NAME.fullmatch(node):
            raise SlurmError(f"not a node name: {node[:40]!r}")
        self.run(["update", f"nodename={node}", *settings])
