"""``nodescope demo [SCENARIO]``: the daemon against a simulated node, in real time.

Materialises the node under a temporary directory, serves ``/metrics`` for it (with the fake
NVML in place of the driver) and shows a terminal view refreshed once per second: per-GPU
PCIe and NVLink rates, disks, InfiniBand ports, source health, events. Stops on Ctrl-C,
SIGTERM or after ``--duration`` seconds, and removes its directory. ``--config`` takes the
``[alerts]`` and ``[detectors]`` tables of a configuration file (thresholds, ``for`` and
resolve times, an Alertmanager to push to); the rest of the demo's configuration is its own,
every path in it under the demo's directory (:mod:`nodescope.sim.sandbox`).

``nodescope demo --nodes N [FLEET]`` runs a fleet (:mod:`nodescope.sim.fleet`): one
``nodescope demo`` child process per node, each on its own scenario written from the fleet
file, its own port and its own ``[alerts] instance`` (the node's name). Separate processes
are separate daemons, as on a cluster: they use every core, and one that fails leaves the
others serving. The orchestrator prints where each node serves, writes a Prometheus file_sd
document of them (``--targets``), shows one line per node per second, and on Ctrl-C or
SIGTERM stops every child and removes every directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from nodescope import assembly, logs
from nodescope.config import DEFAULT_LISTEN, parse_listen
from nodescope.errors import ConfigError, ParseError
from nodescope.progress import Progress

#: Shows GPU copies and NVMe reads piling onto one root port within its first 30 s.
DEFAULT_SCENARIO = "root-port-contention"
#: A multi-node job with a straggler, an asymmetric InfiniBand port, a faulty node and a
#: job-wide stall, one after the other.
DEFAULT_FLEET = "job-straggler"


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="serve /metrics for a simulated node (or a fleet of them) in real time",
        description=(
            "Run the daemon against a simulated GPU node (no GPU needed): /metrics is served "
            "on --listen and a terminal view refreshes once per second. With --nodes N, run "
            "N simulated nodes of a fleet file, each a separate daemon process: node i "
            "(node01, node02, ...) serves on HOST:PORT+i-1 (port 0: each picks a free port). "
            "Every file a demo writes is under its own directory (nodescope-demo-* in /dev/shm, "
            "else the temporary directory; removed when it stops), whatever --config says: the "
            "node in sys/, proc/, dev/, run/, the hooks' socket and job registrations in "
            "run/nodescope/, job reports in var/lib/nodescope/jobs/, a configuration for the "
            "Slurm hooks in etc/nodescope/nodescope.toml; the demo runs no scontrol."
        ),
    )
    parser.add_argument(
        "scenario",
        nargs="?",
        default=None,
        metavar="SCENARIO|FLEET",
        help=(
            f"bundled scenario name or file path (default {DEFAULT_SCENARIO}); with --nodes, "
            f"a bundled fleet name or file path (default {DEFAULT_FLEET})"
        ),
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address of the /metrics server (default {DEFAULT_LISTEN}); "
        "with --nodes, node i listens on PORT+i-1",
    )
    parser.add_argument(
        "--duration", type=float, metavar="SECONDS", help="stop after SECONDS (default: Ctrl-C)"
    )
    parser.add_argument(
        "--no-tty",
        action="store_true",
        help="print one summary block per second instead of redrawing the screen "
        "(with --nodes: one line per node per second)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="take the [alerts] and [detectors] settings from this configuration file "
        "(with --nodes, every node's; each node's [alerts] instance is its name)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help=f"run N simulated nodes of a fleet ({MIN_NODES}-{MAX_NODES}), one daemon process each",
    )
    parser.add_argument(
        "--targets",
        metavar="FILE",
        help="with --nodes: write a Prometheus file_sd JSON file naming every node's address, "
        "its instance label set to the node's name",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the bundled scenarios (and, with --nodes, the bundled fleets)",
    )
    parser.set_defaults(func=run)


# The fleet's bounds, repeated here so that --help does not import the fleet module (and
# jsonschema with it); test_fleet_cli holds the two equal.
MIN_NODES = 2
MAX_NODES = 64


def run(args: argparse.Namespace) -> int:
    if args.list:
        if args.nodes is None:
            from nodescope.cli.replay import list_scenarios

            return list_scenarios(sys.stdout)
        from nodescope.sim.fleet import bundled_fleets, load_fleet

        for name in bundled_fleets():
            summary = " ".join(load_fleet(name).description.split()).split(". ")[0]
            print(f"{name}  {summary.rstrip('.')}")
        return 0
    if args.nodes is not None:
        return run_fleet(args)
    if args.targets is not None:
        print("nodescope demo: --targets needs --nodes", file=sys.stderr)
        return 2
    from nodescope.sim.scenario import load_scenario

    try:
        parse_listen(args.listen)
    except ValueError as exc:
        print(f"nodescope demo: --listen: {exc}", file=sys.stderr)
        return 2
    if args.duration is not None and args.duration <= 0:
        print("nodescope demo: --duration must be greater than 0", file=sys.stderr)
        return 2
    try:
        settings = assembly.load(args.config) if args.config else None
    except ConfigError as exc:
        print(f"nodescope demo: {exc}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario or DEFAULT_SCENARIO)
    except (ParseError, OSError) as exc:
        print(f"nodescope demo: {exc}", file=sys.stderr)
        return 2
    tty = not args.no_tty and sys.stdout.isatty()
    # A redrawn screen has no room for log lines; plain output keeps the warnings.
    logs.setup("error" if tty else "warning")
    from nodescope.sim.driver import demo

    return demo(scenario, args.listen, duration=args.duration, tty=tty, settings=settings)


# --------------------------------------------------------------------------------------------
# Fleets


def _usage(message: str) -> int:
    print(f"nodescope demo: {message}", file=sys.stderr)
    return 2


def run_fleet(args: argparse.Namespace) -> int:
    """``nodescope demo --nodes N``: check everything that can be checked before a child
    starts (a bad argument is exit status 2, as argparse's own), then run the fleet."""
    from nodescope.sim.fleet import check_nodes, load_fleet

    nodes: int = args.nodes
    if not MIN_NODES <= nodes <= MAX_NODES:
        return _usage(f"--nodes must be {MIN_NODES} to {MAX_NODES}, got {nodes}")
    try:
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        return _usage(f"--listen: {exc}")
    if port and port + nodes - 1 > 65535:
        return _usage(f"--listen: ports {port}-{port + nodes - 1} go past 65535")
    if args.duration is not None and not (args.duration > 0 and math.isfinite(args.duration)):
        return _usage("--duration must be a number greater than 0")
    tables: dict[str, Any] = {}
    if args.config:
        try:
            assembly.load(args.config)  # judged as the children will judge it
            tables = node_config_tables(Path(args.config))
        except ConfigError as exc:
            return _usage(str(exc))
    try:
        fleet = load_fleet(args.scenario or DEFAULT_FLEET)
        check_nodes(fleet, nodes)
    except (ParseError, OSError) as exc:
        return _usage(str(exc))
    tty = not args.no_tty and sys.stdout.isatty()
    logs.setup("error" if tty else "warning")
    from nodescope.sim.driver import temp_dir

    root = Path(tempfile.mkdtemp(prefix="nodescope-fleet-", dir=temp_dir()))
    try:
        try:
            specs = write_nodes(fleet, nodes, root, host, port, tables)
        except ParseError as exc:
            return _usage(str(exc))
        runner = FleetRunner(
            specs,
            duration=args.duration,
            targets=Path(args.targets) if args.targets else None,
            tty=tty,
            title=f"fleet {fleet.name}, {nodes} nodes, job {fleet.job.id}",
        )
        return runner.run()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        print(f"removed {root}", flush=True)


def node_config_tables(path: Path) -> dict[str, Any]:
    """The ``[alerts]`` and ``[detectors]`` tables of a configuration file, as written: the
    only ones a demo takes (``assembly.load`` has judged the file already)."""
    try:
        with path.open("rb") as f:
            document = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(str(path), None, f"cannot read: {exc}") from exc
    return {k: document[k] for k in ("alerts", "detectors") if isinstance(document.get(k), dict)}


def node_config(tables: Mapping[str, Any], instance: str) -> str:
    """A node's configuration file: the fleet's ``[alerts]`` and ``[detectors]`` tables with
    ``[alerts] instance`` set to the node's name, so a node's pushed alerts name the node and
    not the one machine every node runs on."""
    alerts = {**tables.get("alerts", {}), "instance": instance}
    return toml_text({**tables, "alerts": alerts})


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+\Z")


def toml_text(tables: Mapping[str, Any]) -> str:
    """TOML for tables of the values ``tomllib`` reads: each table's plain keys, then its
    sub-tables under their dotted names."""
    lines: list[str] = []

    def table(names: tuple[str, ...], values: Mapping[str, Any]) -> None:
        plain = {k: v for k, v in values.items() if not isinstance(v, dict)}
        if names and (plain or not values):
            lines.append(f"[{'.'.join(_toml_key(n) for n in names)}]")
        lines.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in plain.items())
        for key, value in values.items():
            if isinstance(value, dict):
                table((*names, key), value)

    table((), tables)
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    """A TOML basic string: the quote, the backslash and the control characters TOML refuses
    raw (all but tab, and DEL) escaped; everything else as it is (TOML's ``\\u`` escapes
    take no surrogate halves, so characters past U+FFFF cannot be escaped as JSON does)."""
    out = ['"']
    for char in text:
        code = ord(char)
        if char in '"\\':
            out.append("\\" + char)
        elif (code < 0x20 and char != "\t") or code == 0x7F:
            out.append(f"\\u{code:04x}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return _toml_string(str(value))  # dates and times: their ISO text


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One child: the node's name, its scenario and configuration files, where it listens."""

    name: str
    scenario: Path
    config: Path
    listen: str


def write_nodes(
    fleet: Any, nodes: int, root: Path, host: str, port: int, tables: Mapping[str, Any]
) -> list[NodeSpec]:
    """Each node's scenario and configuration under ``root``. Every scenario is read back by
    the scenario loader before a child starts: a fault the loader refuses is the fleet
    file's error, reported once, not N children failing one after another."""
    from nodescope.sim.fleet import node_name, node_scenario
    from nodescope.sim.scenario import ScenarioLoader

    loader = ScenarioLoader()
    shown_host = f"[{host}]" if ":" in host else host
    specs: list[NodeSpec] = []
    for node in range(1, nodes + 1):
        name = node_name(node)
        scenario = root / f"{name}.json"
        scenario.write_text(json.dumps(node_scenario(fleet, node), indent=1), encoding="utf-8")
        try:
            loader.load(scenario)
        except ParseError as exc:
            raise ParseError(fleet.source, f"{name}'s scenario: {exc}") from exc
        config = root / f"{name}.toml"
        config.write_text(node_config(tables, name), encoding="utf-8")
        listen = f"{shown_host}:{port + node - 1 if port else 0}"
        specs.append(NodeSpec(name, scenario, config, listen))
    return specs


_SERVING = re.compile(
    r"^nodescope demo: scenario .*, node under (?P<root>.+), serving (?P<url>\S+)$"
)
_SIMULATED = re.compile(r"simulated t=(?P<t>[0-9.]+)s")
_GPU_ROW = re.compile(r"^\s*\d+\s+[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]\s.*\s(?P<util>\d+)%$")
_FINDING = re.compile(r"^  (?P<severity>CRITICAL|WARNING|INFO)\s+(?P<message>.*)$")


@dataclass(slots=True)
class NodeView:
    """What a child last showed, read from its plain output: its URL, simulated time, GPU
    utilisation and findings (one refresh behind: a block is read when the next begins)."""

    url: str | None = None
    root: str | None = None
    t: float | None = None
    utils: list[int] = field(default_factory=list)
    findings: list[tuple[str, str]] = field(default_factory=list)
    block: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        serving = _SERVING.match(line)
        if serving is not None and self.url is None:
            self.url, self.root = serving["url"], serving["root"]
            return
        if line.startswith("--- "):
            self._read_block(self.block)
            self.block = []
        else:
            self.block.append(line)

    def _read_block(self, lines: Sequence[str]) -> None:
        utils: list[int] = []
        findings: list[tuple[str, str]] = []
        in_findings = False
        for line in lines:
            simulated = _SIMULATED.search(line)
            if simulated is not None and line.startswith("nodescope demo:"):
                self.t = float(simulated["t"])
            row = _GPU_ROW.match(line)
            if row is not None:
                utils.append(int(row["util"]))
            if line.startswith("findings:"):
                in_findings = True
                continue
            finding = _FINDING.match(line) if in_findings else None
            if finding is not None:
                findings.append((finding["severity"].lower(), finding["message"]))
            else:
                in_findings = False
        if lines:
            self.utils, self.findings = utils, findings

    def summary(self) -> str:
        t = "-" if self.t is None else f"{self.t:.0f}s"
        util = f"{sum(self.utils) / len(self.utils):.0f}%" if self.utils else "-"
        if not self.findings:
            found = "none"
        else:
            counts: dict[str, int] = {}
            for severity, _ in self.findings:
                counts[severity] = counts.get(severity, 0) + 1
            found = ", ".join(f"{n} {s}" for s, n in counts.items())
            found += f" ({self.findings[0][1][:60]})"
        return f"t={t:>6}  GPU util {util:>4}  findings: {found}"


class Child:
    """One node's ``nodescope demo`` process and the threads that read its output."""

    def __init__(self, spec: NodeSpec, duration: float | None) -> None:
        self.spec = spec
        self.view = NodeView()
        self.errors: deque[str] = deque(maxlen=20)
        self.lock = threading.Lock()
        self.reported = False
        command = [
            sys.executable,
            "-m",
            "nodescope.cli.main",
            "demo",
            str(spec.scenario),
            "--listen",
            spec.listen,
            "--no-tty",
            "--config",
            str(spec.config),
        ]
        if duration is not None:
            command += ["--duration", repr(duration)]
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            # Its own process group: a terminal's Ctrl-C reaches the orchestrator alone, which
            # stops the children in order; the parent-death signal stops a child whose
            # orchestrator was killed outright, which could not.
            process_group=0,
            preexec_fn=_die_with_parent,
        )
        self.threads: list[threading.Thread] = []

    def start_reading(self, stderr: TextIO) -> None:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        out, err = self.proc.stdout, self.proc.stderr

        def read_out() -> None:
            for line in out:
                with self.lock:
                    self.view.feed(line.rstrip("\n"))

        def read_err() -> None:
            for line in err:
                text = line.rstrip("\n")
                with self.lock:
                    self.errors.append(text)
                print(f"{self.spec.name}: {text}", file=stderr, flush=True)

        for target in (read_out, read_err):
            thread = threading.Thread(target=target, name=f"{self.spec.name}-read", daemon=True)
            thread.start()
            self.threads.append(thread)

    def serving(self) -> str | None:
        with self.lock:
            return self.view.url

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; a killed child cannot remove its
        node's directory, so it is removed here."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for thread in self.threads:
            thread.join(2.0)
        with self.lock:
            root = self.view.root
        if root is not None and Path(root).is_dir():
            shutil.rmtree(root, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the orchestrator dies (Linux prctl
    PR_SET_PDEATHSIG); where prctl is unavailable the child outlives a killed orchestrator."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serving_address(url: str) -> str:
    """``host:port`` of a child's ``http://host:port/metrics``; an unspecified address (a
    node listening on every interface) is reached on loopback."""
    address = url.removeprefix("http://").partition("/")[0]
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"{host}:{port}"


def write_targets(path: Path, targets: Sequence[tuple[str, str]]) -> None:
    """The file_sd document, replaced at once: Prometheus watches the file and must never
    read half of it."""
    from nodescope.sim.fleet import file_sd

    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(file_sd(targets), indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


CLEAR = "\x1b[H\x1b[2J"


class FleetRunner:
    """Starts every child, reports where each serves, shows them, and stops them all."""

    def __init__(
        self,
        specs: Sequence[NodeSpec],
        *,
        duration: float | None,
        targets: Path | None,
        tty: bool,
        title: str,
        out: TextIO | None = None,
        err: TextIO | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        self.specs = specs
        self.duration = duration
        self.targets = targets
        self.tty = tty
        self.title = title
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.install = install_signal_handlers
        self.stop = threading.Event()
        self.children: list[Child] = []
        #: status of each child that ended before it was asked to
        self.early: dict[str, int] = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()

    def run(self) -> int:
        previous: dict[signal.Signals, Any] = {}
        if self.install:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, self._on_signal)
        try:
            # Every child is started before any reading thread: a fork while other threads
            # run is what preexec_fn must not meet.
            for spec in self.specs:
                self.children.append(Child(spec, self.duration))
            for child in self.children:
                child.start_reading(self.err)
            return self._watch()
        finally:
            for child in self.children:
                child.stop(grace=15.0)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _check_exits(self, started: float) -> bool:
        """Report each child that ended unasked; whether any is still running."""
        running = False
        for child in self.children:
            status = child.proc.poll()
            if status is None:
                running = True
                continue
            if child.reported or self.stop.is_set():
                continue
            child.reported = True
            ran_out = self.duration is not None and time.monotonic() - started >= self.duration
            if ran_out and status == 0:
                continue  # its --duration is over
            self.early[child.spec.name] = status
            with child.lock:
                last = list(child.errors)[-5:]
            detail = "".join(f"\n  {line}" for line in last)
            print(
                f"nodescope demo: {child.spec.name} exited early with status {status}{detail}",
                file=self.err,
                flush=True,
            )
        return running

    def _watch(self) -> int:
        started = time.monotonic()
        # Until every node serves (or has ended): building a DGX-class node takes seconds, a
        # fleet of them ten or more; say so, as a bar on a terminal and a line otherwise.
        progress = Progress(len(self.children), self.err)
        if not progress.enabled:
            print(f"nodescope demo: starting {len(self.children)} nodes", file=self.err, flush=True)
        while not self.stop.is_set():
            if not self._check_exits(started):
                break
            ready = sum(c.serving() is not None or c.proc.poll() is not None for c in self.children)
            progress.done = ready
            progress.show(f"nodes serving, {time.monotonic() - started:.0f} s")
            if ready == len(self.children):
                break
            self.stop.wait(0.2)
        progress.close()
        serving = [(c.spec.name, c.serving()) for c in self.children]
        targets = [(name, serving_address(url)) for name, url in serving if url is not None]
        if not self.stop.is_set():
            if self.targets is not None:
                write_targets(self.targets, targets)
            self._say(f"nodescope demo: {self.title}")
            for name, url in serving:
                self._say(f"  {name}  {url or 'not serving'}")
            if self.targets is not None:
                self._say(f"  Prometheus targets: {self.targets}")
        deadline = None if self.duration is None else started + self.duration + 30.0
        while not self.stop.wait(1.0):
            running = self._check_exits(started)
            if not running:
                break
            if deadline is not None and time.monotonic() > deadline:
                # The children stop themselves at --duration; one that has not is stuck.
                self._say("nodescope demo: --duration is over; stopping the nodes still running")
                break
            self._show(started)
        self.stop.set()
        for child in self.children:
            child.stop(grace=15.0)
        status = 0
        for child in self.children:
            code = self.early.get(child.spec.name, child.proc.returncode)
            if child.spec.name in self.early and code == 0:
                code = 1  # a node that ends unasked is a failure even when it says otherwise
            if code and not status:
                status = code if code > 0 else 128 - code
        return status

    def _show(self, started: float) -> None:
        lines = []
        for child in self.children:
            with child.lock:
                summary = child.view.summary()
                url = child.view.url or "not serving"
            state = "" if child.proc.poll() is None else f"  EXITED ({child.proc.returncode})"
            # A redrawn screen replaces the table of URLs printed once: it repeats them.
            where = f"  {url}" if self.tty else ""
            lines.append(f"{child.spec.name}{where}  {summary}{state}")
        wall = time.monotonic() - started
        if self.tty:
            self.out.write(CLEAR + f"nodescope demo: {self.title}  wall {wall:.0f}s\n")
            self.out.write("\n".join(lines) + "\n")
        else:
            self.out.write("".join(f"[{wall:5.0f}s] {line}\n" for line in lines))
        self.out.flush()
