"""The netdev source: parse_links on rtnetlink messages built with pyroute2 (encoded and decoded
as the kernel's would be), link_rates with wraps and resets, the sysfs PCI lookup on this
host's capture, and the exported metrics."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from nodescope import jsonout
from nodescope.errors import ParseError
from nodescope.model.skips import SkipTally
from nodescope.model.snapshot import Snapshot, SourceSample
from nodescope.roots import Roots
from nodescope.sources import netlink as nl
from nodescope_exporters import network_metrics
from nodescope_exporters.prometheus import render

HOST = Path(__file__).resolve().parents[1] / "fixtures" / "hosts" / "kvm-epyc-debian12"


def message(index: int, flags: int = 0, **attrs: Any) -> ifinfmsg:
    """An RTM_NEWLINK message as a dump returns it: built, encoded to bytes, decoded again."""
    msg = ifinfmsg()
    msg["index"] = index
    msg["flags"] = flags
    msg["attrs"] = [(name, value) for name, value in attrs.items()]
    msg.encode()
    decoded = ifinfmsg(msg.data)
    decoded.decode()
    return decoded


def veth(index: int = 7, **stats: int) -> ifinfmsg:
    return message(
        index,
        flags=0x1043,  # UP | BROADCAST | RUNNING | MULTICAST
        IFLA_IFNAME="veth0",
        IFLA_MTU=1500,
        IFLA_OPERSTATE="UP",
        IFLA_CARRIER=1,
        IFLA_LINKINFO={"attrs": [("IFLA_INFO_KIND", "veth")]},
        IFLA_STATS64={"rx_bytes": 1000, "tx_bytes": 2000, "rx_packets": 10, **stats},
    )


class FakeMessage:
    """A message whose fields hold anything at all, for the fuzz."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def get(self, key: Any, default: Any = None) -> Any:
        return self.fields.get(key, default)


# ------------------------------------------------------------------------------------------
# parse_links


def test_parse_veth() -> None:
    (link,) = nl.parse_links([veth(tx_dropped=3, rx_crc_errors=2)], "dump")
    assert link.name == "veth0"
    assert link.ifindex == 7
    assert link.operstate == "up"
    assert link.admin_up is True
    assert link.carrier is True
    assert link.mtu == 1500
    assert link.kind == "veth"
    assert link.pci_address is None
    assert link.stats is not None
    assert (link.stats.rx_bytes, link.stats.tx_bytes, link.stats.rx_packets) == (1000, 2000, 10)
    assert link.stats.tx_dropped == 3
    assert link.stats.rx_crc_errors == 2
    assert link.stats.bits == 64


def test_parse_down_link_with_32bit_stats_only() -> None:
    msg = message(
        3,
        flags=0,
        IFLA_IFNAME="eth9",
        IFLA_OPERSTATE="LOWERLAYERDOWN",
        IFLA_CARRIER=0,
        IFLA_STATS={"rx_bytes": 2**32 - 1},
    )
    (link,) = nl.parse_links([msg])
    assert link.operstate == "lowerlayerdown"
    assert link.admin_up is False
    assert link.carrier is False
    assert link.kind is None
    assert link.mtu is None
    assert link.stats is not None and link.stats.bits == 32
    assert link.stats.rx_bytes == 2**32 - 1


def test_parse_links_sorted_by_ifindex_and_serialisable() -> None:
    links = nl.parse_links(
        [veth(index=9), message(1, 0x49, IFLA_IFNAME="lo", IFLA_OPERSTATE="UNKNOWN")]
    )
    assert [(x.ifindex, x.name) for x in links] == [(1, "lo"), (9, "veth0")]
    assert links[0].operstate == "unknown"
    assert links[0].stats is None
    data = nl.NetdevData(links)
    assert json.loads(jsonout.dumps(data))["links"][1]["kind"] == "veth"


def test_numeric_operstate() -> None:
    (link,) = nl.parse_links([FakeMessage({"IFLA_IFNAME": "x", "index": 2, "IFLA_OPERSTATE": 2})])
    assert link.operstate == "down"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"index": 2}, "IFLA_IFNAME"),
        ({"IFLA_IFNAME": "", "index": 2}, "IFLA_IFNAME"),
        ({"IFLA_IFNAME": "a/b", "index": 2}, "IFLA_IFNAME"),
        ({"IFLA_IFNAME": "x"}, "ifindex"),
        ({"IFLA_IFNAME": "x", "index": -1}, "ifindex"),
        ({"IFLA_IFNAME": "x", "index": True}, "ifindex"),
        ({"IFLA_IFNAME": "x", "index": 2, "IFLA_MTU": "1500"}, "IFLA_MTU"),
        ({"IFLA_IFNAME": "x", "index": 2, "IFLA_CARRIER": 2}, "IFLA_CARRIER"),
        ({"IFLA_IFNAME": "x", "index": 2, "IFLA_OPERSTATE": "SIDEWAYS"}, "IFLA_OPERSTATE"),
        ({"IFLA_IFNAME": "x", "index": 2, "IFLA_STATS64": 5}, "statistics"),
        ({"IFLA_IFNAME": "x", "index": 2, "IFLA_STATS64": {"rx_bytes": 1}}, "missing"),
    ],
)
def test_parse_rejects(fields: dict[str, Any], fragment: str) -> None:
    good = FakeMessage({"IFLA_IFNAME": "ok", "index": 1})
    with pytest.raises(ParseError) as err:
        nl.parse_link(FakeMessage(fields), "dump", 2)
    assert fragment in str(err.value)
    assert err.value.line == 2
    assert err.value.source == "dump"
    # In a dump the bad message is left out and counted, named by its position; the good
    # links around it are kept.
    tally = SkipTally()
    after = FakeMessage({"IFLA_IFNAME": "ok2", "index": 3})
    links = nl.parse_links([good, FakeMessage(fields), after], "dump", tally)
    assert [x.name for x in links] == ["ok", "ok2"]
    skipped = tally.freeze()
    assert skipped.counts == {nl.SKIP_LINK_UNPARSABLE: 1}
    assert skipped.examples[nl.SKIP_LINK_UNPARSABLE].startswith("dump:2: ")


# ------------------------------------------------------------------------------------------
# Fuzz


_names = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="/"),
    min_size=1,
    max_size=15,
)
_u64 = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(
    index=st.integers(1, 2**31 - 1),
    flags=st.integers(0, 2**32 - 1),
    name=_names,
    mtu=st.integers(0, 2**32 - 1),
    operstate=st.sampled_from([s.upper() for s in nl.OPERSTATES]),
    carrier=st.integers(0, 1),
    kind=st.one_of(st.none(), st.sampled_from(["veth", "bond", "vlan", "bridge"])),
    stats=st.fixed_dictionaries({f: _u64 for f in nl.REQUIRED_STATS + nl.OPTIONAL_STATS}),
)
def test_parse_round_trip_fuzz(
    index: int,
    flags: int,
    name: str,
    mtu: int,
    operstate: str,
    carrier: int,
    kind: str | None,
    stats: dict[str, int],
) -> None:
    attrs: dict[str, Any] = {
        "IFLA_IFNAME": name,
        "IFLA_MTU": mtu,
        "IFLA_OPERSTATE": operstate,
        "IFLA_CARRIER": carrier,
        "IFLA_STATS64": stats,
    }
    if kind is not None:
        attrs["IFLA_LINKINFO"] = {"attrs": [("IFLA_INFO_KIND", kind)]}
    (link,) = nl.parse_links([message(index, flags, **attrs)])
    assert (link.name, link.ifindex, link.mtu, link.kind) == (name, index, mtu, kind)
    assert link.operstate == operstate.lower()
    assert link.admin_up == bool(flags & 1)
    assert link.carrier == bool(carrier)
    assert link.stats is not None
    assert {f: getattr(link.stats, f) for f in stats} == stats


_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**65), 2**65),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.sampled_from((*nl.REQUIRED_STATS, "IFLA_INFO_KIND")), st.integers()),
)


@settings(max_examples=200, deadline=None)
@given(
    messages=st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "IFLA_IFNAME",
                    "index",
                    "flags",
                    "IFLA_MTU",
                    "IFLA_OPERSTATE",
                    "IFLA_CARRIER",
                    "IFLA_LINKINFO",
                    "IFLA_STATS64",
                    "IFLA_STATS",
                ]
            ),
            _junk,
        ),
        max_size=4,
    )
)
def test_parse_links_gives_links_and_skips(messages: list[dict[str, Any]]) -> None:
    tally = SkipTally()
    links = nl.parse_links([FakeMessage(m) for m in messages], "fuzz", tally)
    assert len(links) + sum(tally.freeze().counts.values()) == len(messages)


# ------------------------------------------------------------------------------------------
# link_rates


def _data(*links: nl.NetLink) -> nl.NetdevData:
    return nl.NetdevData(links)


def _link(name: str = "eth0", ifindex: int = 2, bits: int = 64, **stats: int) -> nl.NetLink:
    values = dict.fromkeys(nl.REQUIRED_STATS, 0) | stats
    return nl.NetLink(
        name, ifindex, "up", True, True, 1500, None, nl.LinkStats(**values, bits=bits)
    )


def test_link_rates() -> None:
    prev = _data(_link(rx_bytes=1000, tx_bytes=10, rx_dropped=1), _link("gone", 3))
    cur = _data(_link(rx_bytes=5000, tx_bytes=30, rx_dropped=3), _link("new", 4))
    rates = nl.link_rates(prev, cur, 2.0)
    assert [r.name for r in rates.links] == ["eth0"]
    r = rates.link("eth0")
    assert r is not None
    assert r.rx_bytes_per_second == 2000.0
    assert r.tx_bytes_per_second == 10.0
    assert r.rx_dropped_per_second == 1.0
    assert r.rx_packets_per_second == 0.0
    assert nl.link_rates(prev, cur, 0).links == ()


def test_link_rates_wrap_and_reset() -> None:
    # IFLA_STATS (32-bit) wraps at 2^32.
    wrapped = nl.link_rates(
        _data(_link(bits=32, rx_bytes=2**32 - 10)), _data(_link(bits=32, rx_bytes=20)), 1.0
    )
    assert wrapped.links[0].rx_bytes_per_second == 30.0
    # 64-bit counters that drop were reset: unknown, not a huge number.
    reset = nl.link_rates(_data(_link(rx_bytes=2**40)), _data(_link(rx_bytes=5)), 1.0)
    assert reset.links[0].rx_bytes_per_second is None
    # Recreated with the same name but a new ifindex: a different link.
    assert nl.link_rates(_data(_link(ifindex=2)), _data(_link(ifindex=5)), 1.0).links == ()


# ------------------------------------------------------------------------------------------
# sysfs PCI lookup on this host's capture


def test_interface_pci_address_on_capture() -> None:
    roots = Roots.under(HOST)
    # eth0 is virtio-net: its device link is the virtio device below PCI function 00:03.0.
    assert nl.interface_pci_address(roots, "eth0") == "0000:00:03.0"
    assert nl.interface_pci_address(roots, "lo") is None
    assert nl.interface_pci_address(roots, "nosuch0") is None


# ------------------------------------------------------------------------------------------
# Metrics


def test_metrics() -> None:
    up = dataclasses.replace(_link(rx_bytes=7, tx_errors=2), pci_address="0000:17:00.0")
    down = nl.NetLink("veth1", 5, "down", False, False, 9000, "veth", None)
    snap = Snapshot(
        1, 1.0, 1.0, current={"netdev": SourceSample("netdev", 1.0, 0.0, _data(up, down))}
    )
    text = render(snap, [network_metrics.families]).decode()
    m: dict[str, dict[str, float]] = {}
    info: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            m.setdefault(s.name, {})[s.labels["interface"]] = s.value
            if s.name == "nodescope_network_info":
                info[s.labels["interface"]] = s.labels
    assert m["nodescope_network_receive_bytes_total"] == {"eth0": 7}
    assert m["nodescope_network_transmit_errors_total"] == {"eth0": 2}
    assert m["nodescope_network_up"] == {"eth0": 1, "veth1": 0}
    assert m["nodescope_network_admin_up"] == {"eth0": 1, "veth1": 0}
    assert m["nodescope_network_carrier"] == {"eth0": 1, "veth1": 0}
    assert m["nodescope_network_mtu_bytes"] == {"eth0": 1500, "veth1": 9000}
    assert info["eth0"]["pci_address"] == "0000:17:00.0"
    assert info["veth1"] == {
        "interface": "veth1",
        "operstate": "down",
        "kind": "veth",
        "pci_address": "",
    }
    assert "# TYPE nodescope_network_receive_bytes_total counter" in text
    assert "nodescope_infiniband" not in text
