"""``nodescope alerts``: the running daemon's pending and firing alerts, with their evidence.

Asks the daemon's ``/api/v1/alerts`` (served from the last cycle; nothing is computed for the
request). The address is ``--url``, else the ``daemon.listen`` of ``--config`` (by default
/etc/nodescope/nodescope.toml when it exists), else the default listen address.

Exit status: 0 when the daemon answered, whatever its alerts; 1 when it could not be reached
or its answer was not understood; 2 on a bad configuration file.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from nodescope import assembly
from nodescope.errors import ConfigError
from nodescope.text import sanitize, sanitize_lines

DEFAULT_CONFIG = "/etc/nodescope/nodescope.toml"


def register(subparsers: Any, parents: list[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "alerts",
        help="show the running daemon's active alerts with their evidence",
        description=(
            "Show the pending and firing alerts of the running daemon. Exit 0 when the daemon"
            " answered (with or without alerts), 1 when it could not be reached, 2 on a bad"
            " configuration file."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help=f"configuration whose daemon.listen to ask (default {DEFAULT_CONFIG} if present)",
    )
    parser.add_argument("--url", metavar="URL", help="daemon base URL, e.g. http://127.0.0.1:9839")
    parser.add_argument("--json", action="store_true", help="print the daemon's JSON document")
    parser.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="HTTP timeout (default 5)"
    )
    parser.set_defaults(func=run)


def base_url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url).rstrip("/")
    path = args.config
    if path is None and Path(DEFAULT_CONFIG).exists():
        path = DEFAULT_CONFIG
    cfg = assembly.load(path) if path else assembly.default_config()
    host, port = cfg.listen_address
    # A wildcard listen address is reached on loopback.
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _when(unix: float) -> str:
    return datetime.fromtimestamp(unix, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _evidence_lines(alert: dict[str, Any]) -> list[str]:
    last = alert.get("evidence_last") or {}
    peak = alert.get("evidence_peak") or {}
    start = alert.get("evidence_start") or {}
    lines = []
    for name, value in last.items():
        extra = []
        if name in peak and peak[name] != value:
            extra.append(f"peak {peak[name]:g}")
        if name in start and start[name] != value:
            extra.append(f"at start {start[name]:g}")
        shown = "—" if value is None else f"{value:g}"
        lines.append(f"    {name} = {shown}" + (f" ({', '.join(extra)})" if extra else ""))
    return lines


def _action_line(action: Any) -> str | None:
    if not isinstance(action, dict) or not isinstance(action.get("text"), str):
        return None
    when = action.get("time")
    at = _when(float(when)) if isinstance(when, int | float) else "?"
    return f"{at} {action['text']}"


def format_actions(document: dict[str, Any], shown: set[str], out: TextIO) -> None:
    """The recorded actions not already shown under their alert, newest last, each with the
    finding it was about."""
    rest = [
        a for a in document.get("actions", []) if isinstance(a, dict) and a.get("key") not in shown
    ]
    lines = []
    for action in rest[-20:]:
        line = _action_line(action)
        if line is None:
            continue
        finding = f"{action.get('kind', '')} {action.get('subject', '')}".strip()
        lines.append(f"  {line}" + (f" [finding: {finding}]" if finding else ""))
    if lines:
        out.write("recent actions:\n" + "\n".join(lines) + "\n")


def format_alerts(document: dict[str, Any], out: TextIO) -> None:
    """The alerts document for a terminal. Every line goes through the sanitiser: messages and
    subjects name processes, files and devices that users name."""
    buffer = io.StringIO()
    _format_alerts(document, buffer)
    out.write(sanitize_lines(buffer.getvalue()))


def _format_alerts(document: dict[str, Any], out: TextIO) -> None:
    alerts = document.get("alerts", [])
    now = float(document.get("wall_time", 0.0))
    actions: dict[str, Any] = {}
    for action in document.get("actions", []):
        if isinstance(action, dict) and isinstance(action.get("key"), str) and action["key"]:
            actions[action["key"]] = action
    shown: set[str] = set()
    if not alerts:
        out.write("no active alerts\n")
    for alert in alerts:
        state = str(alert["state"]).upper()
        since = alert.get("fired_wall") if alert["state"] == "firing" else alert["started_wall"]
        since = since if since is not None else alert["started_wall"]
        out.write(
            f"{state} {alert['severity']} {alert['kind']}"
            f"{' ' + alert['subject'] if alert.get('subject') else ''}"
            f" for {_duration(now - since)} (since {_when(since)})\n"
        )
        if alert.get("message"):
            out.write(f"  {alert['message']}\n")
        if alert.get("peak_severity") and alert["peak_severity"] != alert["severity"]:
            out.write(f"  peak severity: {alert['peak_severity']}\n")
        lines = _evidence_lines(alert)
        if lines:
            out.write("  evidence:\n")
            out.write("\n".join(lines) + "\n")
        out.write(f"  id: {alert['fingerprint']}  key: {alert['key']}\n")
        line = _action_line(actions.get(alert["key"]))
        if line is not None:
            shown.add(alert["key"])
            out.write(f"  action: {line}\n")
    format_actions(document, shown, out)


def fetch(url: str, timeout: float) -> dict[str, Any]:
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{url}/api/v1/alerts", timeout=timeout) as response:
        document = json.loads(response.read().decode())
    if not isinstance(document, dict) or not isinstance(document.get("alerts"), list):
        raise ValueError("not an alerts document")
    return document


def run(args: argparse.Namespace) -> int:
    # Imported here: `nodescope run` registers this command and should not load urllib.
    import urllib.error

    try:
        url = base_url(args)
    except ConfigError as exc:
        print(f"nodescope: {exc}", file=sys.stderr)
        return 2
    try:
        document = fetch(url, args.timeout)
    except urllib.error.HTTPError as exc:
        print(
            sanitize(f"nodescope: {url}/api/v1/alerts: HTTP {exc.code} {exc.reason}"),
            file=sys.stderr,
        )
        return 1
    except (OSError, ValueError) as exc:
        print(sanitize(f"nodescope: cannot ask the daemon at {url}: {exc}"), file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    else:
        format_alerts(document, sys.stdout)
    return 0
