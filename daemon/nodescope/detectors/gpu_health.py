"""GPU health from NVML's health reads: ECC, row remapping, page retirement, clock slowdowns
and the NVSwitch fabric.

Input: ``NvmlData.health`` (:mod:`nodescope.model.gpu_health`), one :class:`GpuHealth` per
GPU, read by the ``nvml`` source every :data:`HEALTH_EVERY` runs and carried on the
records in between (each dates itself with ``read_at``); "under load" from the same GPU's
:class:`GpuSample` (utilisation, compute processes). Pure: no IO, no clock; the durations are
the derived stage's (``Derived.held_since``), keyed by kind and GPU.

Subjects ``{"gpu": index}``; the jobs on the GPU are named in the message only (the identity
is the GPU's). Kinds:

``gpu_ecc_uncorrectable`` (critical)
    the GPU's uncorrected ECC count, volatile or aggregate, grew between the source's two
    latest health reads. A count lower than the read before is a driver reload (the volatile
    count starts again) and no error; the first health read of a GPU reports a non-zero
    volatile count (errors since the driver loaded; the aggregate count is the GPU's whole
    life and proves nothing new). The finding lasts the cycles whose record pair holds the
    new read; its rule (:data:`RULES`) fires at once and keeps it :data:`ECC_HOLD_SECONDS`.
``gpu_row_remap_pending`` (warning), ``gpu_row_remap_failed`` (critical),
``gpu_page_retirement_pending`` (warning)
    while NVML says so: a remap (Ampere and later) or a page retirement (earlier GPUs) waits
    for the next GPU reset; a remap that failed left a bank with no spare row: replace the GPU.
``gpu_thermal_slowdown``, ``gpu_power_slowdown`` (warning)
    the driver's thermal (``sw_thermal_slowdown``) or power-cap (``sw_power_cap``) clock-event
    reason while the GPU is under load (utilisation at least ``busy_util_percent``, or a
    compute process on it), both held for ``min_slowdown_seconds``: the job runs slower than
    the GPU can. A power cap whose enforced limit is below the management limit is reported
    too, and the message says a lower cap is set.
``gpu_hw_slowdown`` (critical)
    a reason the board asserts itself (``hw_slowdown``, ``hw_thermal_slowdown``,
    ``hw_power_brake_slowdown``: clocks cut hard until the signal clears) held for
    ``min_slowdown_seconds``, loaded or not. These reasons are this kind's alone: the thermal
    and power kinds above take the driver's reasons, so one fault is one finding.
``gpu_fabric_degraded`` (critical)
    on a GPU whose fabric state is not ``not_supported``: its registration with the NVSwitch
    fabric unfinished for longer than ``fabric_grace_seconds``, finished with a status other
    than success, or the health mask saying its fabric bandwidth is degraded.

Health that is not current says nothing: a GPU absent from ``health`` and a health read that
has been the latest for more than :data:`STALE_READS` health cadences (the source stopped
reading it) give no finding, as an unread value is no fault.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from nodescope.alerts import AlertRule
from nodescope.config import Config, GpuHealthSettings
from nodescope.detectors.common import jobs, jobs_of_gpus
from nodescope.model.finding import Finding, Severity
from nodescope.model.gpu_health import (
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_NOT_SUPPORTED,
    HARDWARE_REASONS,
    HEALTH_EVERY,
    NVML_SUCCESS,
    POWER_REASONS,
    THERMAL_REASONS,
    EccErrors,
    GpuHealth,
    clock_event_names,
)
from nodescope.model.nvml import NVML, GpuSample, NvmlData
from nodescope.model.snapshot import Snapshot

ECC = "gpu_ecc_uncorrectable"
REMAP_PENDING = "gpu_row_remap_pending"
REMAP_FAILED = "gpu_row_remap_failed"
RETIREMENT_PENDING = "gpu_page_retirement_pending"
THERMAL = "gpu_thermal_slowdown"
POWER = "gpu_power_slowdown"
HW_SLOWDOWN = "gpu_hw_slowdown"
FABRIC = "gpu_fabric_degraded"

KINDS = (
    ECC,
    REMAP_PENDING,
    REMAP_FAILED,
    RETIREMENT_PENDING,
    THERMAL,
    POWER,
    HW_SLOWDOWN,
    FABRIC,
)

#: A health read that has been the latest for more than this many cadences is stale: the
#: source missed two reads in a row (a GPU that stopped answering, a source that stalls).
STALE_READS = 3

#: Seconds an uncorrectable ECC alert stays firing after the read that showed new errors.
ECC_HOLD_SECONDS = 600.0

#: The driver's thermal and power-cap reasons: the hardware ones are gpu_hw_slowdown's.
SOFTWARE_THERMAL = THERMAL_REASONS & ~HARDWARE_REASONS
SOFTWARE_POWER = POWER_REASONS & ~HARDWARE_REASONS

# Every kind is a state NVML reports (or an event for ECC) whose duration, where one matters,
# the detector already held: its alert fires at once. ECC is seen in one pair of reads, so
# its alert is kept a while.
RULES: Mapping[str, AlertRule] = MappingProxyType(
    {
        kind: AlertRule(
            for_seconds=0.0,
            resolve_after_seconds=ECC_HOLD_SECONDS if kind == ECC else 60.0,
        )
        for kind in KINDS
    }
)

#: ``Derived.held_since`` names: when each health read was first seen, how long each
#: slowdown or unfinished fabric registration has held.
_READS = "gpu_health_reads"
_HELD = "gpu_health_held"
#: The held condition of a fabric registration that has not completed.
_FABRIC_PENDING = "fabric_registration"


@dataclass(frozen=True, slots=True)
class _Gpu:
    """One GPU with current health: its record, its utilisation sample, its jobs."""

    health: GpuHealth
    sample: GpuSample | None
    jobs: tuple[str, ...]
    #: under load: utilisation at least ``busy_util_percent``, or a compute process on it
    busy: bool

    @property
    def name(self) -> str:
        return f"GPU {self.health.index} ({self.health.pci_address})"

    @property
    def subjects(self) -> dict[str, str]:
        return {"gpu": str(self.health.index)}

    @property
    def used(self) -> str:
        return f"; used by job {', '.join(self.jobs)}" if self.jobs else ""


def detect(previous: Snapshot | None, snapshot: Snapshot, config: Config) -> list[Finding]:
    """The registry's form: the ``nvml`` source's latest record, ``[detectors.gpu_health]``."""
    settings = config.detectors.gpu_health
    if not settings.enabled:
        return []
    data = snapshot.latest(NVML)
    if data is None or not data.health:
        return []
    before = None if previous is None else previous.monotonic
    gpus = _current(snapshot, before, data, _read_interval(snapshot, config), settings)
    if not gpus:
        return []
    findings = _ecc(previous, snapshot, gpus)
    findings.extend(_flags(gpus))
    findings.extend(_held(snapshot, before, gpus, settings))
    return findings


def _read_interval(snapshot: Snapshot, config: Config) -> float:
    """Seconds between two reads of the ``nvml`` source: the configured interval, or the
    measured one when reads came further apart (a slow read, a replay's longer tick)."""
    settings = config.sources.get(NVML.name)
    configured = 1.0 if settings is None else settings.interval_seconds
    pair = snapshot.pair(NVML)
    return configured if pair is None else max(configured, pair[2])


def _current(
    snapshot: Snapshot,
    before: float | None,
    data: NvmlData,
    interval: float,
    settings: GpuHealthSettings,
) -> list[_Gpu]:
    """The GPUs whose health read is current, with their samples and jobs.

    A read's age is taken on the snapshots' clock, from the first snapshot that held it
    (``read_at`` is the source's wall clock, which a replay or a container need not share
    with the collector's)."""
    reads = {(h.uuid, h.read_at) for h in data.health}
    since = snapshot.derived.held_since(_READS, reads, snapshot.monotonic, before)
    limit = STALE_READS * HEALTH_EVERY * interval
    samples = {g.uuid: g for g in data.gpus}
    users = jobs_of_gpus(jobs(snapshot))
    by_bdf = {bdf.lower(): ids for bdf, ids in users.items()}
    out = []
    for health in data.health:
        if snapshot.monotonic - since[(health.uuid, health.read_at)] > limit:
            continue
        owners = tuple(sorted(set(by_bdf.get(health.pci_address.lower(), ()))))
        sample = samples.get(health.uuid)
        out.append(_Gpu(health, sample, owners, _busy(sample, settings)))
    return out


# --------------------------------------------------------------------------------------------
# ECC


def _uncorrected(old: EccErrors | None, new: EccErrors) -> int:
    """New uncorrected errors of ``new`` over ``old`` (``None``: no read before)."""
    if old is None:
        return max(new.volatile_uncorrected or 0, 0)
    grown = 0
    for a, b in (
        (old.volatile_uncorrected, new.volatile_uncorrected),
        (old.aggregate_uncorrected, new.aggregate_uncorrected),
    ):
        # A lower count is a reset (the volatile count at a driver reload): no errors, so a
        # negative change counts as none.
        if a is not None and b is not None:
            grown = max(grown, b - a)
    return grown


def _ecc(previous: Snapshot | None, snapshot: Snapshot, gpus: Sequence[_Gpu]) -> list[Finding]:
    pair = snapshot.pair(NVML)
    if pair is not None:
        earlier = {h.uuid: h for h in pair[0].health}
    elif NVML.name in snapshot.previous:
        # A read before that makes no pair (it failed) proves nothing new.
        return []
    else:
        earlier = {}
    # A fatal ECC error may end the job's processes before this cycle saw them: the jobs of
    # the cycle before count too.
    users: dict[str, set[str]] = {}
    if previous is not None:
        for bdf, ids in jobs_of_gpus(jobs(previous)).items():
            users.setdefault(bdf.lower(), set()).update(ids)
    findings = []
    for gpu in gpus:
        health = gpu.health
        ecc = health.ecc
        if ecc is None:
            continue
        old = earlier.get(health.uuid)
        if old is not None and old.read_at >= health.read_at:
            continue  # the same read carried on (or a clock set back): nothing new
        added = _uncorrected(None if old is None else old.ecc, ecc)
        if added <= 0:
            continue
        owners = sorted(users.get(health.pci_address.lower(), set()) | set(gpu.jobs))
        used = f"; used by job {', '.join(owners)}" if owners else ""
        evidence = {"new_uncorrected_errors": float(added)}
        counts = []
        for name, value in (
            ("volatile_uncorrected", ecc.volatile_uncorrected),
            ("aggregate_uncorrected", ecc.aggregate_uncorrected),
            ("volatile_corrected", ecc.volatile_corrected),
            ("aggregate_corrected", ecc.aggregate_corrected),
        ):
            if value is not None:
                evidence[f"{name}_errors"] = float(value)
                if name.endswith("_uncorrected"):
                    counts.append(f"{name.split('_')[0]} {value}")
        total = f" ({', '.join(counts)} in all)" if counts else ""
        since = "since the driver loaded" if old is None else "since the last health read"
        findings.append(
            Finding(
                ECC,
                Severity.CRITICAL,
                gpu.subjects,
                evidence,
                f"{added} uncorrectable ECC error{'s' if added > 1 else ''} on {gpu.name}"
                f" {since}{total}{used}: its jobs may have read corrupted memory; action:"
                " reset the GPU when they end (a row remap or page retirement may be pending)",
            )
        )
    return findings


# --------------------------------------------------------------------------------------------
# Row remapping and page retirement: flags that hold until a reset


def _flags(gpus: Iterable[_Gpu]) -> Iterable[Finding]:
    for gpu in gpus:
        remap = gpu.health.row_remap
        if remap is not None:
            rows = {
                f"{name}_remapped_rows": float(value)
                for name, value in (
                    ("correctable", remap.correctable),
                    ("uncorrectable", remap.uncorrectable),
                )
                if value is not None
            }
            counted = (
                f" ({remap.uncorrectable} rows remapped for uncorrectable errors)"
                if remap.uncorrectable is not None
                else ""
            )
            if remap.failed:
                yield Finding(
                    REMAP_FAILED,
                    Severity.CRITICAL,
                    gpu.subjects,
                    {**rows, "remap_failed": 1.0},
                    f"row remapping failed on {gpu.name}{counted}{gpu.used}: a memory bank has"
                    " no spare row left; action: replace the GPU",
                )
            if remap.pending:
                yield Finding(
                    REMAP_PENDING,
                    Severity.WARNING,
                    gpu.subjects,
                    {**rows, "remap_pending": 1.0},
                    f"row remap pending on {gpu.name}{counted}{gpu.used}: the faulty row is"
                    " replaced at the next GPU reset; action: reset the GPU when its job ends",
                )
        pages = gpu.health.retired_pages
        if pages is not None and pages.pending:
            evidence = {
                f"{name}_retired_pages": float(value)
                for name, value in (
                    ("single_bit_ecc", pages.single_bit_ecc),
                    ("double_bit_ecc", pages.double_bit_ecc),
                )
                if value is not None
            }
            yield Finding(
                RETIREMENT_PENDING,
                Severity.WARNING,
                gpu.subjects,
                {**evidence, "retirement_pending": 1.0},
                f"page retirement pending on {gpu.name}{gpu.used}: the pages are taken out of"
                " use at the next GPU reset; action: reset the GPU when its job ends",
            )


# --------------------------------------------------------------------------------------------
# Held conditions: slowdowns and an unfinished fabric registration


def _busy(sample: GpuSample | None, settings: GpuHealthSettings) -> bool:
    if sample is None:
        return False
    util = sample.gpu_util_percent
    return bool(sample.processes) or (util is not None and util >= settings.busy_util_percent)


def _conditions(gpu: _Gpu) -> dict[str, int]:
    """Kind -> the reason bits (or fabric state) that hold for ``gpu`` in this snapshot."""
    held: dict[str, int] = {}
    clocks = gpu.health.clocks
    if clocks is not None and clocks.event_reasons is not None:
        reasons = clocks.event_reasons
        if gpu.busy and reasons & SOFTWARE_THERMAL:
            held[THERMAL] = reasons & SOFTWARE_THERMAL
        if gpu.busy and reasons & SOFTWARE_POWER:
            held[POWER] = reasons & SOFTWARE_POWER
        if reasons & HARDWARE_REASONS:
            held[HW_SLOWDOWN] = reasons & HARDWARE_REASONS
    fabric = gpu.health.fabric
    if fabric is not None and fabric.state not in (
        FABRIC_STATE_NOT_SUPPORTED,
        FABRIC_STATE_COMPLETED,
    ):
        held[_FABRIC_PENDING] = fabric.state
    return held


def _held(
    snapshot: Snapshot, before: float | None, gpus: Sequence[_Gpu], settings: GpuHealthSettings
) -> list[Finding]:
    conditions = [(gpu, _conditions(gpu)) for gpu in gpus]
    keys: set[Hashable] = {(kind, gpu.health.uuid) for gpu, held in conditions for kind in held}
    since = snapshot.derived.held_since(_HELD, keys, snapshot.monotonic, before)
    findings: list[Finding] = []
    for gpu, held in conditions:
        seconds = {kind: snapshot.monotonic - since[(kind, gpu.health.uuid)] for kind in held}
        for kind, build in ((THERMAL, _thermal), (POWER, _power), (HW_SLOWDOWN, _hardware)):
            if kind in held and seconds[kind] >= settings.min_slowdown_seconds:
                findings.append(build(gpu, held[kind], seconds[kind]))
        pending = seconds.get(_FABRIC_PENDING)
        fabric = _fabric(gpu, pending, settings.fabric_grace_seconds)
        if fabric is not None:
            findings.append(fabric)
    return findings


def _slowdown_evidence(gpu: _Gpu, reasons: int, held: float) -> dict[str, float]:
    evidence = {"clock_event_reasons": float(reasons), "held_seconds": held}
    if gpu.sample is not None:
        if gpu.sample.gpu_util_percent is not None:
            evidence["gpu_util_percent"] = float(gpu.sample.gpu_util_percent)
        evidence["compute_processes"] = float(len(gpu.sample.processes))
    clocks, temps, power = gpu.health.clocks, gpu.health.temperatures, gpu.health.power
    read: tuple[tuple[str, float | None], ...] = ()
    if clocks is not None:
        read += (("sm_clock_mhz", clocks.sm_mhz), ("memory_clock_mhz", clocks.memory_mhz))
    if temps is not None:
        read += (
            ("gpu_temperature_celsius", temps.gpu),
            ("memory_temperature_celsius", temps.memory),
            ("slowdown_temperature_celsius", temps.slowdown),
        )
    if power is not None:
        read += (
            ("power_draw_watts", power.draw_watts),
            ("power_limit_watts", power.limit_watts),
            ("enforced_power_limit_watts", power.enforced_limit_watts),
        )
    evidence.update((name, float(value)) for name, value in read if value is not None)
    return evidence


def _temperature_text(health: GpuHealth) -> str:
    temps = health.temperatures
    if temps is None or temps.gpu is None:
        return ""
    text = f"GPU at {temps.gpu} °C"
    if temps.slowdown is not None:
        text += f" against a slowdown threshold of {temps.slowdown} °C"
    if temps.memory is not None:
        text += f", memory at {temps.memory} °C"
    return text


def _power_text(health: GpuHealth) -> str:
    power = health.power
    if power is None or power.draw_watts is None:
        return ""
    text = f"drawing {power.draw_watts:.0f} W"
    enforced, limit = power.enforced_limit_watts, power.limit_watts
    if enforced is not None:
        text += f" of an enforced {enforced:.0f} W"
        if limit is not None and enforced < limit:
            text += f", below the {limit:.0f} W management limit: a lower cap is set on it"
    return text


def _sm_text(health: GpuHealth) -> str:
    clocks = health.clocks
    return "" if clocks is None or clocks.sm_mhz is None else f"SM clock {clocks.sm_mhz} MHz"


def _details(*parts: str) -> str:
    shown = [p for p in parts if p]
    return f" ({'; '.join(shown)})" if shown else ""


def _thermal(gpu: _Gpu, reasons: int, held: float) -> Finding:
    health = gpu.health
    return Finding(
        THERMAL,
        Severity.WARNING,
        gpu.subjects,
        _slowdown_evidence(gpu, reasons, held),
        f"{gpu.name} slowed by heat under load for {held:.0f} s:"
        f" {', '.join(clock_event_names(reasons))}"
        f"{_details(_temperature_text(health), _sm_text(health))}{gpu.used};"
        " action: check its cooling (airflow, fans, inlet temperature)",
    )


def _power(gpu: _Gpu, reasons: int, held: float) -> Finding:
    health = gpu.health
    return Finding(
        POWER,
        Severity.WARNING,
        gpu.subjects,
        _slowdown_evidence(gpu, reasons, held),
        f"{gpu.name} held to its power limit under load for {held:.0f} s:"
        f" {', '.join(clock_event_names(reasons))}"
        f"{_details(_power_text(health), _sm_text(health))}{gpu.used}",
    )


def _hardware(gpu: _Gpu, reasons: int, held: float) -> Finding:
    health = gpu.health
    load = "under load" if gpu.busy else "while idle"
    return Finding(
        HW_SLOWDOWN,
        Severity.CRITICAL,
        gpu.subjects,
        _slowdown_evidence(gpu, reasons, held),
        f"hardware slowdown on {gpu.name} {load} for {held:.0f} s:"
        f" {', '.join(clock_event_names(reasons))}"
        f"{_details(_temperature_text(health), _power_text(health), _sm_text(health))}"
        f"{gpu.used}; action: check the node's cooling and power supplies, drain the node"
        " if it persists",
    )


def _fabric(gpu: _Gpu, pending: float | None, grace: float) -> Finding | None:
    """The fabric finding of ``gpu``: one per GPU, naming every way its fabric is degraded;
    ``pending`` is how long its registration has been unfinished (``None``: finished)."""
    fabric = gpu.health.fabric
    if fabric is None or fabric.state == FABRIC_STATE_NOT_SUPPORTED:
        return None
    causes = []
    evidence = {"fabric_state": float(fabric.state)}
    if pending is not None and pending > grace:
        causes.append(f"registration {fabric.state_name} for {pending:.0f} s")
        evidence["registration_pending_seconds"] = pending
    if (
        fabric.state == FABRIC_STATE_COMPLETED
        and fabric.status is not None
        and fabric.status != NVML_SUCCESS
    ):
        causes.append(f"registration completed with NVML status {fabric.status}")
    if fabric.bandwidth_degraded:
        causes.append("the fabric reports its bandwidth degraded")
        evidence["bandwidth_degraded"] = 1.0
    if not causes:
        return None
    if fabric.status is not None:
        evidence["fabric_status"] = float(fabric.status)
    if fabric.clique_id is not None:
        evidence["clique_id"] = float(fabric.clique_id)
    return Finding(
        FABRIC,
        Severity.CRITICAL,
        gpu.subjects,
        evidence,
        f"NVSwitch fabric degraded for {gpu.name}: {'; '.join(causes)}{gpu.used}; its NVLink"
        " traffic through the switches is cut or slowed; action: check nvidia-fabricmanager"
        " and the NVSwitches, reset the GPU or drain the node",
    )
