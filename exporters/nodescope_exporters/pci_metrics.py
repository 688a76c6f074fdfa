"""Metrics of the ``pci`` source: PCIe link state, capacity, placement and AER counters.

Only functions that matter for contention and health get series: GPUs, NVMe drives, NICs,
NVSwitches, and the root and switch ports above them. The hundreds of RC-integrated chipset
functions of a server would multiply series without answering anything. Formats behind the
numbers: ``docs/datasources.md`` §2.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import PCI, DeviceClass, PciDevice, PortRole, Topology
from nodescope_exporters.catalog import Metric, metric

AREA = "pci"
#: Built from the ``pci`` source alone: reused while it has not run again (every 10 s).
INPUTS = (PCI,)

LINK_SPEED = metric(
    "nodescope_pcie_link_speed_gts",
    "gauge",
    "Current PCIe link speed (Link Status) in GT/s per lane.",
    ("bdf",),
    area=AREA,
)
LINK_MAX_SPEED = metric(
    "nodescope_pcie_link_max_speed_gts",
    "gauge",
    "Maximum PCIe link speed the function supports (Link Capabilities) in GT/s per lane.",
    ("bdf",),
    area=AREA,
)
LINK_WIDTH = metric(
    "nodescope_pcie_link_width_lanes",
    "gauge",
    "Current negotiated PCIe link width in lanes (0 when the link is down).",
    ("bdf",),
    area=AREA,
)
LINK_MAX_WIDTH = metric(
    "nodescope_pcie_link_max_width_lanes",
    "gauge",
    "Maximum PCIe link width the function supports in lanes.",
    ("bdf",),
    area=AREA,
)
LINK_CAPACITY = metric(
    "nodescope_pcie_link_capacity_bytes_per_second",
    "gauge",
    "Usable bytes per second in each direction of the function's current link, after line"
    " encoding (8b/10b, 128b/130b, Gen6 FLIT).",
    ("bdf",),
    area=AREA,
)
LINK_MAX_CAPACITY = metric(
    "nodescope_pcie_link_max_capacity_bytes_per_second",
    "gauge",
    "Usable bytes per second in each direction at the function's maximum speed and width.",
    ("bdf",),
    area=AREA,
)
DEVICE_INFO = metric(
    "nodescope_pcie_device_info",
    "info",
    "A PCI function: its class, ids, role in the tree, NUMA node, root port and parent bridge.",
    (
        "bdf",
        "class",
        "role",
        "vendor_id",
        "device_id",
        "numa_node",
        "root_port",
        "parent",
        "names",
    ),
    area=AREA,
)
AER_ERRORS = metric(
    "nodescope_pcie_aer_errors_total",
    "counter",
    "AER errors the function reported, by severity and error type (aer_dev_* files); a type"
    " appears once its count is non-zero, the per-severity totals are always exported.",
    ("bdf", "severity", "type"),
    area=AREA,
)
AER_REPORTED = metric(
    "nodescope_pcie_aer_reported_errors_total",
    "counter",
    "Error messages the function reported, by severity (TOTAL_ERR_* lines; can differ from the"
    " sum of the types).",
    ("bdf", "severity"),
    area=AREA,
)

_ENDPOINTS = (
    DeviceClass.GPU,
    DeviceClass.NVME,
    DeviceClass.ETHERNET,
    DeviceClass.INFINIBAND,
    DeviceClass.NVSWITCH,
)
_PORTS = (PortRole.ROOT_PORT, PortRole.UPSTREAM_PORT, PortRole.DOWNSTREAM_PORT)


def devices_of_interest(topology: Topology) -> list[PciDevice]:
    """Endpoints of the classes of interest and the bridges on their paths to the root."""
    wanted: set[str] = set()
    for dev in topology.devices:
        if dev.device_class in _ENDPOINTS:
            wanted.update(dev.chain)
    return [
        dev
        for dev in topology.devices
        if dev.bdf in wanted and (dev.device_class in _ENDPOINTS or dev.role in _PORTS)
    ]


def families(snapshot: Snapshot) -> Iterable[Metric]:
    topology = snapshot.latest(PCI)
    if topology is None:
        return []
    speed, max_speed = LINK_SPEED.family(), LINK_MAX_SPEED.family()
    width, max_width = LINK_WIDTH.family(), LINK_MAX_WIDTH.family()
    capacity, max_capacity = LINK_CAPACITY.family(), LINK_MAX_CAPACITY.family()
    info, aer, reported = DEVICE_INFO.family(), AER_ERRORS.family(), AER_REPORTED.family()
    for dev in devices_of_interest(topology):
        labels = [dev.bdf]
        info.add_metric(
            [
                dev.bdf,
                dev.device_class.value,
                dev.role.value,
                f"0x{dev.vendor_id:04x}",
                f"0x{dev.device_id:04x}",
                "" if dev.numa_node is None else str(dev.numa_node),
                dev.root_port or "",
                dev.parent or "",
                ",".join(dev.os_names),
            ],
            1.0,
        )
        link = dev.link
        if link is not None:
            if link.current_speed_gts is not None:
                speed.add_metric(labels, link.current_speed_gts)
            if link.max_speed_gts is not None:
                max_speed.add_metric(labels, link.max_speed_gts)
            if link.current_width is not None:
                width.add_metric(labels, float(link.current_width))
            if link.max_width is not None:
                max_width.add_metric(labels, float(link.max_width))
            current = link.current_capacity_bytes_per_s
            if current is not None:
                capacity.add_metric(labels, current)
            maximum = link.max_capacity_bytes_per_s
            if maximum is not None:
                max_capacity.add_metric(labels, maximum)
        for record in dev.aer:
            for counter in record.counters:
                # Some 20 types x 3 severities x every bridge would be thousands of zero series
                # on an HGX node; the always-present totals carry the first increment.
                if counter.value:
                    aer.add_metric([dev.bdf, record.severity, counter.name], float(counter.value))
            if record.total is not None:
                reported.add_metric([dev.bdf, record.severity], float(record.total))
    return [info, speed, max_speed, width, max_width, capacity, max_capacity, aer, reported]
