"""The figures a snapshot implies: rates, the PCIe attribution, the job registry.

Sources run on their own intervals and a snapshot holds, per source, the latest sample and the
one before it. The detectors, the exporters, the hooks and the CLI all need the same figures
made from those samples — a source's rates, the traffic of every PCI endpoint attributed
over the topology, the jobs of the node — so each snapshot carries one :class:`Derived` that
computes each figure the first time it is asked for and hands every later reader the same
object.

Across cycles, a figure whose inputs are the very same objects as the cycle before is that
cycle's figure again: a source that did not run hands its sample on unchanged, and most
inputs come from sources that run every 5 to 30 s while the cycle ticks every second. The
stage that makes each cycle's :class:`Derived` (:class:`nodescope.derive.DerivedStage`)
hands it the previous one's figures as ``carried``; a :class:`Derived` made without them (a
fixture, a one-shot command) computes everything from its own samples. Either way the
figures are the same: reuse only decides whether a pure function runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from nodescope.model.attribution import Attribution, LinkIndex, attribute
from nodescope.model.disks import DISKS, IostatReport, iostat_figures
from nodescope.model.error_windows import (
    IB_ERRORS,
    NO_WINDOWS,
    NVML_ECC,
    NVML_LINKS,
    PCI_ERRORS,
    ErrorWindows,
    count_reads,
)
from nodescope.model.infiniband import (
    INFINIBAND,
    InfinibandData,
    InfinibandRates,
    SlowPortRates,
    port_rates,
    slow_pair,
    slow_rates,
    slow_values,
)
from nodescope.model.job_records import JOBS
from nodescope.model.jobs import (
    DepartedRank,
    GpuUse,
    Job,
    JobView,
    build_registry,
    gpu_uses,
    host_staged_gpus,
    job_processes_views,
)
from nodescope.model.mountstats import MOUNTSTATS, MountstatsRates, nfs_rates
from nodescope.model.netdev import NETDEV, NetdevRates, link_rates
from nodescope.model.nvlink_kmod import NVLINK_KMOD, NvlinkKmodRates
from nodescope.model.nvlink_kmod import link_rates as nvlink_link_rates
from nodescope.model.nvml import NVML, NvmlRates, gpu_rates
from nodescope.model.procs import PROCS, ProcsRates, procs_rates
from nodescope.model.source_key import SourceKey
from nodescope.model.topology import PCI
from nodescope.model.traffic import Traffic, endpoint_flows

if TYPE_CHECKING:
    from nodescope.model.snapshot import SourceSample

log = logging.getLogger("nodescope.derive")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Figure:
    """One computed figure and what it was computed from: the objects it depends on by
    identity (``same``) and the small values it depends on by equality (``equal``)."""

    same: tuple[object, ...]
    equal: object
    value: object

    def made_of(self, same: tuple[object, ...], equal: object) -> bool:
        # A loop, not all() over a generator: this runs for every figure of every cycle.
        if len(self.same) != len(same):
            return False
        for a, b in zip(self.same, same, strict=True):
            if a is not b:
                return False
        return self.equal == equal


_NOTHING: Mapping[str, Figure] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class SamplePair(Generic[T]):
    """Two good reads of one source: the samples (for identity) and their records, and the
    measured seconds between them."""

    previous: SourceSample
    current: SourceSample
    before: T
    now: T
    seconds: float


def sample_pair(
    current: Mapping[str, SourceSample], previous: Mapping[str, SourceSample], key: SourceKey[T]
) -> SamplePair[T] | None:
    """The two latest reads of the source ``key`` names, when both succeeded with records of
    its type and time passed between them; else ``None``."""
    cur = current.get(key.name)
    prev = previous.get(key.name)
    if cur is None or prev is None:
        return None
    now, before = key.of(cur.data), key.of(prev.data)
    seconds = cur.monotonic - prev.monotonic
    if now is None or before is None or seconds <= 0:
        return None
    return SamplePair(prev, cur, before, now, seconds)


#: Departed ranks one snapshot keeps (:meth:`Derived.departed_ranks`): a node runs a few
#: jobs of at most a few dozen GPU processes; a churn of short jobs must not grow it.
MAX_DEPARTED = 64


@dataclass(frozen=True, slots=True)
class _Departed:
    """What :meth:`Derived.departed_ranks` carries: the views its members were made from,
    each GPU process of a job (pid -> job, name, GPUs), and the ranks gone."""

    views: tuple[JobView, ...]
    members: Mapping[int, tuple[str, str | None, tuple[int, ...]]]
    departed: tuple[DepartedRank, ...]


def _members(
    views: tuple[JobView, ...], uses: tuple[GpuUse, ...], registry: tuple[Job, ...]
) -> dict[int, tuple[str, str | None, tuple[int, ...]]]:
    """pid -> (job, name, GPUs) of every GPU process of a job view."""
    gpus_of: dict[int, list[int]] = {}
    for use in uses:
        for pid in use.pids:
            gpus_of.setdefault(pid, []).append(use.index)
    comm_of = {t.pid: t.comm for job in registry for t in job.tasks}
    return {
        pid: (view.job_id, comm_of.get(pid), tuple(sorted(gpus_of[pid])))
        for view in views
        for pid in view.pids
        if pid in gpus_of
    }


@dataclass(frozen=True, slots=True)
class _Held:
    """What :meth:`Derived.held_since` knows in one snapshot: the times carried over from
    the snapshot before, and those of every key asked in this one."""

    earlier: Mapping[Hashable, float]
    since: dict[Hashable, float]


class Derived:
    """The figures of one snapshot, each computed at most once (see the module docstring).

    Readers on several threads (the cycle, the hook socket) may ask at once: the worst case
    is a pure function run twice with the same answer.
    """

    __slots__ = ("_carried", "_current", "_figures", "_previous")

    def __init__(
        self,
        current: Mapping[str, SourceSample],
        previous: Mapping[str, SourceSample],
        carried: Mapping[str, Figure] = _NOTHING,
    ) -> None:
        self._current = current
        self._previous = previous
        self._figures: dict[str, Figure] = {}
        # Our own copy: an entry is dropped once this snapshot has its own figure of that
        # name, so last cycle's records are freed now rather than a cycle later.
        self._carried: dict[str, Figure] = dict(carried)

    def made_from(
        self, current: Mapping[str, SourceSample], previous: Mapping[str, SourceSample]
    ) -> bool:
        """Whether these are the samples this object's figures are made of (equal samples are
        the same objects, so the comparison is one identity test per source)."""
        return self._current == current and self._previous == previous

    def figures(self) -> Mapping[str, Figure]:
        """Every figure this snapshot's readers asked for, and those it carried unasked: what
        the next cycle may reuse."""
        return MappingProxyType({**self._carried, **self._figures})

    def hand_on(self) -> Mapping[str, Figure]:
        """:meth:`figures`, for the next snapshot, which now holds them: this object forgets
        them, so a cycle's records live one cycle, not two (a reader of this snapshot that
        still asks computes again, with the same answer)."""
        handed = self.figures()
        self._figures = {}
        self._carried = {}
        return handed

    def _figure(
        self,
        name: str,
        same: tuple[object, ...],
        equal: object,
        compute: Callable[[], R],
        recheck: bool = False,
    ) -> R:
        # A figure of this snapshot's own samples has the same inputs however often it is
        # asked for: made once, it is the answer. ``recheck``: the inputs are the caller's.
        known = self._figures.get(name)
        if known is None or (recheck and not known.made_of(same, equal)):
            old = self._carried.pop(name, None)
            value = old.value if old is not None and old.made_of(same, equal) else compute()
            known = self._figures[name] = Figure(same, equal, value)
        return cast(R, known.value)

    def _latest(self, key: SourceKey[T]) -> T | None:
        sample = self._current.get(key.name)
        return None if sample is None else key.of(sample.data)

    def _rates(self, key: SourceKey[T], rates_of: Callable[[T, T, float], R | None]) -> R | None:
        pair = sample_pair(self._current, self._previous, key)
        if pair is None:
            return None

        def compute() -> R | None:
            try:
                return rates_of(pair.before, pair.now, pair.seconds)
            except Exception as exc:  # a bad pair of samples costs that source's rates only
                log.warning("source=%s derive_error=%r", key.name, f"{type(exc).__name__}: {exc}")
                return None

        return self._figure(f"rates:{key.name}", (pair.previous, pair.current), None, compute)

    def reuse(
        self, name: str, same: tuple[object, ...], equal: object, compute: Callable[[], R]
    ) -> R:
        """``compute()``, a pure function of ``same`` (objects of this snapshot, by identity)
        and ``equal`` (small values, by equality), made once per snapshot and carried over
        from the last one while those are unchanged: for a detector whose inputs change every
        15 or 30 s while the cycle ticks every second. Callers do not modify what it returns."""
        return self._figure(f"reuse:{name}", same, equal, compute, recheck=True)

    def held_since(
        self, name: str, keys: Iterable[Hashable], now: float, before: float | None
    ) -> Mapping[Hashable, float]:
        """For each of ``keys`` (conditions that hold in this snapshot, taken at ``now``), the
        time since which it has held in every snapshot: carried over from the snapshot taken
        at ``before`` (the previous one, ``None`` when there is none) when that snapshot asked
        the same ``name``; a key it did not hold starts now. A condition that stops holding
        for one snapshot starts again, and one whose detector skipped a snapshot (nothing
        could hold) too. Readers of one snapshot that ask with other keys (another
        configuration) get the same times; the next snapshot carries over every key asked.
        For the minimum durations of findings: detectors keep no memory."""
        figure = f"held:{name}"
        known = self._figures.get(figure)
        if known is None or known.equal != now:
            last = self._carried.pop(figure, None)
            earlier: Mapping[Hashable, float] = {}
            if last is not None and before is not None and last.equal == before:
                earlier = cast(_Held, last.value).since
            known = self._figures[figure] = Figure((), now, _Held(earlier, {}))
        held = cast(_Held, known.value)
        for key in keys:
            if key not in held.since:
                held.since[key] = held.earlier.get(key, now)
        return MappingProxyType({key: held.since[key] for key in keys})

    def departed_ranks(
        self, now: float, before: float | None, keep_seconds: float
    ) -> tuple[DepartedRank, ...]:
        """The GPU processes of jobs that left in the last ``keep_seconds``: a pid of a job's
        GPU view in the snapshot taken at ``before`` that no job's view has now. Carried from
        snapshot to snapshot like :meth:`held_since` (a snapshot that does not ask starts the
        memory again), at most :data:`MAX_DEPARTED` of them, the latest kept. Cheap while the
        views are the same objects: the members are then last cycle's."""
        figure = "departed_ranks"
        known = self._figures.get(figure)
        if known is not None and known.equal == now:
            return cast(_Departed, known.value).departed
        last = self._carried.pop(figure, None)
        views = self.job_views
        prior = (
            cast(_Departed, last.value)
            if last is not None and before is not None and last.equal == before
            else None
        )
        if prior is not None and prior.views is views:
            members = prior.members
        else:
            members = _members(views, self.gpu_uses, self.jobs)
        departed: list[DepartedRank] = []
        if prior is not None:
            departed = [
                d
                for d in prior.departed
                if now - d.gone_at <= keep_seconds and d.pid not in members
            ]
            departed.extend(
                DepartedRank(job, pid, comm, gpus, now)
                for pid, (job, comm, gpus) in prior.members.items()
                if pid not in members
            )
        kept = tuple(departed[-MAX_DEPARTED:])
        self._figures[figure] = Figure((), now, _Departed(views, members, kept))
        return kept

    @property
    def error_windows(self) -> ErrorWindows:
        """Every error counter's increases over the last minute and hour
        (:mod:`nodescope.model.error_windows`): the windows of the snapshot before, carried
        over, with what this snapshot's new reads add. Without them (a fixture, a one-shot
        command) the previous samples are the baseline and the current ones add their
        increase over them."""
        samples = tuple(self._current.get(key.name) for key in _WINDOWED)
        known = self._figures.get(_WINDOWS)
        if known is not None and known.made_of(samples, None):
            return cast(ErrorWindows, known.value)
        last = self._carried.pop(_WINDOWS, None)
        if last is not None and last.made_of(samples, None):
            value = cast(ErrorWindows, last.value)
        else:
            state = NO_WINDOWS if last is None else cast(ErrorWindows, last.value)
            reads = [] if last is not None else list(_error_reads(self._previous))
            value = count_reads(state, [*reads, *_error_reads(self._current)])
        self._figures[_WINDOWS] = Figure(samples, None, value)
        return value

    # -- rates between each source's two latest reads ------------------------------------

    @property
    def gpu_rates(self) -> NvmlRates | None:
        return self._rates(NVML, gpu_rates)

    @property
    def disk_rates(self) -> IostatReport | None:
        return self._rates(DISKS, iostat_figures)

    @property
    def ib_rates(self) -> InfinibandRates | None:
        return self._rates(INFINIBAND, self._port_rates)

    def _port_rates(
        self, before: InfinibandData, now: InfinibandData, seconds: float
    ) -> InfinibandRates:
        # The rates of the counters read only on full reads change only with one: made once
        # per full read and carried while the record holds the objects it read.
        pair = slow_pair(before, now, seconds)
        slow: Mapping[tuple[str, int], SlowPortRates] = self._figure(
            "slow-rates:infiniband",
            (None if pair is None else pair[0], *slow_values(now)),
            None if pair is None else pair[1],
            lambda: slow_rates(pair, now),
            recheck=True,
        )
        return port_rates(before, now, seconds, slow)

    @property
    def netdev_rates(self) -> NetdevRates | None:
        return self._rates(NETDEV, link_rates)

    @property
    def procs_rates(self) -> ProcsRates | None:
        return self._rates(PROCS, procs_rates)

    @property
    def nvlink_rates(self) -> NvlinkKmodRates | None:
        return self._rates(NVLINK_KMOD, nvlink_link_rates)

    @property
    def nfs_rates(self) -> MountstatsRates | None:
        return self._rates(MOUNTSTATS, nfs_rates)

    # -- figures across sources -------------------------------------------------------------

    @property
    def traffic(self) -> Traffic:
        """What the endpoints' traffic is measured from."""
        return Traffic(
            nvml=self._latest(NVML),
            nvml_rates=self.gpu_rates,
            disks=self._latest(DISKS),
            disk_rates=self.disk_rates,
            infiniband=self._latest(INFINIBAND),
            ib_rates=self.ib_rates,
            netdev=self._latest(NETDEV),
            netdev_rates=self.netdev_rates,
        )

    @property
    def attribution(self) -> Attribution | None:
        """The traffic of every PCI endpoint attributed over the topology (``None`` before
        the ``pci`` source has read)."""
        topology = self._latest(PCI)
        if topology is None:
            return None
        traffic = self.traffic
        index = self._figure("link_index", (topology,), None, lambda: LinkIndex(topology))
        same = (topology, *(getattr(traffic, f.name) for f in fields(traffic)))
        # Jobs that turned GPUDirect RDMA off: their GPUs' traffic is never peer to peer.
        staged = self.host_staged_gpus if index.peer_pairs else frozenset()
        return self._figure(
            "attribution",
            same,
            staged,
            lambda: attribute(topology, endpoint_flows(traffic, topology), index, staged),
        )

    @property
    def host_staged_gpus(self) -> frozenset[str]:
        """GPUs of jobs whose processes set ``NCCL_NET_GDR_LEVEL=LOC``."""
        data = self._latest(JOBS)
        views = self.job_views
        return self._figure(
            "host_staged_gpus", (data,), views, lambda: host_staged_gpus(data, views)
        )

    @property
    def gpu_uses(self) -> tuple[GpuUse, ...]:
        """Each GPU and the pids of its compute processes."""
        nvml = self._latest(NVML)
        return self._figure("gpu_uses", (nvml,), None, lambda: gpu_uses(nvml))

    @property
    def jobs(self) -> tuple[Job, ...]:
        """The job registry: the ``jobs`` record joined with the GPUs' compute processes.
        NVML is read every second and the ``jobs`` source every 15 s; the registry is made
        again only when the ``jobs`` record is another or the compute processes changed."""
        data = self._latest(JOBS)
        gpus = self.gpu_uses
        return self._figure("jobs", (data,), gpus, lambda: build_registry(data, gpus))

    @property
    def jobs_before(self) -> tuple[Job, ...] | None:
        """The registry of the ``jobs`` record before the latest, joined with the compute
        processes of now (``None`` before the source has read twice): what a job was, to
        compare with what it is."""
        pair = sample_pair(self._current, self._previous, JOBS)
        if pair is None:
            return None
        old = pair.before
        gpus = self.gpu_uses
        return self._figure("jobs_before", (old,), gpus, lambda: build_registry(old, gpus))

    @property
    def job_views(self) -> tuple[JobView, ...]:
        """The jobs with compute processes in their cgroups, their GPUs and the HCAs
        ``NCCL_IB_HCA`` lets them use (the placement view)."""
        data = self._latest(JOBS)
        ib = self._latest(INFINIBAND)
        if data is None or self._latest(NVML) is None:
            return ()
        gpus = self.gpu_uses
        hcas = tuple(d.name for d in ib.devices) if ib is not None else ()
        return self._figure(
            "job_views", (data,), (gpus, hcas), lambda: job_processes_views(data, gpus, hcas)
        )


#: The sources whose error counters are counted over windows, and the figure's name.
_WINDOWED = (PCI, NVML, INFINIBAND)
_WINDOWS = "error-windows"


def _error_reads(samples: Mapping[str, SourceSample]) -> Iterable[tuple[str, object, float]]:
    """The reads of error counters in ``samples``: (kind, record, time of the sample)."""
    for key, kinds in (
        (PCI, (PCI_ERRORS,)),
        (NVML, (NVML_LINKS, NVML_ECC)),
        (INFINIBAND, (IB_ERRORS,)),
    ):
        sample = samples.get(key.name)
        record = None if sample is None else key.of(sample.data)
        if sample is not None and record is not None:
            for kind in kinds:
                yield kind, record, sample.monotonic
