"""The ``nvml`` source's link reader: each GPU's PCIe byte counters (fields 197/198, or the
20 ms throughput snapshot where they are not supported) and NVLink throughput fields 138-141,
all asked in one field-value call a run; and, on slow runs, the PCIe link generation, width
and replay counter and each NVLink's state, peer and DL error counters, carried in the
records between slow reads (:mod:`nodescope.sources.nvml` says why).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from nodescope.model.nvml import CounterColumn, CounterValue, NvLinks, PcieSnapshot
from nodescope.sources.nvml_device import (
    FI_PCIE_RX_BYTES,
    FI_PCIE_TX_BYTES,
    NEVER,
    VALUE_TYPE_ULL,
    FieldPlan,
    Gpu,
    GpuLost,
    Link,
    NvmlAdapter,
    SlowGpu,
    call,
    field_columns,
    log,
    pci_address_of,
    row_value,
)

_PCIE_FIELDS = frozenset({(FI_PCIE_TX_BYTES, 0), (FI_PCIE_RX_BYTES, 0)})


#: NVML_NVLINK_ERROR_DL_* counters read per link, by the name the record gives them.
NVLINK_ERROR_COUNTERS: tuple[tuple[str, int], ...] = (
    ("replay", 0),  # NVML_NVLINK_ERROR_DL_REPLAY: data link transmit replays
    ("recovery", 1),  # NVML_NVLINK_ERROR_DL_RECOVERY: link recoveries
    ("crc_flit", 2),  # NVML_NVLINK_ERROR_DL_CRC_FLIT: flow-control digit CRC errors
    ("crc_data", 3),  # NVML_NVLINK_ERROR_DL_CRC_DATA: data CRC errors
)

_ERROR_COUNTER_KEYS = tuple(
    (name, counter, f"nvmlDeviceGetNvLinkErrorCounter:{name}")
    for name, counter in NVLINK_ERROR_COUNTERS
)

#: nvmlDeviceGetNvLinkRemoteDeviceType values (nvml.h nvmlIntNvLinkDeviceType_t).
REMOTE_TYPES = {0: "gpu", 1: "ibmnpu", 2: "switch", 0xFF: "unknown"}


class Fields:
    """The answers to one GPU's field-value call as columns, by position in the plan:
    value (bytes), timestamp (µs, ``None``: none given) and width (``None``: unknown);
    ``values[i]`` ``None`` where the field gave nothing."""

    __slots__ = ("bits", "stamps", "values")

    def __init__(
        self, values: list[int | None], stamps: list[int | None], bits: list[int | None]
    ) -> None:
        self.values, self.stamps, self.bits = values, stamps, bits

    @classmethod
    def none(cls, count: int) -> Fields:
        empty: list[int | None] = [None] * count
        return cls(empty, empty, empty)

    def counter(self, at: int | None) -> CounterValue | None:
        value = None if at is None else self.values[at]
        if value is None or at is None:
            return None
        return CounterValue(value, self.stamps[at], self.bits[at])

    def column(self, positions: Sequence[int | None]) -> CounterColumn:
        values, stamps, bits = self.values, self.stamps, self.bits
        return CounterColumn(
            tuple([None if i is None else values[i] for i in positions]),
            tuple([None if i is None else stamps[i] for i in positions]),
            tuple([None if i is None else bits[i] for i in positions]),
        )


class LinkReader:
    """Reads the PCIe and NVLink side of each GPU (the records' ``pcie_*`` and ``nvlinks``)."""

    def __init__(self, nvml: NvmlAdapter) -> None:
        self.nvml = nvml

    def discover(self, handle: Any) -> list[Link]:
        """Links are probed once: NVML answers INVALID_ARGUMENT past the GPU's last link
        and NOT_SUPPORTED on a GPU without NVLink."""
        links: list[Link] = []
        for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 36))):
            try:
                state = self.nvml.nvmlDeviceGetNvLinkState(handle, link)
            except (pynvml.NVMLError_InvalidArgument, *NEVER):
                break
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError:
                state = None
            links.append(Link(link, None if state is None else bool(state)))
        return links

    def read_fields(self, gpu: Gpu) -> tuple[FieldPlan, Fields]:
        """The counters of ``gpu``'s fields, in the order of the plan they were asked by."""
        plan = gpu.plan
        if plan is None:
            plan = gpu.plan = FieldPlan.make(gpu.links, gpu.unsupported_fields)
        wanted = plan.wanted
        if not wanted:
            return plan, Fields.none(0)
        values = call(
            gpu, "nvmlDeviceGetFieldValues", self.nvml.nvmlDeviceGetFieldValues, gpu.handle, wanted
        )
        if values is None:
            if "nvmlDeviceGetFieldValues" in gpu.unsupported_calls:
                gpu.unsupported_fields.update(wanted)
                gpu.plan = None
            return plan, Fields.none(len(wanted))
        _fids, _scopes, stamps, _latency, vtypes, rets, unions = field_columns(values)
        success, ull, count = pynvml.NVML_SUCCESS, VALUE_TYPE_ULL, len(wanted)
        if len(rets) == count and rets.count(success) == count and vtypes.count(ull) == count:
            # Every field an unsigned long long, as on current drivers: 74 per H100 a run.
            return plan, Fields(
                [u << 10 if kib else u for kib, u in zip(plan.kib, unions, strict=True)],
                [t if t > 0 else None for t in stamps],
                list(plan.widths),
            )
        fields = Fields([None] * count, [None] * count, [None] * count)
        for i, (kib, stamp, vtype, ret, union) in enumerate(
            zip(plan.kib, stamps, vtypes, rets, unions, strict=False)
        ):
            if ret == success and vtype == ull:
                counter: CounterValue | None = CounterValue(
                    union << 10 if kib else union, stamp if stamp > 0 else None, 74 if kib else 64
                )
            else:
                counter = self._odd_field(gpu, wanted[i], kib, stamp, vtype, ret, union)
            if counter is not None:
                fields.values[i] = counter.value
                fields.stamps[i] = counter.timestamp_us
                fields.bits[i] = counter.bits
        return plan, fields

    def _odd_field(
        self,
        gpu: Gpu,
        key: tuple[int, int],
        kib: bool,
        stamp: int,
        vtype: int,
        ret: int,
        union: int,
    ) -> CounterValue | None:
        """A field that failed or is not an ``unsigned long long``."""
        if ret != pynvml.NVML_SUCCESS:
            if ret in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND):
                gpu.unsupported_fields.add(key)
                gpu.plan = None
            elif ret == pynvml.NVML_ERROR_GPU_IS_LOST:
                raise GpuLost(f"nvmlDeviceGetFieldValues field {key[0]}: GPU is lost")
            return None
        try:
            number, width = row_value(vtype, union)
            count = int(number)  # a double has no width: width is None
        except (ValueError, OverflowError) as exc:  # an unknown type, NaN, infinity
            log.debug("source=nvml gpu=%d field=%s error=%r", gpu.index, key, str(exc))
            return None
        if count < 0:
            return None
        if kib:
            count *= 1024
            width = None if width is None else width + 10
        return CounterValue(count, stamp if stamp > 0 else None, width)

    def pcie_snapshot(self, gpu: Gpu) -> PcieSnapshot | None:
        """The 20 ms throughput snapshot, read only where fields 197/198 are not supported."""
        if _PCIE_FIELDS.isdisjoint(gpu.unsupported_fields):
            return None
        h = gpu.handle
        key, fn = "nvmlDeviceGetPcieThroughput", self.nvml.nvmlDeviceGetPcieThroughput
        tx = call(gpu, key, fn, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = call(gpu, key, fn, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        if tx is None and rx is None:
            return None
        return PcieSnapshot(
            None if tx is None else int(tx) * 1024,
            None if rx is None else int(rx) * 1024,
        )

    def slow_reads(self, gpu: Gpu, slow: bool) -> SlowGpu:
        """What the last slow read gave ``gpu``; read now on a slow run or when none was."""
        carried = gpu.slow
        if slow or carried is None:
            carried = gpu.slow = self._read_slow(gpu)
        return carried

    @staticmethod
    def nvlinks(plan: FieldPlan, fields: Fields, carried: SlowGpu) -> NvLinks:
        """The links of one GPU: this run's throughput fields beside the carried states."""
        data_tx, data_rx, raw_tx, raw_rx = plan.link_columns
        return NvLinks(
            link=carried.link,
            active=carried.active,
            remote_type=carried.remote_type,
            remote_pci_address=carried.remote_pci_address,
            data_tx=fields.column(data_tx),
            data_rx=fields.column(data_rx),
            raw_tx=fields.column(raw_tx),
            raw_rx=fields.column(raw_rx),
            errors=carried.errors,
        )

    def _read_slow(self, gpu: Gpu) -> SlowGpu:
        """The PCIe link and replay counter of ``gpu``, and the state, peer and error
        counters of each of its links (kept on the links)."""
        h, nvml = gpu.handle, self.nvml

        def simple(fn: Callable[[Any], int]) -> int | None:
            value = call(gpu, fn.__name__, fn, h)
            return None if value is None else int(value)

        slow = SlowGpu(
            pcie_gen_current=simple(nvml.nvmlDeviceGetCurrPcieLinkGeneration),
            pcie_width_current=simple(nvml.nvmlDeviceGetCurrPcieLinkWidth),
            pcie_gen_max=simple(nvml.nvmlDeviceGetMaxPcieLinkGeneration),
            pcie_width_max=simple(nvml.nvmlDeviceGetMaxPcieLinkWidth),
            pcie_replays=simple(nvml.nvmlDeviceGetPcieReplayCounter),
        )
        links = gpu.links
        for link in links:
            self._read_link(gpu, link)
        slow.link = tuple([link.index for link in links])
        slow.active = tuple([link.active for link in links])
        slow.remote_type = tuple([link.remote_type for link in links])
        slow.remote_pci_address = tuple([link.remote_pci_address for link in links])
        slow.errors = tuple([link.errors for link in links])
        return slow

    def _read_link(self, gpu: Gpu, link: Link) -> None:
        """The state, peer (when the link came up) and error counters of one link."""
        h, n, nvml = gpu.handle, link.index, self.nvml
        state_key, type_key, remote_key = link.call_keys
        state = call(gpu, state_key, nvml.nvmlDeviceGetNvLinkState, h, n)
        active = None if state is None else bool(state)
        if active and (not link.active or link.remote_type is None):
            # The peer of a link changes only when the link retrains: read it when the link
            # comes up, not every cycle.
            kind = call(gpu, type_key, nvml.nvmlDeviceGetNvLinkRemoteDeviceType, h, n)
            remote = call(gpu, remote_key, nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, n)
            link.remote_type = None if kind is None else REMOTE_TYPES.get(int(kind), "unknown")
            link.remote_pci_address = None if remote is None else pci_address_of(remote)
        link.active = active
        errors: list[tuple[str, int]] = []
        read_counter = nvml.nvmlDeviceGetNvLinkErrorCounter
        for name, counter, key in _ERROR_COUNTER_KEYS:
            # NOT_SUPPORTED for one counter is a property of the GPU, not of one link.
            value = call(gpu, key, read_counter, h, n, counter)
            if value is not None:
                errors.append((name, int(value)))
        link.errors = tuple(errors)

    # ---- health (docs/datasources.md §1.8) ------------------------------------------------
