"""Error counters counted over sliding windows: how many errors a link had in the last minute
and the last hour.

A counter's increase between two reads is no rate: one PCIe replay in the second between two
reads is not "1/s". An error count is judged as an SRE judges it, over a window long enough
to tell an isolated error from a sustained rate. The derived stage keeps, per error counter
that moved in the last hour, the increases it saw in time buckets (:class:`Window`), and the
record of each source it last counted (:class:`ErrorWindows`); each snapshot carries the
state of the one before and adds what its new reads show.

* Each increase is counted once, at the first snapshot that holds the read that saw it: a
  source that reads its error counters only every ``slow_every`` runs carries the same values
  in between, and those records add nothing (the values equal the last counted ones).
* The increase is taken against the last record counted, not the record before: a read in a
  snapshot whose windows nobody asked (the stage carries the windows on unasked) is counted
  with the next one asked.
* Wraps and resets go through :func:`nodescope.model.counters.counter_delta`: a reset (a
  driver reload, a counter cleared) counts nothing and the new value is the next baseline; a
  saturated InfiniBand counter counts nothing more.
* A counter seen for the first time is a baseline: what it held before is of unknown age.

Memory is bounded: a window holds at most :data:`MINUTE_BUCKETS` + :data:`HOUR_BUCKETS`
buckets, a counter without an increase in the last hour is dropped, and the counters are
those the node has. The work of a snapshot whose sources did not read again is one identity
test per source; a new read costs one comparison per counter it holds and one new window per
counter that moved.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from nodescope.model.counters import counter_delta
from nodescope.model.infiniband import (
    TRAFFIC_COUNTERS,
    InfinibandData,
    hw_counter_is_gauge,
)
from nodescope.model.nvml import NvmlData
from nodescope.model.topology import AerRecord, Topology

#: The two windows errors are counted over, in seconds.
MINUTE = 60.0
HOUR = 3600.0
WINDOWS = (MINUTE, HOUR)
#: Bucket widths: a count over a window includes the whole of the bucket the window's start
#: falls in, so a minute is counted over 60 to 65 s and an hour over 60 to 61 minutes: a
#: count is never short of the window's errors.
MINUTE_BUCKET = 5.0
HOUR_BUCKET = 60.0
MINUTE_BUCKETS = int(MINUTE / MINUTE_BUCKET) + 1
HOUR_BUCKETS = int(HOUR / HOUR_BUCKET) + 1

#: Families of error counters, the first part of a :class:`CounterKey`.
AER = "aer"
PCIE_REPLAY = "pcie_replay"
NVLINK = "nvlink"
IB = "ib"
IB_HW = "ib_hw"
ECC = "ecc"

#: Widths of the counters whose record does not carry one.
AER_BITS = 64
PCIE_REPLAY_BITS = 32
NVLINK_BITS = 64
ECC_BITS = 64


class CounterKey(NamedTuple):
    """One error counter: its ``family``, where it is (a PCI function and AER class, a GPU's
    UUID and link, an HCA and port), and its name within the family."""

    family: str
    where: tuple[str, ...]
    counter: str


Reading = tuple[CounterKey, int, int | None]


def _add(
    buckets: tuple[tuple[int, int], ...], index: int, n: int, keep_from: int
) -> tuple[tuple[int, int], ...]:
    kept = [b for b in buckets if b[0] >= keep_from]
    if kept and kept[-1][0] == index:
        kept[-1] = (index, kept[-1][1] + n)
    else:
        kept.append((index, n))
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class Window:
    """The increases of one counter in the last minute (:data:`MINUTE_BUCKET` buckets) and
    hour (:data:`HOUR_BUCKET` buckets), as (bucket number, errors) in time order, and when
    the last increase was seen."""

    minute: tuple[tuple[int, int], ...] = ()
    hour: tuple[tuple[int, int], ...] = ()
    last_at: float = float("-inf")

    def add(self, at: float, n: int) -> Window:
        """This window with ``n`` errors seen at ``at`` (seconds, monotonic)."""
        m, h = int(at // MINUTE_BUCKET), int(at // HOUR_BUCKET)
        return Window(
            _add(self.minute, m, n, m - MINUTE_BUCKETS + 1),
            _add(self.hour, h, n, h - HOUR_BUCKETS + 1),
            max(at, self.last_at),
        )

    def count(self, seconds: float, now: float) -> int:
        """Errors seen in the ``seconds`` (:data:`MINUTE` or :data:`HOUR`) up to ``now``."""
        if seconds <= MINUTE:
            width, buckets = MINUTE_BUCKET, self.minute
        else:
            width, buckets = HOUR_BUCKET, self.hour
        first = int((now - seconds) // width)
        return sum(n for index, n in buckets if index >= first)


@dataclass(frozen=True, slots=True)
class Counted:
    """The record of one kind of reading last counted, the monotonic time of its snapshot
    sample, and which read of the counters it carries (see :func:`read_of`)."""

    record: object
    at: float
    read: object


@dataclass(frozen=True, slots=True)
class ErrorWindows:
    """The windows of every error counter that moved in the last hour (``windows``) and, per
    kind of reading, the record last counted (``counted``)."""

    windows: Mapping[CounterKey, Window]
    counted: Mapping[str, Counted]

    def active(self, now: float) -> Iterator[tuple[CounterKey, Window]]:
        """The counters with an increase in the hour up to ``now``."""
        for key, window in self.windows.items():
            if window.last_at > now - HOUR - HOUR_BUCKET:
                yield key, window

    def count(self, key: CounterKey, seconds: float, now: float) -> int:
        window = self.windows.get(key)
        return 0 if window is None else window.count(seconds, now)


NO_WINDOWS = ErrorWindows(MappingProxyType({}), MappingProxyType({}))


# --------------------------------------------------------------------------------------------
# What each source's records hold: (key, value, width) of every error counter


def aer_total(record: AerRecord) -> int:
    """The ``TOTAL_ERR_*`` line, or the sum of the named counters where it is absent."""
    return record.total if record.total is not None else sum(c.value for c in record.counters)


def aer_readings(topology: Topology) -> Iterator[Reading]:
    for dev in topology.devices:
        for record in dev.aer:
            yield CounterKey(AER, (dev.bdf,), record.severity), aer_total(record), AER_BITS


def link_error_readings(data: NvmlData) -> Iterator[Reading]:
    """PCIe replays and NVLink error counters: the values the source reads on its slow
    cadence."""
    for gpu in data.gpus:
        if gpu.pcie_replays is not None:
            yield (
                CounterKey(PCIE_REPLAY, (gpu.uuid,), "replays"),
                gpu.pcie_replays,
                PCIE_REPLAY_BITS,
            )
        links = gpu.nvlinks
        for number, errors in zip(links.link, links.errors, strict=True):
            where = (gpu.uuid, str(number))
            for name, value in errors:
                yield CounterKey(NVLINK, where, name), value, NVLINK_BITS


def ecc_readings(data: NvmlData) -> Iterator[Reading]:
    """Corrected ECC errors of each GPU's health read: the volatile count (since the driver
    loaded, what a reload resets), or the aggregate where the volatile one is not answered."""
    for health in data.health:
        ecc = health.ecc
        if ecc is None:
            continue
        value = ecc.volatile_corrected
        if value is None:
            value = ecc.aggregate_corrected
        if value is not None:
            yield CounterKey(ECC, (health.uuid,), "corrected"), value, ECC_BITS


def ib_readings(data: InfinibandData) -> Iterator[Reading]:
    """Every counter of every port but the traffic ones (bytes, packets, transmit waits:
    congestion is no error), and every hw_counter that is no gauge. A saturated counter has
    no value: its increases since are unknown."""
    for port in data.ports():
        where = (port.device, str(port.port))
        for counter in port.counters:
            if counter.name not in TRAFFIC_COUNTERS and not counter.saturated:
                yield CounterKey(IB, where, counter.name), counter.value, counter.bits
        for counter in port.hw_counters:
            if not hw_counter_is_gauge(counter.name) and not counter.saturated:
                yield CounterKey(IB_HW, where, counter.name), counter.value, counter.bits


# --------------------------------------------------------------------------------------------
# Counting new reads


def _fresh(last: Counted | None, record: object, at: float, read: object) -> bool:
    """Whether ``record`` (read at ``at``, its counters read in ``read``) holds values not
    counted yet."""
    if last is None:
        return True
    if record is last.record or at <= last.at:
        return False
    # A record that carries the counters of the read last counted holds nothing new.
    return read is None or read != last.read


def increases(
    before: Iterable[Reading] | None, now: Iterable[Reading]
) -> Iterator[tuple[CounterKey, int]]:
    """(key, increase) of each counter of ``now`` that grew since ``before`` (``None``: no
    record before, every value is a baseline)."""
    if before is None:
        return
    old = {key: value for key, value, _ in before}
    for key, value, bits in now:
        prior = old.get(key)
        if prior is None or prior == value:
            continue
        delta = counter_delta(prior, value, bits)
        if delta:
            yield key, delta


def count_reads(state: ErrorWindows, reads: Iterable[tuple[str, object, float]]) -> ErrorWindows:
    """``state`` with the increases of each new read counted: ``reads`` holds (kind, record,
    monotonic time of its sample), ``kind`` one of :data:`READERS`. A read already counted
    (the same record, an older one, or one that carries the counters last counted) adds
    nothing, and costs one test."""
    windows: dict[CounterKey, Window] | None = None
    counted: dict[str, Counted] | None = None
    latest = None
    for kind, record, at in reads:
        last = (state.counted if counted is None else counted).get(kind)
        readings, read_of = READERS[kind]
        read = read_of(record)
        if not _fresh(last, record, at, read):
            continue
        if windows is None or counted is None:
            windows, counted = dict(state.windows), dict(state.counted)
        before = None if last is None else readings(last.record)
        for key, delta in increases(before, readings(record)):
            windows[key] = windows.get(key, Window()).add(at, delta)
        counted[kind] = Counted(record, at, read)
        latest = at if latest is None else max(latest, at)
    if windows is None or counted is None or latest is None:
        return state
    # A counter without an increase in the last hour is dropped: the windows stay bounded.
    horizon = latest - HOUR - HOUR_BUCKET
    kept = {key: w for key, w in windows.items() if w.last_at > horizon}
    return ErrorWindows(MappingProxyType(kept), MappingProxyType(counted))


def _topology(record: object) -> Iterator[Reading]:
    return aer_readings(record) if isinstance(record, Topology) else iter(())


def _links(record: object) -> Iterator[Reading]:
    return link_error_readings(record) if isinstance(record, NvmlData) else iter(())


def _ecc(record: object) -> Iterator[Reading]:
    return ecc_readings(record) if isinstance(record, NvmlData) else iter(())


def _ib(record: object) -> Iterator[Reading]:
    return ib_readings(record) if isinstance(record, InfinibandData) else iter(())


def _slow_read(record: object) -> object:
    """When a record's slowly-read values were read (``None``: it does not say, and every
    new record is a read of everything)."""
    slow = getattr(record, "slow", None)
    return None if slow is None else slow.at


def _health_reads(record: object) -> object:
    if not isinstance(record, NvmlData):
        return None
    return tuple(h.read_at for h in record.health)


def _none(record: object) -> object:
    return None


#: Kinds of reads: what their records hold and which read of the counters a record carries.
#: NVML records hold two: the link error counters (read on the source's slow cadence) and the
#: health reads (on theirs).
PCI_ERRORS = "pci"
NVML_LINKS = "nvml_links"
NVML_ECC = "nvml_ecc"
IB_ERRORS = "infiniband"
READERS: Mapping[str, tuple[Callable[[object], Iterator[Reading]], Callable[[object], object]]] = (
    MappingProxyType(
        {
            PCI_ERRORS: (_topology, _none),
            NVML_LINKS: (_links, _slow_read),
            NVML_ECC: (_ecc, _health_reads),
            IB_ERRORS: (_ib, _slow_read),
        }
    )
)
