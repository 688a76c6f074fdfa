"""The TOML configuration file: schema, defaults and validation.

The schema below is the single source of the README's configuration reference. Validation is
strict: an unknown key or a bad value is a :class:`ConfigError` naming the file and the key,
and the CLI exits with status 2 on it.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

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


def _positive(value: Any) -> str | None:
    return None if value > 0 else "must be greater than 0"


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


def _finite(value: Any) -> str | None:
    return None if math.isfinite(value) else "must be a finite number"


def _non_negative(value: Any) -> str | None:
    return None if math.isfinite(value) and value >= 0 else "must be a finite number, 0 or more"


def _positive_finite(value: Any) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a finite number above 0"


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
        _positive,
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
        _positive_finite,
    ),
    Option(
        "push_timeout_seconds",
        float,
        5.0,
        "timeout of one push to Alertmanager",
        _positive_finite,
    ),
    Option(
        "for_seconds",
        float,
        30.0,
        "default for every kind: seconds a finding must hold before its alert fires",
        _non_negative,
    ),
    Option(
        "resolve_after_seconds",
        float,
        60.0,
        "default for every kind: seconds a finding must be gone before its alert resolves",
        _non_negative,
    ),
    # The pending alert's tolerance of a missing cycle (nodescope.alerts).
    Option(
        "pending_gap_seconds",
        float,
        1.0,
        "default for every kind: seconds a pending alert's finding may be missing before the"
        " alert is cancelled; 0 cancels at the first missing cycle, as Prometheus's `for`",
        _non_negative,
    ),
)

#: ``[alerts.rules.<kind>]``: every key optional; an unset key falls back to the built-in rule
#: of the kind, then to the ``[alerts]`` defaults.
ALERT_RULE_OPTIONS: tuple[Option, ...] = (
    Option("enabled", bool, True, "turn findings of this kind into alerts"),
    Option(
        "for_seconds", float, None, "seconds the finding must hold before firing", _non_negative
    ),
    Option(
        "resolve_after_seconds",
        float,
        None,
        "seconds the finding must be gone before resolving",
        _non_negative,
    ),
    Option(
        "clear_below",
        float,
        None,
        "a firing alert stays firing while its finding's evidence `value` is at least this,"
        " even below the detector's raise threshold",
        _finite,
    ),
    Option(
        "pending_gap_seconds",
        float,
        None,
        "seconds a pending alert's finding may be missing before the alert is cancelled",
        _non_negative,
    ),
)

SOURCE_OPTIONS: tuple[Option, ...] = (
    Option("enabled", bool, True, "run this source"),
    Option("interval_seconds", float, 0.0, "seconds between reads (default per source)", _positive),
)


def _unit_interval(value: Any) -> str | None:
    return None if math.isfinite(value) and 0 < value <= 1 else "must be above 0 and at most 1"


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
                _unit_interval,
            ),
            Option(
                "min_share",
                float,
                0.1,
                "an endpoint takes part when it carries at least this share of the link's"
                " traffic (both directions); two of different classes must",
                _unit_interval,
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
                _unit_interval,
            ),
            Option(
                "one_way_ratio",
                float,
                0.85,
                "one direction over the per-direction capacity",
                _unit_interval,
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
                _non_negative,
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
                _non_negative,
            ),
            Option(
                "pcie_replays_per_second",
                float,
                0.1,
                "GPU PCIe replays per second from which a GPU is reported",
                _non_negative,
            ),
            Option(
                "nvlink_errors_per_second",
                float,
                1.0,
                "NVLink CRC (flit, data) or replay errors per second from which a link is"
                " reported (recoveries always are)",
                _non_negative,
            ),
            Option(
                "ib_symbol_errors_per_second",
                float,
                1 / 60,
                "InfiniBand symbol errors per second from which a port is reported (link_downed"
                " increments always are)",
                _non_negative,
            ),
            Option(
                "ib_xmit_wait_per_second",
                float,
                1e6,
                "port_xmit_wait ticks per second from which a port is reported as congested"
                " (the tick length is the HCA's; tune per fabric)",
                _non_negative,
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
                _positive_finite,
            ),
            Option(
                "stall_critical_cycles_per_us",
                float,
                2000.0,
                "average stall cycles per microsecond above which it is critical; a per-sample"
                " peak above it under a normal average is a stall burst",
                _positive_finite,
            ),
            Option(
                "utilisation_warning_ratio",
                float,
                0.7,
                "average utilisation (larger of TX and RX over the capacity per direction) from"
                " which a link is a warning",
                _positive_finite,
            ),
            Option(
                "utilisation_critical_ratio",
                float,
                0.9,
                "average utilisation above which a link is critical",
                _positive_finite,
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
                _positive_finite,
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
                _unit_interval,
            ),
            Option(
                "idle_bytes_per_second",
                float,
                1e8,
                "… and at or below this PCIe plus NVLink traffic, both directions",
                _non_negative,
            ),
            Option(
                "loader_utilisation_ratio",
                float,
                0.5,
                "a job's GPUs are mostly idle below this mean utilisation",
                _unit_interval,
            ),
            Option(
                "loader_io_pressure_percent",
                float,
                20.0,
                "io pressure of the job cgroup (io.pressure some avg10, %) from which its data"
                " loader counts as waiting on I/O",
                _positive_finite,
            ),
            Option(
                "loader_max_bytes_per_second",
                float,
                2e8,
                "the job's block I/O plus the node's NFS traffic below which that waiting is"
                " starvation rather than a busy disk",
                _non_negative,
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
                _positive_finite,
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
        _non_negative,
    ),
    Option(
        "min_d2h_fraction",
        float,
        0.7,
        "device-to-host copy bandwidth over the link capacity",
        _non_negative,
    ),
    Option(
        "min_h2d_bytes_per_second",
        float,
        0.0,
        "host-to-device bandwidth in bytes per second (also checked on the CPU stand-in)",
        _non_negative,
    ),
    Option(
        "min_d2h_bytes_per_second",
        float,
        0.0,
        "device-to-host bandwidth in bytes per second (also checked on the CPU stand-in)",
        _non_negative,
    ),
    Option(
        "max_bandwidth_asymmetry",
        float,
        0.25,
        "GPU pair copy bandwidth asymmetry from which the pair fails",
        _positive_finite,
    ),
    Option(
        "max_latency_asymmetry",
        float,
        0.3,
        "GPU pair small-copy latency asymmetry from which the pair fails (a +42 % bias in"
        " one direction is 0.35)",
        _positive_finite,
    ),
    Option(
        "min_allreduce_busbw_bytes_per_second",
        float,
        0.0,
        "local all-reduce bus bandwidth (nccl-tests busbw, peak over sizes)",
        _non_negative,
    ),
    Option(
        "timeout_seconds",
        float,
        300.0,
        "the daemon stops a probe it started after this long",
        _positive_finite,
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


def _int_list(value: Any) -> str | None:
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    return None if ok else "must be a list of integers, 0 or more"


def _str_list(value: Any) -> str | None:
    ok = all(isinstance(v, str) and re.fullmatch(r"[A-Za-z0-9_-]+", v) for v in value)
    return None if ok else "must be a list of names (letters, digits, _ and -)"


def _hook_timeout(value: Any) -> str | None:
    ok = math.isfinite(value) and 0 < value <= 2
    return None if ok else "must be above 0 and at most 2 (a hook must never hang a job launch)"


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
        "how long a hook waits for the daemon before running its local checks",
        _hook_timeout,
    ),
    Option(
        "expected_gpus",
        int,
        0,
        "GPUs the node must have (NVML, else /dev/nvidia<N>)",
        _non_negative,
    ),
    Option(
        "xid_codes",
        list,
        [48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120],
        "Xid codes that fail the gate while uncleared (seen since the last job or the last"
        " `nodescope slurm clear-xids`); application faults such as 13, 31 and 43 are not"
        " in the default list",
        _int_list,
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
        _non_negative,
    ),
    Option(
        "required_modules",
        list,
        [],
        "kernel modules that must be loaded (/sys/module/<name>), e.g. nvidia, nvlink_counter",
        _str_list,
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


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to a (host, port) pair."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{value!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{value!r}: port out of range")
    return host, port


def _typed(path: str, key: str, option: Option, value: Any) -> Any:
    if option.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, option.kind) or (option.kind is not bool and isinstance(value, bool)):
        raise ConfigError(path, key, f"expected {option.kind.__name__}, got {type(value).__name__}")
    if option.check is not None:
        problem = option.check(value)
        if problem:
            raise ConfigError(path, key, problem)
    return value


def _section(path: str, prefix: str, table: Any, options: tuple[Option, ...]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(path, prefix, "must be a table")
    known = {o.key: o for o in options}
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}.{key}"
        option = known.get(key)
        if option is None:
            raise ConfigError(path, dotted, "unknown key")
        out[key] = _typed(path, dotted, option, value)
    return out


def from_mapping(data: Mapping[str, Any], path: str = "<config>") -> Config:
    """Validate a parsed TOML document into a :class:`Config`."""
    for key in data:
        if key not in ("daemon", "roots", "sources", "alerts", "detectors", "probe", "slurm"):
            raise ConfigError(path, key, "unknown key")
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
        )
    for name in sources_table:
        if name not in SOURCES:
            raise ConfigError(path, f"sources.{name}", "unknown source")
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
        if not KIND_PATTERN.fullmatch(kind):
            raise ConfigError(path, f"alerts.rules.{kind}", "not a finding kind (a-z, 0-9, _)")
        rule = _section(path, f"alerts.rules.{kind}", rule_table, ALERT_RULE_OPTIONS)
        rules[kind] = AlertRuleSettings(**rule)
    return AlertsSettings(**settings, rules=MappingProxyType(rules))


def _detectors(path: str, table: Any) -> DetectorsSettings:
    if not isinstance(table, dict):
        raise ConfigError(path, "detectors", "must be a table")
    for name in table:
        if name not in DETECTOR_OPTIONS:
            raise ConfigError(path, f"detectors.{name}", "unknown detector")
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
                models[model] = _typed(
                    path,
                    f"detectors.saturation.models.{model}",
                    Option(model, float, None, "", _unit_interval),
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


def load(path: str | Path) -> Config:
    """Read and validate a config file; every problem is a :class:`ConfigError`."""
    text_path = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(text_path, None, f"cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(text_path, None, f"not valid TOML: {exc}") from None
    return from_mapping(data, text_path)


def reference_markdown() -> str:
    """The configuration reference for the README, generated from the schema."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def row(key: str, option: Option, default: Any) -> None:
        shown = (
            repr(default).replace("'", '"')
            if not isinstance(default, bool)
            else str(default).lower()
        )
        shown = "—" if default is None else f"`{shown}`"
        lines.append(f"| `{key}` | {option.kind.__name__} | {shown} | {option.help} |")

    for o in DAEMON_OPTIONS:
        row(f"daemon.{o.key}", o, o.default)
    for o in ROOT_OPTIONS:
        row(f"roots.{o.key}", o, o.default)
    for info in SOURCE_TABLE:
        for o in SOURCE_OPTIONS:
            default = info.default_interval if o.key == "interval_seconds" else o.default
            help_text = o.help if o.key != "enabled" else f"run the source: {info.help}"
            row(f"sources.{info.name}.{o.key}", Option(o.key, o.kind, default, help_text), default)
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
