"""``nodescope slurm prolog|epilog|clear-xids``: the Slurm hooks.

slurmd runs Prolog/Epilog as root with no PATH and the job in the environment
(``SLURM_JOB_ID``, ``SLURM_JOB_UID``, ``SLURM_JOB_USER``, ``SLURM_JOB_PARTITION``,
``SLURM_JOB_GPUS`` as global indices, ``SLURMD_NODENAME``, ``SLURM_CONF``; the epilog also
``SLURM_JOB_EXIT_CODE``). A non-zero exit drains the node, so these fail only on purpose:

* prolog: the daemon registers the job, takes the counter baseline and runs the health gate;
  when the node is unfit, the reason is printed as one line, the node is drained with it
  (``scontrol update ... state=drain reason=...``, since slurmd itself would say only "Prolog
  error") and the exit status is 1. With ``[slurm] run_probe`` the quick probe runs too, when
  it is installed. A stopped job's registration goes and a record of when and why it was
  stopped takes its place (:mod:`nodescope.hooks.stops`), for its epilog. A drain for what
  ``nodescope slurm health`` watches too (the daemon's firing alerts, the checks it runs
  itself) is recorded as nodescope's in the remediation record, so that health resumes the
  node once those have cleared; one for the probe or a link check is left to a person. When
  the daemon's firing alerts alone fail the gate, the hook runs the remediation policy's pass
  for them (:func:`nodescope.remediation.act.remediate`): it drains with the policy's reason,
  or its cool-down or partition guard holds the drain back and the job runs.
* epilog: processes still holding one of the job's GPUs are looked for (``/proc/*/fd``), the
  daemon writes the job's report; GPUs still held fail the epilog the same way. The report of
  a job the gate stopped says so, with the gate's time and reason, and fails its verdict; the
  epilog of such a job does not drain the node again (the prolog did).

The daemon is asked over its socket with a deadline of ``[slurm] timeout_seconds`` (≤ 2 s),
which travels with the request: a daemon that reads it late drops it. When the daemon does not
answer, the hook does what it can itself — registration with the counters it can read, the
local gate checks (GPU devices, kernel modules, and the uncleared Xids the daemon last recorded
in ``<run>/nodescope/gate-state.json``), a report without NVML figures. A daemon out of reach
therefore never fails a job by itself, and never passes a node it had found unfit. When the
daemon answers that the request is invalid (a GPU Slurm assigned that the node does not have),
the prolog fails: Slurm and the node disagree about the node. Exit statuses: 0 fit, 1 unfit
(drained). A daemon that drains nothing (``[slurm] scontrol`` empty, a demo's) answers
``"drains": false``, and the hook that asked it then drains nothing either.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nodescope import assembly
from nodescope.cli.common import roots_from_args
from nodescope.config import Config
from nodescope.errors import ConfigError
from nodescope.hooks.health import (
    Check,
    gate_causes,
    gate_checks,
    gate_state_path,
    gpu_holders,
    local_gate_inputs,
    unfit_reason,
    write_gate_state,
)
from nodescope.hooks.registrations import RegistrationRefused, make_room
from nodescope.hooks.reports import build_report
from nodescope.hooks.request import JobRequest
from nodescope.hooks.stops import (
    GateStop,
    checks_of,
    problems_of,
    read_gate_stop,
    record_gate_drain,
    remove_gate_stop,
    write_gate_stop,
)
from nodescope.hooks.tracker import (
    actions_during,
    local_sample,
    read_registration,
    remove_registration,
    write_registration,
)
from nodescope.hooks.transport import HookUnavailable, call, socket_path
from nodescope.remediation.gateway import Applied, Verb, apply, drain_text
from nodescope.remediation.policy import Problem
from nodescope.remediation.slurm import Scontrol
from nodescope.text import sanitize
from nodescope_exporters.reports import StaleReport, write_report

DEFAULT_CONFIG = "/etc/nodescope/nodescope.toml"
#: The prolog waits at most this long for the quick probe.
PROBE_TIMEOUT_SECONDS = 60.0
#: How long the prolog waits for the remediation record (a health run may hold it): the
#: drain is done by then, only its record would be missing.
GATE_RECORD_WAIT_SECONDS = 1.0
#: The longest one scontrol call of the gate's policy pass may take (a job launch waits).
GATE_SCONTROL_SECONDS = 5.0


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "slurm",
        help="Slurm hooks: prolog (register, health gate), epilog (job report)",
        description="Slurm Prolog/Epilog hooks: prolog registers the job and runs the health"
        " gate (exit 1 with a one-line reason drains the node); epilog writes the job's report"
        " (exit 1 when a process still holds one of its GPUs).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, func, text in (
        ("prolog", prolog, "register the job and run the health gate (exit 1: unfit)"),
        ("epilog", epilog, "write the job's report (exit 1: a GPU is still held)"),
        ("clear-xids", clear_xids, "accept the Xids seen so far, after checking the node"),
    ):
        sub = actions.add_parser(name, parents=parents, help=text, description=text)
        sub.add_argument(
            "--config",
            metavar="FILE",
            help=f"TOML configuration file (default: {DEFAULT_CONFIG} when it exists)",
        )
        sub.set_defaults(func=func)
    _register_health(actions, parents)


def _config(args: argparse.Namespace) -> Config:
    path = args.config or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None)
    config = assembly.load(path) if path else assembly.default_config()
    return replace(config, roots=roots_from_args(args, config.roots))


def _say(message: str) -> None:
    # The message may hold a process name, a path or an error a user caused.
    print(sanitize(message), file=sys.stderr, flush=True)


def drain(config: Config, reason: str) -> Applied | None:
    """Drain this node with ``reason`` through the gateway (dry run, cool-down, partition
    guard); ``None`` when nodescope cannot drain here (no scontrol or no node name: Slurm
    drains the node itself on the hook's exit 1)."""
    node = os.environ.get("SLURMD_NODENAME") or ""
    if not config.remediation.dry_run and (not config.slurm.scontrol or not node):
        return None
    timeout = min(config.remediation.scontrol_timeout_seconds, GATE_SCONTROL_SECONDS)
    applied = apply(config, Verb.DRAIN, node, reason, tool=Scontrol(config.slurm.scontrol, timeout))
    if not applied.done:
        _say(f"nodescope: {applied.describe()}")
    return applied


def _holds(applied: Applied | None) -> bool:
    """Whether the drain was held back (a dry run, the cool-down, the partition guard): the
    hook then exits 0, since Slurm drains the node itself on any other status."""
    return applied is not None and (applied.dry_run or bool(applied.held))


def _prepare(args: argparse.Namespace) -> tuple[Config, JobRequest] | None:
    try:
        config = _config(args)
    except ConfigError as exc:
        _say(f"nodescope: {exc}; hook skipped")
        return None
    try:
        job = JobRequest.from_environ(os.environ)
    except ValueError as exc:
        _say(f"nodescope: {exc}; hook skipped")
        return None
    return config, job


def _probe(config: Config) -> str | None:
    """The quick probe's failure reason, or ``None`` (passed, or not installed)."""
    if importlib.util.find_spec("nodescope.cli.probe") is None:
        return None
    timeout = min(PROBE_TIMEOUT_SECONDS, config.probe.timeout_seconds)
    argv = [sys.executable, "-m", "nodescope.cli.main", "probe", "--quick"]
    if config.path:
        argv += ["--config", config.path]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"nodescope: probe did not finish in {timeout:.0f} s"
    except OSError as exc:
        _say(f"nodescope: probe not run: {exc}")
        return None
    if result.returncode == 0:
        return None
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    last = lines[-1].strip() if lines else f"exit status {result.returncode}"
    return f"nodescope: probe failed: {last}"[:200]


@dataclass
class _Gate:
    """The gate's answer: ``reason`` (``None``: fit), its checks, and ``causes``, what a drain
    is for as ``nodescope slurm health`` will look for it (``None``: a drain health cannot see
    clear — the probe, a refused request, a link check — left to a person)."""

    reason: str | None
    checks: tuple[Check, ...] = ()
    causes: list[Problem] | None = None
    #: False when the daemon answered that it drains nothing ([slurm] scontrol empty)
    drains: bool = True


def _daemon_gate(config: Config, job: JobRequest, hold_alerts: bool = False) -> _Gate:
    """The daemon's gate (it registers the job when fit); :class:`HookUnavailable` when it
    does not answer. ``hold_alerts``: the policy held back the drain its firing alerts call
    for, so they do not fail the gate."""
    request = {"command": "prolog", **job.as_request()}
    if hold_alerts:
        request["hold_alerts"] = True
    response = call(socket_path(config.roots), request, config.slurm.timeout_seconds)
    if not response.get("ok") and response.get("invalid"):
        return _Gate(
            f"nodescope: prolog refused: {response.get('error')}"[:200],
            drains=response.get("drains") is not False,
        )
    if not response.get("ok"):
        raise HookUnavailable(str(response.get("error")))
    refused = response.get("registration_refused")
    if isinstance(refused, str):
        _say(refused[:300])
    return _Gate(
        response.get("reason") if not response.get("fit", True) else None,
        checks_of(response.get("checks")),
        problems_of(response.get("causes")),
        response.get("drains") is not False,
    )


def _without_drains(config: Config) -> Config:
    """``config`` without scontrol: the daemon asked drains nothing (a demo's, whose node is
    simulated), so the hook asking it leaves the host's Slurm alone too."""
    return replace(config, slurm=replace(config.slurm, scontrol=""))


def _local_gate(config: Config, job: JobRequest) -> _Gate:
    """The checks the hook runs itself (it registers the job when fit)."""
    checks = tuple(gate_checks(config.slurm, local_gate_inputs(config)))
    reason = unfit_reason(checks)
    if reason is not None:
        return _Gate(reason, checks, gate_causes(checks, ()))
    now = time.time()
    try:
        # The daemon is not answering: no cgroup view to expire by, only the cap's check.
        make_room(config.roots, job.job_id, config.slurm, None, now)
        write_registration(config.roots, job, local_sample(config.roots, now), now)
    except RegistrationRefused as err:
        _say(str(err))
    except OSError as err:
        _say(f"nodescope: cannot register job {job.job_id}: {err}")
    return _Gate(None, checks)


def _alerts_by_policy(config: Config, node: str, causes: list[Problem]) -> tuple[str, str]:
    """The remediation pass for a gate that failed on firing alerts alone, as ``nodescope
    slurm health`` would run it: ``("drained", reason)`` when it drained the node (with the
    policy's reason); ``("held", why)`` when the policy held the drain back (cool-down,
    partition guard): the job may run, as on every other node the guard keeps in service;
    ``("unreachable", why)`` when Slurm did not answer, ``("failed", why)`` otherwise: the gate
    fails as decided."""
    from nodescope.remediation.act import remediate
    from nodescope.remediation.policy import StepKind
    from nodescope.remediation.slurm import Scontrol, SlurmError

    timeout = min(config.remediation.scontrol_timeout_seconds, GATE_SCONTROL_SECONDS)
    try:
        outcome = remediate(
            config, causes, node, complete=False, source="prolog",
            scontrol=Scontrol(config.slurm.scontrol, timeout),
        )  # fmt: skip
    except SlurmError as exc:
        return "unreachable", str(exc)
    except OSError as exc:  # the record busy or refused
        return "failed", str(exc)
    failed = [entry.error for entry in outcome.entries if not entry.ok]
    if failed:
        return "failed", failed[0]
    drain = outcome.decision.drain
    if drain is not None:
        return "drained", drain.reason
    held = [s for s in outcome.decision.steps if s.action is StepKind.HELD]
    if held:
        return "held", held[0].why
    return "failed", "the policy neither drained nor held the node"


def prolog(args: argparse.Namespace) -> int:
    prepared = _prepare(args)
    if prepared is None:
        return 0
    config, job = prepared
    try:
        gate = _daemon_gate(config, job)
    except HookUnavailable as exc:
        _say(f"nodescope: daemon not answering ({exc}); local checks only")
        gate = _local_gate(config, job)
    if not gate.drains:
        config = _without_drains(config)
    # Whether the node is drained already (by the policy's pass), or Slurm did not answer it
    # (a drain of our own would only wait as long again: Slurm drains on exit 1 anyway).
    drained = slurm_down = False
    failed = {c.name for c in gate.checks if not c.ok}
    if (
        gate.reason is not None
        and failed == {"alerts"}
        and gate.causes
        and job.node
        and config.slurm.scontrol
    ):
        # Firing alerts alone failed the gate: the policy's guards decide, as for any drain.
        outcome, text = _alerts_by_policy(config, job.node, gate.causes)
        if outcome == "drained":
            gate.reason, drained = text, True
        elif outcome == "held":
            _say(f"nodescope: drain held back ({text}): the job runs")
            try:
                gate = _daemon_gate(config, job, hold_alerts=True)
            except HookUnavailable:
                gate = _local_gate(config, job)
        else:
            _say(f"nodescope: the policy could not be applied ({text}); the gate fails")
            slurm_down = outcome == "unreachable"
    if gate.reason is None and config.slurm.run_probe:
        probe = _probe(config)
        if probe is not None:
            gate = _Gate(probe, gate.checks)
    if gate.reason is None:
        # A record left by an earlier start of this job (requeued) is not about this one.
        remove_gate_stop(config.roots, job.job_id)
        return 0
    # One form of the reason for the drain, the record of the stop and the job's output: the
    # one the gateway hands to scontrol.
    reason = drain_text(gate.reason)
    applied = None
    if not (drained or slurm_down):
        applied = drain(config, reason)
        if _holds(applied):
            # Held back (or a dry run): the job runs, as on a node the gate passed.
            _say(f"nodescope: the gate failed ({reason}), the drain is held back: the job runs")
            now = time.time()
            try:
                write_registration(config.roots, job, local_sample(config.roots, now), now)
            except OSError as err:
                _say(f"nodescope: cannot register job {job.job_id}: {err}")
            remove_gate_stop(config.roots, job.job_id)
            return 0
    # The job will not run here: it has no registration, and its epilog finds instead when
    # and why it was stopped, for its report.
    stopped_at = time.time()
    remove_registration(config.roots, job.job_id)
    try:
        write_gate_stop(config.roots, GateStop(job.job_id, stopped_at, reason, gate.checks))
    except OSError as err:
        _say(f"nodescope: cannot record why job {job.job_id} was stopped: {err}")
    print(sanitize(reason), flush=True)
    if drained or slurm_down:
        return 1  # drained and recorded by the policy's pass, or Slurm is not answering
    causes = gate.causes
    if applied is not None and applied.done and causes and job.node:
        try:
            record_gate_drain(
                config.roots, job.node, reason, causes, stopped_at, GATE_RECORD_WAIT_SECONDS
            )
        except OSError as err:
            _say(f"nodescope: drain of {job.node} not recorded: {err}")
    return 1


def epilog(args: argparse.Namespace) -> int:
    prepared = _prepare(args)
    if prepared is None:
        return 0
    config, job = prepared
    holders = gpu_holders(config.roots, job.gpus)
    verdict: dict[str, Any]
    issued_at = time.time()
    try:
        response = call(
            socket_path(config.roots),
            {"command": "epilog", **job.as_request(), "gpu_holders": holders,
             "issued_at": issued_at},
            config.slurm.timeout_seconds,
        )  # fmt: skip
        if not response.get("ok"):
            raise HookUnavailable(str(response.get("error")))
        if response.get("drains") is False:
            config = _without_drains(config)
        if response.get("report_error"):
            _say(f"nodescope: job {job.job_id}: {response['report_error']}")
        verdict = response.get("verdict") or {"ok": True, "reason": None}
        held = bool(response.get("gpu_holders"))
    except HookUnavailable as exc:
        _say(f"nodescope: daemon not answering ({exc}); writing a local report")
        now = time.time()
        registration = read_registration(config.roots, job.job_id) or {}
        gate_stop = read_gate_stop(config.roots, job.job_id)
        start = registration.get("registered_at")
        if not isinstance(start, int | float):
            start = gate_stop.stopped_at if gate_stop is not None else None
        report = build_report(
            job, registration, local_sample(config.roots, now), now, daemon=False,
            holders=holders, issued_at=issued_at, gate_stop=gate_stop,
            actions=actions_during(config.roots, job.node, start, now) if start else (),
        )  # fmt: skip
        try:
            write_report(Path(config.slurm.reports_dir), report)
        except StaleReport as err:
            _say(f"nodescope: {err}; kept it")
        except OSError as err:
            _say(f"nodescope: cannot write the report of job {job.job_id}: {err}")
        finally:
            # The job has ended, report or not: its registration must not outlive it.
            remove_registration(config.roots, job.job_id)
            remove_gate_stop(config.roots, job.job_id)
        verdict = report["verdict"]
        held = bool(report["gpu_holders"])
    if verdict.get("ok", True):
        return 0
    reason = str(verdict.get("reason") or f"nodescope: job {job.job_id} epilog failed")
    print(sanitize(reason), flush=True)
    if not held:
        # The prolog gate stopped the job: the node is drained already, with the gate's
        # reason, which a second drain would only overwrite.
        return 0
    if _holds(drain(config, reason)):
        return 0  # a dry run, or the guards held the drain back: so must the exit status
    return 1


def clear_xids(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
    except ConfigError as exc:
        _say(f"nodescope: {exc}")
        return 2
    try:
        response = call(
            socket_path(config.roots), {"command": "clear_xids"}, config.slurm.timeout_seconds
        )
    except HookUnavailable as exc:
        # The record the hooks fall back on is root's: clearing it is the same decision the
        # daemon would take, made by the same operator.
        _say(f"nodescope: daemon not answering: {exc}")
        if not gate_state_path(config.roots).exists():
            return 1
        try:
            write_gate_state(config.roots, (), time.time())
        except OSError as err:
            _say(f"nodescope: cannot clear the recorded Xids: {err}")
            return 1
        print(f"Xids cleared in {gate_state_path(config.roots)} (the daemon was not running)")
        return 0
    if not response.get("ok"):
        _say(f"nodescope: {response.get('error')}")
        return 1
    print("Xids cleared: the prolog gate accepts the node again")
    return 0


# ---------------------------------------------------------------------------------------------
# nodescope slurm health: Slurm's HealthCheckProgram


def _register_health(actions: Any, parents: list[argparse.ArgumentParser]) -> None:
    text = (
        "drain or resume this node by the [remediation] policy, from the daemon's firing"
        " alerts and the gate's checks (Slurm's HealthCheckProgram)"
    )
    sub = actions.add_parser(
        "health",
        parents=parents,
        help=text,
        description=text + ". Says on stdout what it did, or in a dry run what it would do."
        " Exit 0 whatever the node's health, 2 on a bad configuration.",
    )
    sub.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML configuration file (default: {DEFAULT_CONFIG} when it exists)",
    )
    sub.add_argument(
        "--node",
        metavar="NAME",
        help="this node's Slurm name (default: SLURMD_NODENAME, else the node whose NodeName"
        " or NodeHostName is this host's name)",
    )
    sub.add_argument(
        "--dry-run",
        action="store_true",
        help="change nothing: say what would be drained, resumed or requeued",
    )
    sub.set_defaults(func=health)


#: How long ``health`` watches the node itself when the daemon does not answer: the one-shot
#: check's default, short beside HealthCheckInterval.
LOCAL_CHECK_SECONDS = 3.0


def _local_problems(config: Config) -> list[Any]:
    """What ``nodescope check`` finds on this node in a few seconds, as problems: the daemon is
    away, so the node is looked at here rather than not at all. Findings that need longer
    than the watch (a stall held for 30 s) are not among them: the view is not complete."""
    from nodescope.cli.check import Watch, watch_node
    from nodescope.remediation.act import problems_from_findings

    watch = Watch()
    try:
        watch_node(config, LOCAL_CHECK_SECONDS, watch)
    except Exception as exc:  # a check that fails leaves the gate's checks, as before
        _say(f"nodescope: the local check failed: {type(exc).__name__}: {exc}")
        return []
    problems = problems_from_findings(watch.findings.values())
    _say(f"nodescope: a {LOCAL_CHECK_SECONDS:g} s local check found {len(problems)} problem(s)")
    return problems


def _firing_problems(config: Config) -> tuple[list[Any], bool]:
    """The daemon's firing alerts as problems, and whether they are known (the daemon
    answered after analysing at least one cycle). When it does not answer, a local check's
    findings instead (never complete: nothing is resumed on a few seconds' view)."""
    from nodescope.remediation.act import problems_from_alerts

    try:
        response = call(socket_path(config.roots), {"command": "alerts"},
                        config.slurm.timeout_seconds)  # fmt: skip
    except HookUnavailable as exc:
        _say(f"nodescope: daemon not answering ({exc}); a local check and the gate's checks")
        return _local_problems(config), False
    alerts = response.get("alerts")
    if not response.get("ok") or not isinstance(alerts, list):
        _say(f"nodescope: daemon: {response.get('error') or 'no alerts in its answer'}")
        return [], False
    if response.get("wall_time") is None:
        _say("nodescope: the daemon has not analysed a cycle yet; the gate's checks only")
        return [], False
    return problems_from_alerts(alerts), True


def _node_name(config: Config, given: str | None) -> str | None:
    """``--node``, else ``SLURMD_NODENAME`` (set when slurmd runs the program), else the node
    Slurm lists under this host's name: HealthCheckProgram runs with no job environment."""
    import socket

    from nodescope.remediation.slurm import Scontrol, SlurmError, node_named
    from nodescope.slurm_names import NODE_NAME

    name = given or os.environ.get("SLURMD_NODENAME")
    if name:
        return name if NODE_NAME.fullmatch(name) else None
    host = socket.gethostname()
    scontrol = Scontrol(config.slurm.scontrol, config.remediation.scontrol_timeout_seconds)
    try:
        nodes = scontrol.nodes().items
    except SlurmError as exc:
        _say(f"nodescope: {exc}")
        return None
    return node_named(nodes, [host.split(".")[0], host])


def health(args: argparse.Namespace) -> int:
    from nodescope.remediation.act import problems_from_checks, remediate
    from nodescope.remediation.slurm import SlurmError
    from nodescope.remediation.state import HEALTH_LOCK_NAME, RecordBusy, locked

    try:
        config = _config(args)
    except ConfigError as exc:
        _say(f"nodescope: {exc}")
        return 2
    if not config.slurm.scontrol:
        _say("nodescope: [slurm] scontrol is empty: health cannot read or change the node")
        return 2
    with contextlib.ExitStack() as alone:
        try:
            alone.enter_context(locked(config.roots, timeout=0, name=HEALTH_LOCK_NAME))
        except RecordBusy:
            # The earlier run decides with what it read; this one would only load the node.
            _say("nodescope: an earlier health check still runs on this node; this one stops")
            return 0
        except OSError as exc:
            _say(f"nodescope: nothing done: {exc}")
            return 0
        node = _node_name(config, args.node)
        if node is None:
            _say("nodescope: cannot tell which Slurm node this is; give --node")
            return 0
        problems, complete = _firing_problems(config)
        problems += problems_from_checks(gate_checks(config.slurm, local_gate_inputs(config)))
        try:
            outcome = remediate(
                config, problems, node, complete=complete, dry_run=True if args.dry_run else None
            )
        except (SlurmError, RecordBusy, OSError) as exc:
            # A Slurm that does not answer is no reason to fail the health check: slurmd would
            # only log the exit status, and the next run tries again.
            _say(f"nodescope: nothing done on {node}: {exc}")
            return 0
    prefix = "dry run: " if outcome.dry_run else ""
    for line in outcome.lines:
        # A line may quote a finding's message, and so a process name.
        print(sanitize(prefix + line if not line.startswith("  ") else line), flush=True)
    return 0
