"""The TOML configuration file: schema, defaults and validation.

The schema below is the single source of the README's configuration reference. Validation is
strict: an unknown key or a bad value is a :class:`ConfigError` naming the file and the key,
and the CLI exits with status 2 on it. TOML's types are kept as written (an integer is accepted
where a float is expected, nothing else is converted) and every number has bounds that the
error and the reference name.

The file is read as the daemon reads any file an operator or a user could have replaced
(:mod:`nodescope.fileio`): a FIFO, a device, a socket or a directory is refused without
blocking, and so is a file over :data:`CONFIG_FILE`'s cap. Before ``tomllib`` sees the text, a
scan bounds how deep arrays and inline tables nest and how many parts a dotted key has:
``tomllib`` recurses once per level of nesting and builds every prefix of a dotted key, so a
64 KiB file could otherwise end in a RecursionError or take gigabytes.
"""

from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nodescope import fileio
from nodescope.errors import ConfigError
from nodescope.roots import ROOT_NAMES, Roots
from nodescope.sources.registry import SOURCE_TABLE, SOURCES

DEFAULT_PORT = 9839
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class Option:
    key: str
    kind: type
    default: Any
    help: str
    check: Callable[[Any], str | None] | None = None


#: The longest waits an option may ask for: an hour, a day.
HOUR = 3600.0
DAY = 86400.0

#: The longest string option: PATH_MAX, more than any path, URL or name the options hold.
MAX_TEXT = 4096

#: The config file's size cap. A real file is a few KiB (every option set and commented is
#: under 20 KiB), and ``tomllib`` builds objects many times the size of its input: a 1 MiB
#: file of short table headers took 440 MB, past the unit's ``MemoryMax=256M``.
CONFIG_FILE = fileio.FileKind("config file", 64 * fileio.KIB)

#: How deep arrays and inline tables may nest. The schema needs 3 at most
#: (``alerts = {rules = {kind = {...}}}``); ``tomllib`` recurses once per level.
MAX_NESTING = 8

#: Parts of a dotted key (``detectors.saturation.models.A100`` has 4, the most the schema has).
#: ``tomllib`` keeps every prefix of a dotted key, so its cost grows with the square of the
#: parts: 300,000 of them exhausted this machine's memory.
MAX_KEY_PARTS = 8


def _display(text: str, limit: int = 80) -> str:
    """``text`` on one line and at most ``limit`` characters: keys and values come from the
    file, and an error message stays one line however they were written."""
    cut = text if len(text) <= limit else text[:limit] + "…"
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in cut
    )


def _number_text(number: float) -> str:
    """A bound as an operator writes it: ``3600``, ``0.1``, ``1e13``."""
    if abs(number) >= 1e7:
        return f"{number:.0e}".replace("e+", "e")
    if number == int(number):
        return str(int(number))
    return repr(number)


def _value_text(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    return _display(repr(value))


@dataclass(frozen=True, slots=True)
class Range:
    """The numbers an option accepts: finite, from ``low`` to ``high``, with ``low`` itself
    refused when ``low_open`` (a ratio or timeout of 0 would mean nothing). The error message
    and the configuration reference both name the bounds."""

    low: float
    high: float
    low_open: bool = False
    integer: bool = False

    @property
    def allowed(self) -> str:
        low, high = _number_text(self.low), _number_text(self.high)
        what = "an integer" if self.integer else "a finite number"
        if self.low_open:
            return f"{what} above {low} and at most {high}"
        return f"{what} between {low} and {high}"

    def __call__(self, value: Any) -> str | None:
        # Compared as written: an integer too large for a float must give this message, not
        # an OverflowError from converting it.
        if isinstance(value, float) and not math.isfinite(value):
            ok = False
        else:
            above_low = value > self.low if self.low_open else value >= self.low
            ok = above_low and value <= self.high
        return None if ok else f"must be {self.allowed}, not {_value_text(value)}"


@dataclass(frozen=True, slots=True)
class IntList:
    """A list of integers, each within bounds, and not too long."""

    low: int
    high: int
    max_items: int

    @property
    def allowed(self) -> str:
        return f"at most {self.max_items} integers between {self.low} and {self.high}"

    def __call__(self, value: Any) -> str | None:
        ok = len(value) <= self.max_items and all(
            isinstance(v, int) and not isinstance(v, bool) and self.low <= v <= self.high
            for v in value
        )
        return None if ok else f"must be a list of {self.allowed}"


@dataclass(frozen=True, slots=True)
class NameList:
    """A list of names (letters, digits, ``_`` and ``-``), each short, and not too many."""

    max_items: int
    max_length: int

    @property
    def allowed(self) -> str:
        return f"at most {self.max_items} names of 1 to {self.max_length} letters, digits, _ and -"

    def __call__(self, value: Any) -> str | None:
        ok = len(value) <= self.max_items and all(
            isinstance(v, str) and len(v) <= self.max_length and NAME_PATTERN.fullmatch(v)
            for v in value
        )
        return None if ok else f"must be a list of {self.allowed}"


#: A kernel module's name, as ``required_modules`` lists them.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")

#: How often the loop wakes. Under 0.1 s the loop itself would be most of the daemon's cost;
#: over 60 s the watchdog (fed from the loop) and the alerts' ``for`` durations lose meaning.
SECONDS_TICK = Range(0.1, 60)
#: Between reads of one source: as often as the loop wakes, up to once an hour.
SECONDS_SOURCE_INTERVAL = Range(0.1, HOUR)
#: A read of a healthy node takes milliseconds; the first NVML read of a large node takes
#: seconds. Past a minute the cycle would wait too long for a read that is stuck.
SECONDS_SOURCE_TIMEOUT = Range(0.1, 60)
DEFAULT_SOURCE_TIMEOUT = 5.0
#: A fraction of a link's capacity, a share or a utilisation: 0 would always hold.
FRACTION = Range(0, 1, low_open=True)
#: A pressure stall share in percent (``avg10``, ``avg60``).
PERCENT = Range(0, 100, low_open=True)
#: Bytes per second: 10 TB/s is above any PCIe, NVLink or network link of a node.
BANDWIDTH = Range(0, 1e13)
#: Errors or events per second from which something is reported.
EVENT_RATE = Range(0, 1e9)


def _listen(value: Any) -> str | None:
    try:
        parse_listen(value)
    except ValueError as exc:
        return str(exc)
    return None


def _log_level(value: Any) -> str | None:
    return None if value in LOG_LEVELS else f"must be one of {', '.join(LOG_LEVELS)}"


def _absolute(value: Any) -> str | None:
    return None if str(value).startswith("/") else "must be an absolute path"


def _alertmanager_url(value: Any) -> str | None:
    if value == "":
        return None
    if not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", value):
        return "must be empty or an http:// or https:// URL without query"
    return None


#: A finding kind as detectors name it (``pcie_contention``); the key of ``[alerts.rules.X]``.
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


DAEMON_OPTIONS: tuple[Option, ...] = (
    Option(
        "listen",
        str,
        DEFAULT_LISTEN,
        "HOST:PORT of the /metrics server; [::1]:PORT for IPv6",
        _listen,
    ),
    Option(
        "tick_seconds",
        float,
        1.0,
        "how often the loop wakes to run the sources that are due; no source runs more often",
        SECONDS_TICK,
    ),
    Option("log_level", str, "info", "one of debug, info, warning, error", _log_level),
)

ROOT_OPTIONS: tuple[Option, ...] = tuple(
    Option(name, str, str(getattr(Roots(), name)), f"root of {name} for every source", _absolute)
    for name in ROOT_NAMES
)

ALERT_OPTIONS: tuple[Option, ...] = (
    Option(
        "alertmanager_url",
        str,
        "",
        "Alertmanager base URL to push firing and resolved alerts to (API v2); empty: no push",
        _alertmanager_url,
    ),
    Option(
        "instance",
        str,
        "",
        "the instance label of pushed alerts; empty: the host name",
    ),
    Option(
        "resend_seconds",
        float,
        60.0,
        "how often firing alerts are sent to Alertmanager again while they last",
        Range(1, DAY),
    ),
    Option(
        "push_timeout_seconds",
        float,
        5.0,
        "timeout of one push to Alertmanager",
        Range(0.1, 60),
    ),
    Option(
        "for_seconds",
        float,
        30.0,
        "default for every kind: seconds a finding must hold before its alert fires",
        Range(0, DAY),
    ),
    Option(
        "resolve_after_seconds",
        float,
        60.0,
        "default for every kind: seconds a finding must be gone before its alert resolves",
        Range(0, DAY),
    ),
    # The pending alert's tolerance of a missing cycle (nodescope.alerts).
    Option(
        "pending_gap_seconds",
        float,
        1.0,
        "default for every kind: seconds a pending alert's finding may be missing before the"
        " alert is cancelled; 0 cancels at the first missing cycle, as Prometheus's `for`",
        Range(0, HOUR),
    ),
)

#: ``[alerts.rules.<kind>]``: every key optional; an unset key falls back to the built-in rule
#: of the kind, then to the ``[alerts]`` defaults.
ALERT_RULE_OPTIONS: tuple[Option, ...] = (
    Option("enabled", bool, True, "turn findings of this kind into alerts"),
    Option(
        "for_seconds", float, None, "seconds the finding must hold before firing", Range(0, DAY)
    ),
    Option(
        "resolve_after_seconds",
        float,
        None,
        "seconds the finding must be gone before resolving",
        Range(0, DAY),
    ),
    Option(
        "clear_below",
        float,
        None,
        "a firing alert stays firing while its finding's evidence `value` is at least this,"
        " even below the detector's raise threshold",
        Range(0, 1e15),
    ),
    Option(
        "pending_gap_seconds",
        float,
        None,
        "seconds a pending alert's finding may be missing before the alert is cancelled",
        Range(0, HOUR),
    ),
)

SOURCE_OPTIONS: tuple[Option, ...] = (
    Option("enabled", bool, True, "run this source"),
    Option(
        "interval_seconds",
        float,
        0.0,
        "seconds between reads (default per source)",
        SECONDS_SOURCE_INTERVAL,
    ),
    Option(
        "timeout_seconds",
        float,
        DEFAULT_SOURCE_TIMEOUT,
        "seconds one read may take; a read that overruns is reported down with reason"
        " `timeout`, the cycle goes on without it, and the source is not called again"
        " until the stuck read returns",
        SECONDS_SOURCE_TIMEOUT,
    ),
)


#: ``[detectors.<name>]``: thresholds of the pure detectors (``nodescope.detectors``). Rates
#: are per second over the interval between a source's two latest reads; ratios are
#: fractions of a link's capacity per direction after line encoding.
DETECTOR_OPTIONS: Mapping[str, tuple[Option, ...]] = MappingProxyType(
    {
        "contention": (
            Option("enabled", bool, True, "report shared PCIe links that devices contend for"),
            Option(
                "utilisation_ratio",
                float,
                0.6,
                "a shared link is contended from this demand over capacity in its busier"
                " direction (DMA tops out near 0.8 of the encoded rate: TLP and DLLP overhead)",
                FRACTION,
            ),
            Option(
                "min_share",
                float,
                0.1,
                "an endpoint takes part when it carries at least this share of the link's"
                " traffic (both directions); two of different classes must",
                FRACTION,
            ),
        ),
        "saturation": (
            Option("enabled", bool, True, "report GPUs that saturate their own PCIe link"),
            Option(
                "bidirectional_ratio",
                float,
                0.57,
                "both directions together over twice the per-direction capacity; an A100 on"
                " Gen4 x16 saturated at 38 of 63 GB/s (0.60): 0.57 is 95 % of that point."
                ' Per model: [detectors.saturation.models] "A100" = 0.57',
                FRACTION,
            ),
            Option(
                "one_way_ratio",
                float,
                0.85,
                "one direction over the per-direction capacity",
                FRACTION,
            ),
        ),
        "downtraining": (
            Option("enabled", bool, True, "report links trained below their maximum under load"),
            Option(
                "min_bytes_per_second",
                float,
                1e9,
                "traffic (both directions) from which a device counts as under load; idle"
                " devices lower their link speed to save power",
                BANDWIDTH,
            ),
        ),
        "errors": (
            Option("enabled", bool, True, "report PCIe, NVLink and InfiniBand error rates"),
            Option(
                "aer_correctable_per_second",
                float,
                0.0,
                "correctable AER errors per second above which a function is reported"
                " (non-fatal and fatal errors always are)",
                EVENT_RATE,
            ),
            Option(
                "pcie_replays_per_second",
                float,
                0.1,
                "GPU PCIe replays per second from which a GPU is reported",
                EVENT_RATE,
            ),
            Option(
                "nvlink_errors_per_second",
                float,
                1.0,
                "NVLink CRC (flit, data) or replay errors per second from which a link is"
                " reported (recoveries always are)",
                EVENT_RATE,
            ),
            Option(
                "ib_symbol_errors_per_second",
                float,
                1 / 60,
                "InfiniBand symbol errors per second from which a port is reported (link_downed"
                " increments always are)",
                EVENT_RATE,
            ),
            Option(
                "ib_xmit_wait_per_second",
                float,
                1e6,
                "port_xmit_wait ticks per second from which a port is reported as congested"
                " (the tick length is the HCA's; tune per fabric)",
                Range(0, 1e12),
            ),
        ),
        "placement": (
            Option(
                "enabled",
                bool,
                True,
                "report jobs whose GPUs use HCAs on another NUMA node or root complex",
            ),
        ),
        "nvlink": (
            Option(
                "enabled",
                bool,
                True,
                "report NVLink arbitration stalls, stall bursts and bandwidth saturation seen"
                " by the nvlink_counter module",
            ),
            Option(
                "stall_warning_cycles_per_us",
                float,
                500.0,
                "average stall cycles per microsecond of a link from which it is a warning",
                Range(0, 1e6, low_open=True),
            ),
            Option(
                "stall_critical_cycles_per_us",
                float,
                2000.0,
                "average stall cycles per microsecond above which it is critical; a per-sample"
                " peak above it under a normal average is a stall burst",
                Range(0, 1e6, low_open=True),
            ),
            Option(
                "utilisation_warning_ratio",
                float,
                0.7,
                "average utilisation (larger of TX and RX over the capacity per direction) from"
                " which a link is a warning",
                FRACTION,
            ),
            Option(
                "utilisation_critical_ratio",
                float,
                0.9,
                "average utilisation above which a link is critical",
                FRACTION,
            ),
            Option(
                "burst_findings",
                bool,
                True,
                "report per-sample stall peaks in the critical band when the average is normal",
            ),
        ),
        "jobs": (
            Option(
                "enabled",
                bool,
                True,
                "report escaped job processes and threads, memory limits that do not apply,"
                " OOM kills and memory pressure",
            ),
            Option(
                "memory_pressure_percent",
                float,
                10.0,
                "a job is under sustained memory pressure from this share of the last minute"
                " in which all its tasks stalled on memory (memory.pressure full avg60, %)",
                PERCENT,
            ),
        ),
        "hangs": (
            Option(
                "enabled",
                bool,
                True,
                "report jobs whose GPUs sit idle: stalled on a storage lock or NFS, a starving"
                " data loader, or a stall of unknown cause",
            ),
            Option(
                "idle_utilisation_ratio",
                float,
                0.05,
                "a GPU is idle at or below this NVML utilisation (0.05 = 5 %) …",
                FRACTION,
            ),
            Option(
                "idle_bytes_per_second",
                float,
                1e8,
                "… and at or below this PCIe plus NVLink traffic, both directions",
                BANDWIDTH,
            ),
            Option(
                "loader_utilisation_ratio",
                float,
                0.5,
                "a job's GPUs are mostly idle below this mean utilisation",
                FRACTION,
            ),
            Option(
                "loader_io_pressure_percent",
                float,
                20.0,
                "io pressure of the job cgroup (io.pressure some avg10, %) from which its data"
                " loader counts as waiting on I/O",
                PERCENT,
            ),
            Option(
                "loader_max_bytes_per_second",
                float,
                2e8,
                "the job's block I/O plus the node's NFS traffic below which that waiting is"
                " starvation rather than a busy disk",
                BANDWIDTH,
            ),
        ),
        "hotplug": (
            Option(
                "enabled",
                bool,
                True,
                "report GPUs that fell off the bus and network/InfiniBand links that flap",
            ),
            Option(
                "flap_transitions",
                float,
                4.0,
                "a link flaps from this many up/down transitions within the link_events"
                " source's window (two downs and two ups)",
                Range(1, 1000),
            ),
        ),
    }
)


#: ``[probe]``: what ``nodescope probe`` must measure to pass (its exit status, for the Slurm
#: prolog). Fractions are of the GPU's maximum PCIe capacity per direction after line encoding;
#: asymmetries are ``|a→b − b→a| / mean`` of one GPU pair; 0 turns a minimum off.
PROBE_OPTIONS: tuple[Option, ...] = (
    Option(
        "min_h2d_fraction",
        float,
        0.7,
        "host-to-device copy bandwidth (pinned, peak over sizes) over the link capacity; a"
        " healthy Gen4/Gen5 x16 link reaches about 0.8, a link trained at half width 0.4",
        Range(0, 1),
    ),
    Option(
        "min_d2h_fraction",
        float,
        0.7,
        "device-to-host copy bandwidth over the link capacity",
        Range(0, 1),
    ),
    Option(
        "min_h2d_bytes_per_second",
        float,
        0.0,
        "host-to-device bandwidth in bytes per second (also checked on the CPU stand-in)",
        BANDWIDTH,
    ),
    Option(
        "min_d2h_bytes_per_second",
        float,
        0.0,
        "device-to-host bandwidth in bytes per second (also checked on the CPU stand-in)",
        BANDWIDTH,
    ),
    Option(
        "max_bandwidth_asymmetry",
        float,
        0.25,
        "GPU pair copy bandwidth asymmetry from which the pair fails",
        Range(0, 10, low_open=True),
    ),
    Option(
        "max_latency_asymmetry",
        float,
        0.3,
        "GPU pair small-copy latency asymmetry from which the pair fails (a +42 % bias in"
        " one direction is 0.35)",
        Range(0, 10, low_open=True),
    ),
    Option(
        "min_allreduce_busbw_bytes_per_second",
        float,
        0.0,
        "local all-reduce bus bandwidth (nccl-tests busbw, peak over sizes)",
        BANDWIDTH,
    ),
    Option(
        "timeout_seconds",
        float,
        300.0,
        "the daemon stops a probe it started after this long",
        Range(1, HOUR),
    ),
)


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    min_h2d_fraction: float = 0.7
    min_d2h_fraction: float = 0.7
    min_h2d_bytes_per_second: float = 0.0
    min_d2h_bytes_per_second: float = 0.0
    max_bandwidth_asymmetry: float = 0.25
    max_latency_asymmetry: float = 0.3
    min_allreduce_busbw_bytes_per_second: float = 0.0
    timeout_seconds: float = 300.0


def _absolute_or_empty(value: Any) -> str | None:
    return None if value == "" or str(value).startswith("/") else "must be empty or absolute"


#: ``[slurm]``: the prolog/epilog hooks (``nodescope slurm prolog|epilog``), their socket to the
#: daemon and the prolog's health gate. A gate key at 0, false or [] turns that check off.
SLURM_OPTIONS: tuple[Option, ...] = (
    Option(
        "slurm_user",
        str,
        "slurm",
        "besides root, the only user the daemon's hook socket answers (Slurm's SlurmUser)",
    ),
    Option(
        "reports_dir",
        str,
        "/var/lib/nodescope/jobs",
        "where the epilog's per-job reports are written (<job id>.json)",
        _absolute,
    ),
    Option(
        "scontrol",
        str,
        "/usr/bin/scontrol",
        "scontrol used to drain the node with the gate's reason; empty: leave it to Slurm",
        _absolute_or_empty,
    ),
    Option(
        "timeout_seconds",
        float,
        2.0,
        "how long a hook waits for the daemon before running its local checks (a hook must"
        " never hang a job launch)",
        Range(0, 2, low_open=True),
    ),
    Option(
        "expected_gpus",
        int,
        0,
        "GPUs the node must have (NVML, else /dev/nvidia<N>)",
        Range(0, 1024, integer=True),
    ),
    Option(
        "xid_codes",
        list,
        [48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120],
        "Xid codes that fail the gate while uncleared (seen since the last job or the last"
        " `nodescope slurm clear-xids`); application faults such as 13, 31 and 43 are not"
        " in the default list",
        IntList(0, 9999, max_items=256),
    ),
    Option(
        "check_link_width",
        bool,
        True,
        "fail when a GPU's PCIe link runs narrower than its maximum width",
    ),
    Option(
        "min_link_gen",
        int,
        0,
        "fail when a GPU's PCIe link runs below this generation (idle GPUs may lower it)",
        Range(0, 7, integer=True),
    ),
    Option(
        "required_modules",
        list,
        [],
        "kernel modules that must be loaded (/sys/module/<name>), e.g. nvidia, nvlink_counter",
        NameList(max_items=256, max_length=64),
    ),
    Option(
        "run_probe",
        bool,
        False,
        "run `nodescope probe --quick` (when installed) and fail on its exit status",
    ),
)


@dataclass(frozen=True, slots=True)
class SlurmSettings:
    slurm_user: str = "slurm"
    reports_dir: str = "/var/lib/nodescope/jobs"
    scontrol: str = "/usr/bin/scontrol"
    timeout_seconds: float = 2.0
    expected_gpus: int = 0
    xid_codes: tuple[int, ...] = (48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120)
    check_link_width: bool = True
    min_link_gen: int = 0
    required_modules: tuple[str, ...] = ()
    run_probe: bool = False


def _slurm(path: str, table: Any) -> SlurmSettings:
    values = _section(path, "slurm", table, SLURM_OPTIONS)
    for key in ("xid_codes", "required_modules"):
        if key in values:
            values[key] = tuple(values[key])
    return SlurmSettings(**values)


@dataclass(frozen=True, slots=True)
class SourceSettings:
    enabled: bool
    interval_seconds: float
    timeout_seconds: float = DEFAULT_SOURCE_TIMEOUT


@dataclass(frozen=True, slots=True)
class AlertRuleSettings:
    """One ``[alerts.rules.<kind>]`` table; ``None`` where the file does not set the key."""

    enabled: bool | None = None
    for_seconds: float | None = None
    resolve_after_seconds: float | None = None
    clear_below: float | None = None
    pending_gap_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class AlertsSettings:
    alertmanager_url: str = ""
    instance: str = ""
    resend_seconds: float = 60.0
    push_timeout_seconds: float = 5.0
    for_seconds: float = 30.0
    resolve_after_seconds: float = 60.0
    pending_gap_seconds: float = 1.0
    rules: Mapping[str, AlertRuleSettings] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class DetectorsSettings:
    """``[detectors.<name>]`` tables with their defaults filled in, and the per-GPU-model
    saturation ratios of ``[detectors.saturation.models]`` (a model matches when its key is
    part of the GPU's name, e.g. ``"A100"``)."""

    values: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType(
            {
                name: MappingProxyType({o.key: o.default for o in options})
                for name, options in DETECTOR_OPTIONS.items()
            }
        )
    )
    saturation_models: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({"A100": 0.57})
    )

    def number(self, section: str, key: str) -> float:
        return float(self.values[section][key])

    def enabled(self, section: str) -> bool:
        return bool(self.values[section]["enabled"])


@dataclass(frozen=True, slots=True)
class Config:
    listen: str = DEFAULT_LISTEN
    tick_seconds: float = 1.0
    log_level: str = "info"
    roots: Roots = field(default_factory=Roots)
    sources: Mapping[str, SourceSettings] = field(
        default_factory=lambda: MappingProxyType(
            {s.name: SourceSettings(True, s.default_interval) for s in SOURCE_TABLE}
        )
    )
    alerts: AlertsSettings = field(default_factory=AlertsSettings)
    detectors: DetectorsSettings = field(default_factory=DetectorsSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    path: str | None = None

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


#: A host name as resolvers take it (RFC 1123 labels); Python's IDNA codec raises UnicodeError,
#: not OSError, for a label over 63 characters, so such a name must not reach getaddrinfo.
_HOST_NAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None
    return True


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to a (host, port) pair; HOST is an IP address or a
    host name, PORT decimal digits."""
    shown = _display(value)
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{shown!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    # int() would also take " 80", "8_0" and other scripts' digits.
    if not re.fullmatch(r"[0-9]{1,5}", port_text):
        raise ValueError(f"{shown!r}: port {_display(port_text)!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"{shown!r}: port out of range")
    if not _is_host(host):
        raise ValueError(f"{shown!r}: {_display(host)!r} is neither an IP address nor a host name")
    return host, port


def _text_problem(value: str) -> str | None:
    if len(value) > MAX_TEXT:
        return f"must be at most {MAX_TEXT} characters, not {len(value)}"
    if not value.isprintable():
        return "must not hold control characters (newline, tab, NUL ...)"
    return None


def _typed(path: str, key: str, option: Option, value: Any) -> Any:
    """``value`` if it has the option's TOML type and passes its check. The one conversion is
    an integer where a float is expected (``tick_seconds = 2``); a boolean is never a number
    and a number never a boolean."""
    int_for_float = option.kind is float and isinstance(value, int) and not isinstance(value, bool)
    right_type = isinstance(value, option.kind) or int_for_float
    if not right_type or isinstance(value, bool) != (option.kind is bool):
        raise ConfigError(path, key, f"expected {option.kind.__name__}, got {type(value).__name__}")
    problem = _text_problem(value) if isinstance(value, str) else None
    if problem is None and option.check is not None:
        problem = option.check(value)
    if problem:
        raise ConfigError(path, key, problem)
    if int_for_float:
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(path, key, f"{_value_text(value)} is not a float") from None
    return value


def _section(path: str, prefix: str, table: Any, options: tuple[Option, ...]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(path, prefix, "must be a table")
    known = {o.key: o for o in options}
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}.{_display(key)}"
        option = known.get(key)
        if option is None:
            raise ConfigError(path, dotted, "unknown key")
        out[key] = _typed(path, dotted, option, value)
    return out


def from_mapping(data: Mapping[str, Any], path: str = "<config>") -> Config:
    """Validate a parsed TOML document into a :class:`Config`."""
    for key in data:
        if key not in ("daemon", "roots", "sources", "alerts", "detectors", "probe", "slurm"):
            raise ConfigError(path, _display(key), "unknown key")
    daemon = _section(path, "daemon", data.get("daemon", {}), DAEMON_OPTIONS)
    roots_table = _section(path, "roots", data.get("roots", {}), ROOT_OPTIONS)
    sources_table = data.get("sources", {})
    if not isinstance(sources_table, dict):
        raise ConfigError(path, "sources", "must be a table")
    sources: dict[str, SourceSettings] = {}
    for info in SOURCE_TABLE:
        settings = _section(
            path, f"sources.{info.name}", sources_table.get(info.name, {}), SOURCE_OPTIONS
        )
        sources[info.name] = SourceSettings(
            enabled=settings.get("enabled", True),
            interval_seconds=settings.get("interval_seconds", info.default_interval),
            timeout_seconds=settings.get("timeout_seconds", DEFAULT_SOURCE_TIMEOUT),
        )
    for name in sources_table:
        if name not in SOURCES:
            raise ConfigError(path, f"sources.{_display(name)}", "unknown source")
    return Config(
        alerts=_alerts(path, data.get("alerts", {})),
        detectors=_detectors(path, data.get("detectors", {})),
        probe=ProbeSettings(**_section(path, "probe", data.get("probe", {}), PROBE_OPTIONS)),
        slurm=_slurm(path, data.get("slurm", {})),
        listen=daemon.get("listen", DEFAULT_LISTEN),
        tick_seconds=daemon.get("tick_seconds", 1.0),
        log_level=daemon.get("log_level", "info"),
        roots=Roots().with_overrides(**roots_table),
        sources=MappingProxyType(sources),
        path=path,
    )


def _alerts(path: str, table: Any) -> AlertsSettings:
    if not isinstance(table, dict):
        raise ConfigError(path, "alerts", "must be a table")
    plain = {k: v for k, v in table.items() if k != "rules"}
    settings = _section(path, "alerts", plain, ALERT_OPTIONS)
    rules_table = table.get("rules", {})
    if not isinstance(rules_table, dict):
        raise ConfigError(path, "alerts.rules", "must be a table")
    rules: dict[str, AlertRuleSettings] = {}
    for kind, rule_table in rules_table.items():
        if len(kind) > 64 or not KIND_PATTERN.fullmatch(kind):
            raise ConfigError(
                path, f"alerts.rules.{_display(kind)}", "not a finding kind (a-z, 0-9, _)"
            )
        rule = _section(path, f"alerts.rules.{kind}", rule_table, ALERT_RULE_OPTIONS)
        rules[kind] = AlertRuleSettings(**rule)
    return AlertsSettings(**settings, rules=MappingProxyType(rules))


def _detectors(path: str, table: Any) -> DetectorsSettings:
    if not isinstance(table, dict):
        raise ConfigError(path, "detectors", "must be a table")
    for name in table:
        if name not in DETECTOR_OPTIONS:
            raise ConfigError(path, f"detectors.{_display(name)}", "unknown detector")
    values: dict[str, Mapping[str, Any]] = {}
    models: dict[str, float] = dict(DetectorsSettings().saturation_models)
    for name, options in DETECTOR_OPTIONS.items():
        section = table.get(name, {})
        if name == "saturation" and isinstance(section, dict) and "models" in section:
            section = dict(section)
            models_table = section.pop("models")
            if not isinstance(models_table, dict):
                raise ConfigError(path, "detectors.saturation.models", "must be a table")
            for model, ratio in models_table.items():
                dotted = f"detectors.saturation.models.{_display(model)}"
                problem = _text_problem(model)
                if problem or len(model) > 128:
                    raise ConfigError(
                        path, dotted, problem or "a model name of 128 characters at most"
                    )
                models[model] = _typed(
                    path,
                    dotted,
                    Option(model, float, None, "", FRACTION),
                    ratio,
                )
        given = _section(path, f"detectors.{name}", section, options)
        values[name] = MappingProxyType({o.key: given.get(o.key, o.default) for o in options})
    nvlink = values["nvlink"]
    for low, high in (
        ("stall_warning_cycles_per_us", "stall_critical_cycles_per_us"),
        ("utilisation_warning_ratio", "utilisation_critical_ratio"),
    ):
        if nvlink[low] > nvlink[high]:
            raise ConfigError(path, f"detectors.nvlink.{low}", f"must be at most {high}")
    return DetectorsSettings(MappingProxyType(values), MappingProxyType(models))


#: A TOML string at the position it starts, in each of its four forms. A multi-line string
#: may end with up to two more quotes than its delimiter (``"""a""""`` holds ``a"``).
_TOML_STRING = re.compile(
    r'"""(?:[^\\"]|\\[\s\S]|"(?!""))*"""(?:"{0,2})'
    r"|'''(?:[^']|'(?!''))*'''(?:'{0,2})"
    r'|"(?:[^"\\\n]|\\.)*"'
    r"|'[^'\n]*'"
)
#: Characters of bare keys and of the blanks between the parts of a dotted key; anything else
#: outside a string ends a dotted key.
_KEY_CHARACTERS = re.compile(r"[A-Za-z0-9_\- \t]+")


def structure_problem(text: str) -> str | None:
    """Why ``text`` nests deeper or has longer dotted keys than the schema could use, or
    ``None``. A scan over the TOML outside its strings and comments, before ``tomllib``:
    arrays and inline tables (and table headers) at most :data:`MAX_NESTING` deep, dotted keys
    of at most :data:`MAX_KEY_PARTS` parts. An unterminated string ends the scan; ``tomllib``
    then stops at the same place with its own error."""
    depth = 0
    dots = 0
    position = 0
    end = len(text)
    while position < end:
        bare = _KEY_CHARACTERS.match(text, position)
        if bare is not None:
            position = bare.end()
            continue
        char = text[position]
        if char == "#":
            newline = text.find("\n", position)
            position = end if newline < 0 else newline
            continue
        if char in "\"'":
            string = _TOML_STRING.match(text, position)
            if string is None:
                return None
            position = string.end()  # a quoted key part: the dotted key goes on
            continue
        if char == ".":
            dots += 1
            if dots >= MAX_KEY_PARTS:
                line = text.count("\n", 0, position) + 1
                return f"line {line}: a dotted key of more than {MAX_KEY_PARTS} parts"
        else:
            dots = 0
            if char in "[{":
                depth += 1
                if depth > MAX_NESTING:
                    line = text.count("\n", 0, position) + 1
                    return f"line {line}: arrays and tables nested more than {MAX_NESTING} deep"
            elif char in "]}":
                depth = max(0, depth - 1)
        position += 1
    return None


def load(path: str | Path) -> Config:
    """Read and validate a config file; every problem is a :class:`ConfigError`."""
    text_path = str(path)
    try:
        raw = fileio.read_bytes(path, CONFIG_FILE)
    except (fileio.NotARegularFile, fileio.FileTooLarge) as exc:
        # Their message starts with the path, which ConfigError puts in front already.
        raise ConfigError(text_path, None, str(exc).removeprefix(f"{text_path}: ")) from None
    except OSError as exc:
        raise ConfigError(text_path, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(text_path, None, f"not UTF-8 at byte {exc.start}") from None
    problem = structure_problem(text)
    if problem is not None:
        raise ConfigError(text_path, None, f"{problem}; refused before parsing")
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:
        # TOMLDecodeError is a ValueError, and so is an integer of more than 4300 digits;
        # RecursionError only if the scan above missed a way to nest.
        raise ConfigError(text_path, None, f"not valid TOML: {_display(str(exc), 200)}") from None
    return from_mapping(data, text_path)


def reference_markdown() -> str:
    """The configuration reference for the README, generated from the schema."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]

    def row(key: str, option: Option, default: Any) -> None:
        shown = (
            repr(default).replace("'", '"')
            if not isinstance(default, bool)
            else str(default).lower()
        )
        shown = "—" if default is None else f"`{shown}`"
        allowed = str(getattr(option.check, "allowed", "")) or "—"
        lines.append(f"| `{key}` | {option.kind.__name__} | {shown} | {allowed} | {option.help} |")

    for o in DAEMON_OPTIONS:
        row(f"daemon.{o.key}", o, o.default)
    for o in ROOT_OPTIONS:
        row(f"roots.{o.key}", o, o.default)
    for info in SOURCE_TABLE:
        for o in SOURCE_OPTIONS:
            default = info.default_interval if o.key == "interval_seconds" else o.default
            help_text = o.help if o.key != "enabled" else f"run the source: {info.help}"
            row(
                f"sources.{info.name}.{o.key}",
                Option(o.key, o.kind, default, help_text, o.check),
                default,
            )
    for o in ALERT_OPTIONS:
        row(f"alerts.{o.key}", o, o.default)
    for o in ALERT_RULE_OPTIONS:
        row(f"alerts.rules.<kind>.{o.key}", o, o.default)
    for name, options in DETECTOR_OPTIONS.items():
        for o in options:
            row(f"detectors.{name}.{o.key}", o, o.default)
    for o in PROBE_OPTIONS:
        row(f"probe.{o.key}", o, o.default)
    for o in SLURM_OPTIONS:
        row(f"slurm.{o.key}", o, o.default)
    return "\n".join(lines) + "\n"
