#!/usr/bin/env python3
"""Run the NVML source against the real pynvml once and show every NVML call it made.

For a machine with NVIDIA GPUs, after the README's setup (it uses the project's venv):

    .venv/bin/python scripts/gpu/nvml-check.py

It initialises NVML, collects twice one second apart (so rates can be shown), lets the Xid
thread run for two seconds, closes, and prints: each call's count, latency (total and
maximum) and its first answer or error; the per-GPU record in short; PCIe/NVLink rates; NV#
link counts per GPU pair. It finishes in well under two minutes (a watchdog stops it at 110 s).
Without a driver it says that NVML is unavailable and exits 0.
"""

from __future__ import annotations

import collections
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for root in (REPO / "daemon", REPO / "exporters"):
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))

import pynvml  # noqa: E402

from nodescope.roots import Roots  # noqa: E402
from nodescope.sources import nvml as nv  # noqa: E402

WATCHDOG_SECONDS = 110


class Traced:
    """pynvml with every call timed and its first answer kept."""

    def __init__(self, target: Any = pynvml) -> None:
        self.target = target
        self.lock = threading.Lock()
        self.count: collections.Counter[str] = collections.Counter()
        self.total: dict[str, float] = collections.defaultdict(float)
        self.worst: dict[str, float] = {}
        self.first: dict[str, str] = {}
        self.errors: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.target, name)

        def call(*args: Any) -> Any:
            start = time.perf_counter()
            outcome: str
            try:
                result = fn(*args)
                outcome = short(result)
                return result
            except pynvml.NVMLError as exc:
                outcome = f"raised {type(exc).__name__}: {exc}"
                with self.lock:
                    self.errors[name][type(exc).__name__] += 1
                raise
            finally:
                took = time.perf_counter() - start
                with self.lock:
                    self.count[name] += 1
                    self.total[name] += took
                    self.worst[name] = max(self.worst.get(name, 0.0), took)
                    self.first.setdefault(name, outcome)

        call.__name__ = name
        return call

    def report(self) -> None:
        print(f"\n{'call':46} {'n':>5} {'total ms':>9} {'max ms':>8}  first answer / errors")
        for name in sorted(self.count):
            errors = ", ".join(f"{k}×{v}" for k, v in sorted(self.errors[name].items()))
            print(
                f"{name:46} {self.count[name]:5d} {self.total[name] * 1e3:9.2f} "
                f"{self.worst[name] * 1e3:8.2f}  {self.first[name][:90]}"
                + (f"  [{errors}]" if errors else "")
            )


def short(value: Any) -> str:
    if not isinstance(value, (str, bytes)) and hasattr(value, "__len__"):
        try:
            items = list(value)
        except TypeError:
            return repr(value)[:90]
        return f"{len(items)} items: " + ", ".join(str(i)[:40] for i in items[:2])
    return str(value)[:90]


def watchdog() -> None:
    def expire(_signum: int, _frame: Any) -> None:
        print(f"nvml-check: stopped after {WATCHDOG_SECONDS} s", file=sys.stderr)
        sys.exit(2)

    signal.signal(signal.SIGALRM, expire)
    signal.alarm(WATCHDOG_SECONDS)


def main(target: Any = pynvml) -> int:
    """``target`` is the NVML to check: pynvml, or a fake with its surface."""
    watchdog()
    traced = Traced(target)
    source = nv.NvmlSource(traced, retry_seconds=3600, event_wait_ms=200)
    roots = Roots()
    try:
        start = time.perf_counter()
        try:
            first = source.collect(roots)
        except nv.NvmlUnavailable as exc:
            print(f"NVML is unavailable on this machine: {exc}")
            print("(no NVIDIA driver or libnvidia-ml.so.1: the daemon reports source nvml down)")
            traced.report()
            return 0
        print(
            f"first collect: {(time.perf_counter() - start) * 1e3:.1f} ms, "
            f"{first.device_count} GPU(s)"
        )
        time.sleep(1.0)
        start = time.perf_counter()
        second = source.collect(roots)
        print(f"second collect: {(time.perf_counter() - start) * 1e3:.1f} ms")
        for gpu in second.gpus:
            active = sum(1 for link in gpu.nvlinks if link.active)
            print(
                f"GPU {gpu.index} {gpu.name} {gpu.uuid} at {gpu.pci_address}: "
                f"PCIe gen {gpu.pcie_gen_current}/{gpu.pcie_gen_max} "
                f"x{gpu.pcie_width_current}/x{gpu.pcie_width_max}, replays {gpu.pcie_replays}, "
                f"PCIe bytes via {gpu.pcie_bytes_source}, NVLinks {active}/{len(gpu.nvlinks)} "
                f"active, {len(gpu.processes)} compute process(es), util gpu "
                f"{gpu.gpu_util_percent}% dec {gpu.decoder_util_percent}% enc "
                f"{gpu.encoder_util_percent}% jpeg {gpu.jpeg_util_percent}%"
            )
            if gpu.unsupported:
                print(f"  not supported: {', '.join(gpu.unsupported)}")
        for rates in nv.gpu_rates(first, second, 1.0).gpus:
            nvlink_tx = sum(r.data_tx_bytes_per_second or 0.0 for r in rates.nvlinks)
            nvlink_rx = sum(r.data_rx_bytes_per_second or 0.0 for r in rates.nvlinks)
            print(
                f"GPU {rates.index}: PCIe tx {fmt(rates.pcie_tx_bytes_per_second)} "
                f"rx {fmt(rates.pcie_rx_bytes_per_second)} ({rates.pcie_rate_basis}); "
                f"NVLink data tx {fmt(nvlink_tx)} rx {fmt(nvlink_rx)}"
            )
        for pair in nv.nvlink_pairs(second.gpus):
            print(f"GPU{pair.gpu_a} - GPU{pair.gpu_b}: NV{pair.links} ({pair.via})")
        time.sleep(2.0)
        last = source.collect(roots)
        print(f"Xid source: {last.xid_source}; Xid counts: {last.xids or 'none'}")
        for event in last.events:
            print(f"event: {event}")
    finally:
        start = time.perf_counter()
        source.close()
        print(f"close: {(time.perf_counter() - start) * 1e3:.1f} ms")
    traced.report()
    return 0


def fmt(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e9:.3f} GB/s"


if __name__ == "__main__":
    sys.exit(main())
