"""The PCIe link of a measured GPU, from the sysfs topology (:mod:`nodescope.sources.pci`).

CUDA names a GPU by PCI domain, bus and device numbers; sysfs by BDF. The capacity a copy is
compared with is the narrowest link between the GPU and its root port at the links' maximum
speed and width: a link that trained at half width then shows as half the expected figure
instead of a healthy fraction of a degraded capacity. The trained (current) capacity is kept
beside it; an idle GPU drops its link speed to save power, so that one is read for
information only.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodescope.model.topology import Topology, generation_of, upstream_links


@dataclass(frozen=True, slots=True)
class LinkInfo:
    description: str | None
    capacity_bytes_per_second: float | None
    current_capacity_bytes_per_second: float | None


NO_LINK = LinkInfo(None, None, None)


def bdf_of(domain: int, bus: int, device: int, function: int = 0) -> str:
    """``0000:17:00.0`` as sysfs spells it."""
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function}"


def normalise_bdf(text: str) -> str:
    """NVML's ``00000000:17:00.0`` (and upper case) to the sysfs form ``0000:17:00.0``."""
    value = text.strip().lower()
    domain, sep, rest = value.partition(":")
    if sep and len(domain) > 4 and int(domain, 16) <= 0xFFFF:
        value = f"{int(domain, 16):04x}:{rest}"
    return value


def link_info(topology: Topology | None, bdf: str | None) -> LinkInfo:
    """The capacity figures of ``bdf``'s path to its root port; :data:`NO_LINK` when sysfs does
    not know the device or its link files."""
    if topology is None or bdf is None or topology.get(bdf) is None:
        return NO_LINK
    links = upstream_links(topology, bdf)
    known_max = [link for link in links if link.max_capacity_bytes_per_s is not None]
    known_cur = [link for link in links if link.capacity_bytes_per_s is not None]
    if not known_max:
        return NO_LINK
    narrowest = min(known_max, key=lambda link: link.max_capacity_bytes_per_s or 0.0)
    gen = generation_of(narrowest.max_speed_gts) if narrowest.max_speed_gts else None
    description = (
        f"Gen{gen} x{narrowest.max_width}"
        if gen is not None
        else f"{narrowest.max_speed_gts} GT/s x{narrowest.max_width}"
    )
    current = min((link.capacity_bytes_per_s or 0.0 for link in known_cur), default=None)
    return LinkInfo(description, narrowest.max_capacity_bytes_per_s, current)
