"""``nodescope snapshot``: one collection cycle — two samples, so rates exist — printed."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from nodescope import __version__, jsonout, logs
from nodescope.cli.run import overrides_from_args
from nodescope.collect import Collector
from nodescope.errors import ConfigError
from nodescope.model.snapshot import Snapshot
from nodescope.service import config_loader


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "snapshot",
        parents=parents,
        help="read every source twice and print what was seen, with rates",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between the two samples (default 1)",
    )
    parser.set_defaults(func=run, listen=None)


def snapshot_document(snapshot: Snapshot) -> dict[str, Any]:
    sources: dict[str, Any] = {}
    for name, sample in snapshot.current.items():
        previous = snapshot.previous.get(name)
        sources[name] = {
            "ok": sample.ok,
            "error": sample.error,
            "duration_seconds": sample.duration,
            # The measured time the derived rates are computed over.
            "seconds_between_samples": (
                sample.monotonic - previous.monotonic if previous is not None else None
            ),
            "data": jsonout.plain(sample.data),
            "derived": jsonout.plain(snapshot.derived.rates_of(name)),
        }
    return {
        "nodescope_version": __version__,
        "wall_time": snapshot.wall_time,
        "cycle": snapshot.cycle,
        "sources": sources,
    }


def take(collector: Collector, interval: float) -> Snapshot:
    collector.run_cycle(force=True)
    time.sleep(max(0.0, interval))
    return collector.run_cycle(force=True)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_loader(args.config, overrides_from_args(args))()
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    logs.setup("warning")
    collector = Collector.from_config(config)
    try:
        snapshot = take(collector, args.interval)
    finally:
        collector.close()
    document = snapshot_document(snapshot)
    if args.json:
        sys.stdout.write(jsonout.dumps(document))
        return 0
    for name, entry in document["sources"].items():
        state = "ok" if entry["ok"] else f"DOWN ({entry['error']})"
        print(f"{name:<12} {state}  {entry['duration_seconds'] * 1000:.1f} ms")
    return 0
