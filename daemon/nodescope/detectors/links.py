"""A device against its own PCIe link: saturation, and downtraining under load.

Input: the attribution of the snapshot's traffic (each endpoint's bytes per direction and
the link directly above it, figures of the narrower end: ``docs/datasources.md`` §2.3, §2.5)
and, for GPUs, NVML's current and maximum link generation and width (§1.5).

``pcie_saturation`` (GPUs): the GPU's traffic fills its link. Two measures, either suffices:

* both directions together over twice the per-direction capacity, against the GPU model's
  ratio (``[detectors.saturation.models]``, a key matching part of the GPU's name, else
  ``bidirectional_ratio``). The seeds measured an A100 on a Gen4 x16 link saturating at
  38 of 63 GB/s both ways (0.60): the default 0.57 reports it at 95 % of that point. That
  point was measured at 16 GT/s: the default applies to links running at Gen4 or slower;
  on faster links only a model named in the table has a bidirectional point (an H100
  moving 46 GB/s each way to its NIC over Gen5, GPUDirect RDMA at line rate, is busy, not
  saturated);
* one direction over the per-direction capacity, against ``one_way_ratio``.

``value`` is the larger of the two measures divided by its own threshold, so the raise
threshold is 1 and a ``clear_below`` is a fraction of the saturation point.

``pcie_link_downtrained`` (every data-moving class): the link trained below the speed or the
width both its ends support while the device moves at least ``min_bytes_per_second``. GPUs
lower their link speed when idle to save power (nvidia-smi: "may be reduced when the GPU is
not in use"), so an idle link below its maximum is no finding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodescope.alerts import AlertRule
from nodescope.config import DowntrainingSettings, SaturationSettings
from nodescope.detectors.common import (
    emit_floor,
    gb,
    jobs,
    jobs_of_gpus,
    tcp_evidence,
    tcp_text,
)
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.attribution import TRAFFIC_CLASSES, Attribution, Direction, EndpointLoad
from nodescope.model.finding import THRESHOLD, VALUE, Finding, Severity
from nodescope.model.nvml import NVML, GpuSample
from nodescope.model.snapshot import Snapshot
from nodescope.model.topology import DeviceClass, UpstreamLink, generation_of

SATURATION = "pcie_saturation"
#: Its alert rule, declared here because :func:`detect_saturation` reports the keep band down
#: to ``clear_below``: a firing alert holds while the endpoint stays at 90 % of its
#: saturation point.
SATURATION_RULE = AlertRule(for_seconds=30.0, resolve_after_seconds=60.0, clear_below=0.9)
DOWNTRAINED = "pcie_link_downtrained"
_SIGNAL = (
    "GPU PCIe bytes from NVML fields 197/198 (or the 20 ms throughput call); NVML current and"
    " maximum PCIe generation and width"
)
#: The link speed the default bidirectional saturation point was measured at (Gen4).
MEASURED_SPEED_GTS = 16.0

SATURATION_SPEC = FindingKind(
    SATURATION,
    severities(Severity.WARNING),
    actions(warning="alert"),
    meaning="a GPU moves as many PCIe bytes as its model saturates at (its link's"
    " generation and width counted)",
    signal=_SIGNAL,
    hardware="yes",
    alert=SATURATION_RULE,
    contention=True,
)
DOWNTRAINED_SPEC = FindingKind(
    DOWNTRAINED,
    severities(Severity.WARNING),
    actions(warning="alert"),
    meaning="a GPU under load runs its PCIe link below the generation or width it and the"
    " slot support",
    signal=_SIGNAL,
    hardware="yes",
)
SPECS = (SATURATION_SPEC, DOWNTRAINED_SPEC)


def model_ratio(name: str, models: dict[str, float], default: float) -> tuple[float, str | None]:
    """The bidirectional saturation ratio of a GPU model: the longest key of ``models`` that
    is part of ``name`` (case-insensitive), else ``default``; with the key that matched."""
    lowered = name.lower()
    matches = [key for key in models if key and key.lower() in lowered]
    if not matches:
        return default, None
    key = max(matches, key=len)
    return models[key], key


def _link_text(link: UpstreamLink | None) -> str:
    if link is None or link.current_speed_gts is None:
        return "its link"
    gen = generation_of(link.current_speed_gts)
    text = f"Gen{gen}" if gen is not None else f"{link.current_speed_gts:g} GT/s"
    if link.current_width is not None:
        text += f" x{link.current_width}"
    if link.capacity_bytes_per_s is not None:
        text += f", {gb(link.capacity_bytes_per_s)} per direction"
    return f"its link ({text})"


def _owner(bdf: str, jobs_by_bdf: dict[str, list[str]]) -> str:
    job = jobs_by_bdf.get(bdf)
    return f"; job {', '.join(job)}" if job else ""


def saturation(
    endpoints: tuple[EndpointLoad, ...],
    gpus: dict[str, GpuSample],
    bidirectional_ratio: float,
    one_way_ratio: float,
    models: dict[str, float],
    floor: float = 1.0,
    jobs_by_bdf: dict[str, list[str]] | None = None,
    extra_evidence: dict[str, float] | None = None,
) -> list[Finding]:
    """``pcie_saturation`` for every GPU endpoint whose load reaches ``floor`` (1 = the
    saturation point) of either measure. ``gpus`` maps BDF to the NVML record."""
    owners = jobs_by_bdf or {}
    findings: list[Finding] = []
    for load in endpoints:
        flow = load.flow
        if flow.device_class is not DeviceClass.GPU:
            continue
        both = load.bidirectional_utilisation
        down = load.utilisation(Direction.DOWNSTREAM)
        up = load.utilisation(Direction.UPSTREAM)
        if both is None or down is None or up is None:
            continue
        gpu = gpus.get(flow.bdf)
        name = gpu.name if gpu is not None else ""
        ratio, model = model_ratio(name, models, bidirectional_ratio)
        speed = load.link.current_speed_gts if load.link is not None else None
        measured_here = model is not None or (speed is not None and speed <= MEASURED_SPEED_GTS)
        one_way = max(down, up)
        value = one_way / one_way_ratio
        if measured_here:
            value = max(value, both / ratio)
        if value < floor:
            continue
        capacity = load.capacity_bytes_per_second or 0.0
        evidence = {
            VALUE: value,
            THRESHOLD: 1.0,
            "bidirectional_utilisation_ratio": both,
            "bidirectional_threshold_ratio": ratio,
            "one_way_utilisation_ratio": one_way,
            "one_way_threshold_ratio": one_way_ratio,
            "downstream_bytes_per_second": flow.downstream_bytes_per_second,
            "upstream_bytes_per_second": flow.upstream_bytes_per_second,
            "capacity_bytes_per_second": capacity,
            **(extra_evidence or {}),
        }
        label = f"GPU {gpu.index}" if gpu is not None else flow.name
        what = f" {name}" if name else ""
        basis = f"for {model}" if model else "by default"
        point = (
            f"saturation at {ratio:.0%} {basis}"
            if measured_here
            else "no bidirectional saturation point known at this link speed"
        )
        message = (
            f"{label} ({flow.bdf},{what}) saturates {_link_text(load.link)}:"
            f" H2D {gb(flow.downstream_bytes_per_second)} + D2H"
            f" {gb(flow.upstream_bytes_per_second)} = {gb(flow.total_bytes_per_second)} of"
            f" {gb(2 * capacity)} both ways ({both:.0%}; {point}),"
            f" busier direction {one_way:.0%} (at {one_way_ratio:.0%})"
            f"{_owner(flow.bdf, owners)}{tcp_text(extra_evidence or {})}"
        )
        subjects = {"device": flow.bdf}
        if gpu is not None:
            subjects["gpu"] = str(gpu.index)
        findings.append(Finding(SATURATION, Severity.WARNING, subjects, evidence, message))
    return findings


def _below_max(
    cur: float | int | None, top: float | int | None
) -> tuple[bool, float | None, float | None]:
    if cur is None or top is None:
        return False, None, None
    return cur < top, float(cur), float(top)


def downtraining(
    attribution: Attribution,
    gpus: dict[str, GpuSample],
    min_bytes_per_second: float,
    jobs_by_bdf: dict[str, list[str]] | None = None,
    extra_evidence: dict[str, float] | None = None,
) -> list[Finding]:
    """``pcie_link_downtrained`` for every endpoint under load whose link (sysfs, narrower
    end) or, for GPUs, NVML's view of it runs below its maximum speed or width."""
    owners = jobs_by_bdf or {}
    findings: list[Finding] = []
    for load in attribution.endpoints:
        flow = load.flow
        if flow.device_class not in TRAFFIC_CLASSES:
            continue
        traffic = flow.total_bytes_per_second
        if traffic < min_bytes_per_second:
            continue
        link = load.link
        gpu = gpus.get(flow.bdf)
        speed_down, cur_speed, max_speed = _below_max(
            link.current_speed_gts if link else None, link.max_speed_gts if link else None
        )
        width_down, cur_width, max_width = _below_max(
            link.current_width if link else None, link.max_width if link else None
        )
        cur_gen = None if cur_speed is None else generation_of(cur_speed)
        max_gen = None if max_speed is None else generation_of(max_speed)
        if gpu is not None:
            # NVML's maximum is "possible with this device and system": the slot counts too.
            nvml_gen_down, g_cur, g_max = _below_max(gpu.pcie_gen_current, gpu.pcie_gen_max)
            nvml_width_down, w_cur, w_max = _below_max(gpu.pcie_width_current, gpu.pcie_width_max)
            if nvml_gen_down and not speed_down:
                speed_down = True
                cur_gen = None if g_cur is None else int(g_cur)
                max_gen = None if g_max is None else int(g_max)
            if nvml_width_down and not width_down:
                width_down, cur_width, max_width = True, w_cur, w_max
        if not (speed_down or width_down):
            continue
        evidence: dict[str, float] = {
            "bytes_per_second": traffic,
            "downstream_bytes_per_second": flow.downstream_bytes_per_second,
            "upstream_bytes_per_second": flow.upstream_bytes_per_second,
        }
        if cur_gen is not None and max_gen is not None:
            evidence["current_generation"] = float(cur_gen)
            evidence["max_generation"] = float(max_gen)
        if cur_speed is not None and max_speed is not None:
            evidence["current_speed_gts"] = cur_speed
            evidence["max_speed_gts"] = max_speed
        if cur_width is not None and max_width is not None:
            evidence["current_width_lanes"] = cur_width
            evidence["max_width_lanes"] = max_width
        if link is not None and link.capacity_bytes_per_s is not None:
            evidence["capacity_bytes_per_second"] = link.capacity_bytes_per_s
        if link is not None and link.max_capacity_bytes_per_s is not None:
            evidence["max_capacity_bytes_per_second"] = link.max_capacity_bytes_per_s
        evidence.update(extra_evidence or {})

        def trained(gen: int | None, width: float | None) -> str:
            g = f"Gen{gen}" if gen is not None else "?"
            return f"{g} x{int(width)}" if width is not None else g

        label = f"GPU {gpu.index} ({flow.bdf})" if gpu is not None else f"{flow.name} ({flow.bdf})"
        upper = f" below {link.upstream}" if link is not None else ""
        message = (
            f"{label} link{upper} trained at {trained(cur_gen, cur_width)} of"
            f" {trained(max_gen, max_width)} while moving {gb(traffic)}"
            + (
                f" (capacity {gb(link.capacity_bytes_per_s)} of"
                f" {gb(link.max_capacity_bytes_per_s)} per direction)"
                if link is not None
                and link.capacity_bytes_per_s is not None
                and link.max_capacity_bytes_per_s is not None
                else ""
            )
            + f"{_owner(flow.bdf, owners)}{tcp_text(extra_evidence or {})}"
        )
        subjects = {"device": flow.bdf}
        if gpu is not None:
            subjects["gpu"] = str(gpu.index)
        findings.append(Finding(DOWNTRAINED, Severity.WARNING, subjects, evidence, message))
    return findings


def _gpus(snapshot: Snapshot) -> dict[str, GpuSample]:
    nvml = snapshot.latest(NVML)
    return {} if nvml is None else {g.pci_address: g for g in nvml.gpus}


@dataclass(frozen=True, slots=True)
class SaturationInputs:
    """``[detectors.saturation]``, its per-GPU-model ratios (``[detectors.saturation.models]``)
    and the least value that keeps this kind's firing alert firing (its rule's
    ``clear_below`` as configured; ``None``: none)."""

    settings: SaturationSettings
    models: Mapping[str, float]
    keep_below: float | None


def detect_saturation(
    previous: Snapshot | None, snapshot: Snapshot, inputs: SaturationInputs
) -> list[Finding]:
    settings = inputs.settings
    if not settings.enabled:
        return []
    attribution = snapshot.derived.attribution
    if attribution is None:
        return []
    return saturation(
        attribution.endpoints,
        _gpus(snapshot),
        settings.bidirectional_ratio,
        settings.one_way_ratio,
        dict(inputs.models),
        floor=emit_floor(inputs.keep_below, 1.0),
        jobs_by_bdf=jobs_of_gpus(jobs(snapshot)),
        extra_evidence=tcp_evidence(snapshot),
    )


def detect_downtraining(
    previous: Snapshot | None, snapshot: Snapshot, settings: DowntrainingSettings
) -> list[Finding]:
    if not settings.enabled:
        return []
    attribution = snapshot.derived.attribution
    if attribution is None:
        return []
    return downtraining(
        attribution,
        _gpus(snapshot),
        settings.min_bytes_per_second,
        jobs_by_bdf=jobs_of_gpus(jobs(snapshot)),
        extra_evidence=tcp_evidence(snapshot),
    )
