"""``nodescope run``: the daemon."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nodescope import logs, webconfig
from nodescope.config import LOG_FORMATS, LOG_LEVELS
from nodescope.errors import ConfigError
from nodescope.roots import ROOT_NAMES
from nodescope.service import Service, config_loader


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run",
        parents=parents,
        help="run the daemon: collect every tick and serve /metrics",
        description="Run the daemon in the foreground (systemd Type=notify).",
    )
    parser.add_argument("--config", metavar="FILE", help="TOML configuration file")
    parser.add_argument("--listen", metavar="HOST:PORT", help="override daemon.listen")
    parser.add_argument(
        "--web-config-file",
        metavar="FILE",
        help="TLS and basic auth for /metrics: a Prometheus exporter-toolkit web-config.yml",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        help="override daemon.log_level (default info)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        help="override daemon.log_format: logfmt (key=value) or json lines (default logfmt)",
    )
    parser.set_defaults(func=run)


def overrides_from_args(args: argparse.Namespace) -> dict[str, object]:
    values: dict[str, object] = {name: getattr(args, name, None) for name in ROOT_NAMES}
    values["listen"] = getattr(args, "listen", None)
    values["log_level"] = getattr(args, "log_level", None)
    values["log_format"] = getattr(args, "log_format", None)
    return values


def run(args: argparse.Namespace) -> int:
    loader = config_loader(args.config, overrides_from_args(args))
    try:
        config = loader()
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    web = None
    if getattr(args, "web_config_file", None):
        try:
            web = webconfig.load(args.web_config_file)
        except ConfigError as exc:
            print(f"nodescope: {exc}", file=sys.stderr)
            return 2
    logs.setup(config.log_level, config.log_format)
    try:
        # The service reads the file again, and it may have changed in between.
        service = Service(loader)
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    service.web_config = web
    service.install_signal_handlers()
    try:
        service.start_server()
    except OSError as exc:
        print(f"nodescope: cannot listen on {config.listen}: {exc}", file=sys.stderr)
        service.shutdown()
        return 1
    return service.run()
