"""What the cluster view costs a real Prometheus (docs/cluster.md): ``bash bench/cluster.sh``.

For each fleet size (``--nodes 8 32``): ``nodescope demo --nodes N`` starts N simulated
``dgx-h100`` nodes, each its own daemon serving /metrics, with one Slurm job across all of
them (the bundled fleet ``job-straggler``); Debian's ``prometheus`` scrapes them through the
fleet's file_sd targets and evaluates the shipped rule files (records.yml, alerts.yml,
jobs.yml) at the scrape interval. After a warm-up it measures over a window:

* Prometheus's process CPU (``process_cpu_seconds_total``, its own counter: CPU time, so the
  figure holds on a machine the fleet keeps busy) per second of wall time, and its RSS at the
  end;
* the rule groups' evaluation time (``prometheus_rule_group_last_duration_seconds`` sampled
  every interval, mean and max per group) and the rules' series (head series before and after
  the rule files are loaded are not separable, so the recorded series are counted by name);
* the samples each node's scrape returns (``scrape_samples_scraped``), the head series, the
  series per Slurm job (raw per-job series and the job records).

Prints a Markdown table. Not part of the tests: it needs minutes and most of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "exporters" / "prometheus"
RULE_FILES = ("records.yml", "alerts.yml", "jobs.yml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def query(base: str, promql: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = get_json(
        f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    )["data"]["result"]
    return result


def scalar(base: str, promql: str) -> float | None:
    result = query(base, promql)
    return float(result[0]["value"][1]) if result else None


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)")


def own_metrics(base: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus's own /metrics: name → [(labels, value)]."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples.setdefault(match.group(1), []).append(
                (match.group(2) or "", float(match.group(3)))
            )
    return samples


def one(samples: dict[str, list[tuple[str, float]]], name: str) -> float:
    return samples[name][0][1]


@dataclass
class Run:
    nodes: int
    interval: float
    window: float
    prometheus_cpu_per_second: float = 0.0
    prometheus_rss_mib: float = 0.0
    head_series: float = 0.0
    samples_per_node: float = 0.0
    series_per_job_raw: float = 0.0
    series_per_job_records: float = 0.0
    rule_series: dict[str, float] = field(default_factory=dict)
    group_seconds: dict[str, list[float]] = field(default_factory=dict)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"cluster bench: timed out after {timeout:.0f}s waiting for {what}")


def measure(nodes: int, args: argparse.Namespace, workdir: Path) -> Run:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("cluster bench: Debian's prometheus is not installed")
    targets = workdir / "targets.json"
    fleet_log = (workdir / "fleet.log").open("wb")
    fleet = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nodescope.cli.main",
            "demo",
            "--nodes",
            str(nodes),
            args.fleet,
            "--targets",
            str(targets),
            "--listen",
            "127.0.0.1:0",
            "--no-tty",
        ],
        stdout=fleet_log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    prom: subprocess.Popen[bytes] | None = None
    try:

        def serving() -> bool:
            if fleet.poll() is not None:
                fleet_log.flush()
                tail = (workdir / "fleet.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"cluster bench: the fleet exited ({fleet.returncode}):\n{tail}")
            return targets.exists()

        wait_for(serving, 120 + 5 * nodes, f"the fleet of {nodes} to serve")
        for name in RULE_FILES:
            shutil.copyfile(RULES / name, workdir / name)
        port = free_port()
        interval = f"{args.interval:g}s"
        (workdir / "prometheus.yml").write_text(
            f"""
global:
  scrape_interval: {interval}
  evaluation_interval: {interval}
rule_files: [{", ".join(RULE_FILES)}]
scrape_configs:
  - job_name: nodescope
    file_sd_configs:
      - files: [{targets}]
"""
        )
        prom = subprocess.Popen(
            [
                prometheus,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=(workdir / "prometheus.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: (scalar(base, 'count(up{job="nodescope"} == 1)') or 0) >= nodes,
            60 + 2 * nodes,
            f"{nodes} targets up",
        )
        time.sleep(args.warmup)
        before = own_metrics(base)
        started = time.monotonic()
        run = Run(nodes=nodes, interval=args.interval, window=args.window)
        while time.monotonic() - started < args.window:
            time.sleep(args.interval)
            for labels, value in own_metrics(base).get(
                "prometheus_rule_group_last_duration_seconds", []
            ):
                group = re.search(r'rule_group="[^"]*;([^"]+)"', labels)
                if group:
                    run.group_seconds.setdefault(group.group(1), []).append(value)
        after = own_metrics(base)
        elapsed = time.monotonic() - started
        run.prometheus_cpu_per_second = (
            one(after, "process_cpu_seconds_total") - one(before, "process_cpu_seconds_total")
        ) / elapsed
        run.prometheus_rss_mib = one(after, "process_resident_memory_bytes") / 2**20
        run.head_series = one(after, "prometheus_tsdb_head_series")
        run.samples_per_node = scalar(base, 'avg(scrape_samples_scraped{job="nodescope"})') or 0.0
        run.series_per_job_raw = (
            scalar(base, 'max(count by (job_id) ({__name__=~"nodescope_.+", job_id!=""}))') or 0.0
        )
        run.series_per_job_records = (
            scalar(base, 'max(count by (job_id) ({__name__=~"nodescope:job_.+", job_id!=""}))')
            or 0.0
        )
        for record in query(base, 'count by (__name__) ({__name__=~"nodescope:.+"})'):
            run.rule_series[record["metric"]["__name__"]] = float(record["value"][1])
        if fleet.poll() is not None:
            raise SystemExit(f"cluster bench: the fleet exited early ({fleet.returncode})")
        return run
    finally:
        if prom is not None:
            stop(prom)
        stop(fleet)
        fleet_log.close()


def report(runs: list[Run]) -> str:
    lines = [
        f"Prometheus (`{shutil.which('prometheus')}`), scrape and rule evaluation every "
        f"{runs[0].interval:g} s, window {runs[0].window:g} s after the warm-up; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end.",
        "",
        "| nodes | samples per node scrape | head series | series per job (raw / records)"
        " | Prometheus CPU | Prometheus RSS"
        " | rule evaluation per interval (all groups, mean / max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        totals = [sum(values) for values in zip(*run.group_seconds.values(), strict=False)]
        mean = statistics.fmean(totals) if totals else 0.0
        peak = max(totals) if totals else 0.0
        lines.append(
            f"| {run.nodes} | {run.samples_per_node:.0f} | {run.head_series:.0f} |"
            f" {run.series_per_job_raw:.0f} / {run.series_per_job_records:.0f} |"
            f" {1000 * run.prometheus_cpu_per_second:.1f} ms/s |"
            f" {run.prometheus_rss_mib:.0f} MiB | {1000 * mean:.2f} / {1000 * peak:.2f} ms |"
        )
    lines += ["", "Rule groups, mean evaluation time (ms):", ""]
    groups = sorted({g for run in runs for g in run.group_seconds})
    lines.append("| group | " + " | ".join(f"{r.nodes} nodes" for r in runs) + " |")
    lines.append("|---|" + "---|" * len(runs))
    for group in groups:
        cells = []
        for run in runs:
            values = run.group_seconds.get(group, [])
            cells.append(f"{1000 * statistics.fmean(values):.2f}" if values else "-")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines += ["", "Recorded series by rule (largest fleet):", ""]
    for name, count in sorted(runs[-1].rule_series.items(), key=lambda kv: -kv[1]):
        lines.append(f"* `{name}`: {count:.0f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--fleet", default="job-straggler")
    parser.add_argument("--interval", type=float, default=15.0, help="scrape and rule interval")
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=180.0)
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if any(n < 4 or n > 64 for n in args.nodes):
        # The bundled fleet's phases name node04.
        parser.error("--nodes: each between 4 and 64")
    runs = []
    for nodes in args.nodes:
        with tempfile.TemporaryDirectory(prefix="nodescope-cluster-") as workdir:
            print(f"== {nodes} nodes", file=sys.stderr, flush=True)
            runs.append(measure(nodes, args, Path(workdir)))
    text = report(runs)
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
