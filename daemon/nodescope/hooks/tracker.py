"""The job tracker: what the daemon remembers between a job's prolog and its epilog.

The prolog registers a job (``<run>/nodescope/jobs/<id>.json``, read back by the ``jobs``
source), takes the counter baseline and runs the health gate; the epilog writes the job's
report (:mod:`nodescope_exporters.reports`) and removes the registration. When the daemon is
down, :mod:`nodescope.cli.slurm` calls the same functions with what it can read itself.
The registration goes whether or not the report could be written (a full disk must not keep
a finished job in ``nodescope_job_info``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescope.analysis import alert_json
from nodescope.config import Config
from nodescope.hooks.auth import Peer, prepare_directory
from nodescope.hooks.health import (
    Check,
    GateInputs,
    alert_check,
    count_dev_gpus,
    dev_gpu_minors,
    draining,
    gate_causes,
    gate_checks,
    merge_holders,
    missing_modules,
    nvml_holders,
    read_gate_state,
    unfit_reason,
    write_gate_state,
)
from nodescope.hooks.registrations import RegistrationRefused, cgroup_jobs_of, make_room
from nodescope.hooks.reports import JobWindow, build_report, collective_figures
from nodescope.hooks.request import JobRequest, holders_of
from nodescope.hooks.stops import problem_json, read_gate_stop, remove_gate_stop
from nodescope.hooks.transport import Request, Response, run_dir
from nodescope.model.alert import AlertState
from nodescope.model.collectives import TRACES
from nodescope.model.disks import DISKS, DisksData
from nodescope.model.infiniband import INFINIBAND, InfinibandData
from nodescope.model.job_records import REGISTRATION_FORMAT, registrations_dir
from nodescope.model.jobs import Job
from nodescope.model.nvml import NVML, NvmlData
from nodescope.model.snapshot import Snapshot
from nodescope.remediation.policy import Policy, Problem
from nodescope.roots import Roots
from nodescope.sources.base import read_optional
from nodescope.sources.diskstats import read_disks
from nodescope.sources.infiniband import read_infiniband
from nodescope_exporters.reports import (
    StaleReport,
    counter_sample,
    write_private,
    write_report,
)

#: One logger for every part of the hooks: its name is in each line operators search for.
log = logging.getLogger("nodescope.hooks")

#: Bounds of what the tracker remembers.
MAX_EPISODES = 20_000
#: A job window not seen and not registered for this long is forgotten.
FORGET_SECONDS = 3600.0
#: Finding kinds that are node-wide contention: a report lists their episodes whatever they
#: name, since a job shares the PCIe tree and the fabric with everything else on the node.
#: The kinds whose spec says ``contention`` (``nodescope.detectors.kinds``), written by
#: ``python -m nodescope.docgen --write-code`` and checked by the test suite.
# BEGIN generated contention-kinds
CONTENTION_KINDS = frozenset(
    {
        "ib_xmit_wait",
        "nvlink_bandwidth_saturation",
        "pcie_contention",
        "pcie_saturation",
    }
)
# END generated contention-kinds


# ---------------------------------------------------------------------------------------------
# Registrations: written by the prolog, removed by the epilog


def write_registration(
    roots: Roots, job: JobRequest, baseline: Mapping[str, Any], wall_time: float
) -> Path:
    document = {
        "format": REGISTRATION_FORMAT,
        "job_id": job.job_id,
        "uid": job.uid,
        "user": job.user,
        "partition": job.partition,
        "gpus": list(job.gpus),
        "node": job.node,
        "registered_at": wall_time,
        "baseline": dict(baseline),
    }
    prepare_directory(run_dir(roots))
    return write_private(
        registrations_dir(roots),
        f"{job.job_id}.json",
        (json.dumps(document, allow_nan=False) + "\n").encode(),
        0o640,
    )


def read_registration(roots: Roots, job_id: str) -> dict[str, Any] | None:
    text = read_optional(registrations_dir(roots) / f"{job_id}.json")
    if text is None:
        return None
    try:
        document = json.loads(text)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def remove_registration(roots: Roots, job_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(registrations_dir(roots) / f"{job_id}.json")


#: Actions of the remediation record a report lists: what was done to the node, or held.
REPORTED_ACTIONS = frozenset({"drain", "drain_requeue", "held", "resume"})
#: The prolog's own policy pass (a drain for firing alerts, or one held back) comes before the
#: job's registration by at most this long: it is the job's too.
PROLOG_SECONDS = 30.0


def actions_during(
    roots: Roots, node: str | None, start: float, end: float
) -> list[dict[str, Any]]:
    """What nodescope did to the job's node while the job was on it (drains during the job,
    from the daemon or ``nodescope slurm health``; drains held back, at the prolog too), from
    the remediation record. ``node``: the job's Slurm node (``None``: not known, every node of
    the record)."""
    # Imported here: the remediation record imports the hooks package, which imports this
    # module.
    from nodescope.remediation.state import read_record

    return [
        entry.as_json()
        for entry in read_record(roots).entries
        if start - PROLOG_SECONDS <= entry.time <= end
        and entry.action in REPORTED_ACTIONS
        and (node is None or entry.node == node)
    ]


def local_sample(roots: Roots, wall_time: float) -> dict[str, Any]:
    """The counters the hook can read without the daemon: InfiniBand ports and disks."""
    infiniband: InfinibandData | None
    disks: DisksData | None
    try:
        infiniband = read_infiniband(roots)
    except Exception:  # a counter file that cannot be parsed costs those figures only
        infiniband = None
    try:
        disks = read_disks(roots)
    except Exception:
        disks = None
    return counter_sample(None, infiniband, disks, wall_time)


# ---------------------------------------------------------------------------------------------
# The tracker: what the daemon remembers between prolog and epilog


@dataclass
class Episode:
    """A finding (or alert) over consecutive cycles: first and last wall time seen."""

    key: str
    kind: str
    severity: str
    subjects: dict[str, str]
    message: str
    first: float
    last: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "severity": self.severity,
            "subjects": dict(self.subjects),
            "message": self.message,
            "first": self.first,
            "last": self.last,
            "start": self.first,
            "end": self.last,
            "seconds": self.last - self.first,
        }


def _relevant(subjects: Mapping[str, str], job: str, gpus: set[str], bdfs: set[str]) -> bool:
    for role, name in subjects.items():
        if role == "job" and name == job:
            return True
        if role == "gpu" and name in gpus:
            return True
        if name in bdfs:
            return True
    return False


class JobTracker:
    """Fed every analysed snapshot by the service; answers the prolog and the epilog."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._lock = threading.Lock()
        self.latest: Snapshot | None = None
        self._xid_cleared: dict[str, int] | None = None
        self._open: dict[str, Episode] = {}
        self._closed: deque[Episode] = deque(maxlen=MAX_EPISODES)
        self._alerts_open: dict[str, Episode] = {}
        self._alerts_closed: deque[Episode] = deque(maxlen=MAX_EPISODES)
        self.windows: dict[str, JobWindow] = {}
        # Uncleared Xids recorded before this daemon started (NVML counts restart at zero).
        self._carried_xids: tuple[tuple[str, int, int], ...] = read_gate_state(config().roots) or ()
        self._recorded_xids: tuple[tuple[str, int, int], ...] | None = None

    # -- observation ---------------------------------------------------------------------
    def observe(self, snapshot: Snapshot) -> None:
        with self._lock:
            self.latest = snapshot
            now = snapshot.wall_time
            nvml = snapshot.latest(NVML)
            if self._xid_cleared is None and nvml is not None:
                self._xid_cleared = _xid_counts(nvml)
            self._track(
                self._open,
                self._closed,
                (
                    (f.key, f.kind, f.severity.label, dict(f.subjects), f.message)
                    for f in snapshot.findings
                ),
                now,
            )
            self._track(
                self._alerts_open,
                self._alerts_closed,
                (
                    (a.key, a.kind, a.severity.label, dict(a.subjects), a.message)
                    for a in snapshot.alerts
                    if a.state is AlertState.FIRING
                ),
                now,
            )
            self._observe_jobs(snapshot, now)
            # Under the lock: a clear-xids in between must not be overwritten by older Xids.
            self._record_xids(self.xid_inputs(), now)

    def _record_xids(self, xids: tuple[tuple[str, int, int], ...] | None, now: float) -> None:
        """Write the gate record when the uncleared Xids change (not every cycle)."""
        if xids is None or xids == self._recorded_xids:
            return
        try:
            write_gate_state(self._config().roots, xids, now)
        except OSError as exc:
            log.error("event=gate_state_not_written error=%r", str(exc))
            return
        self._recorded_xids = xids

    @staticmethod
    def _track(
        open_: dict[str, Episode],
        closed: deque[Episode],
        items: Iterable[tuple[str, str, str, dict[str, str], str]],
        now: float,
    ) -> None:
        seen: set[str] = set()
        for key, kind, severity, subjects, message in items:
            seen.add(key)
            episode = open_.get(key)
            if episode is None:
                open_[key] = Episode(key, kind, severity, subjects, message, now, now)
            else:
                episode.last = now
                episode.message = message
                if severity == "critical" or (severity == "warning" and episode.severity == "info"):
                    episode.severity = severity
        for key in [k for k in open_ if k not in seen]:
            closed.append(open_.pop(key))

    def _observe_jobs(self, snapshot: Snapshot, now: float) -> None:
        rates = snapshot.derived.gpu_rates
        pcie: dict[int, float] = {}
        if rates is not None:
            for gpu in rates.gpus:
                tx, rx = gpu.pcie_tx_bytes_per_second, gpu.pcie_rx_bytes_per_second
                if tx is not None or rx is not None:
                    pcie[gpu.index] = (tx or 0.0) + (rx or 0.0)
        traces = snapshot.latest(TRACES)
        for job in snapshot.derived.jobs:
            window = self.windows.get(job.job_id)
            if window is None:
                window = JobWindow(job.job_id, now, now)
                self.windows[job.job_id] = window
            window.last_seen = now
            window.gpus, window.gpu_source = job.gpus, job.gpu_source
            figures = traces.job(job.job_id) if traces is not None else None
            if figures is not None:
                window.collectives = collective_figures(figures)
            if not job.running:
                continue
            self._sample(window, job, pcie, now)
        for job_id in [j for j, w in self.windows.items() if now - w.last_seen > FORGET_SECONDS]:
            del self.windows[job_id]

    @staticmethod
    def _sample(window: JobWindow, job: Job, pcie: Mapping[int, float], now: float) -> None:
        stats = job.stats
        memory = stats.memory_current if stats is not None else None
        peaks = [
            v
            for v in (memory, stats.memory_peak if stats is not None else None, window.peak_memory)
            if v is not None
        ]
        window.peak_memory = max(peaks) if peaks else None
        window.memory_limit = job.memory_limit_bytes
        if stats is not None and stats.memory_events is not None:
            window.oom_kills = max(window.oom_kills, stats.memory_events.oom_kill or 0)
        gpu_rates = [pcie[g] for g in job.gpus if g in pcie]
        window.add_sample(
            now,
            {
                "memory_bytes": float(memory) if memory is not None else None,
                "gpu_pcie_bytes_per_second": sum(gpu_rates) if gpu_rates else None,
            },
        )

    # -- what the reports take -----------------------------------------------------------
    def _episodes(
        self, open_: Mapping[str, Episode], closed: Iterable[Episode], start: float, end: float
    ) -> list[Episode]:
        return [e for e in [*closed, *open_.values()] if e.last >= start and e.first <= end]

    def xid_inputs(self) -> tuple[tuple[str, int, int], ...] | None:
        snapshot = self.latest
        nvml = snapshot.latest(NVML) if snapshot is not None else None
        if nvml is None:
            return self._carried_xids or None
        cleared = self._xid_cleared or {}
        merged: dict[tuple[str, int], int] = {}
        for gpu, code, count in self._carried_xids:
            merged[(gpu, code)] = merged.get((gpu, code), 0) + count
        for key, count in _xid_counts(nvml).items():
            name, _, code_text = key.rpartition(":")
            moved = count - cleared.get(key, 0)
            if moved > 0:
                merged[(name, int(code_text))] = merged.get((name, int(code_text)), 0) + moved
        return tuple((gpu, code, n) for (gpu, code), n in sorted(merged.items()))

    def gate_inputs(self, config: Config) -> GateInputs:
        with self._lock:
            snapshot = self.latest
            nvml = snapshot.latest(NVML) if snapshot is not None else None
            if nvml is not None:
                count, source = nvml.device_count, "NVML"
                links: tuple[tuple[int, int | None, int | None, int | None], ...] | None = tuple(
                    (g.index, g.pcie_width_current, g.pcie_width_max, g.pcie_gen_current)
                    for g in nvml.gpus
                )
            else:
                count, source = count_dev_gpus(config.roots), f"{config.roots.dev}/nvidia devices"
                links = None
            return GateInputs(
                gpu_count=count,
                gpu_count_source=source,
                xids=self.xid_inputs(),
                links=links,
                missing_modules=missing_modules(config.roots, config.slurm.required_modules),
            )

    # -- commands ------------------------------------------------------------------------
    def node_gpus(self, config: Config) -> frozenset[int] | None:
        """The node's GPU indices: NVML's, else the minors of ``/dev/nvidia<N>``; ``None``
        when neither is known."""
        with self._lock:
            snapshot = self.latest
        nvml = snapshot.latest(NVML) if snapshot is not None else None
        if nvml is not None and nvml.gpus:
            return frozenset(g.index for g in nvml.gpus)
        minors = dev_gpu_minors(config.roots)
        return minors or None

    def prolog(self, request: Request, peer: Peer) -> Response:
        config = self._config()
        try:
            job = JobRequest.from_request(request, self.node_gpus(config))
        except ValueError as exc:
            return {"ok": False, "invalid": True, "error": str(exc),
                    "drains": bool(config.slurm.scontrol)}  # fmt: skip
        with self._lock:
            snapshot = self.latest
        now = time.time()
        sample = self._sample_counters(snapshot, config, now)
        checks = gate_checks(config.slurm, self.gate_inputs(config))
        policy = Policy.from_settings(config.remediation)
        firing = self.firing()
        alerts = alert_check(policy, firing)
        if not alerts.ok and request.get("hold_alerts") is True:
            # The hook ran the policy's pass: its cool-down or partition guard held the drain
            # back, so the alerts keep no job off this node either.
            alerts = Check(alerts.name, True, f"held back by the policy: {alerts.detail}")
            log.info("event=prolog_alerts_held job=%s detail=%r", job.job_id, alerts.detail)
        checks.append(alerts)
        reason = unfit_reason(checks)
        if alerts.detail.startswith("dry run"):
            log.info("event=prolog_dry_run job=%s says=%r", job.job_id, alerts.detail)
        causes = None if reason is None else gate_causes(checks, draining(policy, firing))
        refused: str | None = None
        if reason is None:
            # Registered only once fit: a job on the node is what lets the daemon drain it
            # during a job (:mod:`nodescope.hooks.jobdrain`), and a job the gate stops never
            # runs here (Slurm requeues it).
            try:
                make_room(config.roots, job.job_id, config.slurm, cgroup_jobs_of(snapshot), now)
            except RegistrationRefused as exc:
                refused = str(exc)
                log.warning("event=registration_refused job=%s why=%r", job.job_id, refused)
            else:
                write_registration(config.roots, job, sample, now)
        else:
            remove_registration(config.roots, job.job_id)
        log.info(
            "event=prolog job=%s uid=%s gpus=%s fit=%s%s",
            job.job_id,
            job.uid,
            ",".join(str(g) for g in job.gpus),
            reason is None,
            f" reason={reason!r}" if reason else "",
        )
        return {
            "ok": True,
            "fit": reason is None,
            "reason": reason,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
            # What the gate's drain is for, as `nodescope slurm health` will look for it:
            # the hook records the drain with them, so that health resumes the node once
            # they have cleared (null: the hook does not record it, a person resumes).
            "causes": None if causes is None else [problem_json(p) for p in causes],
            # Set when the job runs unregistered (the registrations cap): the hook says why.
            "registration_refused": refused,
            # A daemon without scontrol (a demo's) drains nothing, and neither does its hook.
            "drains": bool(config.slurm.scontrol),
        }

    def firing(self) -> list[Problem]:
        """The firing alerts of the last analysed cycle as the remediation policy takes
        them (the same conversion ``nodescope slurm health`` applies to them)."""
        # Imported here: the remediation's passes import the hooks package, which imports
        # this module.
        from nodescope.remediation.act import problems_from_alerts

        with self._lock:
            snapshot = self.latest
        if snapshot is None:
            return []
        return problems_from_alerts(
            alert_json(a) for a in snapshot.alerts if a.state is AlertState.FIRING
        )

    def _sample_counters(
        self, snapshot: Snapshot | None, config: Config, now: float
    ) -> dict[str, Any]:
        if snapshot is None:
            return local_sample(config.roots, now)
        return counter_sample(
            snapshot.latest(NVML),
            snapshot.latest(INFINIBAND),
            snapshot.latest(DISKS),
            now,
        )

    def epilog(self, request: Request, peer: Peer) -> Response:
        config = self._config()
        try:
            job = JobRequest.from_request(request, self.node_gpus(config))
            local_holders = holders_of(request.get("gpu_holders"))
        except ValueError as exc:
            return {"ok": False, "invalid": True, "error": str(exc),
                    "drains": bool(config.slurm.scontrol)}  # fmt: skip
        deadline = request.get("deadline")
        issued_at = request.get("issued_at")
        registration = read_registration(config.roots, job.job_id)
        gate_stop = read_gate_stop(config.roots, job.job_id)
        now = time.time()
        with self._lock:
            snapshot = self.latest
            # Taken out: observe() must not change what the report is being built from.
            window = self.windows.pop(job.job_id, None)
            start = registration.get("registered_at") if registration else None
            if not isinstance(start, int | float):
                start = window.first_seen if window is not None else None
            if start is None and gate_stop is not None:
                start = gate_stop.stopped_at
            if start is None:
                start = now
            gpus = set(job.gpus) or set(window.gpus if window is not None else ())
            nvml = snapshot.latest(NVML) if snapshot is not None else None
            bdfs = {g.pci_address for g in nvml.gpus if g.index in gpus} if nvml else set()
            names = {str(g) for g in gpus}
            findings = [
                e.as_dict()
                for e in self._episodes(self._open, self._closed, start, now)
                if _relevant(e.subjects, job.job_id, names, bdfs)
            ]
            alerts = [
                e.as_dict()
                for e in self._episodes(self._alerts_open, self._alerts_closed, start, now)
                if _relevant(e.subjects, job.job_id, names, bdfs)
            ]
            contention = [
                e.as_dict()
                for e in self._episodes(self._open, self._closed, start, now)
                if e.kind in CONTENTION_KINDS
            ]
        holders = merge_holders(local_holders, nvml_holders(config.roots, nvml, gpus))
        actions = actions_during(config.roots, job.node, start, now)
        sample = self._sample_counters(snapshot, config, now)
        report = build_report(
            job,
            registration,
            sample,
            now,
            daemon=True,
            window=window,
            findings=findings,
            alerts=alerts,
            contention=contention,
            holders=holders,
            issued_at=issued_at if isinstance(issued_at, int | float) else now,
            gate_stop=gate_stop,
            actions=actions,
        )
        path: Path | None = None
        problem = None
        try:
            path = write_report(
                Path(config.slurm.reports_dir),
                report,
                deadline if isinstance(deadline, int | float) else None,
            )
        except StaleReport as exc:
            # The hook has given up on us and done the epilog itself: change nothing.
            log.info("event=epilog_stale job=%s reason=%r", job.job_id, str(exc))
            return {"ok": False, "stale": True, "error": str(exc)}
        except OSError as exc:
            problem = f"report not written: {exc}"
            log.error("event=report_failed job=%s error=%r", job.job_id, str(exc))
        # The job has ended whether or not its report could be written: a registration left
        # behind would keep it in nodescope_job_info for good.
        remove_registration(config.roots, job.job_id)
        remove_gate_stop(config.roots, job.job_id)
        with self._lock:
            self.windows.pop(job.job_id, None)  # observe() may have seen the job meanwhile
        verdict = report["verdict"]
        log.info(
            "event=epilog job=%s report=%s ok=%s%s%s",
            job.job_id,
            path,
            verdict["ok"],
            "" if gate_stop is None else f" gate_stopped_at={gate_stop.stopped_at}",
            f" reason={verdict['reason']!r}" if verdict["reason"] else "",
        )
        return {
            "ok": True,
            "report": None if path is None else str(path),
            "report_error": problem,
            "verdict": verdict,
            "gpu_holders": holders,
            "drains": bool(config.slurm.scontrol),
        }

    def clear_xids(self, request: Request, peer: Peer) -> Response:
        with self._lock:
            snapshot = self.latest
            nvml = snapshot.latest(NVML) if snapshot is not None else None
            self._xid_cleared = _xid_counts(nvml) if nvml is not None else None
            self._carried_xids = ()
            self._recorded_xids = None
            self._record_xids(self.xid_inputs() or (), time.time())
        log.info("event=xids_cleared uid=%d pid=%d", peer.uid, peer.pid)
        return {"ok": True}


def _xid_counts(nvml: NvmlData) -> dict[str, int]:
    counts: dict[str, int] = {}
    for xid in nvml.xids:
        key = f"{xid.gpu if xid.gpu is not None else xid.pci_address}:{xid.xid}"
        counts[key] = counts.get(key, 0) + xid.count
    return counts
