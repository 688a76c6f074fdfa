"""GPU health as NVML reports it: the records the ``nvml`` source reads on its health cadence.

What each record holds and in which unit (docs/datasources.md §1.8): error counts as NVML
counts them, temperatures in °C, power in watts (NVML answers milliwatts), clocks in MHz,
framebuffer in bytes, GPM figures as percentages or bytes/s over the window between two GPM
samples. A value the GPU does not answer is ``None``; the calls it answered NOT_SUPPORTED to
are named in :attr:`GpuHealth.unsupported` and not asked again.

The bit values and state numbers below are NVML's (nvml.h, as nvidia-ml-py exports them:
``nvmlClocksEventReason*``, ``NVML_GPU_FABRIC_STATE_*``,
``NVML_GPU_FABRIC_HEALTH_MASK_*_DEGRADED_BW``); a unit test holds them equal to pynvml's, so
this module needs no NVML library to be read.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Runs of the ``nvml`` source between two health reads (its ``health_every`` default): the
#: source reads on this cadence and the detector judges a read stale by it.
HEALTH_EVERY = 5

# --------------------------------------------------------------------------------------------
# Clock-event ("throttle") reasons: nvmlDeviceGetCurrentClocksEventReasons' bit mask

CLOCK_EVENT_GPU_IDLE = 0x1
CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING = 0x2
CLOCK_EVENT_SW_POWER_CAP = 0x4
CLOCK_EVENT_HW_SLOWDOWN = 0x8
CLOCK_EVENT_SYNC_BOOST = 0x10
CLOCK_EVENT_SW_THERMAL_SLOWDOWN = 0x20
CLOCK_EVENT_HW_THERMAL_SLOWDOWN = 0x40
CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN = 0x80
CLOCK_EVENT_DISPLAY_CLOCK_SETTING = 0x100

#: Each reason bit and the name nodescope's metrics and findings give it.
CLOCK_EVENT_REASONS: dict[int, str] = {
    CLOCK_EVENT_GPU_IDLE: "gpu_idle",
    CLOCK_EVENT_APPLICATIONS_CLOCKS_SETTING: "applications_clocks_setting",
    CLOCK_EVENT_SW_POWER_CAP: "sw_power_cap",
    CLOCK_EVENT_HW_SLOWDOWN: "hw_slowdown",
    CLOCK_EVENT_SYNC_BOOST: "sync_boost",
    CLOCK_EVENT_SW_THERMAL_SLOWDOWN: "sw_thermal_slowdown",
    CLOCK_EVENT_HW_THERMAL_SLOWDOWN: "hw_thermal_slowdown",
    CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
    CLOCK_EVENT_DISPLAY_CLOCK_SETTING: "display_clock_setting",
}

#: Reasons that mean the GPU is held back by heat.
THERMAL_REASONS = CLOCK_EVENT_SW_THERMAL_SLOWDOWN | CLOCK_EVENT_HW_THERMAL_SLOWDOWN
#: Reasons that mean the GPU is held back by its power budget (the cap or the brake signal).
POWER_REASONS = CLOCK_EVENT_SW_POWER_CAP | CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
#: Reasons asserted by the board's hardware (not the driver's software policy): the clock is
#: cut, often by half or more, until the signal clears.
HARDWARE_REASONS = (
    CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_THERMAL_SLOWDOWN | CLOCK_EVENT_HW_POWER_BRAKE_SLOWDOWN
)


def clock_event_names(mask: int) -> tuple[str, ...]:
    """The names of the reasons set in ``mask``, lowest bit first; unknown bits are left out
    (a newer driver may set bits this table does not have)."""
    return tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit)


# --------------------------------------------------------------------------------------------
# GPU fabric (NVSwitch systems): nvmlDeviceGetGpuFabricInfo / ...InfoV

FABRIC_STATE_NOT_SUPPORTED = 0
FABRIC_STATE_NOT_STARTED = 1
FABRIC_STATE_IN_PROGRESS = 2
FABRIC_STATE_COMPLETED = 3

FABRIC_STATES: dict[int, str] = {
    FABRIC_STATE_NOT_SUPPORTED: "not_supported",
    FABRIC_STATE_NOT_STARTED: "not_started",
    FABRIC_STATE_IN_PROGRESS: "in_progress",
    FABRIC_STATE_COMPLETED: "completed",
}

#: healthMask bits 0-1: the GPU's fabric bandwidth is degraded (1 true, 2 false, 0 unknown).
FABRIC_HEALTH_DEGRADED_BW_SHIFT = 0
FABRIC_HEALTH_DEGRADED_BW_WIDTH = 0x3
FABRIC_HEALTH_DEGRADED_BW_TRUE = 1
FABRIC_HEALTH_DEGRADED_BW_FALSE = 2

#: nvmlReturn_t of a fabric registration that succeeded.
NVML_SUCCESS = 0


def fabric_bandwidth_degraded(health_mask: int | None) -> bool | None:
    """Whether ``health_mask`` says the fabric bandwidth is degraded; ``None``: not said."""
    if health_mask is None:
        return None
    field = (health_mask >> FABRIC_HEALTH_DEGRADED_BW_SHIFT) & FABRIC_HEALTH_DEGRADED_BW_WIDTH
    if field == FABRIC_HEALTH_DEGRADED_BW_TRUE:
        return True
    if field == FABRIC_HEALTH_DEGRADED_BW_FALSE:
        return False
    return None


# --------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True, slots=True)
class EccErrors:
    """``nvmlDeviceGetTotalEccErrors``: volatile counts since the driver loaded, aggregate
    over the GPU's life."""

    volatile_corrected: int | None
    volatile_uncorrected: int | None
    aggregate_corrected: int | None
    aggregate_uncorrected: int | None


@dataclass(frozen=True, slots=True)
class RetiredPages:
    """``nvmlDeviceGetRetiredPages`` per cause and ``...PendingStatus`` (pre-Ampere GPUs;
    Ampere and later remap rows instead)."""

    single_bit_ecc: int | None
    double_bit_ecc: int | None
    pending: bool | None


@dataclass(frozen=True, slots=True)
class RowRemap:
    """``nvmlDeviceGetRemappedRows``: rows remapped for correctable and uncorrectable errors,
    a remap waiting for the next GPU reset, and a remap that failed (the GPU has no spare row
    left in that bank: replace it)."""

    correctable: int | None
    uncorrectable: int | None
    pending: bool | None
    failed: bool | None


@dataclass(frozen=True, slots=True)
class Temperatures:
    """°C: the GPU die and the HBM (field ``NVML_FI_DEV_MEMORY_TEMP``), and the thresholds at
    which the GPU slows itself, shuts down, and the maxima for GPU and memory."""

    gpu: int | None
    memory: int | None
    slowdown: int | None
    shutdown: int | None
    gpu_max: int | None
    memory_max: int | None


@dataclass(frozen=True, slots=True)
class Power:
    """Watts: the board's draw, the management limit set on it, the limit enforced (the
    lowest of every limit in force) and the board's default limit
    (``nvmlDeviceGetPowerManagementDefaultLimit``, the limit it ships with: a GPU working
    hard draws close to it, and an enforced limit below it is a cap someone set)."""

    draw_watts: float | None
    limit_watts: float | None
    enforced_limit_watts: float | None
    default_limit_watts: float | None = None


@dataclass(frozen=True, slots=True)
class Clocks:
    """MHz of the SM and memory clocks, the clock-event reasons in force (bit mask of
    :data:`CLOCK_EVENT_REASONS`; ``None`` when not answered) and the SM clock the GPU's
    applications are meant to run at (``nvmlDeviceGetApplicationsClock``, the target the
    driver boosts to when power and heat allow)."""

    sm_mhz: int | None
    memory_mhz: int | None
    event_reasons: int | None
    applications_sm_mhz: int | None = None


@dataclass(frozen=True, slots=True)
class FrameBuffer:
    used_bytes: int | None
    total_bytes: int | None


@dataclass(frozen=True, slots=True)
class Fabric:
    """The GPU's registration with the NVSwitch fabric manager: ``state`` one of
    :data:`FABRIC_STATES`, ``status`` the nvmlReturn_t of the registration (meaningful once
    completed), the clique (the GPUs it can reach over NVLink), the cluster UUID, and the
    health mask's degraded-bandwidth bit where the driver has one."""

    state: int
    status: int | None
    clique_id: int | None
    cluster_uuid: str | None
    bandwidth_degraded: bool | None

    @property
    def state_name(self) -> str:
        return FABRIC_STATES.get(self.state, f"state_{self.state}")


@dataclass(frozen=True, slots=True)
class Gpm:
    """GPU Performance Monitoring figures (Hopper and later) over ``window_seconds`` between
    two GPM samples: SM activity, tensor-core activity and DRAM bandwidth used as percentages,
    NVLink and PCIe traffic in bytes/s (NVML gives MiB/s)."""

    window_seconds: float
    sm_activity_percent: float | None
    tensor_activity_percent: float | None
    dram_bandwidth_percent: float | None
    nvlink_tx_bytes_per_second: float | None
    nvlink_rx_bytes_per_second: float | None
    pcie_tx_bytes_per_second: float | None
    pcie_rx_bytes_per_second: float | None


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """One GPU's health, read at ``read_at`` (the source's wall clock, Unix seconds). ``gpm``
    is the latest GPM window, read on a slower cadence, ``None`` before the second sample or
    on a GPU without GPM."""

    index: int
    uuid: str
    pci_address: str
    read_at: float
    ecc: EccErrors | None
    retired_pages: RetiredPages | None
    row_remap: RowRemap | None
    temperatures: Temperatures | None
    power: Power | None
    clocks: Clocks | None
    framebuffer: FrameBuffer | None
    fabric: Fabric | None
    gpm: Gpm | None
    #: health calls this GPU answered NOT_SUPPORTED to (not asked again)
    unsupported: tuple[str, ...] = ()
