"""The TOML configuration file: its options, their defaults and bounds, and validation.

Each option is declared once, as a field of the frozen dataclass that holds its value: the
field's annotation is its type, the field's default its default, and :func:`option` (or
:func:`about`) attaches its help and its check (bounds, a pattern) as field metadata. The
validator, the sample file (``systemd/nodescope.toml``) and the README's configuration
reference are all derived from these declarations, so none of them can disagree with the code
that reads the value, and mypy checks every read of a typed attribute
(``config.detectors.contention.min_share``).

The ``[sources.<name>]`` tables are the one part declared elsewhere: each source's spec holds
its default interval, its help and the class of its own keys. This module imports no source
(every stage reads it); the validator and both documents take the specs as an argument
(:data:`SourceCatalogue`), handed in where the program is put together
(:mod:`nodescope.assembly`).

Validation is strict: an unknown key or a bad value is a :class:`ConfigError` naming the file
and the key, and the CLI exits with status 2 on it. TOML's types are kept as written (an integer
is accepted where a float is expected, nothing else is converted) and every number has bounds
that the error and the reference name.

The file is read as the daemon reads any file an operator or a user could have replaced
(:mod:`nodescope.fileio`): a FIFO, a device, a socket or a directory is refused without
blocking, and so is a file over :data:`CONFIG_FILE`'s cap. Before ``tomllib`` sees the text, a
scan bounds how deep arrays and inline tables nest and how many parts a dotted key has:
``tomllib`` recurses once per level of nesting and builds every prefix of a dotted key, so a
64 KiB file could otherwise end in a RecursionError or take gigabytes.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import textwrap
import tomllib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from nodescope import fileio
from nodescope.errors import ConfigError
from nodescope.model.collectives import SpoolSettings
from nodescope.model.error_thresholds import BANDS as ERROR_BANDS
from nodescope.model.error_thresholds import default_of
from nodescope.model.job_records import DEFAULT_MAX_REGISTRATIONS
from nodescope.model.link_events import LinkEventsOptions
from nodescope.model.netdev import NetdevOptions
from nodescope.options import (
    IntList,
    NameList,
    OneOf,
    Option,
    Range,
    about,
    display,
    option,
    options_of,
    value_text,
)
from nodescope.roots import ROOT_NAMES, Roots

DEFAULT_PORT = 9839
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("logfmt", "json")

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
#: How long a stall must hold before it is a finding (0: at once).
STALL_DURATION = Range(0, HOUR)
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


def _log_format(value: Any) -> str | None:
    return None if value in LOG_FORMATS else f"must be one of {', '.join(LOG_FORMATS)}"


def _absolute(value: Any) -> str | None:
    return None if str(value).startswith("/") else "must be an absolute path"


def _absolute_or_empty(value: Any) -> str | None:
    return None if value == "" or str(value).startswith("/") else "must be empty or absolute"


def _alertmanager_url(value: Any) -> str | None:
    if value == "":
        return None
    if not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", value):
        return "must be empty or an http:// or https:// URL without query"
    return None


#: A finding kind as detectors name it (``pcie_contention``); the key of ``[alerts.rules.X]``.
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


# -- the tables, each option declared once ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceSettings:
    """One ``[sources.<name>]`` table; the read interval's default is the source's own
    (``SourceSpec.default_interval``)."""

    enabled: bool = option(True, "run this source")
    interval_seconds: float = field(
        metadata=about("seconds between reads (default per source)", SECONDS_SOURCE_INTERVAL)
    )
    timeout_seconds: float = option(
        DEFAULT_SOURCE_TIMEOUT,
        "seconds one read may take; a read that overruns is reported down with reason"
        " `timeout`, the cycle goes on without it, and the source is not called again"
        " until the stuck read returns",
        SECONDS_SOURCE_TIMEOUT,
    )
    #: The keys a source has beyond the common ones, as the object of the class its spec
    #: declares them in (``SourceSpec.settings``); None for a source without any.
    extra: Any = None


def _extra(config: Config, name: str) -> Any:
    """The keys of its own that ``[sources.<name>]`` set (``SourceSettings.extra``)."""
    settings = config.sources.get(name)
    return settings.extra if settings is not None else None


def netdev_options(config: Config) -> NetdevOptions:
    """How the ``netdev`` source reads (``[sources.netdev]``)."""
    extra = _extra(config, "netdev")
    return extra if isinstance(extra, NetdevOptions) else NetdevOptions()


def link_events_options(config: Config) -> LinkEventsOptions:
    """How the ``link_events`` source follows links (``[sources.link_events]``)."""
    extra = _extra(config, "link_events")
    return extra if isinstance(extra, LinkEventsOptions) else LinkEventsOptions()


def spool_settings(config: Config) -> SpoolSettings | None:
    """The ``traces`` source's settings, None when no spool directory is set."""
    extra = _extra(config, "traces")
    return extra if isinstance(extra, SpoolSettings) and extra.spool_dir else None


@dataclass(frozen=True, slots=True)
class AlertRuleSettings:
    """One ``[alerts.rules.<kind>]`` table; ``None`` where the file does not set the key."""

    enabled: bool | None = option(None, "turn findings of this kind into alerts", unset_means=True)
    for_seconds: float | None = option(
        None, "seconds the finding must hold before firing", Range(0, DAY)
    )
    resolve_after_seconds: float | None = option(
        None, "seconds the finding must be gone before resolving", Range(0, DAY)
    )
    clear_below: float | None = option(
        None,
        "a firing alert stays firing while its finding's evidence `value` is at least this,"
        " even below the detector's raise threshold",
        Range(0, 1e15),
    )
    pending_gap_seconds: float | None = option(
        None,
        "seconds a pending alert's finding may be missing before the alert is cancelled",
        Range(0, HOUR),
    )


@dataclass(frozen=True, slots=True)
class AlertsSettings:
    """``[alerts]``: the push to Alertmanager and the timing every kind defaults to."""

    alertmanager_url: str = option(
        "",
        "Alertmanager base URL to push firing and resolved alerts to (API v2); empty: no push",
        _alertmanager_url,
    )
    instance: str = option("", "the instance label of pushed alerts; empty: the host name")
    external_url: str = option(
        "",
        "URL this daemon is reached at by whoever reads its alerts (`http://node01.example:9839`):"
        " pushed alerts link to `<external_url>/api/v1/alerts`; empty: the host name and the"
        " listen port, or the listen address when it is a specific non-loopback one",
        _alertmanager_url,
    )
    resend_seconds: float = option(
        60.0,
        "how often firing alerts are sent to Alertmanager again while they last",
        Range(1, DAY),
    )
    push_timeout_seconds: float = option(5.0, "timeout of one push to Alertmanager", Range(0.1, 60))
    for_seconds: float = option(
        30.0,
        "default for every kind: seconds a finding must hold before its alert fires",
        Range(0, DAY),
    )
    resolve_after_seconds: float = option(
        60.0,
        "default for every kind: seconds a finding must be gone before its alert resolves",
        Range(0, DAY),
    )
    # The pending alert's tolerance of a missing cycle (nodescope.alerts).
    pending_gap_seconds: float = option(
        1.0,
        "default for every kind: seconds a pending alert's finding may be missing before the"
        " alert is cancelled; 0 cancels at the first missing cycle, as Prometheus's `for`",
        Range(0, HOUR),
    )
    rules: Mapping[str, AlertRuleSettings] = field(default_factory=lambda: MappingProxyType({}))


# ``[detectors.<name>]``: one class per detector (``nodescope.detectors``), each a field of
# DetectorsSettings below; SAMPLE_NOTES["detectors"] says what the rates and ratios are of.


@dataclass(frozen=True, slots=True)
class ContentionSettings:
    enabled: bool = option(True, "report shared PCIe links that devices contend for")
    utilisation_ratio: float = option(
        0.6,
        "a shared link is contended from this demand over capacity in its busier direction"
        " (DMA tops out near 0.8 of the encoded rate: TLP and DLLP overhead)",
        FRACTION,
    )
    min_share: float = option(
        0.1,
        "an endpoint takes part when it carries at least this share of the link's traffic"
        " (both directions); two of different classes must",
        FRACTION,
    )


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    """The per-model ratios of ``[detectors.saturation.models]`` are
    :attr:`DetectorsSettings.saturation_models`."""

    enabled: bool = option(True, "report GPUs that saturate their own PCIe link")
    bidirectional_ratio: float = option(
        0.57,
        "both directions together over twice the per-direction capacity; an A100 on Gen4 x16"
        " saturated at 38 of 63 GB/s (0.60): 0.57 is 95 % of that point. Applies to links at"
        " Gen4 or slower; on faster ones only to the models of [detectors.saturation.models]"
        ' ("A100" = 0.57)',
        FRACTION,
    )
    one_way_ratio: float = option(0.85, "one direction over the per-direction capacity", FRACTION)


@dataclass(frozen=True, slots=True)
class DowntrainingSettings:
    enabled: bool = option(True, "report links trained below their maximum under load")
    min_bytes_per_second: float = option(
        1e9,
        "traffic (both directions) from which a device counts as under load; idle devices"
        " lower their link speed to save power",
        BANDWIDTH,
    )


@dataclass(frozen=True, slots=True)
class ErrorsSettings:
    enabled: bool = option(True, "report PCIe, NVLink and InfiniBand error rates")
    # The defaults are the thresholds table's (nodescope.model.error_thresholds, also
    # docs/thresholds.md): the one place the numbers and their references are kept.
    aer_correctable_warning_per_minute: float = option(
        default_of("aer_correctable_warning_per_minute"),
        "correctable AER errors of one PCI function in a minute from which it is a warning"
        " (non-fatal errors always are, fatal ones critical)",
        EVENT_RATE,
    )
    aer_correctable_critical_per_minute: float = option(
        default_of("aer_correctable_critical_per_minute"),
        "correctable AER errors of one PCI function in a minute from which it is critical",
        EVENT_RATE,
    )
    pcie_replays_warning_per_minute: float = option(
        default_of("pcie_replays_warning_per_minute"),
        "GPU PCIe replays in a minute from which a GPU's link is a warning (DCGM: 8)",
        EVENT_RATE,
    )
    pcie_replays_critical_per_minute: float = option(
        default_of("pcie_replays_critical_per_minute"),
        "GPU PCIe replays in a minute from which a GPU's link is critical",
        EVENT_RATE,
    )
    nvlink_crc_warning_per_minute: float = option(
        default_of("nvlink_crc_warning_per_minute"),
        "NVLink CRC (flit or data) errors of one link in a minute from which it is a warning"
        " (DCGM: 100 a second)",
        EVENT_RATE,
    )
    nvlink_crc_critical_per_minute: float = option(
        default_of("nvlink_crc_critical_per_minute"),
        "NVLink CRC (flit or data) errors of one link in a minute from which it is critical",
        EVENT_RATE,
    )
    ib_symbol_ber_warning: float = option(
        default_of("ib_symbol_ber_warning"),
        "InfiniBand symbol errors over an hour as a bit error ratio of the port's line rate"
        " from which the port is a warning",
        Range(0, 1, low_open=True),
    )
    ib_symbol_ber_critical: float = option(
        default_of("ib_symbol_ber_critical"),
        "InfiniBand symbol errors over a minute as a bit error ratio of the port's line rate"
        " from which the port is critical (the IBTA's limit: 1e-12)",
        Range(0, 1, low_open=True),
    )
    ib_xmit_wait_per_second: float = option(
        1e6,
        "port_xmit_wait ticks per second from which a port is reported as congested (the tick"
        " length is the HCA's; tune per fabric)",
        Range(0, 1e12),
    )


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    enabled: bool = option(
        True, "report jobs whose GPUs use HCAs on another NUMA node or root complex"
    )


@dataclass(frozen=True, slots=True)
class NvlinkSettings:
    """The warning bound of each band is at most its critical bound (checked on load)."""

    enabled: bool = option(
        True,
        "report NVLink arbitration stalls, stall bursts and bandwidth saturation seen by the"
        " nvlink_counter module, and saturation from NVML's per-link data counters on links"
        " the module does not serve",
    )
    stall_warning_cycles_per_us: float = option(
        500.0,
        "average stall cycles per microsecond of a link from which it is a warning",
        Range(0, 1e6, low_open=True),
    )
    stall_critical_cycles_per_us: float = option(
        2000.0,
        "average stall cycles per microsecond above which it is critical; a per-sample peak"
        " above it under a normal average is a stall burst",
        Range(0, 1e6, low_open=True),
    )
    utilisation_warning_ratio: float = option(
        0.7,
        "average utilisation (larger of TX and RX over the capacity per direction) from which"
        " a link is a warning",
        FRACTION,
    )
    utilisation_critical_ratio: float = option(
        0.9, "average utilisation above which a link is critical", FRACTION
    )
    burst_findings: bool = option(
        True, "report per-sample stall peaks in the critical band when the average is normal"
    )
    min_stall_seconds: float = option(
        5.0,
        "a link (or a switch's links) must stall this long before a stall finding: a blip of a"
        " few seconds is no finding",
        STALL_DURATION,
    )


#: The ``[detectors.nvlink]`` bands as (warning, critical) keys: warning may not exceed critical.
NVLINK_BANDS = (
    ("stall_warning_cycles_per_us", "stall_critical_cycles_per_us"),
    ("utilisation_warning_ratio", "utilisation_critical_ratio"),
)


@dataclass(frozen=True, slots=True)
class JobsSettings:
    enabled: bool = option(
        True,
        "report escaped job processes and threads, memory limits that do not apply, OOM kills,"
        " memory pressure and reclaim thrash at a memory limit",
    )
    memory_pressure_percent: float = option(
        10.0,
        "a job is under sustained memory pressure from this share of the last minute in which"
        " all its tasks stalled on memory (memory.pressure full avg60, %)",
        PERCENT,
    )
    memory_limit_thrash_events_per_second: float = option(
        50.0,
        "a job or step thrashes against its memory.max from this rate of memory.events max"
        " (charges that hit the limit and had to reclaim) between two reads of the jobs"
        " source, events/s",
        EVENT_RATE,
    )
    memory_limit_thrash_stall_percent: float = option(
        10.0,
        "hitting memory.max is thrash only when the cgroup's tasks stalled on memory for at"
        " least this share of the interval between two reads (growth of memory.pressure some"
        " total, %), or the OOM killer struck there: page cache filling a limit makes nobody"
        " wait (docs/thresholds.md)",
        PERCENT,
    )


@dataclass(frozen=True, slots=True)
class CollectivesSettings:
    enabled: bool = option(
        True,
        "report jobs whose traces in the spool (sources.traces) show an AllToAll send skew or a"
        " rank the others waited for",
    )
    max_skew: float = option(
        0.5,
        "a collective kind's send skew δ (std/mean of the ranks' send bytes) above this is a"
        " collective_skew finding",
        Range(0, 100, low_open=True),
    )
    max_wait_seconds: float = option(
        1.0,
        "a straggler that kept another rank waiting longer than this in one collective is a"
        " collective_straggler finding, seconds",
        Range(0, HOUR, low_open=True),
    )


@dataclass(frozen=True, slots=True)
class HangsSettings:
    enabled: bool = option(
        True,
        "report jobs whose GPUs sit idle: stalled on a storage lock or NFS, a starving data"
        " loader, or a stall of unknown cause",
    )
    idle_utilisation_ratio: float = option(
        0.05, "a GPU is idle at or below this NVML utilisation (0.05 = 5 %) …", FRACTION
    )
    idle_bytes_per_second: float = option(
        1e8, "… and at or below this PCIe plus NVLink traffic, both directions", BANDWIDTH
    )
    loader_utilisation_ratio: float = option(
        0.5, "a job's GPUs are mostly idle below this mean utilisation", FRACTION
    )
    loader_io_pressure_percent: float = option(
        20.0,
        "io pressure of the job cgroup (io.pressure some avg10, %) from which its data loader"
        " counts as waiting on I/O",
        PERCENT,
    )
    loader_max_bytes_per_second: float = option(
        2e8,
        "the job's block I/O plus the node's NFS traffic below which that waiting is"
        " starvation rather than a busy disk",
        BANDWIDTH,
    )
    min_stall_seconds: float = option(
        20.0,
        "a job must make no progress this long before any of these findings: a pause at an"
        " epoch boundary or a checkpoint barrier of a few seconds is no finding",
        STALL_DURATION,
    )


@dataclass(frozen=True, slots=True)
class HotplugSettings:
    enabled: bool = option(
        True,
        "report GPUs that fell off the bus, other PCI functions that left it and"
        " network/InfiniBand links that flap",
    )
    flap_transitions: float = option(
        4.0,
        "a link flaps from this many up/down transitions within the link_events source's"
        " window (two downs and two ups)",
        Range(1, 1000),
    )


@dataclass(frozen=True, slots=True)
class XidsSettings:
    enabled: bool = option(
        True,
        "report new Xids by class (memory, NVLink, bus, firmware, thermal/power, engine,"
        " application) with the severity and action of the packaged Xid catalog; Xid 79 is"
        " the hotplug detector's",
    )


@dataclass(frozen=True, slots=True)
class GpuHealthSettings:
    enabled: bool = option(
        True,
        "report uncorrectable ECC errors, pending or failed row remaps, pending page"
        " retirement, thermal, power and hardware clock slowdowns and a degraded NVSwitch"
        " fabric from NVML's health reads",
    )
    busy_util_percent: float = option(
        50.0,
        "a GPU is under load from this NVML utilisation (%), or while it has a compute"
        " process: thermal and power slowdowns of an idle GPU cost nothing",
        PERCENT,
    )
    min_slowdown_seconds: float = option(
        30.0,
        "a thermal or power slowdown under load, or a hardware slowdown, must hold this long"
        " before a finding: boost clocks step down for moments under any heavy load",
        STALL_DURATION,
    )
    power_clock_fraction: float = option(
        0.5,
        "a GPU held by its power cap (sw_power_cap) under load at its default power limit is"
        " a finding only when its SM clock falls below this fraction of its applications"
        " clock (half: as slow as a hardware slowdown); a limit enforced below the board's"
        " default is a finding at any clock (docs/thresholds.md)",
        FRACTION,
    )
    fabric_grace_seconds: float = option(
        60.0,
        "a GPU's NVSwitch fabric registration may be unfinished this long (the fabric"
        " manager registers GPUs after the driver loads) before it is a finding",
        Range(0, HOUR),
    )


def _no_tables() -> Mapping[str, Mapping[str, Any]]:
    return MappingProxyType({})


def _default_models() -> Mapping[str, float]:
    return MappingProxyType({"A100": 0.57})


@dataclass(frozen=True, slots=True)
class DetectorsSettings:
    """Every ``[detectors.<name>]`` table as a typed attribute (``self.contention``, ...), and
    the per-GPU-model saturation ratios of ``[detectors.saturation.models]`` (a model matches
    when its key is part of the GPU's name, e.g. ``"A100"``).

    Built from ``values``, the tables by detector name (a missing table or key takes its
    default); after construction ``values`` holds every table with every key (the form a
    reload compares and a test replaces). Readers use the typed attributes, which hold the
    same values and are checked by mypy at each read."""

    values: Mapping[str, Mapping[str, Any]] = field(default_factory=_no_tables)
    saturation_models: Mapping[str, float] = field(default_factory=_default_models)
    # One field per detector, in the order of the reference and the sample; the field's type
    # is the detector's settings class (DETECTOR_SECTIONS is read from these).
    contention: ContentionSettings = field(init=False, repr=False, compare=False)
    saturation: SaturationSettings = field(init=False, repr=False, compare=False)
    downtraining: DowntrainingSettings = field(init=False, repr=False, compare=False)
    errors: ErrorsSettings = field(init=False, repr=False, compare=False)
    placement: PlacementSettings = field(init=False, repr=False, compare=False)
    nvlink: NvlinkSettings = field(init=False, repr=False, compare=False)
    jobs: JobsSettings = field(init=False, repr=False, compare=False)
    hangs: HangsSettings = field(init=False, repr=False, compare=False)
    hotplug: HotplugSettings = field(init=False, repr=False, compare=False)
    xids: XidsSettings = field(init=False, repr=False, compare=False)
    gpu_health: GpuHealthSettings = field(init=False, repr=False, compare=False)
    collectives: CollectivesSettings = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tables: dict[str, Mapping[str, Any]] = {}
        for name, section in DETECTOR_SECTIONS.items():
            typed = section(**self.values.get(name, {}))
            object.__setattr__(self, name, typed)
            tables[name] = MappingProxyType(
                {o.key: getattr(typed, o.key) for o in DETECTOR_OPTIONS[name]}
            )
        object.__setattr__(self, "values", MappingProxyType(tables))
        object.__setattr__(
            self, "saturation_models", MappingProxyType(dict(self.saturation_models))
        )


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """``[probe]``: what ``nodescope probe`` must measure to pass (SAMPLE_NOTES["probe"] says
    what the fractions and asymmetries are of)."""

    min_h2d_fraction: float = option(
        0.7,
        "host-to-device copy bandwidth (pinned, peak over sizes) over the link capacity; a"
        " healthy Gen4/Gen5 x16 link reaches about 0.8, a link trained at half width 0.4",
        Range(0, 1),
    )
    min_d2h_fraction: float = option(
        0.7, "device-to-host copy bandwidth over the link capacity", Range(0, 1)
    )
    min_h2d_bytes_per_second: float = option(
        0.0,
        "host-to-device bandwidth in bytes per second (also checked on the CPU stand-in)",
        BANDWIDTH,
    )
    min_d2h_bytes_per_second: float = option(
        0.0,
        "device-to-host bandwidth in bytes per second (also checked on the CPU stand-in)",
        BANDWIDTH,
    )
    max_bandwidth_asymmetry: float = option(
        0.25,
        "GPU pair copy bandwidth asymmetry from which the pair fails",
        Range(0, 10, low_open=True),
    )
    max_latency_asymmetry: float = option(
        0.3,
        "GPU pair small-copy latency asymmetry from which the pair fails (a +42 % bias in one"
        " direction is 0.35)",
        Range(0, 10, low_open=True),
    )
    min_allreduce_busbw_bytes_per_second: float = option(
        0.0,
        "local all-reduce bus bandwidth (nccl-tests busbw, peak over sizes)",
        BANDWIDTH,
    )
    timeout_seconds: float = option(
        300.0, "the daemon stops a probe it started after this long", Range(1, HOUR)
    )


@dataclass(frozen=True, slots=True)
class SlurmSettings:
    """``[slurm]``: the prolog/epilog hooks, their socket to the daemon and the prolog's
    health gate, where a key at 0, false or [] turns its check off."""

    slurm_user: str = option(
        "slurm",
        "besides root, the only user the daemon's hook socket answers (Slurm's SlurmUser)",
    )
    reports_dir: str = option(
        "/var/lib/nodescope/jobs",
        "where the epilog's per-job reports are written (<job id>.json)",
        _absolute,
    )
    scontrol: str = option(
        "/usr/bin/scontrol",
        "scontrol that drains the node: the prolog gate, the daemon on a finding during a job,"
        " nodescope slurm health; empty: the gate leaves the drain to Slurm and nothing else"
        " drains",
        _absolute_or_empty,
    )
    timeout_seconds: float = option(
        2.0,
        "how long a hook waits for the daemon before running its local checks (a hook must"
        " never hang a job launch)",
        Range(0, 2, low_open=True),
    )
    expected_gpus: int = option(
        0, "GPUs the node must have (NVML, else /dev/nvidia<N>)", Range(0, 1024, integer=True)
    )
    xid_codes: tuple[int, ...] = option(
        (48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 119, 120),
        "Xid codes that fail the gate while uncleared (seen since the last job or the last"
        " `nodescope slurm clear-xids`); application faults such as 13, 31 and 43 are not in"
        " the default list",
        IntList(0, 9999, max_items=256),
    )
    check_link_width: bool = option(
        True, "fail when a GPU's PCIe link runs narrower than its maximum width"
    )
    min_link_gen: int = option(
        0,
        "fail when a GPU's PCIe link runs below this generation (idle GPUs may lower it)",
        Range(0, 7, integer=True),
    )
    required_modules: tuple[str, ...] = option(
        (),
        "kernel modules that must be loaded (/sys/module/<name>), e.g. nvidia, nvlink_counter",
        NameList(max_items=256, max_length=64),
    )
    run_probe: bool = option(
        False, "run `nodescope probe --quick` (when installed) and fail on its exit status"
    )
    max_registrations: int = option(
        DEFAULT_MAX_REGISTRATIONS,
        "jobs registered on the node at most (<run>/nodescope/jobs/<id>.json): past it the"
        " prolog registers no more (it says so; the job still runs) once registrations of"
        " ended jobs are expired, and the jobs source reads no more",
        Range(1, 65536, integer=True),
    )
    registration_max_age_seconds: float = option(
        DAY,
        "a registration whose job has no cgroup on the node is removed when Slurm (scontrol"
        " show job) no longer knows the job or, when Slurm does not answer, once it is this old",
        Range(HOUR, 30 * DAY),
    )


#: What the remediation policy may do about a finding: nothing, keep it an alert, drain the
#: node (running jobs finish), or drain it and requeue the job the finding names.
REMEDIATION_ACTIONS = OneOf(("none", "alert", "drain", "drain_requeue"))


@dataclass(frozen=True, slots=True)
class RemediationRuleSettings:
    """One ``[remediation.rules.<kind>]`` table; ``None`` where the file does not set the key
    (the kind's built-in rule, then the ``[remediation]`` default applies)."""

    critical: str | None = option(
        None, "action on a critical finding of this kind", REMEDIATION_ACTIONS
    )
    warning: str | None = option(
        None, "action on a warning finding of this kind", REMEDIATION_ACTIONS
    )
    info: str | None = option(None, "action on an info finding of this kind", REMEDIATION_ACTIONS)


def _no_remediation_rules() -> Mapping[str, RemediationRuleSettings]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RemediationSettings:
    """``[remediation]``: what ``nodescope slurm health`` does about a firing alert or a failed
    gate check, per severity, and the guards around a drain."""

    critical: str = option("drain", "action on a critical finding", REMEDIATION_ACTIONS)
    warning: str = option("alert", "action on a warning finding", REMEDIATION_ACTIONS)
    info: str = option("none", "action on an info finding", REMEDIATION_ACTIONS)
    dry_run: bool = option(
        False, "decide and say what would be done, but drain, resume and requeue nothing"
    )
    cooldown_seconds: float = option(
        600.0,
        "after nodescope drains or resumes a node, the opposite change waits this long (no"
        " flip-flop of a finding that comes and goes)",
        Range(0, DAY),
    )
    max_drained_share: float = option(
        0.1,
        "no new drain while the nodes nodescope has drained make up this share of one of the"
        " node's partitions or more (read from Slurm); the first drain of a partition always"
        " goes ahead",
        Range(0, 1, low_open=True),
    )
    scontrol_timeout_seconds: float = option(
        10.0,
        "how long one scontrol call may take before it is abandoned",
        Range(0.1, 60),
    )
    rules: Mapping[str, RemediationRuleSettings] = field(default_factory=_no_remediation_rules)


class SourceDeclaration(Protocol):
    """What the configuration reads of a source's spec (``nodescope.sources.spec.SourceSpec``
    has it): the configuration is handed the specs where the program is put together
    (:mod:`nodescope.assembly`) and imports no source, so that every stage may read it."""

    @property
    def name(self) -> str: ...
    @property
    def default_interval(self) -> float: ...
    @property
    def help(self) -> str: ...
    @property
    def settings(self) -> type[Any] | None: ...


#: The sources a file may configure, by name, in the order they run.
SourceCatalogue = Mapping[str, SourceDeclaration]


def _extra_options(info: SourceDeclaration) -> tuple[Option, ...]:
    """The keys the source has beyond the common ones."""
    return () if info.settings is None else options_of(info.settings)


def _source_settings(info: SourceDeclaration, given: Mapping[str, Any]) -> SourceSettings:
    """One source's settings from the keys a file set; a source with keys of its own gets
    them as its ``extra`` object, and the ``traces`` source runs only with a spool."""
    common = {k: v for k, v in given.items() if k in SOURCE_KEYS}
    extra = None
    if info.settings is not None:
        extra = info.settings(**{k: v for k, v in given.items() if k not in SOURCE_KEYS})
    if isinstance(extra, SpoolSettings) and not extra.spool_dir:
        common["enabled"] = False
    return SourceSettings(**{"interval_seconds": info.default_interval, **common}, extra=extra)


def default_sources(catalogue: SourceCatalogue) -> Mapping[str, SourceSettings]:
    """Every source of ``catalogue`` at its defaults, as a file without ``[sources]`` has it."""
    return MappingProxyType({name: _source_settings(info, {}) for name, info in catalogue.items()})


@dataclass(frozen=True, slots=True)
class Config:
    """The whole file. The ``[daemon]`` keys are the options declared here; every other table
    is a settings object of its own."""

    listen: str = option(
        DEFAULT_LISTEN, "HOST:PORT of the /metrics server; [::1]:PORT for IPv6", _listen
    )
    tick_seconds: float = option(
        1.0,
        "how often the loop wakes to run the sources that are due; no source runs more often",
        SECONDS_TICK,
    )
    log_level: str = option("info", "one of debug, info, warning, error", _log_level)
    log_format: str = option(
        "logfmt",
        "log lines as logfmt (key=value) or json, one record a line; a time stamp leads each"
        " unless stderr is the journal's",
        _log_format,
    )
    roots: Roots = field(default_factory=Roots)
    #: Empty in a ``Config()``, which configures the stages after the sources: the daemon's
    #: configuration, every source in it, is built where the sources are known
    #: (:mod:`nodescope.assembly`).
    sources: Mapping[str, SourceSettings] = field(default_factory=lambda: MappingProxyType({}))
    alerts: AlertsSettings = field(default_factory=AlertsSettings)
    detectors: DetectorsSettings = field(default_factory=DetectorsSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    remediation: RemediationSettings = field(default_factory=RemediationSettings)
    path: str | None = None

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_listen(self.listen)


# -- the options of each table, derived from the declarations above --------------------------

DAEMON_OPTIONS = options_of(Config)
ROOT_OPTIONS: tuple[Option, ...] = tuple(
    Option(name, str, str(getattr(Roots(), name)), f"root of {name} for every source", _absolute)
    for name in ROOT_NAMES
)
SOURCE_OPTIONS = options_of(SourceSettings)
SOURCE_KEYS = frozenset(o.key for o in SOURCE_OPTIONS)
ALERT_OPTIONS = options_of(AlertsSettings)
#: ``[alerts.rules.<kind>]``: every key optional; an unset key falls back to the built-in rule
#: of the kind, then to the ``[alerts]`` defaults.
ALERT_RULE_OPTIONS = options_of(AlertRuleSettings)


def _detector_sections() -> Mapping[str, type[Any]]:
    """Detector name -> its settings class, in the order :class:`DetectorsSettings` declares
    its typed fields."""
    hints = typing.get_type_hints(DetectorsSettings)
    return MappingProxyType(
        {f.name: hints[f.name] for f in dataclasses.fields(DetectorsSettings) if not f.init}
    )


DETECTOR_SECTIONS = _detector_sections()
DETECTOR_OPTIONS: Mapping[str, tuple[Option, ...]] = MappingProxyType(
    {name: options_of(section) for name, section in DETECTOR_SECTIONS.items()}
)
PROBE_OPTIONS = options_of(ProbeSettings)
SLURM_OPTIONS = options_of(SlurmSettings)
REMEDIATION_OPTIONS = options_of(RemediationSettings)
REMEDIATION_RULE_OPTIONS = options_of(RemediationRuleSettings)

#: The tables a file may hold, in the order the sample and the reference list them.
TABLES = ("daemon", "roots", "sources", "alerts", "detectors", "probe", "slurm", "remediation")


#: A host name as resolvers take it (RFC 1123 labels); Python's IDNA codec raises UnicodeError,
#: not OSError, for a label over 63 characters, so such a name must not reach getaddrinfo.
_HOST_NAME = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def is_host(host: str) -> bool:
    """Whether ``host`` is an IP address or a host name (letters, digits, dots, dashes)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None
    return True


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to a (host, port) pair; HOST is an IP address or a
    host name, PORT decimal digits."""
    shown = display(value)
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{shown!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    # int() would also take " 80", "8_0" and other scripts' digits.
    if not re.fullmatch(r"[0-9]{1,5}", port_text):
        raise ValueError(f"{shown!r}: port {display(port_text)!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"{shown!r}: port out of range")
    if not is_host(host):
        raise ValueError(f"{shown!r}: {display(host)!r} is neither an IP address nor a host name")
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
    and a number never a boolean. An array becomes the tuple its field holds."""
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
            raise ConfigError(path, key, f"{value_text(value)} is not a float") from None
    if option.kind is list:
        return tuple(value)
    return value


def _section(path: str, prefix: str, table: Any, options: tuple[Option, ...]) -> dict[str, Any]:
    """The keys ``table`` sets, each checked against its option; unset keys are left out, so
    the settings class fills in its own defaults."""
    if not isinstance(table, dict):
        raise ConfigError(path, prefix, "must be a table")
    known = {o.key: o for o in options}
    out: dict[str, Any] = {}
    for key, value in table.items():
        dotted = f"{prefix}.{display(key)}"
        option = known.get(key)
        if option is None:
            raise ConfigError(path, dotted, "unknown key")
        out[key] = _typed(path, dotted, option, value)
    return out


def from_mapping(
    data: Mapping[str, Any], path: str = "<config>", *, catalogue: SourceCatalogue
) -> Config:
    """Validate a parsed TOML document into a :class:`Config` whose ``[sources.<name>]``
    tables are those of the sources of ``catalogue``."""
    for key in data:
        if key not in TABLES:
            raise ConfigError(path, display(key), "unknown key")
    daemon = _section(path, "daemon", data.get("daemon", {}), DAEMON_OPTIONS)
    roots_table = _section(path, "roots", data.get("roots", {}), ROOT_OPTIONS)
    sources = _sources(path, data.get("sources", {}), catalogue)
    alerts = _alerts(path, data.get("alerts", {}))
    detectors = _detectors(path, data.get("detectors", {}))
    probe = _section(path, "probe", data.get("probe", {}), PROBE_OPTIONS)
    slurm = _section(path, "slurm", data.get("slurm", {}), SLURM_OPTIONS)
    remediation = _remediation(path, data.get("remediation", {}))
    return Config(
        **daemon,
        roots=Roots().with_overrides(**roots_table),
        sources=sources,
        alerts=alerts,
        detectors=detectors,
        probe=ProbeSettings(**probe),
        slurm=SlurmSettings(**slurm),
        remediation=remediation,
        path=path,
    )


def _sources(path: str, table: Any, catalogue: SourceCatalogue) -> Mapping[str, SourceSettings]:
    if not isinstance(table, dict):
        raise ConfigError(path, "sources", "must be a table")
    sources: dict[str, SourceSettings] = {}
    for info in catalogue.values():
        options = SOURCE_OPTIONS + _extra_options(info)
        given = _section(path, f"sources.{info.name}", table.get(info.name, {}), options)
        sources[info.name] = _source_settings(info, given)
    for name in table:
        if name not in catalogue:
            raise ConfigError(path, f"sources.{display(name)}", "unknown source")
    return MappingProxyType(sources)


def _with_rules(
    path: str,
    name: str,
    table: Any,
    options: tuple[Option, ...],
    rule_options: tuple[Option, ...],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The keys a section with per-kind rules (``[alerts]``, ``[remediation]``) sets, and each
    of its ``[<name>.rules.<kind>]`` tables' keys by kind."""
    if not isinstance(table, dict):
        raise ConfigError(path, name, "must be a table")
    plain = {k: v for k, v in table.items() if k != "rules"}
    settings = _section(path, name, plain, options)
    rules_table = table.get("rules", {})
    if not isinstance(rules_table, dict):
        raise ConfigError(path, f"{name}.rules", "must be a table")
    rules: dict[str, dict[str, Any]] = {}
    for kind, rule_table in rules_table.items():
        if len(kind) > 64 or not KIND_PATTERN.fullmatch(kind):
            raise ConfigError(
                path, f"{name}.rules.{display(kind)}", "not a finding kind (a-z, 0-9, _)"
            )
        rules[kind] = _section(path, f"{name}.rules.{kind}", rule_table, rule_options)
    return settings, rules


def _alerts(path: str, table: Any) -> AlertsSettings:
    settings, rules = _with_rules(path, "alerts", table, ALERT_OPTIONS, ALERT_RULE_OPTIONS)
    return AlertsSettings(
        **settings,
        rules=MappingProxyType({k: AlertRuleSettings(**r) for k, r in rules.items()}),
    )


def _remediation(path: str, table: Any) -> RemediationSettings:
    settings, rules = _with_rules(
        path, "remediation", table, REMEDIATION_OPTIONS, REMEDIATION_RULE_OPTIONS
    )
    return RemediationSettings(
        **settings,
        rules=MappingProxyType({k: RemediationRuleSettings(**r) for k, r in rules.items()}),
    )


def _saturation_models(path: str, table: Any) -> dict[str, float]:
    """``[detectors.saturation.models]``: GPU model name -> its bidirectional ratio."""
    if not isinstance(table, dict):
        raise ConfigError(path, "detectors.saturation.models", "must be a table")
    ratio_option = Option("", float, None, "", FRACTION)
    models: dict[str, float] = {}
    for model, ratio in table.items():
        dotted = f"detectors.saturation.models.{display(model)}"
        problem = _text_problem(model)
        if problem or len(model) > 128:
            raise ConfigError(path, dotted, problem or "a model name of 128 characters at most")
        models[model] = _typed(path, dotted, ratio_option, ratio)
    return models


def _detectors(path: str, table: Any) -> DetectorsSettings:
    if not isinstance(table, dict):
        raise ConfigError(path, "detectors", "must be a table")
    for name in table:
        if name not in DETECTOR_SECTIONS:
            raise ConfigError(path, f"detectors.{display(name)}", "unknown detector")
    tables: dict[str, Mapping[str, Any]] = {}
    models = dict(_default_models())
    for name, options in DETECTOR_OPTIONS.items():
        section = table.get(name, {})
        if name == "saturation" and isinstance(section, dict) and "models" in section:
            section = dict(section)
            models.update(_saturation_models(path, section.pop("models")))
        tables[name] = _section(path, f"detectors.{name}", section, options)
    settings = DetectorsSettings(tables, models)
    for low, high in NVLINK_BANDS:
        if getattr(settings.nvlink, low) > getattr(settings.nvlink, high):
            raise ConfigError(path, f"detectors.nvlink.{low}", f"must be at most {high}")
    for low, high in ERROR_BANDS:
        if getattr(settings.errors, low) > getattr(settings.errors, high):
            raise ConfigError(path, f"detectors.errors.{low}", f"must be at most {high}")
    return settings


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


def load(path: str | Path, *, catalogue: SourceCatalogue) -> Config:
    """Read and validate a config file configuring the sources of ``catalogue``; every
    problem is a :class:`ConfigError`."""
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
        raise ConfigError(text_path, None, f"not valid TOML: {display(str(exc), 200)}") from None
    return from_mapping(data, text_path, catalogue=catalogue)


# -- the documents generated from the declarations -------------------------------------------


def _toml_value(value: Any) -> str:
    """A default as the file spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return repr(value)


def _allowed(option: Option) -> str:
    """The values the option's check accepts, in words; empty where the help says it."""
    return str(getattr(option.check, "allowed", ""))


def _source_options(info: SourceDeclaration) -> tuple[Option, ...]:
    """:data:`SOURCE_OPTIONS` as one source has them: its own interval, and what it reads."""
    return tuple(
        dataclasses.replace(o, default=info.default_interval)
        if o.key == "interval_seconds"
        else dataclasses.replace(o, help=f"run the source: {info.help}")
        if o.key == "enabled"
        else o
        for o in SOURCE_OPTIONS
    ) + _extra_options(info)


def _tables(catalogue: SourceCatalogue) -> Iterator[tuple[str, tuple[Option, ...]]]:
    """Every table with its options, in the order both documents follow."""
    yield "daemon", DAEMON_OPTIONS
    yield "roots", ROOT_OPTIONS
    for info in catalogue.values():
        yield f"sources.{info.name}", _source_options(info)
    yield "alerts", ALERT_OPTIONS
    yield "alerts.rules.<kind>", ALERT_RULE_OPTIONS
    for name, options in DETECTOR_OPTIONS.items():
        yield f"detectors.{name}", options
    yield "probe", PROBE_OPTIONS
    yield "slurm", SLURM_OPTIONS
    yield "remediation", REMEDIATION_OPTIONS
    yield "remediation.rules.<kind>", REMEDIATION_RULE_OPTIONS


def reference_markdown(catalogue: SourceCatalogue) -> str:
    """The configuration reference for the README, generated from the declarations and the
    specs of the sources of ``catalogue``."""
    lines = ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for table, options in _tables(catalogue):
        for o in options:
            shown = "—" if o.default is None else f"`{_toml_value(o.default)}`"
            allowed = _allowed(o) or "—"
            lines.append(
                f"| `{table}.{o.key}` | {o.kind.__name__} | {shown} | {allowed} | {o.help} |"
            )
    return "\n".join(lines) + "\n"


#: The sample's opening. Lines of prose in the sample start with "##", so that uncommenting
#: every "# key = value" and "# [table]" line gives a file that loads.
SAMPLE_HEADER = f"""\
# /etc/nodescope/nodescope.toml: the configuration of the nodescope daemon and its commands.
# Every key is optional and shown commented out at its default, with the values it accepts;
# the README's configuration reference lists the same keys. A value out of its bounds, an
# unknown key, or a file that is not a regular file of at most
# {CONFIG_FILE.max_bytes // fileio.KIB} KiB stops the daemon at start (exit status 2); on
# `systemctl reload` the running configuration is kept.
#
# Generated from the declarations in nodescope/config.py:
#   python -m nodescope.docgen --sample systemd/nodescope.toml
"""

#: What the sample says before the tables it names.
SAMPLE_NOTES: Mapping[str, str] = MappingProxyType(
    {
        "roots": "Where every source finds sysfs, procfs, /dev, the cgroup tree and /run; a"
        " fixture tree or a container's view of the host is just another set of roots.",
        "sources": "[sources.<name>]: one table per source. "
        + " ".join(f"{o.key}: {o.help}." for o in SOURCE_OPTIONS),
        "alerts": "Push alerts to Alertmanager (API v2), and the timing of every finding"
        " kind's alert; [alerts.rules.<kind>] sets one kind's.",
        "alerts.rules.<kind>": "[alerts.rules.<kind>]: one table per finding kind, every key"
        " optional; an unset key falls back to the built-in rule of the kind, then to the"
        " [alerts] defaults.",
        "detectors": "[detectors.<name>]: thresholds of the detectors. Rates are per second over"
        " the interval between a source's two latest reads; ratios are fractions of a link's"
        " capacity per direction after line encoding.",
        "detectors.saturation.models": "The bidirectional_ratio of a GPU model: a model matches"
        " when its key is part of the GPU's name.",
        "probe": "What `nodescope probe` must measure to pass (its exit status, for the Slurm"
        " prolog). Fractions are of the GPU's maximum PCIe capacity per direction after line"
        " encoding; asymmetries are |a→b − b→a| / mean of one GPU pair; 0 turns a minimum off.",
        "slurm": "The prolog/epilog hooks (nodescope slurm prolog|epilog), their socket to the"
        " daemon and the prolog's health gate. A gate key at 0, false or [] turns that check"
        " off.",
        "remediation": "What `nodescope slurm health` (Slurm's HealthCheckProgram) does about"
        " the daemon's firing alerts and the gate's failed checks: none, alert (shown, nothing"
        " done), drain (running jobs finish) or drain_requeue (the job the finding names is"
        " requeued too). A node is resumed only when nodescope drained it and every finding"
        " it drained for has cleared; a drain set by a person is never touched.",
        "remediation.rules.<kind>": "[remediation.rules.<kind>]: one table per finding kind,"
        " every key optional; an unset key falls back to the kind's built-in rule"
        " (gpu_xid_application never drains), then to the [remediation] defaults.",
    }
)

#: The finding kind the sample's example ``[alerts.rules.<kind>]`` table names.
SAMPLE_RULE_KIND = "pcie_contention"

_SAMPLE_WIDTH = 100
_SAMPLE_VALUE_COLUMN = 40


def _prose(text: str) -> list[str]:
    return ["## " + line for line in textwrap.wrap(text, _SAMPLE_WIDTH - 3)]


def _sample_option(option: Option, with_help: bool = True) -> list[str]:
    """An option as the sample shows it: its help, then its default commented out with the
    values it accepts beside it (above it when the line would be too long). An option
    without a default (an alert rule's, unset unless the file sets it) is prose only."""
    allowed = _allowed(option)
    if option.default is None:
        return _prose(f"{option.key}: {option.help}" + (f"; {allowed}" if allowed else ""))
    lines = _prose(option.help) if with_help else []
    value = f"# {option.key} = {_toml_value(option.default)}"
    if allowed:
        beside = f"{value.ljust(max(len(value) + 2, _SAMPLE_VALUE_COLUMN))}# {allowed}"
        if len(beside) <= _SAMPLE_WIDTH:
            value = beside
        else:
            lines += _prose(f"{option.key}: {allowed}")
    return [*lines, value]


def sample_toml(catalogue: SourceCatalogue) -> str:
    """The sample configuration file (``systemd/nodescope.toml``), generated from the
    declarations and the specs of the sources of ``catalogue``: every table, every key at
    its default."""
    out = [SAMPLE_HEADER.rstrip("\n")]
    noted: set[str] = set()

    def note(name: str) -> None:
        if name in SAMPLE_NOTES and name not in noted:
            noted.add(name)
            out.extend(["", *_prose(SAMPLE_NOTES[name])])

    for table, options in _tables(catalogue):
        group = table.split(".")[0]
        note(group)
        note(table)
        if group == "sources":
            name = table.removeprefix("sources.")
            out.extend(["", f"[{table}]", *_prose(catalogue[name].help)])
            for o in options:
                out.extend(_sample_option(o, with_help=False))
            continue
        header = f"[{table}]"
        if table == "alerts.rules.<kind>":
            header = f"# [alerts.rules.{SAMPLE_RULE_KIND}]"
        if table == "remediation.rules.<kind>":
            header = "# [remediation.rules.gpu_xid_application]"
        out.extend(["", header])
        for o in options:
            out.extend(_sample_option(o))
        if table == "detectors.saturation":
            out.extend(["", "[detectors.saturation.models]"])
            out.extend(_prose(SAMPLE_NOTES["detectors.saturation.models"]))
            out.extend(f'# "{model}" = {ratio!r}' for model, ratio in _default_models().items())
    return "\n".join(out) + "\n"
