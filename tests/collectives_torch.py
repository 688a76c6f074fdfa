"""Real collective traces for the tests: a small MoE-like job run by torch on the CPU.

``ranks`` processes join one gloo group over 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT``, a
port free when it was picked). After a barrier that absorbs their uneven start, each step
runs an AllToAll of "tokens" (rows of ``hidden`` floats) with the split sizes the caller
chose — ``splits[s][d]`` rows from rank ``s`` to rank ``d``, the router's choice in an MoE
layer — then an all-reduce of a gradient-sized tensor. One rank sleeps ``delay_seconds``
before the all-reduce of step ``delay_step``. The profiler (``record_shapes=True``, one
warm-up step, then ``steps`` recorded ones) writes one Chrome trace per rank,
``rank<r>.json`` (``.json.gz`` with ``gzip``), and the flight recorder
(``TORCH_FR_BUFFER_SIZE``) dumps each rank's ring as JSON (``fr_trace_rank_<r>.json``) and as
the pickle the watchdog writes on a timeout (``fr_trace_rank_<r>``).

The job runs in a child interpreter (``python -m tests.collectives_torch SPEC``) so the test
process never imports torch; the ranks are forked from it, which has touched no accelerator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class JobSpec:
    out: str
    splits: list[list[int]]
    hidden: int = 16
    steps: int = 3
    allreduce_elements: int = 4096
    delay_rank: int | None = None
    delay_step: int = 1
    delay_seconds: float = 0.0
    gzip: bool = False
    flight_recorder: bool = True
    timeout_seconds: float = 60.0
    ranks: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", len(self.splits))
        if any(len(row) != len(self.splits) for row in self.splits):
            raise ValueError("splits must be a square matrix: one row and column per rank")


def run_job(spec: JobSpec, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the job in a child interpreter; the traces land in ``spec.out``."""
    document = {k: v for k, v in asdict(spec).items() if k != "ranks"}
    return subprocess.run(
        [sys.executable, "-m", "tests.collectives_torch", json.dumps(document)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )


def _rank_main(rank: int, spec: JobSpec, port: int) -> None:
    import datetime
    import time

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=spec.ranks,
        timeout=datetime.timedelta(seconds=spec.timeout_seconds),
    )
    send_rows = spec.splits[rank]
    recv_rows = [spec.splits[source][rank] for source in range(spec.ranks)]
    tokens = torch.full((sum(send_rows), spec.hidden), float(rank))
    received = torch.empty((sum(recv_rows), spec.hidden))
    gradient = torch.ones(spec.allreduce_elements)
    out = Path(spec.out)
    suffix = ".json.gz" if spec.gzip else ".json"
    dist.barrier()  # every rank has started: the first profiled collective is not the start
    # One warm-up step, as a training job's profiler schedule has: starting the profiler
    # takes each rank a different time, and that lands in the warm-up, not in the trace.
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=spec.steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"rank{rank}{suffix}")),
    ) as prof:
        for step in range(-1, spec.steps):
            dist.all_to_all_single(received, tokens, recv_rows, send_rows)
            if rank == spec.delay_rank and step == spec.delay_step:
                time.sleep(spec.delay_seconds)
            dist.all_reduce(gradient)
            prof.step()
    if spec.flight_recorder:
        from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json

        (out / f"fr_trace_rank_{rank}.json").write_bytes(_dump_fr_trace_json(True, False))
        (out / f"fr_trace_rank_{rank}").write_bytes(_dump_fr_trace(True, False, False))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from torch.multiprocessing.spawn import start_processes

    spec = JobSpec(**json.loads(argv[0]))
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    if spec.flight_recorder:
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # read when the group is made
    start_processes(_rank_main, args=(spec, free_port()), nprocs=spec.ranks, start_method="fork")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
