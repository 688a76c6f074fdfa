"""The traffic of every PCI endpoint, for attribution over the topology.

Gathers, from the sources' records and their rates, one
:class:`~nodescope.model.attribution.EndpointFlow` per PCI function and direction
(``docs/datasources.md`` §1, §4, §7; directions as :mod:`nodescope.model.attribution` defines
them):

* GPUs, from NVML fields 197/198 (``gpu_rates``): TX is "from this GPU" = upstream, RX "to
  this GPU" = downstream;
* NVMe drives, from ``/proc/diskstats`` (``iostat_figures``; rMB/s and wMB/s are MiB, sectors
  of 512 bytes): a read is a DMA write into host memory = upstream, a write = downstream.
  A disk reaches its PCI function through the disks source's NVMe mapping; with native
  multipath the bytes are split evenly over its PCIe paths (the kernel does not say which
  path served what);
* InfiniBand and RoCE functions, from ``port_xmit_data``/``port_rcv_data`` × 4 summed over
  the device's ports (``port_rates``): transmit = the HCA reads host memory = downstream,
  receive = upstream;
* Ethernet functions without an RDMA device, from the netdev byte counters, same directions.

Pure: a function of the records it is given.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nodescope.model.attribution import EndpointFlow
from nodescope.model.disks import DisksData, IostatReport
from nodescope.model.infiniband import InfinibandData, InfinibandRates
from nodescope.model.netdev import NetdevData, NetdevRates
from nodescope.model.nvml import NvmlData, NvmlRates
from nodescope.model.topology import DeviceClass, Topology


@dataclass(frozen=True, slots=True)
class Traffic:
    """What the endpoints' traffic is measured from: each source's latest record and the
    rates between its two latest reads (``None`` where a source has not read twice)."""

    nvml: NvmlData | None = None
    nvml_rates: NvmlRates | None = None
    disks: DisksData | None = None
    disk_rates: IostatReport | None = None
    infiniband: InfinibandData | None = None
    ib_rates: InfinibandRates | None = None
    netdev: NetdevData | None = None
    netdev_rates: NetdevRates | None = None


MIB = 1 << 20


def _summed(
    bdf: str,
    parts: list[tuple[str, float, float]],
    device_class: DeviceClass,
    measured_by: str,
) -> EndpointFlow:
    """One flow for a PCI function from the (name, downstream, upstream) bytes per second of
    the block devices or interfaces it serves."""
    return EndpointFlow(
        bdf=bdf,
        name=",".join(sorted(name for name, _down, _up in parts)),
        device_class=device_class,
        downstream_bytes_per_second=sum(down for _n, down, _up in parts),
        upstream_bytes_per_second=sum(up for _n, _down, up in parts),
        measured_by=measured_by,
    )


def endpoint_flows(traffic: Traffic, topology: Topology | None) -> tuple[EndpointFlow, ...]:
    """Every endpoint's bytes per second, one flow per PCI function.

    ``topology`` gives each function its class; a function it does not know keeps the class
    of the source that measured it.
    """
    topo = topology
    flows: dict[str, EndpointFlow] = {}

    def klass(bdf: str, default: DeviceClass) -> DeviceClass:
        dev = topo.get(bdf) if topo is not None else None
        return dev.device_class if dev is not None else default

    nvml, nvml_rates = traffic.nvml, traffic.nvml_rates
    if nvml is not None and nvml_rates is not None:
        address = {g.uuid: (g.index, g.pci_address) for g in nvml.gpus}
        for rates in nvml_rates.gpus:
            where = address.get(rates.uuid)
            if where is None:
                continue
            if rates.pcie_rx_bytes_per_second is None and rates.pcie_tx_bytes_per_second is None:
                continue
            index, bdf = where
            flows[bdf] = EndpointFlow(
                bdf=bdf,
                name=f"gpu{index}",
                device_class=klass(bdf, DeviceClass.GPU),
                downstream_bytes_per_second=rates.pcie_rx_bytes_per_second or 0.0,
                upstream_bytes_per_second=rates.pcie_tx_bytes_per_second or 0.0,
                measured_by="nvml",
            )

    disks, iostat = traffic.disks, traffic.disk_rates
    if disks is not None and iostat is not None:
        paths = {
            ns.disk: [p.pci_address for p in ns.paths if p.pci_address is not None]
            for ns in disks.nvme
        }
        per_function: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
        for figures in iostat.devices:
            functions = paths.get(figures.device) or []
            for bdf in functions:
                per_function[bdf].append(
                    (
                        figures.device,
                        figures.wmb_s * MIB / len(functions),
                        figures.rmb_s * MIB / len(functions),
                    )
                )
        for bdf, parts in per_function.items():
            if bdf not in flows:
                flows[bdf] = _summed(bdf, parts, klass(bdf, DeviceClass.NVME), "disks")

    ib, ib_rates = traffic.infiniband, traffic.ib_rates
    rdma_functions: set[str] = set()
    if ib is not None and ib_rates is not None:
        for device in ib.devices:
            if device.pci_address is None:
                continue
            rdma_functions.add(device.pci_address)
            xmit = rcv = 0.0
            measured = False
            for port in device.ports:
                port_rates = ib_rates.port(device.name, port.port)
                if port_rates is None:
                    continue
                if port_rates.xmit_bytes_per_second is not None:
                    xmit += port_rates.xmit_bytes_per_second
                    measured = True
                if port_rates.rcv_bytes_per_second is not None:
                    rcv += port_rates.rcv_bytes_per_second
                    measured = True
            if not measured or device.pci_address in flows:
                continue
            flows[device.pci_address] = EndpointFlow(
                bdf=device.pci_address,
                name=device.name,
                device_class=klass(device.pci_address, DeviceClass.INFINIBAND),
                downstream_bytes_per_second=xmit,
                upstream_bytes_per_second=rcv,
                measured_by="infiniband",
            )

    netdev, net_rates = traffic.netdev, traffic.netdev_rates
    if netdev is not None and net_rates is not None:
        by_function: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
        for link in netdev.links:
            function = link.pci_address
            if function is None or function in rdma_functions:
                continue  # virtual, or counted by its RDMA device already
            link_rates = net_rates.link(link.name)
            if link_rates is None or (
                link_rates.tx_bytes_per_second is None and link_rates.rx_bytes_per_second is None
            ):
                continue
            by_function[function].append(
                (
                    link.name,
                    link_rates.tx_bytes_per_second or 0.0,
                    link_rates.rx_bytes_per_second or 0.0,
                )
            )
        for bdf, links in by_function.items():
            if bdf not in flows:
                flows[bdf] = _summed(bdf, links, klass(bdf, DeviceClass.ETHERNET), "netdev")
    return tuple(flows[b] for b in sorted(flows))
