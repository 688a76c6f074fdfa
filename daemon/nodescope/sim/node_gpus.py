"""The simulated node's GPUs as the fake NVML (:class:`nodescope.sim.fake_nvml.FakeNvml`)
shows them: their PCI identity and links, and their health (ECC and remap counters,
temperatures, power, clocks and their event reasons, fabric registration, GPM), which follows
their load and the timeline's GPU health activities."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynvml

from nodescope.model.gpu_health import (
    CLOCK_EVENT_GPU_IDLE,
    FABRIC_HEALTH_DEGRADED_BW_FALSE,
    FABRIC_HEALTH_DEGRADED_BW_SHIFT,
    FABRIC_HEALTH_DEGRADED_BW_TRUE,
    FABRIC_HEALTH_DEGRADED_BW_WIDTH,
    FABRIC_STATE_COMPLETED,
    NVML_SUCCESS,
)
from nodescope.sim.fake_nvml import FakeGpu, FakeLink
from nodescope.sim.node_base import NodePart
from nodescope.sim.node_pci import GENERATIONS
from nodescope.sim.scenario import (
    INSTANT_KINDS,
)

if TYPE_CHECKING:
    from nodescope.sim.node import SimulatedNode


def _nvml_bus_id(bdf: str) -> str:
    domain, bus, devfn = bdf.split(":")
    device, _, function = devfn.partition(".")
    return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function}"


#: A GPU at full utilisation when no ``gpu_temperature`` or ``gpu_power`` activity says
#: otherwise: an H100 SXM training flat out runs its die near 70 °C, its HBM a little cooler,
#: and draws most of its power limit without reaching it (no power-cap clock events). Between
#: idle (the fake GPU's resting values) and these, temperature and draw follow utilisation.
_LOADED_GPU_CELSIUS = 70
_LOADED_MEMORY_CELSIUS = 66
_LOADED_DRAW_SHARE_OF_LIMIT = 0.9
_MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class _HealthyGpu:
    """A GPU's health values before the timeline touches it: what a value returns to when
    the activity that set it ends (counters start from these and only grow)."""

    temperature_gpu: int
    temperature_memory: int
    power_draw_mw: int
    power_limit_mw: int
    power_enforced_limit_mw: int
    power_default_limit_mw: int
    sm_clock_mhz: int
    memory_clock_mhz: int
    clock_event_reasons: int
    applications_sm_clock_mhz: int
    fabric_state: int
    fabric_status: int
    fabric_health_mask: int
    counters: tuple[tuple[str, int], ...]


#: The FakeGpu counters health activities add to (activity field -> fake GPU field, by kind).
_HEALTH_COUNTERS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "gpu_ecc": (
        ("corrected", "ecc_volatile_corrected"),
        ("corrected", "ecc_aggregate_corrected"),
        ("uncorrected", "ecc_volatile_uncorrected"),
        ("uncorrected", "ecc_aggregate_uncorrected"),
    ),
    "gpu_row_remap": (
        ("correctable_rows", "remapped_rows_correctable"),
        ("uncorrectable_rows", "remapped_rows_uncorrectable"),
    ),
    "gpu_retired_pages": (
        ("single_bit", "retired_pages_single_bit"),
        ("double_bit", "retired_pages_double_bit"),
    ),
}
_COUNTER_FIELDS = tuple(
    sorted({fake_field for pairs in _HEALTH_COUNTERS.values() for _, fake_field in pairs})
)


def _apply_gpm(
    fake: FakeGpu,
    gpu_percent: float,
    memory_percent: float,
    traffic: Sequence[float],
    values: Mapping[tuple[str, str], Any],
) -> None:
    """GPM figures: the SMs as busy as the utilisation says (an upper bound: a kernel may run
    on few SMs), DRAM as the memory utilisation, NVLink and PCIe bytes the timeline's rates,
    unless a ``gpu_gpm`` activity states them."""

    def stated(name: str, default: float) -> float:
        value = values.get(("gpu_gpm", name))
        return default if value is None else float(value)

    nvlink_tx, nvlink_rx, pcie_tx, pcie_rx = traffic
    fake.gpm_sm_activity_percent = stated("sm_activity_percent", gpu_percent)
    fake.gpm_tensor_activity_percent = stated("tensor_activity_percent", 0.0)
    fake.gpm_dram_bandwidth_percent = stated("dram_bandwidth_percent", memory_percent)
    fake.gpm_nvlink_tx_mib_per_second = stated("nvlink_tx_bytes_per_second", nvlink_tx) / _MIB
    fake.gpm_nvlink_rx_mib_per_second = stated("nvlink_rx_bytes_per_second", nvlink_rx) / _MIB
    fake.gpm_pcie_tx_mib_per_second = stated("pcie_tx_bytes_per_second", pcie_tx) / _MIB
    fake.gpm_pcie_rx_mib_per_second = stated("pcie_rx_bytes_per_second", pcie_rx) / _MIB


def _with_degraded_bandwidth(mask: int, degraded: bool) -> int:
    """``mask`` with its degraded-bandwidth field saying ``degraded``."""
    field_value = FABRIC_HEALTH_DEGRADED_BW_TRUE if degraded else FABRIC_HEALTH_DEGRADED_BW_FALSE
    cleared = mask & ~(FABRIC_HEALTH_DEGRADED_BW_WIDTH << FABRIC_HEALTH_DEGRADED_BW_SHIFT)
    return cleared | (field_value << FABRIC_HEALTH_DEGRADED_BW_SHIFT)


class GpusPart(NodePart):
    """The GPUs of the node behind the fake NVML, their traffic and their health."""

    def __init__(self, node: SimulatedNode) -> None:
        super().__init__(node)
        #: each GPU's health values before the timeline touches it
        self._healthy: list[_HealthyGpu] = []

    def fake_gpus(self) -> list[FakeGpu]:
        node = self.node
        gpus = []
        gpu_addresses = {g.pci for g in node.hardware.gpus}
        switches = set(node.hardware.nvswitches)
        uptime = node.hardware.os.uptime_seconds
        #: each GPU's health before the timeline touches it, by index
        self._healthy = []
        for gpu in node.hardware.gpus:
            dev = node.functions[gpu.pci]
            links = [
                FakeLink(
                    remote_pci_bus_id=_nvml_bus_id(peer),
                    remote_type=(
                        pynvml.NVML_NVLINK_DEVICE_TYPE_GPU
                        if peer in gpu_addresses
                        else pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH
                    ),
                )
                for peer in gpu.link_peers()
            ]
            fake = FakeGpu(
                uuid=gpu.uuid,
                name=gpu.name,
                pci_bus_id=_nvml_bus_id(gpu.pci),
                pci_device_id=((dev.device_id or 0) << 16) | (dev.vendor_id or 0x10DE),
                curr_gen=GENERATIONS.get(dev.link_sta_speed_gts or 0.0, 0),
                curr_width=dev.link_sta_width or 0,
                max_gen=GENERATIONS.get(dev.link_cap_speed_gts or 0.0, 0),
                max_width=dev.link_cap_width or 0,
                links=links,
                unsupported=set(gpu.nvml_unsupported),
            )
            # Counters since the driver loaded: a steady trickle over the uptime.
            node.acc[("gpu", gpu.index, "tx")] = uptime * 2.0e8
            node.acc[("gpu", gpu.index, "rx")] = uptime * 3.0e8
            fake.pcie_tx_bytes = int(node.acc[("gpu", gpu.index, "tx")])
            fake.pcie_rx_bytes = int(node.acc[("gpu", gpu.index, "rx")])
            fake.fb_total_bytes = gpu.memory_bytes
            if any(peer in switches for peer in gpu.link_peers()):
                # On an NVSwitch system the fabric manager has registered every GPU before
                # jobs run: state completed, status success, bandwidth not degraded.
                fake.fabric_state = FABRIC_STATE_COMPLETED
                fake.fabric_status = NVML_SUCCESS
                fake.fabric_health_mask = (
                    FABRIC_HEALTH_DEGRADED_BW_FALSE << FABRIC_HEALTH_DEGRADED_BW_SHIFT
                )
            self._healthy.append(
                _HealthyGpu(
                    temperature_gpu=fake.temperature_gpu,
                    temperature_memory=fake.temperature_memory,
                    power_draw_mw=fake.power_draw_mw,
                    power_limit_mw=fake.power_limit_mw,
                    power_enforced_limit_mw=fake.power_enforced_limit_mw,
                    power_default_limit_mw=fake.power_default_limit_mw,
                    sm_clock_mhz=fake.sm_clock_mhz,
                    memory_clock_mhz=fake.memory_clock_mhz,
                    clock_event_reasons=fake.clock_event_reasons,
                    applications_sm_clock_mhz=fake.applications_sm_clock_mhz,
                    fabric_state=fake.fabric_state,
                    fabric_status=fake.fabric_status,
                    fabric_health_mask=fake.fabric_health_mask,
                    counters=tuple((name, getattr(fake, name)) for name in _COUNTER_FIELDS),
                )
            )
            gpus.append(fake)
        return gpus

    def apply_gpu_health(self, t: float, util: Mapping[int, Sequence[float]]) -> None:
        """Each GPU's health at ``t``: its resting values moved by its load (temperature and
        draw follow utilisation; a busy GPU is not idle), then what the GPU health
        activities active at ``t`` state, a later activity's value over an earlier one's
        (clock-event reasons of overlapping activities add up). Counters are the GPU's own
        plus every count of an activity that started by ``t``: they never go back."""
        node = self.node
        counts: dict[int, dict[str, int]] = {}
        held: dict[int, dict[tuple[str, str], Any]] = {}
        for activity in node.health_activities:
            if activity.start > t:
                continue
            get, kind = activity.get, activity.kind
            gpu_counts = counts.setdefault(get("gpu"), {})
            for name, fake_field in _HEALTH_COUNTERS.get(kind, ()):
                gpu_counts[fake_field] = gpu_counts.get(fake_field, 0) + get(name)
            if kind in INSTANT_KINDS or not activity.active_at(t):
                continue
            values = held.setdefault(get("gpu"), {})
            for name, value in activity.params:
                if name == "gpu" or value is None:
                    continue
                key = (kind, name)
                if kind == "gpu_clocks" and name == "reasons":
                    values[key] = values.get(key, 0) | value
                elif kind in ("gpu_row_remap", "gpu_retired_pages") and name in (
                    "pending",
                    "failed",
                ):
                    values[key] = values.get(key, False) or value
                else:
                    values[key] = value
        traffic = self.gpu_traffic(t)
        for gpu in node.hardware.gpus:
            fake = node.nvml.gpus[gpu.index]
            healthy = self._healthy[gpu.index]
            added = counts.get(gpu.index, {})
            for fake_field, base in healthy.counters:
                setattr(fake, fake_field, base + added.get(fake_field, 0))
            values = held.get(gpu.index, {})
            gpu_percent, memory_percent = util[gpu.index][0], util[gpu.index][1]
            load = gpu_percent / 100.0
            fake.remap_pending = values.get(("gpu_row_remap", "pending"), False)
            fake.remap_failed = values.get(("gpu_row_remap", "failed"), False)
            fake.retired_pages_pending = values.get(("gpu_retired_pages", "pending"), False)
            fake.temperature_gpu = values.get(
                ("gpu_temperature", "gpu_celsius"),
                round(
                    healthy.temperature_gpu + (_LOADED_GPU_CELSIUS - healthy.temperature_gpu) * load
                ),
            )
            fake.temperature_memory = values.get(
                ("gpu_temperature", "memory_celsius"),
                round(
                    healthy.temperature_memory
                    + (_LOADED_MEMORY_CELSIUS - healthy.temperature_memory) * load
                ),
            )
            default = values.get(("gpu_power", "default_limit_watts"))
            fake.power_default_limit_mw = (
                healthy.power_default_limit_mw if default is None else round(default * 1000)
            )
            limit = values.get(("gpu_power", "limit_watts"))
            fake.power_limit_mw = healthy.power_limit_mw if limit is None else round(limit * 1000)
            enforced = values.get(("gpu_power", "enforced_limit_watts"))
            fake.power_enforced_limit_mw = (
                min(healthy.power_enforced_limit_mw, fake.power_limit_mw)
                if enforced is None
                else round(enforced * 1000)
            )
            draw = values.get(("gpu_power", "draw_watts"))
            loaded_mw = fake.power_enforced_limit_mw * _LOADED_DRAW_SHARE_OF_LIMIT
            fake.power_draw_mw = (
                round(healthy.power_draw_mw + (loaded_mw - healthy.power_draw_mw) * load)
                if draw is None
                else round(draw * 1000)
            )
            fake.sm_clock_mhz = values.get(("gpu_clocks", "sm_mhz"), healthy.sm_clock_mhz)
            fake.applications_sm_clock_mhz = values.get(
                ("gpu_clocks", "applications_sm_mhz"), healthy.applications_sm_clock_mhz
            )
            fake.memory_clock_mhz = values.get(
                ("gpu_clocks", "memory_mhz"), healthy.memory_clock_mhz
            )
            # A GPU running kernels is not idle: NVML drops the idle reason.
            reasons = healthy.clock_event_reasons
            if gpu_percent > 0:
                reasons &= ~CLOCK_EVENT_GPU_IDLE
            fake.clock_event_reasons = values.get(("gpu_clocks", "reasons"), reasons)
            fake.fabric_state = values.get(("gpu_fabric", "state"), healthy.fabric_state)
            fake.fabric_status = values.get(("gpu_fabric", "status"), healthy.fabric_status)
            degraded = values.get(("gpu_fabric", "bandwidth_degraded"))
            fake.fabric_health_mask = (
                healthy.fabric_health_mask
                if degraded is None
                else _with_degraded_bandwidth(healthy.fabric_health_mask, degraded)
            )
            _apply_gpm(fake, gpu_percent, memory_percent, traffic[gpu.index], values)

    def gpu_traffic(self, t: float) -> dict[int, list[float]]:
        """Each GPU's NVLink TX and RX and PCIe TX and RX bytes per second at ``t``, as the
        timeline's rates state them (a burst's average over its period), for GPM."""
        node = self.node
        rates = {gpu.index: [0.0] * 4 for gpu in node.hardware.gpus}
        for activity in node.scenario.timeline:
            if not activity.active_at(t):
                continue
            get = activity.get
            if activity.kind == "nvlink":
                links = get("links") or range(node.hardware.gpus[get("gpu")].nvlink_count)
                burst = get("burst")
                duty = 1.0 if burst is None else burst.on_seconds / burst.period_seconds
                rates[get("gpu")][0] += get("tx_bytes_per_second") * len(links) * duty
                rates[get("gpu")][1] += get("rx_bytes_per_second") * len(links) * duty
            elif activity.kind == "gpu_pcie":
                rates[get("gpu")][2] += get("d2h_bytes_per_second")
                rates[get("gpu")][3] += get("h2d_bytes_per_second")
            elif activity.kind == "gpu_peer":
                rates[get("gpu")][2] += get("from_gpu_bytes_per_second")
                rates[get("gpu")][3] += get("to_gpu_bytes_per_second")
                if isinstance(get("peer"), int):
                    rates[get("peer")][2] += get("to_gpu_bytes_per_second")
                    rates[get("peer")][3] += get("from_gpu_bytes_per_second")
        return rates
