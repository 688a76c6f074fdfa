"""``nodescope check``: is this node healthy? One command, no daemon needed.

Reads the node for a few seconds (every source, so rates and counter increases exist), runs
every detector on each cycle, and prints a verdict per component — each GPU, the NVLink
fabric, each PCIe root port, each InfiniBand port, the disks, each job, the kernel log — with
the evidence of what is wrong and what the remediation policy does about it. When a daemon
answers on the configured address, the alerts it is firing are added (it has watched the node
for longer than a few seconds); ``--no-daemon`` leaves it out.

``--scenario NAME`` checks a simulated node instead: the bundled scenario (or scenario file)
replayed in simulated time up to ``--at`` seconds, as a demo node would be by then.

Exit status: 0 healthy, 1 degraded (a warning, or a part that could not be checked), 2 failed
(a critical finding) — also 2 for a bad configuration or argument, as for every command. That
fits Slurm's ``HealthCheckProgram`` wrapper and a prolog that runs it when the daemon is away
(docs/check.md).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from nodescope import __version__, jsonout, logs
from nodescope.cli.common import seconds_in
from nodescope.errors import ConfigError, ParseError
from nodescope.model.finding import Finding
from nodescope.text import sanitize

DEFAULT_CONFIG = "/etc/nodescope/nodescope.toml"
#: Long enough for rates and a slow read of every source; short enough for a prolog.
DEFAULT_SECONDS = 3.0
MAX_SECONDS = 300.0
#: The daemon's answer is an extra, never worth holding the check up for.
DAEMON_TIMEOUT_SECONDS = 1.0


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "check",
        parents=parents,
        help="one-shot health verdict of this node (exit 0 healthy, 1 degraded, 2 failed)",
        description=(
            "Read the node for a few seconds, run every detector and print a verdict per"
            " component (GPUs, NVLink fabric, PCIe root ports, InfiniBand ports, disks, jobs,"
            " kernel log) with its evidence and the action the remediation policy takes. Adds"
            " the alerts a running daemon is firing. Exit 0 healthy, 1 degraded, 2 failed."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"TOML configuration file (default: {DEFAULT_CONFIG} when it exists)",
    )
    parser.add_argument(
        "--seconds",
        type=seconds_in(1.0, MAX_SECONDS),
        default=DEFAULT_SECONDS,
        metavar="SECONDS",
        help=f"how long to watch the node, 1 to {MAX_SECONDS:g} (default {DEFAULT_SECONDS:g})",
    )
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument(
        "--no-daemon", action="store_true", help="do not ask a running daemon for its alerts"
    )
    parser.add_argument(
        "--url", metavar="URL", help="the daemon to ask (default: the configured daemon.listen)"
    )
    parser.add_argument(
        "--scenario",
        metavar="NAME|FILE",
        help="check a simulated node: a bundled scenario name or a scenario file",
    )
    parser.add_argument(
        "--at",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --scenario: the scenario's time to check at (default: its end)",
    )
    parser.set_defaults(func=run)


class Watch:
    """Every finding the run saw, the latest of each key, at its worst severity."""

    def __init__(self) -> None:
        self.findings: dict[str, Finding] = {}

    def add(self, findings: Sequence[Finding]) -> None:
        for finding in findings:
            before = self.findings.get(finding.key)
            if before is not None and before.severity > finding.severity:
                finding = Finding(
                    finding.kind,
                    before.severity,
                    finding.subjects,
                    finding.evidence,
                    before.message,
                )
            self.findings[finding.key] = finding


def _config(args: argparse.Namespace) -> Any:
    from nodescope.cli.run import overrides_from_args
    from nodescope.service import config_loader

    path = args.config or (DEFAULT_CONFIG if Path(DEFAULT_CONFIG).is_file() else None)
    return config_loader(path, overrides_from_args(args))()


def watch_node(config: Any, seconds: float, watch: Watch, progress: TextIO | None = None) -> Any:
    """Run the daemon's cycle on this node for ``seconds``, every finding into ``watch``;
    the last analysed snapshot (``nodescope slurm health`` uses it when the daemon is away)."""
    from nodescope.analysis import Analyzer
    from nodescope.collect import Collector
    from nodescope.cycle import Cycle, LatestSnapshot

    kept = LatestSnapshot()
    # The daemon's cycle, strict (a failure is this command's to report), on every source
    # each time, and without the parts that act outside: a check only looks.
    cycle = Cycle(
        Collector.from_config(config),
        Analyzer.from_config(config),
        kept.offer,
        strict=True,
        every_source=True,
    )
    tick = max(0.2, min(1.0, float(config.tick_seconds)))
    deadline = time.monotonic() + seconds
    snapshot = None
    try:
        while True:
            cycle.run()
            snapshot = kept.snapshot
            assert snapshot is not None  # strict: a cycle that failed raised
            watch.add(snapshot.findings)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if progress is not None:
                progress.write(f"\rnodescope check: watching the node, {left:.0f} s left ")
                progress.flush()
            time.sleep(min(tick, left))
    finally:
        cycle.collector.close()
        cycle.analyzer.close()
        if progress is not None:
            progress.write("\r" + " " * 60 + "\r")
            progress.flush()
    return snapshot


def _watch_scenario(name: str, at: float | None, watch: Watch) -> Any:
    import dataclasses
    import tempfile

    from nodescope.sim.driver import replay, temp_dir
    from nodescope.sim.scenario import load_scenario

    scenario = load_scenario(name)
    end = scenario.duration_seconds if at is None else max(0.0, min(at, scenario.duration_seconds))
    # Expectations are the scenario's test, not the check's: only its node is wanted.
    scenario = dataclasses.replace(scenario, duration_seconds=end, expect=type(scenario.expect)())
    last: list[Any] = []
    # The findings of the last few simulated seconds: what a check run then would have seen.
    since = max(0.0, end - DEFAULT_SECONDS)

    def on_cycle(t: float, snapshot: Any, body: bytes) -> None:
        if t >= since:
            watch.add(snapshot.findings)
        last[:] = [snapshot]

    with tempfile.TemporaryDirectory(prefix="nodescope-check-", dir=temp_dir()) as root:
        replay(scenario, Path(root), on_cycle=on_cycle)
    return last[0] if last else None


def _daemon_alerts(args: argparse.Namespace) -> tuple[str | None, list[Mapping[str, object]]]:
    """(the daemon's address, its firing alerts); (None, []) when none answered."""
    from nodescope.cli.alerts import base_url, fetch

    try:
        url = base_url(args)
        document = fetch(url, DAEMON_TIMEOUT_SECONDS)
    except (OSError, ValueError, ConfigError):
        return None, []
    alerts: list[Mapping[str, object]] = [
        a for a in document.get("alerts", []) if isinstance(a, dict)
    ]
    return url, alerts


def verdict_document(
    verdict: Any, *, node: str, seconds: float, daemon: str | None, daemon_asked: bool
) -> dict[str, Any]:
    return {
        "nodescope_version": __version__,
        "node": node,
        "seconds": seconds,
        "daemon": daemon,
        "daemon_asked": daemon_asked,
        "verdict": verdict.status.label,
        "exit_status": int(verdict.status),
        "components": [
            {
                "category": c.category,
                "name": c.name,
                "title": c.title,
                "status": c.status.label,
                "facts": list(c.facts),
                "unchecked": c.unchecked,
                "concerns": [
                    {
                        "kind": k.kind,
                        "severity": k.severity.label,
                        "message": k.message,
                        "subjects": dict(k.subjects),
                        "evidence": dict(k.evidence),
                        "action": k.action,
                        "origin": k.origin,
                    }
                    for k in c.concerns
                ],
            }
            for c in verdict.components
        ],
        "sources_down": dict(verdict.sources_down),
    }


def format_verdict(document: Mapping[str, Any], out: TextIO) -> None:
    daemon = document["daemon"]
    if daemon:
        asked = f", with the alerts of the daemon at {daemon}"
    else:
        asked = ", no daemon answered" if document["daemon_asked"] else ""
    out.write(
        f"nodescope check on {sanitize(document['node'])}: watched"
        f" {document['seconds']:g} s{asked}\n"
    )
    width = max((len(c["title"]) for c in document["components"]), default=10)
    for component in document["components"]:
        status = component["status"].upper()
        facts = "; ".join(component["facts"])
        out.write(f"  {status:<8}  {sanitize(component['title']):<{width}}  {sanitize(facts)}\n")
        if component["unchecked"]:
            out.write(f"            not checked: {sanitize(component['unchecked'])}\n")
        for concern in component["concerns"]:
            origin = " (daemon)" if concern["origin"] == "daemon" else ""
            out.write(
                f"            {concern['severity']} {concern['kind']}{origin}:"
                f" {sanitize(concern['message'])}\n"
            )
            evidence = ", ".join(f"{k}={v:.4g}" for k, v in sorted(concern["evidence"].items()))
            if evidence:
                out.write(f"              evidence: {sanitize(evidence)}\n")
            out.write(f"              action: {concern['action']}\n")
    counts = {"failed": 0, "degraded": 0, "healthy": 0}
    for component in document["components"]:
        counts[component["status"]] += 1
    out.write(
        f"verdict: {document['verdict']} ({counts['failed']} failed, {counts['degraded']}"
        f" degraded, {counts['healthy']} healthy component(s))\n"
    )


def run(args: argparse.Namespace) -> int:
    from nodescope.remediation.policy import Policy
    from nodescope.verdict import assess

    logs.setup("error")
    if args.at is not None and args.scenario is None:
        print("nodescope check: --at needs --scenario", file=sys.stderr)
        return 2
    try:
        config = _config(args)
    except ConfigError as exc:
        print(f"nodescope check: {exc}", file=sys.stderr)
        return 2
    policy = Policy.from_settings(config.remediation)
    watch = Watch()
    daemon_url: str | None = None
    alerts: list[Mapping[str, object]] = []
    if args.scenario is not None:
        try:
            snapshot = _watch_scenario(args.scenario, args.at, watch)
        except (ParseError, OSError) as exc:
            print(f"nodescope check: {exc}", file=sys.stderr)
            return 2
        node = f"simulated node ({args.scenario})"
        seconds = DEFAULT_SECONDS
        if snapshot is not None:
            # The simulated daemon has watched the node since t=0: its firing alerts are the
            # daemon's view, as a running daemon's are on a real node.
            from nodescope.analysis import alert_json

            daemon_url = "simulated"
            alerts = [alert_json(a) for a in snapshot.alerts]
    else:
        if not args.no_daemon:
            daemon_url, alerts = _daemon_alerts(args)
        progress = sys.stderr if sys.stderr.isatty() and not args.json else None
        snapshot = watch_node(config, args.seconds, watch, progress)
        node = socket.gethostname()
        seconds = args.seconds
    if snapshot is None:
        print("nodescope check: no cycle ran", file=sys.stderr)
        return 2
    verdict = assess(
        snapshot,
        watch.findings.values(),
        lambda kind, severity: policy.action(kind, severity).value,
        alerts,
    )
    document = verdict_document(
        verdict,
        node=node,
        seconds=seconds,
        daemon=daemon_url,
        daemon_asked=args.scenario is None and not args.no_daemon,
    )
    if args.json:
        sys.stdout.write(json.dumps(jsonout.plain(document), indent=2) + "\n")
    else:
        format_verdict(document, sys.stdout)
    return int(verdict.status)
