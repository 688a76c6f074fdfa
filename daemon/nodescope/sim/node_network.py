"""The simulated node's network: the InfiniBand ports under ``sys/class/infiniband``
(drivers/infiniband/core/sysfs.c; data counters in 4-byte words; error counters stop at their
width's maximum) and ``proc/net/snmp`` (net/ipv4/proc.c)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nodescope.model.infiniband import ERROR_COUNTER_BITS
from nodescope.sim.node_base import NodePart
from nodescope.sim.scenario import (
    load_ib_capture_device,
)

if TYPE_CHECKING:
    from nodescope.sim.node import SimulatedNode

#: The InfiniBand counters that traffic moves.
_IB_TRAFFIC_COUNTERS = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "port_xmit_wait",
)

#: /proc/net/snmp columns (net/ipv4/proc.c, Linux 6.12), one header line per group.
_SNMP_FIELDS: dict[str, tuple[str, ...]] = {
    "Ip": (
        "Forwarding", "DefaultTTL", "InReceives", "InHdrErrors", "InAddrErrors", "ForwDatagrams",
        "InUnknownProtos", "InDiscards", "InDelivers", "OutRequests", "OutDiscards",
        "OutNoRoutes", "ReasmTimeout", "ReasmReqds", "ReasmOKs", "ReasmFails", "FragOKs",
        "FragFails", "FragCreates", "OutTransmits",
    ),
    "Icmp": (
        "InMsgs", "InErrors", "InCsumErrors", "InDestUnreachs", "InTimeExcds", "InParmProbs",
        "InSrcQuenchs", "InRedirects", "InEchos", "InEchoReps", "InTimestamps",
        "InTimestampReps", "InAddrMasks", "InAddrMaskReps", "OutMsgs", "OutErrors",
        "OutRateLimitGlobal", "OutRateLimitHost", "OutDestUnreachs", "OutTimeExcds",
        "OutParmProbs", "OutSrcQuenchs", "OutRedirects", "OutEchos", "OutEchoReps",
        "OutTimestamps", "OutTimestampReps", "OutAddrMasks", "OutAddrMaskReps",
    ),
    "Tcp": (
        "RtoAlgorithm", "RtoMin", "RtoMax", "MaxConn", "ActiveOpens", "PassiveOpens",
        "AttemptFails", "EstabResets", "CurrEstab", "InSegs", "OutSegs", "RetransSegs",
        "InErrs", "OutRsts", "InCsumErrors",
    ),
    "Udp": (
        "InDatagrams", "NoPorts", "InErrors", "OutDatagrams", "RcvbufErrors", "SndbufErrors",
        "InCsumErrors", "IgnoredMulti", "MemErrors",
    ),
}  # fmt: skip
_SNMP_FIELDS["UdpLite"] = _SNMP_FIELDS["Udp"]


def _default_ib_counters() -> dict[str, int]:
    names = (
        "VL15_dropped", "excessive_buffer_overrun_errors", "link_downed", "link_error_recovery",
        "local_link_integrity_errors", "multicast_rcv_packets", "multicast_xmit_packets",
        "port_rcv_constraint_errors", "port_rcv_data", "port_rcv_errors", "port_rcv_packets",
        "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors",
        "port_xmit_constraint_errors", "port_xmit_data", "port_xmit_discards",
        "port_xmit_packets", "port_xmit_wait", "symbol_error", "unicast_rcv_packets",
        "unicast_xmit_packets",
    )  # fmt: skip
    return dict.fromkeys(names, 0)


def _default_ib_hw_counters() -> dict[str, int]:
    names = (
        "duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err",
        "out_of_buffer", "out_of_sequence", "packet_seq_err", "rnr_nak_retry_err",
    )  # fmt: skip
    return {name: (12 if name == "lifespan" else 0) for name in names}


class NetworkPart(NodePart):
    """The InfiniBand ports and the IP/TCP counters of the node."""

    def __init__(self, node: SimulatedNode) -> None:
        super().__init__(node)
        #: (InfiniBand port, counter file) of every traffic counter, with its accumulator key
        self._ib_counter_files: list[tuple[str, tuple[Any, ...], Path]] = []

    def write_infiniband(self) -> None:
        node = self.node
        sysfs = node.roots.sysfs
        files = node.files
        for nic in node.hardware.nics:
            function = node.dirs[nic.pci[0]]
            device = function / "infiniband" / nic.name
            files.mkdir(device)
            files.symlink(device / "device", function)
            files.symlink(sysfs / "class" / "infiniband" / nic.name, device)
            files.write(device / "node_guid", f"{nic.node_guid}\n")
            files.write(device / "hca_type", f"{nic.hca_type}\n")
            files.write(device / "fw_ver", f"{nic.fw_ver}\n")
            files.write(device / "board_id", f"{nic.board_id}\n")
            files.write(device / "node_type", "1: CA\n")
            capture = load_ib_capture_device(nic.capture) if nic.capture else None
            for port in range(1, nic.ports + 1):
                captured = (capture or {}).get("ports", {}).get(str(port), {})
                port_dir = device / "ports" / str(port)
                files.write(port_dir / "state", "4: ACTIVE\n")
                files.write(port_dir / "phys_state", "5: LinkUp\n")
                files.write(port_dir / "rate", f"{nic.rate}\n")
                files.write(port_dir / "link_layer", f"{nic.link_layer}\n")
                counters = captured.get("counters") or _default_ib_counters()
                hw_counters = captured.get("hw_counters") or _default_ib_hw_counters()
                for name, value in counters.items():
                    node.acc[("ib", nic.name, port, name)] = float(value)
                    files.write(port_dir / "counters" / name, f"{int(value)}\n")
                for name, value in hw_counters.items():
                    node.acc[("ib_hw", nic.name, port, name)] = float(value)
                    files.write(port_dir / "hw_counters" / name, f"{int(value)}\n")

    def snmp(self) -> str:
        node = self.node
        out_segs = int(node.acc.get(("tcp", "out_segs"), 0.0)) + 48_000_000
        retrans = int(node.acc.get(("tcp", "retrans_segs"), 0.0)) + 1_200
        in_segs = out_segs - 2_000_000
        packets_in, packets_out = in_segs + 90_000, out_segs + 80_000
        values = {
            "Ip": [1, 64, packets_in, 0, 0, 0, 0, 0, packets_in, packets_out]
            + [0] * 9
            + [packets_out],
            "Icmp": [40, 0, 0, 40] + [0] * 10 + [40, 0, 0, 0, 40] + [0] * 10,
            "Tcp": [
                1,
                200,
                120000,
                -1,
                3120,
                1850,
                12,
                40,
                42,
                in_segs,
                out_segs,
                retrans,
                0,
                310,
                0,
            ],
            "Udp": [90000, 12, 0, 80000, 0, 0, 0, 400, 0],
            "UdpLite": [0] * 9,
        }
        return "".join(
            f"{group}: {' '.join(_SNMP_FIELDS[group])}\n{group}: {' '.join(map(str, row))}\n"
            for group, row in values.items()
        )

    def write_ib_counters(self) -> None:
        """The traffic counters of every port that is still there."""
        node = self.node
        if not self._ib_counter_files:
            # Paths built once: a refresh between two reads writes them several times a second.
            for nic in node.hardware.nics:
                device = node.dirs[nic.pci[0]] / "infiniband" / nic.name
                for port in range(1, nic.ports + 1):
                    counters = device / "ports" / str(port) / "counters"
                    for name in _IB_TRAFFIC_COUNTERS:
                        key = ("ib", nic.name, port, name)
                        self._ib_counter_files.append((nic.pci[0], key, counters / name))
            for nic_name, port, name in sorted(node.ib_errors):
                nic = node.hardware.nic(nic_name)
                device = node.dirs[nic.pci[0]] / "infiniband" / nic.name
                path = device / "ports" / str(port) / "counters" / name
                self._ib_counter_files.append((nic.pci[0], ("ib", nic.name, port, name), path))
            for nic_name, port, name in sorted(node.ib_hw_errors):
                nic = node.hardware.nic(nic_name)
                device = node.dirs[nic.pci[0]] / "infiniband" / nic.name
                path = device / "ports" / str(port) / "hw_counters" / name
                key = ("ib_hw", nic.name, port, name)
                self._ib_counter_files.append((nic.pci[0], key, path))
        files = node.files
        for function, key, path in self._ib_counter_files:
            if function in node.removed:
                continue
            value = node.acc.get(key)
            if value is not None:
                # Driver hw_counters are 64-bit; PMA error counters stop at their maximum
                # rather than wrap (IBA 16.1.3.5).
                bits = ERROR_COUNTER_BITS.get(key[3]) if key[0] == "ib" else None
                count = int(value) if bits is None else min(int(value), (1 << bits) - 1)
                files.write(path, f"{count}\n")
