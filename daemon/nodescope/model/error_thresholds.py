"""The thresholds error counters are judged by: one table, read by the errors detector, the
configuration's defaults and ``docs/thresholds.md``.

Each :class:`Threshold` row judges one counter of one family (:mod:`nodescope.model.error_windows`)
over one window: errors counted in the window at or above ``warning`` make a warning, at or
above ``critical`` a critical finding. A row with ``per_bit`` states bit error ratios: the
count is the ratio times the bits the link's line rate carries in the window (a receiver
decodes symbols at line rate whether data flows or idles). Rows with a ``*_key`` take that
bound from ``[detectors.errors]``.

A bit error is a random event and one alone proves nothing: every row of a counter that counts
bit or packet errors needs at least :data:`MIN_ERRORS` in its window. Rows of counters that
count events (a link that went down, a fatal AER error) may judge one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from nodescope.model.error_windows import AER, ECC, HOUR, IB, IB_HW, MINUTE, NVLINK, PCIE_REPLAY

#: An isolated error never warns.
MIN_ERRORS = 2

#: Public references the rows cite (``docs/thresholds.md`` gives the addresses).
DCGM_LIMITS = "DCGM dcgm_gpu_hardware_limits.h"
DCGM_HEALTH = "DCGM health watch (DcgmHealthWatch.cpp)"
IBTA_BER = "IBTA BER < 1e-12; NVIDIA cables tested to 1e-15 (DGX SuperPOD cabling guide)"
IBDIAGNET = "NVIDIA ibdiagnet, Bit Error Rate"
UFM_COUNTERS = "NVIDIA UFM, Supported Port Counters"
PCIE_SPEC = "PCI Express Base Specification, Advanced Error Reporting"
MLX5_COUNTERS = "NVIDIA MLNX_OFED, Understanding mlx5 Linux Counters"
PAGE_RETIREMENT = "NVIDIA Dynamic Page Retirement; DCGM_LIMIT_MAX_SBE_RATE"


@dataclass(frozen=True, slots=True)
class Threshold:
    """One row: ``family`` and ``counter`` name the counter, ``window_seconds`` the window
    (:data:`~nodescope.model.error_windows.MINUTE` or ``HOUR``), ``warning`` and
    ``critical`` the counts in it (``None``: that severity is not judged here), ``judged``,
    ``why`` and ``reference`` the documentation."""

    family: str
    counter: str
    judged: str
    window_seconds: float
    warning: float | None
    critical: float | None
    why: str
    reference: str
    per_bit: bool = False
    warning_key: str | None = None
    critical_key: str | None = None

    @property
    def window(self) -> str:
        return "1 min" if self.window_seconds <= MINUTE else "1 h"


def _rows(
    family: str,
    counters: tuple[str, ...],
    judged: str,
    window: float,
    warning: float | None,
    critical: float | None,
    why: str,
    reference: str,
) -> tuple[Threshold, ...]:
    return tuple(
        Threshold(family, c, judged, window, warning, critical, why, reference) for c in counters
    )


THRESHOLDS: tuple[Threshold, ...] = (
    # -- PCIe -------------------------------------------------------------------------------
    Threshold(
        AER,
        "correctable",
        "correctable AER errors of one PCI function (any class: root port, switch port, NIC,"
        " NVMe, GPU)",
        MINUTE,
        8,
        600,
        "each correctable error (bad TLP or DLLP, replay timeout or rollover, receiver error)"
        " is a retransmission or a retrained symbol: a few an hour are noise, a sustained rate"
        " at DCGM's replay limit costs bandwidth, ten a second is a failing link",
        f"{PCIE_SPEC}; {DCGM_LIMITS} (8 replays/min)",
        warning_key="aer_correctable_warning_per_minute",
        critical_key="aer_correctable_critical_per_minute",
    ),
    Threshold(
        AER,
        "nonfatal",
        "uncorrectable non-fatal AER errors of one PCI function",
        MINUTE,
        1,
        None,
        "a transaction was lost (completion timeout, poisoned or malformed TLP): the driver"
        " may recover, the data it carried is gone; the alert rule keeps it 10 minutes",
        PCIE_SPEC,
    ),
    Threshold(
        AER,
        "fatal",
        "uncorrectable fatal AER errors of one PCI function",
        MINUTE,
        None,
        1,
        "the link or device is unreliable until reset: the kernel resets the link; the"
        " alert rule keeps it 10 minutes",
        PCIE_SPEC,
    ),
    Threshold(
        PCIE_REPLAY,
        "replays",
        "NVML PCIe replay counter of one GPU",
        MINUTE,
        8,
        120,
        "8 replays a minute is the most the driver (RM) recommends; two a second is a link"
        " retransmitting constantly",
        f"{DCGM_LIMITS}: DCGM_LIMIT_MAX_PCIREPLAY_RATE = 8 per minute",
        warning_key="pcie_replays_warning_per_minute",
        critical_key="pcie_replays_critical_per_minute",
    ),
    # -- NVLink -----------------------------------------------------------------------------
    *(
        Threshold(
            NVLINK,
            name,
            f"NVML NVLink DL {name.replace('_', '-').upper()} errors of one GPU link",
            MINUTE,
            6000,
            60000,
            "CRC errors are retried by the link layer and matter only at 100 a second and"
            " more (6000 a minute); ten times that is a link to take out of service",
            f"{DCGM_LIMITS}: DCGM_LIMIT_MAX_NVLINK_CRC_ERROR = 100 per second",
            warning_key="nvlink_crc_warning_per_minute",
            critical_key="nvlink_crc_critical_per_minute",
        )
        for name in ("crc_flit", "crc_data")
    ),
    Threshold(
        NVLINK,
        "replay",
        "NVML NVLink DL replay errors of one GPU link",
        MINUTE,
        8,
        600,
        "a replay resends a flit that failed its CRC: a sustained rate means the link's"
        " errors outrun its retries",
        f"{DCGM_LIMITS}: DCGM_LIMIT_MAX_NVLINK_ERROR = 1 (per check of the health watch)",
    ),
    Threshold(
        NVLINK,
        "recovery",
        "NVML NVLink DL recovery events of one GPU link",
        HOUR,
        1,
        3,
        "a recovery retrains the link: traffic stops meanwhile; repeated recoveries are a"
        " link that is failing",
        f"{DCGM_LIMITS}: DCGM_LIMIT_MAX_NVLINK_ERROR = 1",
    ),
    # -- InfiniBand port counters ------------------------------------------------------------
    Threshold(
        IB,
        "symbol_error",
        "symbol errors of one port as a bit error ratio of the line rate (sysfs rate)",
        HOUR,
        1e-13,
        None,
        "on HDR and NDR links symbol errors are what FEC could not correct: a healthy link"
        " stays below 1e-14; a ratio at 1e-13 over an hour is a degrading cable or port",
        f"{IBTA_BER}; {IBDIAGNET}",
        per_bit=True,
        warning_key="ib_symbol_ber_warning",
    ),
    Threshold(
        IB,
        "symbol_error",
        "symbol errors of one port as a bit error ratio of the line rate (sysfs rate)",
        MINUTE,
        None,
        1e-12,
        "above the IBTA's 1e-12 the link breaks the specification it was sold against",
        IBTA_BER,
        per_bit=True,
        critical_key="ib_symbol_ber_critical",
    ),
    Threshold(
        IB,
        "link_downed",
        "times the port's link went down",
        HOUR,
        1,
        3,
        "a link that goes down drops every connection over it; three times an hour is a"
        " flapping link",
        UFM_COUNTERS,
    ),
    Threshold(
        IB,
        "link_error_recovery",
        "link error recovery procedures the port completed",
        HOUR,
        3,
        10,
        "each recovery retrains the link without taking it down: isolated ones happen,"
        " repeated ones precede link_downed",
        UFM_COUNTERS,
    ),
    *_rows(
        IB,
        ("port_rcv_errors", "port_rcv_remote_physical_errors"),
        "received packets with errors (local physical errors: ICRC, VCRC, length; or marked"
        " bad upstream)",
        MINUTE,
        10,
        600,
        "each is a packet dropped and retransmitted by the transport; ten a second is a link"
        " that loses traffic",
        UFM_COUNTERS,
    ),
    Threshold(
        IB,
        "port_xmit_discards",
        "outbound packets the port discarded (port down or congestion timeout)",
        MINUTE,
        100,
        6000,
        "a lossless fabric discards only when a packet waited past its lifetime: a hundred a"
        " minute is a stuck path, a hundred a second a fabric dropping traffic",
        UFM_COUNTERS,
    ),
    *_rows(
        IB,
        ("local_link_integrity_errors", "excessive_buffer_overrun_errors"),
        "local link integrity threshold and buffer overrun events (4-bit counters)",
        HOUR,
        2,
        10,
        "each event is already a threshold of physical errors crossed (or flow control"
        " broken); they saturate at 15",
        UFM_COUNTERS,
    ),
    *_rows(
        IB,
        ("port_rcv_constraint_errors", "port_xmit_constraint_errors"),
        "packets dropped by partition or raw-packet enforcement",
        MINUTE,
        10,
        600,
        "a misconfigured partition key or a peer sending where it may not: traffic lost",
        UFM_COUNTERS,
    ),
    Threshold(
        IB,
        "port_rcv_switch_relay_errors",
        "packets a switch port could not relay",
        MINUTE,
        100,
        None,
        "a routing fault on a switch port (an HCA counts none)",
        UFM_COUNTERS,
    ),
    Threshold(
        IB,
        "VL15_dropped",
        "subnet management packets dropped for lack of buffers",
        MINUTE,
        600,
        None,
        "a few drops during subnet sweeps are normal; ten a second starves management",
        UFM_COUNTERS,
    ),
    # -- hw_counters (RoCE and the HCA's transport) -------------------------------------------
    *_rows(
        IB_HW,
        ("out_of_sequence", "packet_seq_err", "duplicate_request", "implied_nak_seq_err"),
        "transport sequence errors of the port's queue pairs",
        MINUTE,
        600,
        60000,
        "a lossy (RoCE) fabric drops packets that the transport resends: ten a second is"
        " loss to look at, a thousand a second collapses throughput",
        MLX5_COUNTERS,
    ),
    *_rows(
        IB_HW,
        ("local_ack_timeout_err", "rnr_nak_retry_err"),
        "transport timeouts and receiver-not-ready retries that ran out",
        MINUTE,
        10,
        600,
        "a queue pair's retries timed out: the peer or the path is gone or stalled",
        MLX5_COUNTERS,
    ),
    *_rows(
        IB_HW,
        ("roce_adp_retrans", "roce_slow_restart", "roce_adp_retrans_to"),
        "RoCE adaptive retransmissions and slow restarts",
        MINUTE,
        60,
        6000,
        "retransmission with back-off after loss: sustained, the path loses packets",
        MLX5_COUNTERS,
    ),
    Threshold(
        IB_HW,
        "rx_icrc_encapsulated",
        "RoCE packets received with an ICRC error",
        MINUTE,
        10,
        600,
        "corrupted packets on the wire: a physical or switch fault",
        MLX5_COUNTERS,
    ),
    Threshold(
        IB_HW,
        "out_of_buffer",
        "packets dropped for lack of receive buffers (WQEs) on the port's queues",
        MINUTE,
        600,
        60000,
        "the application posts receive buffers too slowly: drops and retransmissions",
        MLX5_COUNTERS,
    ),
    # -- GPU memory ---------------------------------------------------------------------------
    Threshold(
        ECC,
        "corrected",
        "corrected (single-bit) ECC errors of one GPU, volatile count",
        HOUR,
        100,
        10000,
        "corrected errors are repaired and retired or remapped by the driver; a rate of a"
        " hundred an hour is a memory region wearing out (the driver's own Xid 92 fires on"
        " high rates); uncorrectable errors and failed remaps are the gpu_health findings",
        PAGE_RETIREMENT,
    ),
)

#: The rows of each (family, counter), in table order.
BY_COUNTER: Mapping[tuple[str, str], tuple[Threshold, ...]] = MappingProxyType(
    {
        key: tuple(r for r in THRESHOLDS if (r.family, r.counter) == key)
        for key in dict.fromkeys((r.family, r.counter) for r in THRESHOLDS)
    }
)


def default_of(key: str) -> float:
    """The table's value of the bound a ``[detectors.errors]`` key sets."""
    for row in THRESHOLDS:
        if row.warning_key == key and row.warning is not None:
            return float(row.warning)
        if row.critical_key == key and row.critical is not None:
            return float(row.critical)
    raise KeyError(key)


#: Pairs of ``[detectors.errors]`` keys: the warning bound may not exceed the critical one.
BANDS: tuple[tuple[str, str], ...] = (
    ("aer_correctable_warning_per_minute", "aer_correctable_critical_per_minute"),
    ("pcie_replays_warning_per_minute", "pcie_replays_critical_per_minute"),
    ("nvlink_crc_warning_per_minute", "nvlink_crc_critical_per_minute"),
    ("ib_symbol_ber_warning", "ib_symbol_ber_critical"),
)


_FAMILY_NAMES: Mapping[str, str] = MappingProxyType(
    {
        AER: "PCIe AER",
        PCIE_REPLAY: "GPU PCIe",
        NVLINK: "NVLink",
        IB: "InfiniBand",
        IB_HW: "InfiniBand hw_counters",
        ECC: "GPU memory",
    }
)


def _bound_text(value: float | None, per_bit: bool) -> str:
    if value is None:
        return "—"
    return f"BER {value:.0e}" if per_bit else f"{value:g}"


def markdown_table() -> str:
    """The table as ``docs/thresholds.md`` shows it (a test keeps the two the same)."""
    lines = [
        "| family | counter | what is judged | window | warning from | critical from | why"
        " | reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in THRESHOLDS:
        keys = [f"`{k}`" for k in (r.warning_key, r.critical_key) if k is not None]
        configured = f" (config: {', '.join(keys)})" if keys else ""
        lines.append(
            f"| {_FAMILY_NAMES[r.family]} | `{r.counter}` | {r.judged} | {r.window}"
            f" | {_bound_text(r.warning, r.per_bit)} | {_bound_text(r.critical, r.per_bit)}"
            f" | {r.why}{configured} | {r.reference} |"
        )
    return "\n".join(lines) + "\n"
