"""``nodescope replay SCENARIO [--json]``: run a scenario in simulated time and check it.

Prints the timeline of notable events (sources down and up, GPUs lost, Xids; findings when
detectors exist) and every expectation of the scenario with what was observed. Exit status:
0 when every expectation held, 1 when one did not (the report names it and the values seen),
2 when a scenario file is invalid (the message names the file and the JSON pointer).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from nodescope import logs
from nodescope.errors import ParseError
from nodescope.progress import Progress
from nodescope.text import sanitize_lines

if TYPE_CHECKING:
    from nodescope.sim.driver import ReplayResult


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="run scenarios on the simulated node in simulated time and check expectations",
        description=(
            "Run each SCENARIO (a bundled name or a scenario JSON file) on a simulated node "
            "as fast as it can, print the timeline and check the scenario's expectations. "
            "Exit 1 when one fails, 2 when a scenario is invalid."
        ),
    )
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help="bundled scenario name or file path"
    )
    parser.add_argument("--all", action="store_true", help="every bundled scenario")
    parser.add_argument(
        "--list", action="store_true", help="list the bundled scenarios with their descriptions"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def list_scenarios(out: TextIO) -> int:
    """The bundled scenarios, one a line: name and the first sentence of its description."""
    from nodescope.sim.scenario import bundled_scenarios, scenario_path

    names = bundled_scenarios()
    width = max(map(len, names), default=0)
    for name in names:
        # The description alone: validating every scenario would take seconds.
        document = json.loads(scenario_path(name).read_text())
        summary = " ".join(str(document.get("description", "")).split())
        first = summary.split(". ")[0].rstrip(".")
        out.write(f"{name:<{width}}  {first}\n")
    return 0


def run_one(scenario: Any, progress: Progress | None = None) -> ReplayResult:
    # The simulator is imported only by the commands that run it: `nodescope run` registers
    # every subcommand and should not carry the simulator in its memory.
    from nodescope.sim.driver import replay, temp_dir

    def step(t: float, snapshot: object, body: bytes) -> None:
        if progress is not None:
            progress.step(f"{scenario.name} t={t:g}/{scenario.duration_seconds:g} s")

    with tempfile.TemporaryDirectory(prefix="nodescope-replay-", dir=temp_dir()) as root:
        return replay(scenario, Path(root), on_cycle=step)


def run(args: argparse.Namespace) -> int:
    from nodescope.sim.driver import replay_document, replay_text, tick_times
    from nodescope.sim.scenario import bundled_scenarios, load_scenario

    logs.setup("error")  # source failures are in the timeline; no log noise on stderr
    if args.list:
        return list_scenarios(sys.stdout)
    names: list[str] = list(args.scenarios)
    if args.all:
        names += [n for n in bundled_scenarios() if n not in names]
    if not names:
        print(
            "nodescope replay: name a scenario, or use --all (--list shows the bundled ones)",
            file=sys.stderr,
        )
        return 2
    scenarios = []
    for name in names:
        try:
            scenarios.append(load_scenario(name))
        except (ParseError, OSError) as exc:
            print(f"nodescope replay: {exc}", file=sys.stderr)
            return 2
    results: list[ReplayResult] = []
    # Simulated time runs as fast as the machine allows: seconds to minutes for a long one.
    progress = Progress(
        sum(len(tick_times(s.tick_seconds, s.duration_seconds)) for s in scenarios), sys.stderr
    )
    for scenario in scenarios:
        try:
            result = run_one(scenario, progress)
        except ParseError as exc:
            print(f"nodescope replay: {exc}", file=sys.stderr)
            return 2
        results.append(result)
        progress.close()
        if not args.json:
            sys.stdout.write(sanitize_lines(replay_text(result)))  # messages name processes
            if len(scenarios) > 1:
                sys.stdout.write("\n")
            sys.stdout.flush()
    passed = all(r.passed for r in results)
    if args.json:
        documents = [replay_document(r) for r in results]
        if len(documents) == 1:
            document: dict[str, Any] = documents[0]
        else:
            document = {
                "scenarios": documents,
                "summary": {
                    "passed": passed,
                    "scenarios_passed": sum(1 for r in results if r.passed),
                    "scenarios_failed": sum(1 for r in results if not r.passed),
                },
            }
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    elif len(results) > 1:
        failed = [r.scenario for r in results if not r.passed]
        print(
            f"{len(results) - len(failed)} of {len(results)} scenarios passed"
            + (f"; failed: {', '.join(failed)}" if failed else "")
        )
    return 0 if passed else 1
