"""Hand-made PCIe topologies and snapshots for the attribution and detector tests.

The tree (both host bridges on NUMA node 0 unless said otherwise)::

    pci0000:10  10:01.0 RP (Gen5 x16) -> 11:00.0 USP -> 12:00.0 DSP -> 13:00.0 GPU (Gen5 x16)
                                                     -> 12:01.0 DSP -> 14:00.0 NVMe (Gen4 x4)
                                                     -> 12:02.0 DSP -> 15:00.0 IB HCA (Gen5 x16)
                10:02.0 RP (Gen5 x16) -> 16:00.0 GPU
    pci0000:80  80:01.0 RP (Gen5 x16, NUMA 1) -> 81:00.0 USP -> 82:00.0 DSP -> 83:00.0 GPU
                                                            -> 82:01.0 DSP -> 84:00.0 IB HCA
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.model.topology import (
    DeviceClass,
    LinkState,
    PciDevice,
    PciRoot,
    PortRole,
    Topology,
)

G5 = LinkState(32.0, 16, 32.0, 16)
G4X4 = LinkState(16.0, 4, 16.0, 4)

B, RP, USP, DSP, EP = (
    DeviceClass.BRIDGE,
    PortRole.ROOT_PORT,
    PortRole.UPSTREAM_PORT,
    PortRole.DOWNSTREAM_PORT,
    PortRole.ENDPOINT,
)

_CLASS_CODES = {
    DeviceClass.GPU: 0x030200,
    DeviceClass.ETHERNET: 0x020000,
    DeviceClass.INFINIBAND: 0x020700,
    DeviceClass.NVME: 0x010802,
    DeviceClass.BRIDGE: 0x060400,
}

GPU_A, NVME, HCA, GPU_B, GPU_C, HCA_C = (
    "0000:13:00.0",
    "0000:14:00.0",
    "0000:15:00.0",
    "0000:16:00.0",
    "0000:83:00.0",
    "0000:84:00.0",
)
RP_SHARED, RP_ALONE, RP_REMOTE = "0000:10:01.0", "0000:10:02.0", "0000:80:01.0"


def dev(
    chain: tuple[str, ...],
    root: str,
    cls: DeviceClass,
    role: PortRole,
    numa: int | None = 0,
    link: LinkState | None = G5,
) -> PciDevice:
    return PciDevice(
        bdf=chain[-1],
        root=root,
        chain=chain,
        vendor_id=0x10DE,
        device_id=0x2330,
        class_code=_CLASS_CODES[cls],
        device_class=cls,
        role=role,
        numa_node=numa,
        local_cpus=None,
        link=link,
    )


def topology(
    links: Mapping[str, LinkState] | None = None, aer: Mapping[str, Any] | None = None
) -> Topology:
    """The tree of the module docstring; ``links`` overrides the link state of functions and
    ``aer`` their AER records."""
    rp = (RP_SHARED,)
    usp = (*rp, "0000:11:00.0")
    rr = (RP_REMOTE,)
    rusp = (*rr, "0000:81:00.0")
    h, r = "pci0000:10", "pci0000:80"
    IB = DeviceClass.INFINIBAND
    devices = [
        dev(rp, h, B, RP),
        dev(usp, h, B, USP),
        dev((*usp, "0000:12:00.0"), h, B, DSP),
        dev((*usp, "0000:12:00.0", GPU_A), h, DeviceClass.GPU, EP),
        dev((*usp, "0000:12:01.0"), h, B, DSP, link=G4X4),
        dev((*usp, "0000:12:01.0", NVME), h, DeviceClass.NVME, EP, link=G4X4),
        dev((*usp, "0000:12:02.0"), h, B, DSP),
        dev((*usp, "0000:12:02.0", HCA), h, IB, EP),
        dev((RP_ALONE,), h, B, RP),
        dev((RP_ALONE, GPU_B), h, DeviceClass.GPU, EP),
        dev(rr, r, B, RP, 1),
        dev(rusp, r, B, USP, 1),
        dev((*rusp, "0000:82:00.0"), r, B, DSP, 1),
        dev((*rusp, "0000:82:00.0", GPU_C), r, DeviceClass.GPU, EP, 1),
        dev((*rusp, "0000:82:01.0"), r, B, DSP, 1),
        dev((*rusp, "0000:82:01.0", HCA_C), r, IB, EP, 1),
    ]
    changed = []
    for d in devices:
        if links and d.bdf in links:
            d = dataclasses.replace(d, link=links[d.bdf])
        if aer and d.bdf in aer:
            d = dataclasses.replace(d, aer=aer[d.bdf])
        changed.append(d)
    roots = (
        PciRoot(h, 0, 0x10, (RP_SHARED, RP_ALONE)),
        PciRoot(r, 0, 0x80, (RP_REMOTE,)),
    )
    return Topology(tuple(sorted(changed, key=lambda d: d.bdf)), roots)


def snapshot(
    current: Mapping[str, Any],
    previous: Mapping[str, Any] | None = None,
    seconds: float = 1.0,
    t: float = 100.0,
) -> Snapshot:
    """A snapshot whose sources' latest data are ``current`` (read at ``t``) and, where given,
    ``previous`` (read ``seconds`` earlier)."""
    cur = {name: SourceSample(name, t, 0.0, data) for name, data in current.items()}
    prev = {
        name: SourceSample(name, t - seconds, 0.0, data) for name, data in (previous or {}).items()
    }
    return Snapshot(cycle=1, monotonic=t, wall_time=t, current=cur, previous=prev)
