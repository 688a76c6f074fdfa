"""The traffic of every PCI endpoint in a snapshot, for attribution over the topology.

Gathers, from the sources' derived rates (:mod:`nodescope.derive`), one
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

Pure: reads only the snapshot.
"""

from __future__ import annotations

from collections import defaultdict

from nodescope import derive
from nodescope.model.attribution import Attribution, EndpointFlow, attribute
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import DeviceClass, Topology
from nodescope.sources.diskstats import DisksData, IostatReport
from nodescope.sources.infiniband import InfinibandData, InfinibandRates
from nodescope.sources.netlink import NetdevData, NetdevRates
from nodescope.sources.nvml import NvmlData, NvmlRates

MIB = 1 << 20


def endpoint_flows(
    snapshot: Snapshot, topology: Topology | None = None
) -> tuple[EndpointFlow, ...]:
    """Every endpoint's bytes per second in this snapshot, one flow per PCI function.

    ``topology`` (the ``pci`` source's by default) gives each function its class; a function
    it does not know keeps the class of the source that measured it.
    """
    topo = topology if topology is not None else snapshot.data("pci", Topology)
    flows: dict[str, EndpointFlow] = {}

    def klass(bdf: str, default: DeviceClass) -> DeviceClass:
        dev = topo.get(bdf) if topo is not None else None
        return dev.device_class if dev is not None else default

    nvml = snapshot.data("nvml", NvmlData)
    nvml_rates = derive.derived(snapshot, "nvml")
    if nvml is not None and isinstance(nvml_rates, NvmlRates):
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

    disks = snapshot.data("disks", DisksData)
    iostat = derive.derived(snapshot, "disks")
    if disks is not None and isinstance(iostat, IostatReport):
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
            if bdf in flows:
                continue
            flows[bdf] = EndpointFlow(
                bdf=bdf,
                name=",".join(sorted(name for name, _w, _r in parts)),
                device_class=klass(bdf, DeviceClass.NVME),
                downstream_bytes_per_second=sum(w for _n, w, _r in parts),
                upstream_bytes_per_second=sum(r for _n, _w, r in parts),
                measured_by="disks",
            )

    ib = snapshot.data("infiniband", InfinibandData)
    ib_rates = derive.derived(snapshot, "infiniband")
    rdma_functions: set[str] = set()
    if ib is not None and isinstance(ib_rates, InfinibandRates):
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

    netdev = snapshot.data("netdev", NetdevData)
    net_rates = derive.derived(snapshot, "netdev")
    if netdev is not None and isinstance(net_rates, NetdevRates):
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
            if bdf in flows:
                continue
            flows[bdf] = EndpointFlow(
                bdf=bdf,
                name=",".join(sorted(name for name, _t, _r in links)),
                device_class=klass(bdf, DeviceClass.ETHERNET),
                downstream_bytes_per_second=sum(t for _n, t, _r in links),
                upstream_bytes_per_second=sum(r for _n, _t, r in links),
                measured_by="netdev",
            )
    return tuple(flows[b] for b in sorted(flows))


#: The last snapshot attributed and its result: several detectors and the exporter ask for
#: the same snapshot's attribution in one cycle. A cache of one, keyed by identity or by the
#: samples it is made of (the analysed snapshot the exporter sees is a copy with findings);
#: it never changes what a call returns.
_last: tuple[Snapshot, Attribution | None] | None = None


def snapshot_attribution(snapshot: Snapshot) -> Attribution | None:
    """The attribution of this snapshot's traffic over its topology (``None`` without one)."""
    global _last
    cached = _last
    # Comparing the sample mappings is cheap: equal samples are the same objects.
    if cached is not None and (
        cached[0] is snapshot
        or (cached[0].current == snapshot.current and cached[0].previous == snapshot.previous)
    ):
        return cached[1]
    topology = snapshot.data("pci", Topology)
    result = None if topology is None else attribute(topology, endpoint_flows(snapshot, topology))
    _last = (snapshot, result)
    return result
