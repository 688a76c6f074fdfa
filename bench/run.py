"""nodescope's overhead benchmark (issue 10): ``bash bench/run.sh`` runs it; see
docs/performance.md for what it measures and the last results.

Phases (``--phases``, default all):

``overhead``
    The simulated ``dgx-h100`` node in real time in its own process
    (``python -m nodescope.sim.run_node``), the daemon (``bench/daemon.py``: the service of
    ``nodescope run`` at its default 1 s tick and source intervals, NVML mirrored from the
    simulator) and Debian's ``prometheus-node-exporter`` on the same tree with the collectors
    that read what nodescope reads. Two windows of ``--window`` seconds, one with one scrape
    of each per second and one with one every 15 s (``--scrape-intervals``), give the
    daemon's process CPU per cycle (``/proc/<pid>/stat`` utime+stime, its serving
    process's included) and RSS over time (the daemon's and the serving process's, and their
    PSS), node_exporter's CPU per scrape and RSS, and the floor's CPU per cycle: before
    anything is measured, a recording run of the daemon (``bench/daemon.py --record-files``)
    lists what it reads in ``--floor-cycles`` cycles, and ``bench/floor.py`` opens, reads and
    closes exactly those files (and lists those directories) once per second through both
    windows, the least any agent reading them could do in Python; then ``/metrics`` latency
    with 1 scraper (gzip as Prometheus asks, and plain) and with 50 scrapers that fire
    together (gzip), for both, from a load generator that is one thread and one
    ``selectors`` loop over keep-alive connections. Prints the ratios. ``--baseline REV``
    adds the daemon of git revision REV (checked out into a temporary worktree) on the same
    node in the same window, and prints this tree's figures as ratios to its.
``profile``
    py-spy samples the same daemon (scraped once a second) for ``--profile-seconds`` and the
    collapsed stacks are summed by the daemon's parts (each source's collect, analyse, render)
    and by function: where to look when a target is missed.
``scale``
    Variants of dgx-h100 (``bench/variants.py``: GPUs, processes, jobs, NVLinks per GPU) in
    simulated time, each in a fresh process: the daemon's cycle (collect, analyse, render)
    timed with the main thread's CPU clock over 20 one-second cycles at the default source
    intervals, per source too; the cost per element is the slope between the end points.
``soak``
    10,000 cycles in simulated time with job churn (``--churn-every`` cycles one job ends and
    one starts): the simulator steps in its own process, the daemon's parts run in the soak
    process (1 s tick, default intervals); RSS and open descriptors after warm-up and at the
    end, and at mid-period checks no series of an ended job.

Results go to stdout (Markdown) and ``--out`` (``results.json``, ``results.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PYTHON = sys.executable
CLK_TCK = os.sysconf("SC_CLK_TCK")
NODE_EXPORTER = shutil.which("prometheus-node-exporter") or "/usr/bin/prometheus-node-exporter"
#: node_exporter collectors that read what nodescope reads on the simulated node's tree:
#: /proc/diskstats, /sys/class/infiniband, /proc/<pid>/mountstats, /proc/net/snmp,
#: /sys/class/nvme, /proc/<pid>/stat of every process and thread, /proc/loadavg.
NODE_EXPORTER_COLLECTORS = (
    "diskstats",
    "infiniband",
    "mountstats",
    "netstat",
    "nvme",
    "processes",
    "loadavg",
)
SCRAPE_TIMEOUT = 30.0


# --------------------------------------------------------------------------------------------
# Process and HTTP helpers


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_schedstat_seconds(pid: int) -> float:
    """CPU seconds of every thread of a process from /proc/<pid>/task/*/schedstat
    (nanoseconds: the floor's few milliseconds a second are below /proc/<pid>/stat's 10 ms
    ticks)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def proc_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def proc_pss_bytes(pid: int) -> int:
    """Proportional set size (shared pages divided among their users), from smaps_rollup."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def proc_children(pid: int) -> list[int]:
    """Live children of every thread of ``pid`` (/proc/<pid>/task/<tid>/children)."""
    children: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
            children.extend(int(c) for c in text.split())
    except OSError:
        pass
    return children


def serving_process(pid: int) -> int | None:
    """The daemon's serving process (nodescope.serving), if it has one."""
    from nodescope.httpserver import SERVING_COMMAND_LINE

    for child in proc_children(pid):
        try:
            if SERVING_COMMAND_LINE.search(Path(f"/proc/{child}/cmdline").read_bytes()):
                return child
        except OSError:
            continue
    return None


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process, of its children that exited (cutime + cstime: a serving process that
    was replaced still counts) and of its live children."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    own = sum(int(f) for f in fields[11:15]) / CLK_TCK
    live = 0.0
    for child in proc_children(pid):
        try:
            live += proc_cpu_seconds(child)
        except OSError:
            continue
    return own + live


@dataclass
class Memory:
    """One sample of a target's memory: the main process and, for nodescope, its serving
    process."""

    rss: int
    serving_rss: int = 0
    pss: int = 0
    serving_pss: int = 0

    @property
    def total_rss(self) -> int:
        return self.rss + self.serving_rss

    @property
    def total_pss(self) -> int:
        return self.pss + self.serving_pss


def memory(pid: int) -> Memory:
    sample = Memory(proc_rss_bytes(pid), pss=proc_pss_bytes(pid))
    child = serving_process(pid)
    if child is not None:
        try:
            sample.serving_rss = proc_rss_bytes(child)
            sample.serving_pss = proc_pss_bytes(child)
        except OSError:
            pass
    return sample


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Scraper:
    """One scraper: a keep-alive HTTP/1.1 connection, like Prometheus keeps per target."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def get(self, path: str = "/metrics") -> tuple[float, int, bytes]:
        """(seconds, status, body) of one GET."""
        started = time.perf_counter()
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(
                    "127.0.0.1", self.port, timeout=SCRAPE_TIMEOUT
                )
            try:
                self.conn.request("GET", path)
                response = self.conn.getresponse()
                body = response.read()
                return time.perf_counter() - started, response.status, body
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                started = time.perf_counter()
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def wait_ready(port: int, seconds: float, process: subprocess.Popen[Any]) -> None:
    deadline = time.monotonic() + seconds
    scraper = Scraper(port)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            _, status, _ = scraper.get()
            if status == 200:
                scraper.close()
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing answered on port {port} within {seconds:.0f} s")


def series_count(body: bytes) -> int:
    return sum(1 for line in body.split(b"\n") if line and not line.startswith(b"#"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def stop(process: subprocess.Popen[Any], seconds: float = 10.0) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def start_simulator(
    scenario: str, root: Path, *extra: str, stepped: bool = False
) -> subprocess.Popen[str]:
    cmd = [PYTHON, "-m", "nodescope.sim.run_node", scenario, str(root), *extra]
    if stepped:
        cmd.append("--stepped")
    sim = subprocess.Popen(
        cmd, stdin=subprocess.PIPE if stepped else subprocess.DEVNULL, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert sim.stdout is not None
    line = sim.stdout.readline()
    if line.strip() != "ready":
        stop(sim)
        raise RuntimeError(f"simulator did not start: {line!r}")
    return sim


@contextmanager
def temp_root(prefix: str) -> Iterator[Path]:
    from nodescope.sim.node import preferred_temp_dir

    base = Path(tempfile.mkdtemp(prefix=prefix, dir=preferred_temp_dir()))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def machine() -> dict[str, Any]:
    cpu = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    try:
        version = subprocess.run(
            [NODE_EXPORTER, "--version"], capture_output=True, text=True, timeout=10
        )
        ne = (version.stdout or version.stderr).splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        ne = "not installed"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "os": _os_release(),
        "node_exporter": ne,
        "loadavg_start": os.getloadavg(),
    }


def _os_release() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()


# --------------------------------------------------------------------------------------------
# Overhead: real time, side by side with node_exporter


@dataclass
class Target:
    name: str
    port: int
    process: subprocess.Popen[Any]
    memory: list[Memory] = field(default_factory=list)


def _request(gzip: bool) -> bytes:
    """A GET of /metrics as Prometheus sends it (with ``Accept-Encoding: gzip``) or plain."""
    return (
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: nodescope-bench\r\n"
        + (b"Accept-Encoding: gzip\r\n" if gzip else b"")
        + b"\r\n"
    )


#: SO_TIMESTAMPNS (asm-generic/socket.h, 64-bit time_t): the kernel stamps each received
#: segment with CLOCK_REALTIME, and recvmsg(2) hands back the stamp of the last one read
#: (socket(7)). Python's socket module does not name it.
SO_TIMESTAMPNS = 35
_TIMESPEC = struct.Struct("qq")


class _Exchange:
    """One response being received on a keep-alive connection."""

    def __init__(self, sock: socket.socket, keep_body: bool) -> None:
        self.sock = sock
        self.keep_body = keep_body
        self.head = b""
        self.parts: list[bytes] = []
        self.length = -1
        self.received = 0
        self.status = 0
        self.encoding = ""
        self.sent_ns = 0
        self.done_ns = 0
        self.chunked = False
        self.raw = bytearray()
        self.pos = 0

    def feed(self, data: memoryview) -> bool:
        """Take received bytes; True once the response is complete."""
        if self.length < 0:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = self.head[:end].decode("latin-1").split("\r\n")
            self.status = int(lines[0].split()[1])
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            # Go's net/http (node_exporter) streams a gzip body in chunks, without a length.
            self.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            self.length = int(headers.get("content-length", "0"))
            self.encoding = headers.get("content-encoding", "")
            data = memoryview(self.head)[end + 4 :]
        if self.chunked:
            return self._feed_chunked(data)
        self.received += len(data)
        if self.keep_body:
            self.parts.append(bytes(data))
        return self.received >= self.length

    def _feed_chunked(self, data: memoryview) -> bool:
        self.raw += data
        while True:
            line_end = self.raw.find(b"\r\n", self.pos)
            if line_end < 0:
                return False
            size = int(bytes(self.raw[self.pos : line_end]).split(b";")[0], 16)
            start = line_end + 2
            if size == 0:
                # The last chunk, no trailers: an empty line ends the response.
                return self.raw.find(b"\r\n", start) == start
            if len(self.raw) < start + size + 2:
                return False
            if self.keep_body:
                self.parts.append(bytes(self.raw[start : start + size]))
            self.pos = start + size + 2


class LoadGenerator:
    """``n`` keep-alive connections driven by one thread and one :mod:`selectors` loop: a
    round sends the request on every connection at once and times each response to its last
    byte. Unlike threads in this process, it never waits for its own GIL to notice that a
    response has arrived; and a response's end is the kernel's receive timestamp of its last
    segment, so the time this loop spends on the other 49 responses is not counted in it."""

    def __init__(self, port: int, n: int) -> None:
        self.port = port
        self.socks: list[socket.socket | None] = [None] * n
        self.errors: list[str] = []
        self.bodies_checked = 0
        self._buffer = bytearray(1 << 20)

    def _connect(self, index: int) -> socket.socket:
        sock = self.socks[index]
        if sock is None:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=SCRAPE_TIMEOUT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            sock.setblocking(False)
            self.socks[index] = sock
        return sock

    def round(self, gzip: bool, timeout: float = SCRAPE_TIMEOUT) -> list[float]:
        """Latencies (seconds) of the 200 responses of one round."""
        import gzip as gzip_module
        import selectors

        request = _request(gzip)
        selector = selectors.DefaultSelector()
        pending: dict[socket.socket, _Exchange] = {}
        for index in range(len(self.socks)):
            try:
                sock = self._connect(index)
            except OSError as exc:
                self.errors.append(f"connect: {exc!r}")
                continue
            exchange = _Exchange(sock, keep_body=index == 0)
            pending[sock] = exchange
        for sock, exchange in pending.items():
            exchange.sent_ns = time.time_ns()
            sock.sendall(request)  # about 100 bytes: the socket buffer takes them at once
            selector.register(sock, selectors.EVENT_READ, exchange)
        done: list[_Exchange] = []
        buffer = memoryview(self._buffer)
        ancillary = socket.CMSG_SPACE(_TIMESPEC.size)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for key, _mask in selector.select(max(0.0, deadline - time.monotonic())):
                exchange = key.data
                try:
                    size, cmsgs, _flags, _addr = exchange.sock.recvmsg_into([buffer], ancillary)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    size, cmsgs = 0, []
                    self.errors.append(repr(exc))
                if not size:
                    self._drop(exchange.sock, selector, pending)
                    self.errors.append("connection closed before the response ended")
                    continue
                stamp = time.time_ns()
                for level, kind, data in cmsgs:
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                        seconds, nanoseconds = _TIMESPEC.unpack(data[: _TIMESPEC.size])
                        stamp = seconds * 1_000_000_000 + nanoseconds
                if exchange.feed(buffer[:size]):
                    exchange.done_ns = stamp
                    selector.unregister(exchange.sock)
                    del pending[exchange.sock]
                    done.append(exchange)
        for sock in list(pending):
            self.errors.append("no response in time")
            self._drop(sock, selector, pending)
        selector.close()
        for exchange in done:
            if exchange.keep_body and exchange.status == 200:
                body = b"".join(exchange.parts)
                if gzip and exchange.encoding != "gzip":
                    self.errors.append(f"asked for gzip, got {exchange.encoding or 'identity'}")
                elif exchange.encoding == "gzip":
                    body = gzip_module.decompress(body)
                if not body.startswith(b"#") and b"\n" not in body[:4096]:
                    self.errors.append("the body is not an exposition")
                self.bodies_checked += 1
        return [(e.done_ns - e.sent_ns) / 1e9 for e in done if e.status == 200]

    def _drop(self, sock: socket.socket, selector: Any, pending: dict[socket.socket, Any]) -> None:
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(sock)
        pending.pop(sock, None)
        index = self.socks.index(sock)
        sock.close()
        self.socks[index] = None

    def close(self) -> None:
        for sock in self.socks:
            if sock is not None:
                sock.close()
        self.socks = [None] * len(self.socks)


def _latency_single(port: int, seconds: float, max_requests: int, gzip: bool) -> list[float]:
    """One scraper: sequential GETs on a keep-alive connection, 10 ms apart."""
    load = LoadGenerator(port, 1)
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    try:
        while len(latencies) < max_requests and time.monotonic() < deadline:
            latencies.extend(load.round(gzip))
            time.sleep(0.01)
    finally:
        load.close()
    _report_errors(load)
    return latencies


def _latency_burst(
    port: int, scrapers: int, seconds: float, max_rounds: int, gzip: bool
) -> list[float]:
    """``scrapers`` keep-alive connections whose requests are all sent together, once per
    round, rounds 0.2 s apart."""
    load = LoadGenerator(port, scrapers)
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    rounds = 0
    try:
        while rounds < max_rounds and time.monotonic() < deadline:
            latencies.extend(load.round(gzip))
            rounds += 1
            time.sleep(0.2)
    finally:
        load.close()
    _report_errors(load)
    return latencies


def _report_errors(load: LoadGenerator) -> None:
    if load.errors:
        print(f"  ({len(load.errors)} scrape errors, first: {load.errors[0]})", file=sys.stderr)


def _latency_figures(values: list[float]) -> dict[str, Any]:
    return {
        "requests": len(values),
        "p50_ms": round(percentile(values, 50) * 1000, 2),
        "p99_ms": round(percentile(values, 99) * 1000, 2),
        "max_ms": round(max(values) * 1000, 2) if values else float("nan"),
    }


def phase_overhead(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"scenario": args.scenario}
    if args.baseline:
        result["baseline"] = args.baseline
    with contextlib.ExitStack() as stack:
        baseline_tree = stack.enter_context(_checked_out(args.baseline)) if args.baseline else None
        base = stack.enter_context(temp_root("nodescope-bench-"))
        root = base / "node"
        stats_path = base / "daemon-stats.json"
        floor_stats = base / "floor-stats.json"
        print(f"== overhead: simulator for {args.scenario} under {root}", flush=True)
        sim = start_simulator(args.scenario, root)
        targets: list[Target] = []
        floor: subprocess.Popen[str] | None = None
        if baseline_tree is not None:
            stack.enter_context(_hook_socket_taken(root))
        try:
            if args.floor_cycles:
                files = base / "files.json"
                result["files"] = _record_files(args, root, files)
                floor = _start_floor(files, root, floor_stats)
            port = free_port()
            daemon = subprocess.Popen(
                [PYTHON, str(BENCH / "daemon.py"), str(root), "--listen", f"127.0.0.1:{port}",
                 "--stats", str(stats_path)],
                env=_tree_environment(REPO),
            )  # fmt: skip
            targets.append(Target("nodescope", port, daemon))
            if baseline_tree is not None:
                targets.append(_start_baseline(baseline_tree, root, base / "baseline-stats.json"))
            if not args.no_node_exporter:
                ne_port = free_port()
                ne = subprocess.Popen(
                    [
                        NODE_EXPORTER,
                        f"--path.procfs={root / 'proc'}",
                        f"--path.sysfs={root / 'sys'}",
                        f"--path.rootfs={root}",
                        f"--web.listen-address=127.0.0.1:{ne_port}",
                        "--collector.disable-defaults",
                        *(f"--collector.{c}" for c in NODE_EXPORTER_COLLECTORS),
                        "--log.level=warn",
                    ],
                    stderr=subprocess.DEVNULL,
                )
                targets.append(Target("node_exporter", ne_port, ne))
            for target in targets:
                wait_ready(target.port, 120, target.process)
            windows = []
            for number, every in enumerate(args.scrape_intervals):
                windows.append(_overhead_window(args, targets, floor, every, warmup=number == 0))
            if floor is not None:
                # The floor stops before the latency runs: it is measured in the windows only.
                stop(floor)
            result["overhead"] = windows[0]
            result["slower_scrapes"] = windows[1:]
            result["latency"] = _latency(args, targets)
        finally:
            for target in targets:
                stop(target.process)
            if floor is not None:
                stop(floor)
            stop(sim)
        stats = {
            name: json.loads(path.read_text()) if path.exists() else {}
            for name, path in (
                ("nodescope", stats_path),
                ("baseline", base / "baseline-stats.json"),
                ("floor", floor_stats),
            )
        }
        for window in [result.get("overhead"), *result.get("slower_scrapes", [])]:
            if not window:
                continue
            for name in ("nodescope", "baseline"):
                if name in window:
                    _add_cycle_stats(window, stats[name], name)
            if "floor" in window:
                _add_floor_stats(window, stats["floor"])
    return result


def _record_files(args: argparse.Namespace, root: Path, path: Path) -> dict[str, Any]:
    """A recording run of the daemon (``bench/daemon.py --record-files``) on the node, before
    anything is measured: the files, directories and links it read in ``--floor-cycles``
    cycles after two of warm-up, for the floor. Its audit hook never runs in a measured
    process."""
    sys.path.insert(0, str(BENCH))
    import floor

    print(f"   recording what the daemon reads: {args.floor_cycles} cycles", flush=True)
    subprocess.run(
        [PYTHON, str(BENCH / "daemon.py"), str(root), "--listen", f"127.0.0.1:{free_port()}",
         "--record-files", str(path), "--record-skip", "2",
         "--record-cycles", str(args.floor_cycles)],
        env=_tree_environment(REPO), check=True, timeout=120 + 2 * args.floor_cycles,
    )  # fmt: skip
    summary: dict[str, Any] = floor.FileList.read(path).summary()
    # Kept beside the results: which files a cycle read is worth reading when a figure moves.
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, args.out / "files.json")
    return summary


def _start_floor(files: Path, root: Path, stats: Path) -> subprocess.Popen[str]:
    """The floor reader (``bench/floor.py``) on the node, one recorded cycle per second."""
    process = subprocess.Popen(
        [PYTHON, str(BENCH / "floor.py"), str(files), str(root), "--stats", str(stats)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    if line.strip() != "ready":
        stop(process)
        raise RuntimeError(f"the floor reader did not start: {line!r}")
    return process


@contextmanager
def _hook_socket_taken(root: Path) -> Iterator[None]:
    """The simulated node's hook socket held by the benchmark, so that neither of two daemons
    on the node serves it (the first to start would otherwise run the hook server alone)."""
    from nodescope.hooks.transport import socket_path
    from nodescope.roots import Roots

    path = socket_path(Roots.under(root))
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(64)
        yield


@contextmanager
def _checked_out(revision: str) -> Iterator[Path]:
    """A detached git worktree of ``revision`` of this repository, removed afterwards."""
    repository = BENCH.parent
    place = Path(tempfile.mkdtemp(prefix="nodescope-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(repository), "worktree", "add", "--quiet", "--detach", str(place),
         revision],
        check=True,
    )  # fmt: skip
    try:
        compile_tree(place)
        yield place
    finally:
        subprocess.run(
            ["git", "-C", str(repository), "worktree", "remove", "--force", str(place)],
            check=False,
        )
        shutil.rmtree(place.parent, ignore_errors=True)


def compile_tree(tree: Path) -> None:
    """Byte-compile ``tree``'s packages, as installing them does (pip, the Debian and RPM
    packages): a daemon started from sources it must compile first carries the compiler's
    leftovers in its heap (about 1.7 MiB), and its serving process, run from the source,
    compiles it on every start (``nodescope.httpserver.serving_script``)."""
    subprocess.run(
        [PYTHON, "-m", "compileall", "-q", "-j", "0",
         str(tree / "daemon"), str(tree / "exporters"), str(tree / "bench")],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def _tree_environment(tree: Path) -> dict[str, str]:
    """The environment that makes a daemon import its packages from ``tree``'s source roots.
    Both daemons of a side-by-side run are started so: one imported through the editable
    install's finder and the other through ``PYTHONPATH`` would not be the same program
    apart from the revision."""
    return dict(os.environ, PYTHONPATH=f"{tree / 'daemon'}{os.pathsep}{tree / 'exporters'}")


def _start_baseline(tree: Path, root: Path, stats_path: Path) -> Target:
    """The daemon of another revision (its own ``bench/daemon.py`` and packages, this
    environment's interpreter and libraries) on the same simulated node as this one: both run
    in the same window, so the machine's noise falls on both alike."""
    env = _tree_environment(tree)
    port = free_port()
    daemon = subprocess.Popen(
        [PYTHON, str(tree / "bench" / "daemon.py"), str(root), "--listen", f"127.0.0.1:{port}",
         "--stats", str(stats_path)],
        env=env,
    )  # fmt: skip
    return Target("baseline", port, daemon)


def _overhead_window(
    args: argparse.Namespace,
    targets: list[Target],
    floor: subprocess.Popen[str] | None,
    every: int,
    warmup: bool,
) -> dict[str, Any]:
    """One measured window of ``args.window`` seconds with one scrape of each target every
    ``every`` seconds (the first at the window's start); memory is sampled every second. The
    floor reader, when there is one, reads through it."""
    scrapers = {t.name: Scraper(t.port) for t in targets}
    if warmup:
        print(f"   warm-up {args.warmup:.0f} s", flush=True)
        deadline = time.monotonic() + args.warmup
        while time.monotonic() < deadline:
            for s in scrapers.values():
                s.get()
            time.sleep(max(0.0, 1.0 - (time.monotonic() % 1.0)))
    print(f"   window {args.window:.0f} s: one scrape of each every {every} s", flush=True)
    start = time.monotonic()
    # nodescope's CPU is the daemon's and its serving process's together.
    serving0 = {t.name: _serving_cpu(t.process.pid) for t in targets}
    cpu0 = {t.name: tree_cpu_seconds(t.process.pid) for t in targets}
    floor0 = proc_schedstat_seconds(floor.pid) if floor is not None else 0.0
    scrapes = dict.fromkeys(scrapers, 0)
    bodies: dict[str, bytes] = {}
    scrape_latency: dict[str, list[float]] = {name: [] for name in scrapers}
    samples: dict[str, list[Memory]] = {t.name: [] for t in targets}
    next_tick = start
    ticks = rounds = 0
    while time.monotonic() - start < args.window:
        if ticks % every == 0:
            # Scraped in turn, first one then the other ahead: neither daemon is always the
            # one whose serving process wakes while the other's still holds a core.
            rounds += 1
            for target in targets if rounds % 2 else targets[::-1]:
                latency, _, body = scrapers[target.name].get()
                scrapes[target.name] += 1
                scrape_latency[target.name].append(latency)
                bodies[target.name] = body
        for target in targets:
            samples[target.name].append(memory(target.process.pid))
        ticks += 1
        next_tick += 1.0
        time.sleep(max(0.0, next_tick - time.monotonic()))
    end = time.monotonic()
    cpu1 = {t.name: tree_cpu_seconds(t.process.pid) for t in targets}
    serving1 = {t.name: _serving_cpu(t.process.pid) for t in targets}
    floor1 = proc_schedstat_seconds(floor.pid) if floor is not None else 0.0
    for s in scrapers.values():
        s.close()
    out: dict[str, Any] = {
        "window_seconds": round(end - start, 2),
        "scrape_every_seconds": every,
        "start": start,
        "end": end,
    }
    if floor is not None:
        out["floor"] = {"cpu_seconds": round(floor1 - floor0, 4)}
    for target in targets:
        target.memory.extend(samples[target.name])
        cpu = cpu1[target.name] - cpu0[target.name]
        body = bodies.get(target.name, b"")
        rss = [m.total_rss for m in samples[target.name]]
        last = samples[target.name][-1]
        out[target.name] = {
            "cpu_seconds": round(cpu, 3),
            "serving_cpu_seconds": round(serving1[target.name] - serving0[target.name], 3),
            "scrapes": scrapes[target.name],
            "cpu_ms_per_scrape": round(cpu / max(1, scrapes[target.name]) * 1000, 2),
            # RSS of the daemon and its serving process together (the serving process shares
            # the interpreter's pages with the daemon: PSS counts them once).
            "rss_mib_start": round(rss[0] / 2**20, 1),
            "rss_mib_end": round(rss[-1] / 2**20, 1),
            "rss_mib_max": round(max(rss) / 2**20, 1),
            "rss_mib_series": [round(r / 2**20, 1) for r in rss],
            "daemon_rss_mib_end": round(last.rss / 2**20, 1),
            "serving_rss_mib_end": round(last.serving_rss / 2**20, 1),
            "pss_mib_end": round(last.total_pss / 2**20, 1),
            "daemon_pss_mib_end": round(last.pss / 2**20, 1),
            "serving_pss_mib_end": round(last.serving_pss / 2**20, 1),
            "series": series_count(body),
            "bytes": len(body),
            "fds": proc_fds(target.process.pid),
            "scrape_p50_ms_quiet": round(percentile(scrape_latency[target.name], 50) * 1000, 2),
        }
    return out


#: Latency modes: (key, scrapers, gzip). Prometheus asks for gzip; plain for one scraper too.
LATENCY_MODES = (("1", 1, True), ("1-plain", 1, False), ("burst", 0, True))


def _latency(args: argparse.Namespace, targets: list[Target]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target in targets:
        entry: dict[str, Any] = {}
        for key, scrapers, gzip in LATENCY_MODES:
            scrapers = scrapers or args.scrapers
            key = key if scrapers == 1 else str(scrapers)
            encoding = "gzip" if gzip else "plain"
            print(f"   latency: {target.name}, {scrapers} scraper(s), {encoding}", flush=True)
            cpu0 = tree_cpu_seconds(target.process.pid)
            if scrapers == 1:
                values = _latency_single(target.port, args.latency_seconds, 300, gzip)
            else:
                values = _latency_burst(target.port, scrapers, args.latency_seconds * 2, 20, gzip)
            cpu = tree_cpu_seconds(target.process.pid) - cpu0
            figures = _latency_figures(values)
            figures["encoding"] = encoding
            figures["process_cpu_seconds"] = round(cpu, 3)
            entry[key] = figures
        out[target.name] = entry
    return out


def _serving_cpu(pid: int) -> float:
    """CPU seconds of the daemon's serving process, from /proc/<pid>/schedstat (nanoseconds:
    a few milliseconds a second are below /proc/<pid>/stat's 10 ms ticks)."""
    child = serving_process(pid)
    if child is None:
        return 0.0
    try:
        return int(Path(f"/proc/{child}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _add_cycle_stats(window: dict[str, Any], stats: dict[str, Any], name: str) -> None:
    """Cycles of the daemon ``name`` that ended inside ``window``, from its own log, and its
    CPU per cycle."""
    if not stats or not window:
        return
    ends = stats["cycle_end_monotonic"]
    cpu = stats["cycle_thread_cpu_seconds"]
    inside = [c for e, c in zip(ends, cpu, strict=True) if window["start"] <= e <= window["end"]]
    refresh = stats["nvml_refresh_cpu_seconds"] / max(1, stats["nvml_refreshes"])
    ns = window[name]
    ns["cycles"] = len(inside)
    ns["cpu_ms_per_cycle"] = round(ns["cpu_seconds"] / max(1, len(inside)) * 1000, 2)
    ns["serving_cpu_ms_per_cycle"] = round(
        ns.get("serving_cpu_seconds", 0.0) / max(1, len(inside)) * 1000, 2
    )
    ns["nvml_mirror_refresh_ms_per_cycle"] = round(refresh * 1000, 3)
    ns["cpu_ms_per_cycle_without_mirror"] = round(ns["cpu_ms_per_cycle"] - refresh * 1000, 2)
    ns["main_thread_cycle_ms"] = {
        "mean": round(statistics.fmean(inside) * 1000, 2) if inside else None,
        "p50": round(percentile(inside, 50) * 1000, 2),
        "p99": round(percentile(inside, 99) * 1000, 2),
        "max": round(max(inside) * 1000, 2) if inside else None,
    }
    ns["sources"] = stats["sources"]
    ns["parts_ms_per_cycle"] = _parts_in_window(window, stats)


def _parts_in_window(window: dict[str, Any], stats: dict[str, Any]) -> dict[str, float]:
    """CPU per cycle of each part the daemon timed (``bench/daemon.py`` ``PartClocks``) over
    the cycles that ended inside ``window``: its running totals at the last of them less
    those at the cycle before the first."""
    names, log = stats.get("parts"), stats.get("parts_cpu_cumulative")
    if not names or not log:
        return {}
    ends = stats["cycle_end_monotonic"]
    inside = [i for i, e in enumerate(ends) if window["start"] <= e <= window["end"]]
    if not inside:
        return {}
    last = log[inside[-1]]
    before = log[inside[0] - 1] if inside[0] > 0 else [0.0] * len(names)
    return {
        name: round((last[k] - before[k]) / len(inside) * 1000, 3) for k, name in enumerate(names)
    }


def _add_floor_stats(window: dict[str, Any], stats: dict[str, Any]) -> None:
    """The floor reader's cycles inside ``window``: its process CPU per cycle (the floor),
    its loop's own CPU, and what a cycle read on average."""
    floor = window["floor"]
    if not stats:
        return
    ends = stats["cycle_end_monotonic"]
    inside = [i for i, e in enumerate(ends) if window["start"] <= e <= window["end"]]
    cycles = max(1, len(inside))
    floor["cycles"] = len(inside)
    floor["cpu_ms_per_cycle"] = round(floor["cpu_seconds"] / cycles * 1000, 3)
    loop = [stats["cycle_thread_cpu_seconds"][i] for i in inside]
    floor["loop_cpu_ms_mean"] = round(statistics.fmean(loop) * 1000, 3) if loop else None
    floor["loop_cpu_ms_p50"] = round(percentile(loop, 50) * 1000, 3)
    for key in ("files", "bytes", "dirs", "names", "links", "missing", "refused"):
        floor[f"{key}_per_cycle"] = round(sum(stats[key][i] for i in inside) / cycles, 1)
    floor["skipped_at_load"] = len(stats.get("skipped_at_load", []))


# --------------------------------------------------------------------------------------------
# Profile: where the daemon's cycle goes, by py-spy


def phase_profile(args: argparse.Namespace) -> dict[str, Any]:
    """py-spy samples the daemon (as in the overhead phase, scraped once a second) for
    ``--profile-seconds``; the collapsed stacks are summed by the daemon's parts and by
    function (self time)."""
    py_spy = Path(PYTHON).with_name("py-spy")
    if not py_spy.exists():
        py_spy = Path(shutil.which("py-spy") or "py-spy")
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "profile.txt"
    with temp_root("nodescope-profile-") as base:
        root = base / "node"
        print(f"== profile: py-spy on the daemon for {args.profile_seconds:.0f} s", flush=True)
        sim = start_simulator(args.scenario, root)
        port = free_port()
        daemon = subprocess.Popen(
            [PYTHON, str(BENCH / "daemon.py"), str(root), "--listen", f"127.0.0.1:{port}"]
        )
        try:
            wait_ready(port, 120, daemon)
            scraper = Scraper(port)
            time.sleep(args.warmup / 2)
            spy = subprocess.Popen(
                [str(py_spy), "record", "--pid", str(daemon.pid), "--duration",
                 str(int(args.profile_seconds)), "--rate", str(PROFILE_RATE), "--format", "raw",
                 "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            # One scrape a second, as in the overhead phase's first window: the daemon then
            # renders every cycle (unscraped, it would render nothing).
            while spy.poll() is None:
                scraper.get()
                time.sleep(1.0)
            scraper.close()
            if spy.returncode != 0:
                raise RuntimeError(f"py-spy exited with {spy.returncode}")
        finally:
            stop(daemon)
            stop(sim)
    return summarise_profile(raw.read_text())


#: py-spy's samples per second: a cycle costs milliseconds, so 200 Hz caught a few hundred
#: samples in 30 s, too few to tell the sources apart.
PROFILE_RATE = 1000

#: The daemon's parts, by the frame that identifies them (first match from the root).
_PARTS = (
    ("render", "MetricsCache.render_latest"),
    ("render", "JsonCache.render_latest"),
    ("analyse", "Analyzer.analyze"),
    ("self-measurement", "ProcessMeter.measure"),
    ("publish", "MetricsHTTPServer.publish"),
    ("nvml xid thread", "_XidWatcher"),
    ("render thread (on-demand renders, serving process's messages)", "_render_loop"),
)
#: Leaf frames of a thread that py-spy sampled while it waited (a blocking call that holds
#: no GIL but was caught entering or leaving it): counted apart, not as work.
_WAITS = ("Condition.wait", "Event.wait", "EpollSelector.select", "PollSelector.select",
          "Thread.join", "sleep (")  # fmt: skip


def summarise_profile(text: str) -> dict[str, Any]:
    own: dict[str, int] = {}
    parts: dict[str, int] = {}
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        total += count
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + count
        part = "other"
        if any(leaf.startswith(wait) for wait in _WAITS):
            part = "waiting"
        else:
            for frame in frames:
                # A source's run: the worker thread's _call (collect.py), then its collect.
                if frame.startswith("_call (") and "collect.py" in frame:
                    source = next(
                        (f for f in frames if ".collect (" in f and "Collector" not in f), ""
                    )
                    part = "collect " + (source.split(" (")[0] or "?")
                    break
                found = next((name for name, key in _PARTS if key in frame), None)
                if found is not None:
                    part = found
                    break
        parts[part] = parts.get(part, 0) + count
    busy = {k: v for k, v in parts.items() if k not in ("other", "waiting")}
    return {
        "samples": total,
        "parts_percent": {
            k: round(v / total * 100, 1) for k, v in sorted(parts.items(), key=lambda i: -i[1])
        },
        "busy_samples": sum(busy.values()),
        "top_self_percent": [
            [k, round(v / total * 100, 1)] for k, v in sorted(own.items(), key=lambda i: -i[1])[:25]
        ],
    }


# --------------------------------------------------------------------------------------------
# Scale curves: simulated time, one process per variant


def scale_point(path: str, cycles: int) -> dict[str, Any]:
    """The daemon's cycle on one variant, in simulated time; run in a process of its own."""
    from daemon import time_calls  # bench/daemon.py, beside this script: its timer

    from nodescope.assembly import default_config
    from nodescope.config import Config
    from nodescope.service import Service
    from nodescope.sim.node import SimulatedNode, make_temp_root
    from nodescope.sim.scenario import load_scenario
    from nodescope.sources.registry import SourceInputs

    scenario = load_scenario(path)
    root = make_temp_root("nodescope-scale-")
    try:
        node = SimulatedNode(scenario, root)
        node.materialise()
        node.advance_to(0.0)
        clock = _SimClock()
        config = default_config(roots=node.roots)
        # One set of shared inputs, as the daemon builds its sources (one cgroup walk a cycle).
        inputs = SourceInputs()
        sources = node.sources(inputs=inputs)
        per_source: dict[str, float] = dict.fromkeys((s.name for s in sources), 0.0)
        for source in sources:
            time_calls(source, "collect", per_source, source.name)

        def make(cfg: Config) -> Any:
            from nodescope.collect import Collector

            collector = Collector.from_config(cfg, sources, inputs)
            for item in collector.scheduled:
                # Sources in this thread, so its CPU clock counts them (the daemon runs them
                # in a worker under a deadline; in simulated time nothing blocks).
                item.timeout = None
            collector.clock = clock
            collector.wall_clock = lambda: 1_750_000_000.0 + clock.now
            return collector

        service = Service(lambda: config, make_collector=make)
        parts = {"analyze": 0.0, "render": 0.0}
        time_calls(service.analyzer, "analyze", parts, "analyze")
        # With no server the service renders as each cycle ends (both documents).
        time_calls(service.cache, "render_latest", parts, "render")
        time_calls(service.alerts_cache, "render_latest", parts, "render")
        totals: list[float] = []
        for i in range(cycles + 1):
            node.advance_to(float(i))
            clock.now = float(i)
            if i == 0:
                service.run_cycle()
                # As Service.run does after its first cycle.
                gc.freeze()
                for key in per_source:
                    per_source[key] = 0.0
                parts.update(analyze=0.0, render=0.0)
                continue
            started = time.thread_time()
            service.run_cycle()
            totals.append(time.thread_time() - started)
        _, body = service.cache.body()
        service.shutdown()
        procs = sum(1 for e in os.scandir(node.roots.procfs) if e.name.isdigit())
        threads = sum(
            len(os.listdir(node.roots.procfs / e.name / "task"))
            for e in os.scandir(node.roots.procfs)
            if e.name.isdigit()
        )
        return {
            "scenario": scenario.name,
            "gpus": len(scenario.hardware.gpus),
            "nvlinks": sum(g.nvlink_count for g in scenario.hardware.gpus),
            "processes": procs,
            "threads": threads,
            "jobs": len(scenario.jobs),
            "cycles": cycles,
            "cpu_ms_per_cycle": round(statistics.fmean(totals) * 1000, 2),
            "cpu_ms_p50": round(percentile(totals, 50) * 1000, 2),
            "cpu_ms_max": round(max(totals) * 1000, 2),
            "sources_ms_per_cycle": {k: round(v / cycles * 1000, 2) for k, v in per_source.items()},
            "analyze_ms_per_cycle": round(parts["analyze"] / cycles * 1000, 2),
            "render_ms_per_cycle": round(parts["render"] / cycles * 1000, 2),
            "series": series_count(body),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def phase_scale(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(BENCH))
    import variants

    curves: dict[str, list[dict[str, Any]]] = {}
    with temp_root("nodescope-variants-") as directory:
        for curve, (points, build) in variants.CURVES.items():
            if args.curves and curve not in args.curves:
                continue
            for point in points:
                if args.quick and point not in (points[0], points[-1]):
                    continue
                path = variants.write_variant(build(point), directory)
                print(f"== scale: {curve} = {point}", flush=True)
                out = subprocess.run(
                    [PYTHON, str(BENCH / "run.py"), "_scale_point", str(path),
                     str(args.scale_cycles)],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                if out.returncode != 0:
                    print(out.stderr, file=sys.stderr)
                    raise RuntimeError(f"scale point {path.name} failed")
                entry = json.loads(out.stdout.strip().splitlines()[-1])
                entry["point"] = point
                curves.setdefault(curve, []).append(entry)
    slopes: dict[str, Any] = {}
    element = {"gpus": "gpus", "processes": "threads", "jobs": "jobs", "nvlinks": "nvlinks"}
    for curve, entries in curves.items():
        if len(entries) < 2:
            continue
        first, last = entries[0], entries[-1]
        key = element[curve]
        span = last[key] - first[key]
        if span:
            slopes[curve] = {
                "per": key.rstrip("s"),
                "us_per_element": round(
                    (last["cpu_ms_per_cycle"] - first["cpu_ms_per_cycle"]) / span * 1000, 2
                ),
                "series_per_element": round((last["series"] - first["series"]) / span, 2),
            }
    return {"curves": curves, "cost_per_element": slopes}


# --------------------------------------------------------------------------------------------
# Soak: simulated time, job churn

JOB_ID = re.compile(rb'job_id="([^"]*)"')


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Runs in a process of its own (so its RSS and descriptors are the daemon's parts')."""
    sys.path.insert(0, str(BENCH))
    from daemon import node_sources

    from nodescope.assembly import default_config
    from nodescope.config import Config
    from nodescope.roots import Roots
    from nodescope.service import Service
    from nodescope.sim.nvml_mirror import MirroredNvml
    from nodescope.sim.run_node import STATE_FILE
    from nodescope.sources.registry import SourceInputs

    with temp_root("nodescope-soak-") as base:
        root = base / "node"
        scenario = args.soak_scenario
        sim = start_simulator(
            scenario, root, "--churn-slots", str(args.churn_slots), "--churn-every",
            str(args.churn_every), stepped=True,
        )  # fmt: skip
        assert sim.stdin is not None and sim.stdout is not None
        try:
            mirror = MirroredNvml(root / STATE_FILE)
            clock = _SimClock()
            config = default_config(roots=Roots.under(root))
            inputs = SourceInputs()
            sources = node_sources(mirror, inputs)

            def make(cfg: Config) -> Any:
                from nodescope.collect import Collector

                collector = Collector.from_config(cfg, sources, inputs)
                collector.clock = clock
                collector.wall_clock = mirror.wall_clock
                return collector

            service = Service(lambda: config, make_collector=make)
            pid = os.getpid()
            warm = args.soak_warmup
            samples: list[tuple[int, int, int, int]] = []  # cycle, rss, fds, series
            stale: list[tuple[int, list[str]]] = []
            checks = 0
            seen_jobs: set[str] = set()
            traced: tracemalloc.Snapshot | None = None
            started = time.monotonic()
            for cycle in range(args.soak_cycles + 1):
                t = float(cycle)
                sim.stdin.write(f"{t}\n")
                sim.stdin.flush()
                reply = json.loads(sim.stdout.readline())
                clock.now = t
                service.run_cycle()
                if cycle == 0:
                    gc.freeze()  # as Service.run does after its first cycle
                if cycle % args.churn_every == args.churn_every // 2 and cycle > args.churn_every:
                    _, body = service.cache.body()
                    labelled = {m.decode() for m in JOB_ID.findall(body)}
                    seen_jobs |= labelled
                    leftover = sorted(labelled & set(reply["ended"]))
                    checks += 1
                    if leftover:
                        stale.append((cycle, leftover))
                if args.soak_tracemalloc and cycle == warm:
                    tracemalloc.start(8)
                    traced = tracemalloc.take_snapshot()
                if cycle % 100 == 0 or cycle == warm:
                    _, body = service.cache.body()
                    samples.append((cycle, proc_rss_bytes(pid), proc_fds(pid), series_count(body)))
                if cycle % 1000 == 0:
                    print(
                        f"   soak cycle {cycle}: rss {proc_rss_bytes(pid) / 2**20:.1f} MiB, "
                        f"{proc_fds(pid)} fds, {time.monotonic() - started:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            elapsed = time.monotonic() - started
            growth: list[str] = []
            if args.soak_tracemalloc and traced is not None:
                stats = tracemalloc.take_snapshot().compare_to(traced, "traceback")
                growth = [
                    f"{st.size_diff / 1024:+.1f} KiB {st.count_diff:+d} blocks at "
                    + " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in st.traceback)
                    for st in stats[:15]
                ]
            service.shutdown()
            ended = reply["ended"]
        finally:
            sim.stdin.close()
            stop(sim)
    after = [s for s in samples if s[0] >= warm]
    # RSS wobbles with the allocator; compare the median of the first and last tenth.
    tenth = max(1, len(after) // 10)
    rss_warm = statistics.median(s[1] for s in after[:tenth])
    rss_end = statistics.median(s[1] for s in after[-tenth:])
    return {
        "scenario": Path(scenario).stem,
        "cycles": args.soak_cycles,
        "warmup_cycles": warm,
        "churn": {"slots": args.churn_slots, "every": args.churn_every, "jobs_ended": len(ended)},
        "elapsed_seconds": round(elapsed, 1),
        "rss_mib_after_warmup": round(rss_warm / 2**20, 2),
        "rss_mib_end": round(rss_end / 2**20, 2),
        "rss_growth_mib": round((rss_end - rss_warm) / 2**20, 2),
        "rss_mib_max_after_warmup": round(max(s[1] for s in after) / 2**20, 2),
        "fds_after_warmup": after[0][2],
        "fds_end": after[-1][2],
        "series_after_warmup": after[0][3],
        "series_end": after[-1][3],
        "series_max": max(s[3] for s in after),
        "job_ids_seen": len(seen_jobs),
        "stale_checks": checks,
        "stale_series": stale[:10],
        "samples": samples,
        "tracemalloc_growth": growth,
        "passed": (rss_end - rss_warm) <= 2**20 and not stale and after[-1][2] <= after[0][2],
    }


def phase_soak(args: argparse.Namespace) -> dict[str, Any]:
    with temp_root("nodescope-soak-scenario-") as directory:
        return _phase_soak(args, directory)


def _phase_soak(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    if not args.soak_scenario:
        sys.path.insert(0, str(BENCH))
        import variants

        # dgx-h100 cut down to what a soak needs to run 10,000 cycles in minutes: every kind
        # of source and series, fewer GPUs and background processes.
        doc = variants.with_gpus(args.soak_gpus)
        doc["hardware"]["os"]["background_processes"] = args.soak_processes
        doc["name"] = f"dgx-h100-soak-{args.soak_gpus}gpu-{args.soak_processes}proc"
        args.soak_scenario = str(variants.write_variant(doc, directory))
    print(
        f"== soak: {args.soak_cycles} cycles of {args.soak_scenario}, a job ends and one "
        f"starts every {args.churn_every} cycles",
        flush=True,
    )
    cmd = [
        PYTHON, str(BENCH / "run.py"), "_soak", "--soak-cycles", str(args.soak_cycles),
        "--soak-warmup", str(args.soak_warmup), "--soak-scenario", args.soak_scenario,
        "--churn-slots", str(args.churn_slots), "--churn-every", str(args.churn_every),
        "--soak-gpus", str(args.soak_gpus), "--soak-processes", str(args.soak_processes),
        *(["--soak-tracemalloc"] if args.soak_tracemalloc else []),
    ]  # fmt: skip
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError("soak failed")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# --------------------------------------------------------------------------------------------
# Report


def _side_by_side(
    revision: str,
    ours: dict[str, Any],
    theirs: dict[str, Any],
    latency: dict[str, Any],
    slower: list[dict[str, Any]] | None = None,
) -> list[str]:
    """The rows of this tree against the baseline revision's daemon, both measured over the
    same window on the same simulated node (and in each window of slower scrapes)."""

    def row(label: str, a: float | None, b: float | None) -> str:
        ratio = f"{a / b:.3f}" if a is not None and b else "–"
        shown = ["–" if x is None else str(x) for x in (a, b)]
        return f"| {label} | {shown[0]} | {shown[1]} | {ratio} |"

    def p(figures: dict[str, Any], key: str) -> float | None:
        value = figures.get("main_thread_cycle_ms", {}).get(key)
        return float(value) if value is not None else None

    lines = [
        f"### Side by side with `{revision}` (same window, same node)",
        "",
        "| | this tree | baseline | ratio |",
        "|---|---:|---:|---:|",
        row(
            "process CPU ms per cycle (without the mirror)",
            ours.get("cpu_ms_per_cycle_without_mirror"),
            theirs.get("cpu_ms_per_cycle_without_mirror"),
        ),
        row("main-thread cycle CPU p50 ms", p(ours, "p50"), p(theirs, "p50")),
        row("main-thread cycle CPU mean ms", p(ours, "mean"), p(theirs, "mean")),
        row("main-thread cycle CPU p99 ms", p(ours, "p99"), p(theirs, "p99")),
        row(
            "serving process CPU ms per cycle",
            ours.get("serving_cpu_ms_per_cycle"),
            theirs.get("serving_cpu_ms_per_cycle"),
        ),
        row("RSS MiB, end of window", ours.get("rss_mib_end"), theirs.get("rss_mib_end")),
        row("PSS MiB, end of window", ours.get("pss_mib_end"), theirs.get("pss_mib_end")),
        row("series", ours.get("series"), theirs.get("series")),
    ]
    for window in slower or []:
        if "baseline" in window:
            every = window["scrape_every_seconds"]
            lines += [
                row(
                    f"process CPU ms per cycle, one scrape every {every:g} s",
                    window["nodescope"].get("cpu_ms_per_cycle_without_mirror"),
                    window["baseline"].get("cpu_ms_per_cycle_without_mirror"),
                ),
                row(
                    f"main-thread cycle CPU mean ms, one scrape every {every:g} s",
                    p(window["nodescope"], "mean"),
                    p(window["baseline"], "mean"),
                ),
            ]
    for mode, figures in sorted(latency.get("nodescope", {}).items()):
        other = latency.get("baseline", {}).get(mode)
        if other:
            lines.append(
                row(f"scrape p99 ms, {mode} scraper(s)", figures["p99_ms"], other["p99_ms"])
            )
    return [*lines, ""]


def _parts_table(ov: dict[str, Any]) -> list[str]:
    """nodescope's CPU per cycle by part, on its threads' clocks, in each scrape-interval
    window: where the time goes, from the measured daemon itself."""
    windows = [ov["overhead"], *ov.get("slower_scrapes", [])]
    columns = [w for w in windows if w.get("nodescope", {}).get("parts_ms_per_cycle")]
    if not columns:
        return []
    names = list(columns[0]["nodescope"]["parts_ms_per_cycle"])
    heads = [f"one scrape every {w.get('scrape_every_seconds', 1):g} s" for w in columns]
    lines = [
        "### nodescope's CPU per cycle by part (thread CPU clocks, ms)",
        "",
        "| part | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name in names:
        cells = [str(w["nodescope"]["parts_ms_per_cycle"].get(name, "–")) for w in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [
        (w["nodescope"]["cpu_ms_per_cycle"], sum(w["nodescope"]["parts_ms_per_cycle"].values()))
        for w in columns
    ]
    lines.append(
        "| the rest (loop, publish, collector, threads' start-up, serving process) | "
        + " | ".join(f"{round(total - parts, 2)}" for total, parts in totals)
        + " |"
    )
    lines += [
        "",
        "`source nvml` includes the NVML mirror's refresh (simulation plumbing, taken out of "
        "the CPU figures above).",
        "",
    ]
    return lines


def _intervals_and_floor(ov: dict[str, Any]) -> list[str]:
    """CPU per cycle in each scrape-interval window: nodescope's, node_exporter's per scrape,
    the floor's, and nodescope's ratio to each; then what the floor reads per cycle."""
    windows = [ov["overhead"], *ov.get("slower_scrapes", [])]
    if not any("floor" in w for w in windows) and len(windows) < 2:
        return []

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}" if a is not None and b else "–"

    def shown(x: float | None) -> str:
        return "–" if x is None else str(x)

    lines = [
        "### CPU per cycle by scrape interval, against node_exporter and the floor",
        "",
        "| scrapes | window s | nodescope ms/cycle | node_exporter ms/scrape | floor ms/cycle "
        "| nodescope ÷ node_exporter | nodescope ÷ floor |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in windows:
        every = w.get("scrape_every_seconds", 1)
        ns = w.get("nodescope", {}).get("cpu_ms_per_cycle_without_mirror")
        ne = w.get("node_exporter", {}).get("cpu_ms_per_scrape")
        fl = w.get("floor", {}).get("cpu_ms_per_cycle")
        label = "one per second" if every == 1 else f"one every {every} s"
        lines.append(
            f"| {label} | {w['window_seconds']:.0f} | {shown(ns)} | {shown(ne)} | {shown(fl)} "
            f"| {ratio(ns, ne)} | {ratio(ns, fl)} |"
        )
    lines.append("")
    files = ov.get("files")
    first = next((w["floor"] for w in windows if "cycles" in w.get("floor", {})), None)
    if files and first:
        lines += [
            f"The floor (`bench/floor.py`) replays what the daemon read in {files['cycles']} "
            f"cycles of a recording run after {files['skipped_cycles']} of warm-up, one cycle "
            f"per second: per cycle {first['files_per_cycle']} files opened, read to EOF and "
            f"closed ({first['bytes_per_cycle'] / 1024:.1f} KiB), {first['dirs_per_cycle']} "
            f"directories listed ({first['names_per_cycle']} names), "
            f"{first['links_per_cycle']} links read; {files['file_paths']} distinct files and "
            f"{files['dir_paths']} directories, from the threads "
            f"{', '.join(files['threads']) or '–'}. Its loop's own CPU per cycle: mean "
            f"{first['loop_cpu_ms_mean']} ms, p50 {first['loop_cpu_ms_p50']} ms (the 10, 15 and "
            f"30 s sources' files fall on few cycles); failed opens per cycle "
            f"{first['missing_per_cycle']}, refused files {first['refused_per_cycle']}, "
            f"left out when loaded (not regular files) {first['skipped_at_load']}.",
            f"The daemon per cycle, recorded: {files.get('opens_per_cycle', '–')} file opens, "
            f"{files.get('dir_opens_per_cycle', '–')} directory opens, "
            f"{files.get('listings_per_cycle', '–')} listings, "
            f"{files.get('readlinks_per_cycle', '–')} link reads; of all these "
            f"{files.get('outside_per_cycle', '–')} outside the node's tree (its own /proc "
            "entries), not replayed; the process's read calls "
            f"{files.get('read_calls_per_cycle', '–')} and bytes read "
            f"{files.get('bytes_read_per_cycle', '–')} (all files and sockets, the "
            "simulator's NVML state included).",
            "",
        ]
    return lines


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Run {m['date']} on {m['cpus']} × {m['cpu']}, {m['memory_gib']} GiB, {m['os']}, "
        f"kernel {m['kernel']}, Python {m['python']}; {m['node_exporter']}.",
        f"Load average at start {m['loadavg_start'][0]:.2f}, "
        f"at end {results.get('loadavg_end', [float('nan')])[0]:.2f}.",
        "",
    ]
    ov = results.get("overhead")
    if ov and "overhead" in ov:
        w = ov["overhead"]
        ns = w["nodescope"]
        ne = w.get("node_exporter")
        lines += [
            f"### Overhead on `{ov['scenario']}` ({w['window_seconds']:.0f} s window, "
            f"{ns.get('cycles', '?')} cycles, one scrape of each per second)",
            "",
            "| | nodescope | node_exporter | ratio | target |",
            "|---|---:|---:|---:|---|",
        ]
        ne_cpu = ne["cpu_ms_per_scrape"] if ne else None
        ratio = f"{ns['cpu_ms_per_cycle_without_mirror'] / ne_cpu:.2f}" if ne_cpu else "–"
        lines.append(
            f"| CPU ms per cycle / per scrape | {ns['cpu_ms_per_cycle_without_mirror']:.2f} "
            f"| {ne_cpu if ne_cpu is not None else '–'} | {ratio} | ≤ 5 ms and ≤ node_exporter |"
        )
        lines.append(
            f"| RSS MiB (end of window; max) | {ns['rss_mib_end']} ({ns['rss_mib_max']}) | "
            + (f"{ne['rss_mib_end']} ({ne['rss_mib_max']})" if ne else "–")
            + " | "
            + (f"{ns['rss_mib_end'] / ne['rss_mib_end']:.2f}" if ne else "–")
            + " | ≤ 45 MiB |"
        )
        lines.append(
            f"| series | {ns['series']} | {ne['series'] if ne else '–'} | "
            + (f"{ns['series'] / ne['series']:.1f}" if ne and ne["series"] else "–")
            + " | |"
        )
        lines.append(f"| /metrics bytes | {ns['bytes']} | {ne['bytes'] if ne else '–'} | | |")
        lat = ov.get("latency", {})

        def cell(x: dict[str, Any] | None) -> str:
            return f"{x['p50_ms']} / {x['p99_ms']}" if x else "–"

        modes = {k for v in lat.values() for k in v}
        for n in sorted(modes, key=lambda k: (int(k.split("-")[0]), k)):
            a = lat.get("nodescope", {}).get(n)
            b = lat.get("node_exporter", {}).get(n)
            encoding = (a or b or {}).get("encoding", "plain")
            lines.append(
                f"| scrape p50 / p99 ms, {n.split('-')[0]} scraper(s), {encoding} "
                f"| {cell(a)} | {cell(b)} | "
                + (f"{a['p99_ms'] / b['p99_ms']:.2f}" if a and b and b["p99_ms"] else "–")
                + " | p99 ≤ 5 ms |"
            )
        lines += [
            "",
            f"nodescope process CPU per cycle including the NVML mirror's refresh: "
            f"{ns['cpu_ms_per_cycle']} ms (refresh {ns['nvml_mirror_refresh_ms_per_cycle']} ms); "
            f"main-thread cycle CPU p50 {ns['main_thread_cycle_ms']['p50']} ms, "
            f"p99 {ns['main_thread_cycle_ms']['p99']} ms, "
            f"max {ns['main_thread_cycle_ms']['max']} ms.",
            f"nodescope RSS over the window (MiB, one sample per second, first/last): "
            f"{ns['rss_mib_series'][0]} → {ns['rss_mib_series'][-1]}.",
            *(
                [
                    f"nodescope's CPU and RSS are the daemon's and its serving process's "
                    f"together: the serving process took {ns['serving_cpu_ms_per_cycle']} ms of "
                    f"CPU per cycle; RSS at the end {ns['daemon_rss_mib_end']} + "
                    f"{ns['serving_rss_mib_end']} = {ns['rss_mib_end']} MiB, PSS (shared pages "
                    f"counted once) {ns['daemon_pss_mib_end']} + {ns['serving_pss_mib_end']} = "
                    f"{ns['pss_mib_end']} MiB.",
                ]
                if "serving_rss_mib_end" in ns and "serving_cpu_ms_per_cycle" in ns
                else []
            ),
            "",
        ]
        lines += _intervals_and_floor(ov)
        lines += _parts_table(ov)
        if "baseline" in w:
            lines += _side_by_side(ov["baseline"], ns, w["baseline"], lat, ov.get("slower_scrapes"))
    pr = results.get("profile")
    if pr:
        lines += [
            f"### Where the daemon's CPU goes (py-spy, {pr['samples']} samples of busy threads "
            f"at {PROFILE_RATE} Hz; `waiting`: threads caught blocked, not work)",
            "",
            "| part | % of samples |",
            "|---|---:|",
            *(f"| {k} | {v} |" for k, v in pr["parts_percent"].items()),
            "",
            "Functions with the most self time (% of samples):",
            "",
            *(f"- {name}: {pct}" for name, pct in pr["top_self_percent"][:15]),
            "",
        ]
    sc = results.get("scale")
    if sc:
        lines += ["### Scale (simulated time, CPU ms per 1 s cycle at default intervals)", ""]
        for curve, entries in sc["curves"].items():
            lines += [
                f"**{curve}**",
                "",
                "| point | GPUs | NVLinks | processes | threads | jobs | series | CPU ms/cycle "
                "| collect | analyse | render |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for e in entries:
                collect = sum(e["sources_ms_per_cycle"].values())
                lines.append(
                    f"| {e['point']} | {e['gpus']} | {e['nvlinks']} | {e['processes']} "
                    f"| {e['threads']} | {e['jobs']} | {e['series']} | {e['cpu_ms_per_cycle']} "
                    f"| {collect:.2f} | {e['analyze_ms_per_cycle']} | {e['render_ms_per_cycle']} |"
                )
            lines.append("")
        if sc["cost_per_element"]:
            lines += ["Cost per element (slope between the end points):", ""]
            for curve, s in sc["cost_per_element"].items():
                lines.append(
                    f"- {curve}: {s['us_per_element']} µs CPU per cycle and "
                    f"{s['series_per_element']} series per {s['per']}"
                )
            lines.append("")
    so = results.get("soak")
    if so:
        lines += [
            f"### Soak: {so['cycles']} cycles of `{so['scenario']}` in simulated time, "
            f"{so['churn']['jobs_ended']} jobs ended ({so['elapsed_seconds']:.0f} s)",
            "",
            f"- RSS after {so['warmup_cycles']} cycles of warm-up "
            f"{so['rss_mib_after_warmup']} MiB, "
            f"at the end {so['rss_mib_end']} MiB: growth {so['rss_growth_mib']} MiB (≤ 1 MiB)",
            "- RSS every 1,000 cycles (MiB): "
            + ", ".join(f"{c}: {r / 2**20:.1f}" for c, r, _f, _s in so["samples"] if c % 1000 == 0),
            f"- open descriptors {so['fds_after_warmup']} → {so['fds_end']}",
            f"- series {so['series_after_warmup']} → {so['series_end']} (max {so['series_max']}); "
            f"{so['job_ids_seen']} job ids seen; series of ended jobs at "
            f"{so['stale_checks']} mid-period checks: "
            + ("none" if not so["stale_series"] else f"{so['stale_series']}"),
            *(f"- grew: {g}" for g in so.get("tracemalloc_growth", [])[:8]),
            f"- {'PASS' if so['passed'] else 'FAIL'}",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_scale_point":
        print(json.dumps(scale_point(argv[1], int(argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description="nodescope overhead benchmark")
    parser.add_argument("--phases", default="overhead,profile,scale,soak")
    parser.add_argument("--scenario", default="dgx-h100")
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--scrapers", type=int, default=50)
    parser.add_argument("--latency-seconds", type=float, default=10.0)
    parser.add_argument("--no-node-exporter", action="store_true")
    parser.add_argument(
        "--scrape-intervals",
        type=int,
        nargs="+",
        default=[1, 15],
        metavar="SECONDS",
        help="overhead: one window of --window seconds per interval, one scrape of each "
        "target every SECONDS (default: 1 and Prometheus's default of 15)",
    )
    parser.add_argument(
        "--floor-cycles",
        type=int,
        default=30,
        help="overhead: cycles whose reads the floor replays (30: one period of the longest "
        "default interval); 0 measures no floor",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="overhead: also run the daemon of git revision REV, side by side in the same "
        "window, and print this tree's figures as ratios to it",
    )
    parser.add_argument("--profile-seconds", type=float, default=30.0)
    parser.add_argument("--scale-cycles", type=int, default=60)
    parser.add_argument("--curves", nargs="*")
    parser.add_argument("--quick", action="store_true", help="end points of each curve only")
    parser.add_argument("--soak-cycles", type=int, default=10000)
    parser.add_argument("--soak-warmup", type=int, default=1000)
    parser.add_argument("--soak-scenario", help="scenario (default: dgx-h100 with fewer processes)")
    parser.add_argument("--soak-processes", type=int, default=200)
    parser.add_argument("--soak-gpus", type=int, default=2)
    parser.add_argument(
        "--soak-tracemalloc", action="store_true", help="report where memory grew (slower)"
    )
    parser.add_argument("--churn-slots", type=int, default=4)
    parser.add_argument("--churn-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=BENCH / "results")
    if argv and argv[0] == "_soak":
        args = parser.parse_args(argv[1:])
        print(json.dumps(soak(args)))
        return 0
    parser.add_argument("--report", type=Path, help="print the report of a results.json")
    args = parser.parse_args(argv)
    if any(every < 1 for every in args.scrape_intervals) or args.floor_cycles < 0:
        parser.error("scrape intervals must be whole seconds ≥ 1, --floor-cycles ≥ 0")
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    compile_tree(REPO)
    results: dict[str, Any] = {"machine": machine(), "command": " ".join(["bench/run.py", *argv])}
    if "overhead" in phases:
        results["overhead"] = phase_overhead(args)
    if "profile" in phases:
        results["profile"] = phase_profile(args)
    if "scale" in phases:
        results["scale"] = phase_scale(args)
    if "soak" in phases:
        results["soak"] = phase_soak(args)
    results["loadavg_end"] = os.getloadavg()
    text = report(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(text + "\n")
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
