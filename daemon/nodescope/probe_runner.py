"""The daemon's side of the bandwidth probe: start it on request (the hook socket's
``probe`` and ``probe_result`` commands, :class:`ProbeHook`; ``nodescope probe --via-daemon``),
keep its last result, and the ``probe`` source that hands that result to the exporter.

The probe imports torch, which the daemon never does (its RSS budget is tens of MiB), so it
runs as its own process, ``python -m nodescope.probe --json`` (:mod:`nodescope.probe`), in
its own session so that a timeout kills it together with its all-reduce ranks. Its stdout is
the JSON report of :mod:`nodescope.model.probe`; its exit status the verdict (0 passed, 1 a
threshold failed, 2 usage, 3 nothing measured).

The last report is also written to ``<run>/nodescope/probe-report.json`` (by the probe
itself, atomically), so a probe that ``nodescope probe --record`` ran from the Slurm prolog
is exported too, and a restarted daemon still exports the last figures with their time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodescope.config import Config
from nodescope.errors import ParseError
from nodescope.model.probe import (
    EXIT_FAILED,
    EXIT_NOT_MEASURED,
    EXIT_PASSED,
    ProbeReport,
    parse_report,
    report_to_json,
)
from nodescope.probe.sweep import check_sizes, format_sizes
from nodescope.roots import Roots
from nodescope.sources.probe_report import state_path

log = logging.getLogger("nodescope.probe_runner")


def probe_command(
    *,
    quick: bool = True,
    config_path: str | None = None,
    write_report: Path | None = None,
    python: str = sys.executable,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of one probe run that prints its report as JSON."""
    command = [python, "-m", "nodescope.probe", "--json"]
    if quick:
        command.append("--quick")
    if config_path:
        command += ["--config", config_path]
    if write_report is not None:
        command += ["--write-report", str(write_report)]
    return command + list(extra)


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One requested run: the exit status, the report when one came back, and one line that
    says how it went (the first failed threshold, or why nothing was measured)."""

    status: int
    report: ProbeReport | None
    reason: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == EXIT_PASSED and self.report is not None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def parse_probe_output(
    returncode: int, stdout: str, stderr: str, seconds: float = 0.0, source: str = "probe"
) -> ProbeOutcome:
    """The outcome of a finished probe process from its exit status and output (pure)."""
    if returncode in (EXIT_PASSED, EXIT_FAILED):
        try:
            report = parse_report(stdout, source=f"{source} stdout")
        except ParseError as exc:
            return ProbeOutcome(EXIT_NOT_MEASURED, None, f"unreadable report: {exc}", seconds)
        if report.passed != (returncode == EXIT_PASSED):
            return ProbeOutcome(
                EXIT_NOT_MEASURED,
                None,
                f"exit status {returncode} contradicts the report's verdict",
                seconds,
            )
        reason = "passed" if report.passed else report.failures[0].message
        if len(report.failures) > 1:
            reason += f" (+{len(report.failures) - 1} more)"
        return ProbeOutcome(returncode, report, reason, seconds)
    if returncode < 0:
        reason = f"killed by signal {-returncode}"
    else:
        reason = _last_line(stderr) or f"exit status {returncode}"
    return ProbeOutcome(returncode if returncode > 0 else EXIT_NOT_MEASURED, None, reason, seconds)


Run = Callable[[Sequence[str], float], tuple[int, str, str]]


def run_process(command: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """Run ``command`` in a new session; on timeout kill the whole session (the probe's
    all-reduce ranks too) and report it as exit status 3 with the reason on stderr."""
    with subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return EXIT_NOT_MEASURED, "", f"probe: no result after {timeout:g} s (killed)"
        return proc.returncode, stdout, stderr


class ProbeRunner:
    """Starts probes on request, one at a time, and keeps the last outcome.

    ``run`` is injected so tests hand in a fake process; by default :func:`run_process`.
    ``extra`` are more arguments for the probe (``--no-allreduce``, ``--cpu``).
    """

    def __init__(
        self,
        roots: Roots,
        config_path: str | None = None,
        timeout: float = 300.0,
        run: Run = run_process,
        clock: Callable[[], float] = time.monotonic,
        python: str = sys.executable,
        extra: Sequence[str] = (),
    ) -> None:
        self.roots = roots
        self.extra = tuple(extra)
        self.config_path = config_path
        self.timeout = timeout
        self._run = run
        self._clock = clock
        self._python = python
        self._lock = threading.Lock()
        self.last: ProbeOutcome | None = None

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def command(self, quick: bool) -> list[str]:
        return probe_command(
            quick=quick,
            config_path=self.config_path,
            write_report=state_path(self.roots),
            python=self._python,
            extra=[f"--sysfs={self.roots.sysfs}", *self.extra],
        )

    def request(self, quick: bool = True, extra: Sequence[str] = ()) -> ProbeOutcome:
        """Run one probe and wait for it (at most ``timeout`` seconds). A request while one
        runs does not start a second: it gets status 3 and says so."""
        if not self._lock.acquire(blocking=False):
            return ProbeOutcome(EXIT_NOT_MEASURED, None, "a probe is already running", 0.0)
        try:
            start = self._clock()
            log.info("event=probe_start quick=%s", quick)
            command = [*self.command(quick), *extra]
            returncode, stdout, stderr = self._run(command, self.timeout)
            outcome = parse_probe_output(returncode, stdout, stderr, self._clock() - start)
            self.last = outcome
            log.info(
                "event=probe_done status=%d seconds=%.1f reason=%r",
                outcome.status,
                outcome.seconds,
                outcome.reason,
            )
            return outcome
        finally:
            self._lock.release()


class ProbeHook:
    """The ``probe`` and ``probe_result`` commands of the daemon's hook socket.

    A socket request has a deadline of seconds and a probe takes tens of them, so ``probe``
    starts one in a background thread and answers at once with its ``id``; ``probe_result``
    answers whether it still runs and, once done, its outcome with the whole report. The
    configuration is read at each request, so thresholds and the timeout follow a reload.
    """

    def __init__(self, config: Callable[[], Config], run: Run = run_process) -> None:
        self._config = config
        self._run = run
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.id = 0
        self.outcome: ProbeOutcome | None = None

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self, request: Mapping[str, Any], peer: object = None) -> dict[str, Any]:
        quick = request.get("quick", True)
        no_allreduce = request.get("no_allreduce", False)
        if not isinstance(quick, bool) or not isinstance(no_allreduce, bool):
            return {"ok": False, "error": "quick and no_allreduce must be true or false"}
        sizes = request.get("sizes")
        # The socket's peer is any local user the socket lets in: the list is checked with
        # the bounds of --sizes before it reaches a command line.
        if sizes is not None:
            if not isinstance(sizes, list) or len(sizes) > 64:
                return {"ok": False, "error": "sizes must be a list of byte counts"}
            try:
                sizes = check_sizes(sizes)
            except ValueError as exc:
                return {"ok": False, "error": f"sizes: {exc}"}
        with self._lock:
            if self.running:
                return {"ok": True, "started": False, "running": True, "id": self.id}
            config = self._config()
            runner = ProbeRunner(
                config.roots, config.path, config.probe.timeout_seconds, run=self._run
            )
            self.id += 1
            self.outcome = None
            extra = ["--no-allreduce"] if no_allreduce else []
            if sizes is not None:
                extra.append(f"--sizes={format_sizes(sizes)}")
            self._thread = threading.Thread(
                target=self._work,
                args=(runner, quick, extra),
                name="nodescope-probe",
                daemon=True,
            )
            self._thread.start()
            return {"ok": True, "started": True, "running": True, "id": self.id}

    def _work(self, runner: ProbeRunner, quick: bool, extra: list[str]) -> None:
        self.outcome = runner.request(quick, extra)

    def wait(self, timeout: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def result(
        self, request: Mapping[str, Any] | None = None, peer: object = None
    ) -> dict[str, Any]:
        with self._lock:
            outcome = None if self.running else self.outcome
            answer: dict[str, Any] = {"ok": True, "id": self.id, "running": self.running}
        if outcome is not None:
            answer["outcome"] = {
                "status": outcome.status,
                "reason": outcome.reason,
                "seconds": outcome.seconds,
                "report": None if outcome.report is None else report_to_json(outcome.report),
            }
        return answer


def outcome_from_answer(answer: Mapping[str, Any]) -> ProbeOutcome:
    """The outcome in a ``probe_result`` answer (for the client); ParseError when malformed."""
    raw = answer.get("outcome")
    if not isinstance(raw, dict):
        raise ParseError("probe_result", "no outcome in the answer")
    status, reason, seconds = raw.get("status"), raw.get("reason"), raw.get("seconds")
    if not isinstance(status, int) or not isinstance(reason, str):
        raise ParseError("probe_result", "outcome lacks status or reason")
    if not isinstance(seconds, int | float):
        raise ParseError("probe_result", "outcome lacks seconds")
    document = raw.get("report")
    report = None if document is None else parse_report(json.dumps(document), "probe_result")
    return ProbeOutcome(status, report, reason, float(seconds))
