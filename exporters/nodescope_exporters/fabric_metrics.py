"""Metrics of the attribution: demand and utilisation of every shared PCIe link, per direction,
and the endpoints that carry the most through each.

Built from the snapshot's traffic attributed over its topology
(:mod:`nodescope.model.attribution`: directions, narrower-end capacity, host bridges;
the flows from NVML fields 197/198, ``/proc/diskstats`` and the InfiniBand/netdev counters,
``docs/datasources.md`` §1, §2, §4, §7). ``link`` is the BDF of the port at the link's upper
end (root port or switch downstream port) or the host bridge ``pciDDDD:BB``; ``direction`` is
``downstream`` (host to device) or ``upstream`` (device to host). Only shared links get series
(a device's own link is covered by its device metrics), and only the :data:`TOP_CONTRIBUTORS`
largest endpoints per link and direction: cardinality stays bounded by the hardware.
The per-function capacity of one end is ``nodescope_pcie_link_capacity_bytes_per_second``
(pci area); the capacity here is the link's, at its narrower end.
"""

from __future__ import annotations

from collections.abc import Iterable

from nodescope.model.attribution import DIRECTIONS
from nodescope.model.snapshot import Snapshot
from nodescope_exporters.catalog import Metric, metric

AREA = "fabric"

#: Endpoints exported per shared link and direction.
TOP_CONTRIBUTORS = 5

DEMAND = metric(
    "nodescope_pcie_link_demand_bytes_per_second",
    "gauge",
    "Bytes per second the endpoints below a shared PCIe link moved through it, by direction"
    " (downstream: host to device; upstream: device to host).",
    ("link", "direction"),
    area=AREA,
)
UTILIZATION = metric(
    "nodescope_pcie_link_utilization_ratio",
    "gauge",
    "Demand of a shared PCIe link over its capacity per direction at the narrower end"
    " (0..1; above 1 only through timing).",
    ("link", "direction"),
    area=AREA,
)
CAPACITY = metric(
    "nodescope_pcie_shared_link_capacity_bytes_per_second",
    "gauge",
    "Usable bytes per second in each direction of a shared PCIe link at its narrower end"
    " (current speed and width after line encoding); a host bridge's is its root ports' sum.",
    ("link",),
    area=AREA,
)
ENDPOINT = metric(
    "nodescope_pcie_link_endpoint_bytes_per_second",
    "gauge",
    "Bytes per second one endpoint moved through a shared PCIe link, for the largest"
    " contributors of each link and direction.",
    ("link", "direction", "endpoint", "class"),
    area=AREA,
)
LINK_INFO = metric(
    "nodescope_pcie_shared_link_info",
    "info",
    "A shared PCIe link: its kind (root_port, switch_port, host_bridge), host bridge, NUMA"
    " node and the number of data-moving functions below it.",
    ("link", "kind", "host_bridge", "numa_node", "endpoints"),
    area=AREA,
)


def families(snapshot: Snapshot) -> Iterable[Metric]:
    attribution = snapshot.derived.attribution
    if attribution is None:
        return []
    demand, utilization = DEMAND.family(), UTILIZATION.family()
    capacity, endpoint, info = CAPACITY.family(), ENDPOINT.family(), LINK_INFO.family()
    for link in attribution.shared_links:
        info.add_metric(
            [
                link.name,
                link.kind.value,
                link.host_bridge,
                "" if link.numa_node is None else str(link.numa_node),
                str(len(link.endpoints)),
            ],
            1.0,
        )
        if link.capacity_bytes_per_second is not None:
            capacity.add_metric([link.name], link.capacity_bytes_per_second)
        if not link.flows:
            continue  # nothing measured below it yet: no figures, not zeros
        for direction in DIRECTIONS:
            load = link.load(direction)
            demand.add_metric([link.name, direction.value], load.demand_bytes_per_second)
            if load.utilisation is not None:
                utilization.add_metric([link.name, direction.value], load.utilisation)
            for c in load.contributions[:TOP_CONTRIBUTORS]:
                endpoint.add_metric(
                    [link.name, direction.value, c.endpoint, c.device_class.value],
                    c.bytes_per_second,
                )
    return [info, capacity, demand, utilization, endpoint]
