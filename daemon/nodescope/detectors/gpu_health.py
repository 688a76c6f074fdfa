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
``gpu_thermal_slowdown`` (warning)
    the driver's thermal reason (``sw_thermal_slowdown``) while the GPU is under load
    (utilisation at least ``busy_util_percent``, or a compute process on it), held for
    ``min_slowdown_seconds``: the job runs slower than the GPU can.
``gpu_power_slowdown`` (warning)
    the driver's power-cap reason (``sw_power_cap``) under load, held as long, and only when
    the cap costs more than the GPU's normal operating point: its enforced limit is below the
    board's default limit (the management limit where the default is not answered: a cap
    someone set; the message names both), or its SM clock is below ``power_clock_fraction``
    of its applications clock (the message names the load, the clock and the fraction). A
    busy H100 drawing 695 W of its default 700 W with ``sw_power_cap`` is working as designed.
``gpu_hw_slowdown`` (critical)
    a reason the board asserts itself (``hw_slowdown``, ``hw_thermal_slowdown``,
    ``hw_power_brake_slowdown``: clocks cut hard until the signal clears) held for
    ``min_slowdown_seconds``, loaded or not.

One fault is one finding: a GPU gets at most one slowdown finding a cycle, the first of the
hardware, thermal and power kinds held long enough, and its evidence lists every reason in
force (``reason_<name>``) with the clock-event mask. Thresholds: docs/thresholds.md.
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
from nodescope.config import GpuHealthSettings
from nodescope.detectors.common import jobs, jobs_of_gpus
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.finding import Finding, Severity
from nodescope.model.gpu_health import (
    FABRIC_STATE_COMPLETED,
    FABRIC_STATE_NOT_SUPPORTED,
    HARDWARE_REASONS,
    HEALTH_EVERY,
    NVML_SUCCESS,
    POWER_REASONS,
    THERMAL_REASONS,
    Clocks,
    EccErrors,
    GpuHealth,
    Power,
    RowRemap,
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

_W, _C = severities(Severity.WARNING), severities(Severity.CRITICAL)
_ALERT, _DRAIN = actions(warning="alert"), actions(critical="drain")
_REMAP = "NVML remapped rows (pending, failure)"
_REMAP_HARDWARE = "yes, Ampere and later"
_SLOWDOWN = (
    "NVML clock-event (throttle) reasons with temperature, thresholds, power draw and limits;"
    ' "under load" from NVML utilisation and compute processes'
)


def _spec(
    name: str,
    levels: frozenset[Severity],
    remedy: Mapping[Severity, str],
    *,
    meaning: str,
    signal: str,
    hardware: str,
) -> FindingKind:
    return FindingKind(name, levels, remedy, meaning, signal, hardware, alert=RULES[name])


SPECS = (
    _spec(
        ECC,
        _C,
        _DRAIN,
        meaning="a GPU reported new uncorrectable ECC errors",
        signal="NVML total ECC errors, uncorrected, volatile and aggregate",
        hardware="yes, on GPUs with ECC enabled",
    ),
    _spec(
        REMAP_PENDING,
        _W,
        _ALERT,
        meaning="a GPU has a faulty memory row to replace at its next reset",
        signal=_REMAP,
        hardware=_REMAP_HARDWARE,
    ),
    _spec(
        REMAP_FAILED,
        _C,
        _DRAIN,
        meaning="a GPU's memory bank has no spare row left: replace the GPU",
        signal=_REMAP,
        hardware=_REMAP_HARDWARE,
    ),
    _spec(
        RETIREMENT_PENDING,
        _W,
        _ALERT,
        meaning="a GPU has memory pages to retire at its next reset",
        signal="NVML retired pages pending status",
        hardware="yes, before Ampere (later GPUs remap rows instead)",
    ),
    _spec(
        THERMAL,
        _W,
        _ALERT,
        meaning="a GPU under load is slowed by its temperature for a while",
        signal=_SLOWDOWN,
        hardware="yes",
    ),
    _spec(
        POWER,
        _W,
        _ALERT,
        meaning="a GPU under load is held by its power cap, far below its clocks or at a"
        " lowered limit",
        signal=_SLOWDOWN,
        hardware="yes",
    ),
    _spec(
        HW_SLOWDOWN,
        _C,
        _DRAIN,
        meaning="a GPU is slowed by a hardware signal (thermal or power brake) for a while",
        signal=_SLOWDOWN,
        hardware="yes",
    ),
    _spec(
        FABRIC,
        _C,
        _DRAIN,
        meaning="a GPU's NVSwitch fabric registration failed, stays unfinished or reports"
        " degraded health",
        signal="NVML GPU fabric info: registration state, status, health mask",
        hardware="on NVSwitch systems under the fabric manager (Hopper and later); the"
        " degraded-bandwidth bit needs a driver with the versioned call",
    ),
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


@dataclass(frozen=True, slots=True)
class GpuHealthInputs:
    """``[detectors.gpu_health]`` and the ``nvml`` source's configured interval (seconds; the
    held times count reads that come no more often than that)."""

    settings: GpuHealthSettings
    nvml_interval_seconds: float = 1.0


def detect(previous: Snapshot | None, snapshot: Snapshot, inputs: GpuHealthInputs) -> list[Finding]:
    """The registry's form: the ``nvml`` source's latest record, ``[detectors.gpu_health]``."""
    settings = inputs.settings
    if not settings.enabled:
        return []
    data = snapshot.latest(NVML)
    if data is None or not data.health:
        return []
    before = None if previous is None else previous.monotonic
    gpus = _current(
        snapshot, before, data, _read_interval(snapshot, inputs.nvml_interval_seconds), settings
    )
    if not gpus:
        return []
    findings = _ecc(previous, snapshot, gpus)
    findings.extend(_flags(gpus))
    findings.extend(_held(snapshot, before, gpus, settings))
    return findings


def _read_interval(snapshot: Snapshot, configured: float) -> float:
    """Seconds between two reads of the ``nvml`` source: the configured interval, or the
    measured one when reads came further apart (a slow read, a replay's longer tick)."""
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


def _remap_cause(remap: RowRemap) -> str:
    """What the rows were remapped for, as NVML counts them: correctable errors (a row that
    kept correcting single-bit errors), uncorrectable ones, or both; a count of 0 is left
    out, so a remap of a correctable row does not read as "0 rows ... uncorrectable"."""
    causes = [
        f"{count} row{'s' if count > 1 else ''} for {kind} errors"
        for count, kind in (
            (remap.correctable, "correctable"),
            (remap.uncorrectable, "uncorrectable"),
        )
        if count
    ]
    return f" (remapped: {' and '.join(causes)})" if causes else ""


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
            counted = _remap_cause(remap)
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


def _capped_below_default(power: Power | None) -> tuple[float, float] | None:
    """(enforced, reference) watts when the enforced limit is below the board's default
    limit (its management limit where the default is not answered): a cap someone or
    something set. ``None`` at the default, or when a limit is not answered."""
    if power is None or power.enforced_limit_watts is None:
        return None
    reference = power.default_limit_watts
    if reference is None:
        reference = power.limit_watts
    if reference is None or power.enforced_limit_watts >= reference:
        return None
    return power.enforced_limit_watts, reference


def _clock_fraction(clocks: Clocks | None) -> float | None:
    """The SM clock as a fraction of the applications clock; ``None`` when either is not
    answered."""
    if clocks is None or clocks.sm_mhz is None or not clocks.applications_sm_mhz:
        return None
    return clocks.sm_mhz / clocks.applications_sm_mhz


def _power_limited(gpu: _Gpu, settings: GpuHealthSettings) -> bool:
    """Whether the power cap costs this busy GPU more than its normal operating point: an
    H100 working hard sits at its default limit with ``sw_power_cap`` set, and that is
    healthy. A limit enforced below the default, or an SM clock pulled below
    ``power_clock_fraction`` of the applications clock, is not."""
    if _capped_below_default(gpu.health.power) is not None:
        return True
    fraction = _clock_fraction(gpu.health.clocks)
    return fraction is not None and fraction < settings.power_clock_fraction


def _conditions(gpu: _Gpu, settings: GpuHealthSettings) -> dict[str, int]:
    """Kind -> the reason bits (or fabric state) that hold for ``gpu`` in this snapshot."""
    held: dict[str, int] = {}
    clocks = gpu.health.clocks
    if clocks is not None and clocks.event_reasons is not None:
        reasons = clocks.event_reasons
        if gpu.busy and reasons & SOFTWARE_THERMAL:
            held[THERMAL] = reasons & SOFTWARE_THERMAL
        if gpu.busy and reasons & SOFTWARE_POWER and _power_limited(gpu, settings):
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


#: The slowdown kinds, the one a GPU's finding takes first: a hardware reason says the most
#: (the clocks are cut hard), then heat, then the power cap.
_SLOWDOWNS = (HW_SLOWDOWN, THERMAL, POWER)


def _held(
    snapshot: Snapshot, before: float | None, gpus: Sequence[_Gpu], settings: GpuHealthSettings
) -> list[Finding]:
    conditions = [(gpu, _conditions(gpu, settings)) for gpu in gpus]
    keys: set[Hashable] = {(kind, gpu.health.uuid) for gpu, held in conditions for kind in held}
    since = snapshot.derived.held_since(_HELD, keys, snapshot.monotonic, before)
    builders = {THERMAL: _thermal, POWER: _power, HW_SLOWDOWN: _hardware}
    findings: list[Finding] = []
    for gpu, held in conditions:
        seconds = {kind: snapshot.monotonic - since[(kind, gpu.health.uuid)] for kind in held}
        # One fault, one finding: heat that trips the board's own slowdown sets a driver
        # reason too. The GPU's finding is the first kind held long enough, and names
        # every reason in force.
        kind = next(
            (k for k in _SLOWDOWNS if k in held and seconds[k] >= settings.min_slowdown_seconds),
            None,
        )
        if kind is not None:
            findings.append(builders[kind](gpu, _all_reasons(gpu), seconds[kind], settings))
        pending = seconds.get(_FABRIC_PENDING)
        fabric = _fabric(gpu, pending, settings.fabric_grace_seconds)
        if fabric is not None:
            findings.append(fabric)
    return findings


def _all_reasons(gpu: _Gpu) -> int:
    clocks = gpu.health.clocks
    return 0 if clocks is None or clocks.event_reasons is None else clocks.event_reasons


def _slowdown_evidence(gpu: _Gpu, reasons: int, held: float) -> dict[str, float]:
    evidence = {"clock_event_reasons": float(reasons), "held_seconds": held}
    # Every reason in force, one key each, so a finding shows all of them.
    evidence.update((f"reason_{name}", 1.0) for name in clock_event_names(reasons))
    if gpu.sample is not None:
        if gpu.sample.gpu_util_percent is not None:
            evidence["gpu_util_percent"] = float(gpu.sample.gpu_util_percent)
        evidence["compute_processes"] = float(len(gpu.sample.processes))
    clocks, temps, power = gpu.health.clocks, gpu.health.temperatures, gpu.health.power
    read: tuple[tuple[str, float | None], ...] = ()
    if clocks is not None:
        read += (
            ("sm_clock_mhz", clocks.sm_mhz),
            ("memory_clock_mhz", clocks.memory_mhz),
            ("applications_sm_clock_mhz", clocks.applications_sm_mhz),
            ("sm_clock_fraction", _clock_fraction(clocks)),
        )
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
            ("default_power_limit_watts", power.default_limit_watts),
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
    if power.enforced_limit_watts is not None:
        text += f" of an enforced {power.enforced_limit_watts:.0f} W"
        capped = _capped_below_default(power)
        if capped is not None:
            which = "default" if power.default_limit_watts is not None else "management"
            text += f", below the board's {capped[1]:.0f} W {which} limit: a lower cap is set"
    return text


def _sm_text(health: GpuHealth) -> str:
    clocks = health.clocks
    if clocks is None or clocks.sm_mhz is None:
        return ""
    fraction = _clock_fraction(clocks)
    if fraction is None:
        return f"SM clock {clocks.sm_mhz} MHz"
    return (
        f"SM clock {clocks.sm_mhz} MHz, {fraction:.0%} of its {clocks.applications_sm_mhz} MHz"
        " applications clock"
    )


def _load_text(gpu: _Gpu) -> str:
    sample = gpu.sample
    if sample is None or sample.gpu_util_percent is None:
        return ""
    return f"{sample.gpu_util_percent} % utilisation"


def _details(*parts: str) -> str:
    shown = [p for p in parts if p]
    return f" ({'; '.join(shown)})" if shown else ""


def _reason_names(reasons: int) -> str:
    return ", ".join(clock_event_names(reasons)) or "no reason given"


def _thermal(gpu: _Gpu, reasons: int, held: float, settings: GpuHealthSettings) -> Finding:
    health = gpu.health
    return Finding(
        THERMAL,
        Severity.WARNING,
        gpu.subjects,
        _slowdown_evidence(gpu, reasons, held),
        f"{gpu.name} slowed by heat under load for {held:.0f} s: {_reason_names(reasons)}"
        f"{_details(_temperature_text(health), _sm_text(health), _load_text(gpu))}{gpu.used};"
        " action: check its cooling (airflow, fans, inlet temperature)",
    )


def _power(gpu: _Gpu, reasons: int, held: float, settings: GpuHealthSettings) -> Finding:
    health = gpu.health
    if _capped_below_default(health.power) is not None:
        why = "its power limit is set below the board's default"
        action = "action: find what set the cap (nvidia-smi -pl, a power policy) and lift it"
    else:
        why = (
            f"its SM clock is below {settings.power_clock_fraction:.0%} of its applications"
            " clock at its default power limit"
        )
        action = "action: check what the board is drawing power for (its cooling, its firmware)"
    return Finding(
        POWER,
        Severity.WARNING,
        gpu.subjects,
        {
            **_slowdown_evidence(gpu, reasons, held),
            "power_clock_fraction": settings.power_clock_fraction,
        },
        f"{gpu.name} held back by its power cap under load for {held:.0f} s: {why};"
        f" {_reason_names(reasons)}"
        f"{_details(_power_text(health), _sm_text(health), _load_text(gpu))}{gpu.used}; {action}",
    )


def _hardware(gpu: _Gpu, reasons: int, held: float, settings: GpuHealthSettings) -> Finding:
    health = gpu.health
    load = "under load" if gpu.busy else "while idle"
    return Finding(
        HW_SLOWDOWN,
        Severity.CRITICAL,
        gpu.subjects,
        _slowdown_evidence(gpu, reasons, held),
        f"hardware slowdown on {gpu.name} {load} for {held:.0f} s: {_reason_names(reasons)}"
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
