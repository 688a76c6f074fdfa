"""Shared fixtures: paths of the fixture trees, a helper to run the CLI, loopback ports that
parallel test workers do not share, and how those workers split the suite."""

from __future__ import annotations

import logging
import os
import random
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
HOST_FIXTURE = FIXTURES / "hosts" / "kvm-epyc-debian12"


@pytest.fixture
def host_fixture() -> Path:
    return HOST_FIXTURE


@pytest.fixture(autouse=True)
def _nodescope_logger_as_found() -> Iterator[None]:
    """A CLI's main() run in a test sets up the ``nodescope`` logger (its level, handler and
    propagation) for the whole process: every test gets it back as it found it, so that what a
    test logs does not depend on which tests its worker happened to run before."""
    logger = logging.getLogger("nodescope")
    level, handlers, propagate = logger.level, list(logger.handlers), logger.propagate
    yield
    logger.setLevel(level)
    logger.handlers[:] = handlers
    logger.propagate = propagate


def nodescope_command() -> list[str]:
    """The installed console script next to the interpreter running the tests."""
    script = Path(sys.executable).with_name("nodescope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "nodescope.cli.main"]


def is_root() -> bool:
    return os.geteuid() == 0


def new_v2_cgroup(prefix: str) -> tuple[Path, Path]:
    """(the cgroup2 root, a new empty cgroup below it named after ``prefix``) for a test that
    moves real processes; skipped where that cannot be done."""
    import uuid

    from nodescope.roots import Roots
    from nodescope.sources.cgroup import find_v2_root

    if not is_root():
        pytest.skip("creating cgroups needs root")
    hierarchy = find_v2_root(Roots().cgroupfs)
    if hierarchy.path is None:
        pytest.skip(f"no cgroup2 mount under {Roots().cgroupfs}")
    base = hierarchy.path / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    base.mkdir()
    return hierarchy.path, base


def remove_cgroup_tree(base: Path) -> None:
    """Remove the cgroups under ``base``, deepest first, once their tasks have left."""
    import time

    for directory, _, _ in os.walk(base, topdown=False):
        for _ in range(100):
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)  # "populated" drops just after the last task leaves


# --------------------------------------------------------------------------------------------
# Hypothesis under parallel workers
#
# Several workers share the cores: an example or its data can take ten times as long as on
# an idle machine. What a property test proves does not depend on how long one example took,
# so no per-example deadline and no health check on slow data generation; the examples run,
# and the properties checked, are the same.
settings.register_profile("nodescope", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("nodescope")


# --------------------------------------------------------------------------------------------
# Loopback ports
#
# A port found free by binding port 0 and handed to a server started later is free only until
# someone else takes it, and port 0 draws from the kernel's ephemeral range, which every other
# port-0 bind and every outgoing connection of every test worker draws from too. The ports
# handed out here come from below that range instead, a block of its own for each pytest-xdist
# worker: two workers never hand out the same port, and the kernel never hands out one of them.

#: The ports below Linux's default ephemeral range (32768-60999) that tests hand out.
PORTS_FIRST = 20000
PORTS_END = 32768
#: Ports in one worker's block: 25 workers fit.
PORTS_PER_WORKER = 500


def _worker_index() -> int:
    """This test worker's number (``gw3`` is 3); 0 in a run without workers."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    digits = name.removeprefix("gw")
    return int(digits) if digits.isdigit() else 0


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return PORTS_END


class _PortBlock:
    """Walks this process's block of ports from a random place in it (two test runs on one
    machine, each with a worker gw0, seldom walk the same ports at once) and hands out each
    port that nothing holds now, never the same one twice in a row of the block's length."""

    def __init__(self) -> None:
        self.owner_pid = 0
        self.first = PORTS_FIRST
        self.span = PORTS_PER_WORKER
        self.next = 0

    def reset(self) -> None:
        # Recomputed in every process: a forked child must not walk its parent's ports.
        end = min(PORTS_END, _ephemeral_low())
        blocks = max(1, (end - PORTS_FIRST) // PORTS_PER_WORKER)
        self.first = PORTS_FIRST + (_worker_index() % blocks) * PORTS_PER_WORKER
        self.span = PORTS_PER_WORKER if end - PORTS_FIRST >= PORTS_PER_WORKER else 1
        self.next = random.randrange(self.span)
        self.owner_pid = os.getpid()

    def take(self) -> int:
        if self.owner_pid != os.getpid():
            self.reset()
        for _ in range(self.span):
            port = self.first + self.next
            self.next = (self.next + 1) % self.span
            if _bindable(port):
                return port
        raise RuntimeError(f"no free port in {self.first}-{self.first + self.span - 1}")


def _bindable(port: int) -> bool:
    """Whether a listener could bind ``port`` on 127.0.0.1 now (nothing listens there, nothing
    holds it in TIME_WAIT against a listener)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PORTS = _PortBlock()


def free_port() -> int:
    """A loopback port free now that no other test worker is handed (see above)."""
    return _PORTS.take()


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive loopback ports, all free now, from this worker's
    block (a fleet of demo nodes listens on consecutive ports)."""
    for _ in range(PORTS_PER_WORKER):
        first = free_port()
        last = first + count - 1
        in_block = last < _PORTS.first + _PORTS.span
        if in_block and all(_bindable(port) for port in range(first + 1, last + 1)):
            _PORTS.next = (last + 1 - _PORTS.first) % _PORTS.span  # the walk goes on past them
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


# --------------------------------------------------------------------------------------------
# Parallel workers (pytest-xdist; scripts/test.sh runs ``--dist loadgroup``)
#
# The tests of one file run in one worker, in order: many files share an expensive module
# fixture (a replay of every scenario, a Slurm cluster, a fleet) that a worker would otherwise
# build again for each test it got. The Slurm files share one worker whatever their file: their
# clusters are named after this host and own its cgroup directories ``slurm_<host>``, so two at
# once would take each other's jobs (tests/integration/slurm_harness.py). And the tests of a
# file whose tests are independent and slow are shared out one by one.
#
# The groups are told apart by the test's path: pytest-xdist hands the scheduler test ids
# only, and the group name it appends to the id of a test marked ``xdist_group`` no longer
# reaches the id under pytest 9, so the scheduler below replaces its loadgroup scheduler.

#: Files whose tests run in one worker together, by the name of what they share.
SHARED_WORKER = {
    "tests/integration/test_slurm.py": "slurm-cluster",
    "tests/integration/test_slurm_gate_policy.py": "slurm-cluster",
    "tests/integration/test_slurm_health.py": "slurm-cluster",
    "tests/adversarial/test_registration_flood.py": "slurm-cluster",
}
#: Files whose tests are shared out one by one: each bundled scenario over the FUSE mount.
ONE_BY_ONE = frozenset({"tests/kernelfs/test_scenarios.py"})


def worker_group(nodeid: str) -> str:
    """The group of the test ``nodeid``: the tests of one group run in one worker."""
    path = nodeid.split("::", 1)[0]
    if path in ONE_BY_ONE:
        return nodeid
    return SHARED_WORKER.get(path, path)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist", None) != "loadgroup":
        return None  # a caller's own --dist
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log)


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (the lone surrogates that stand for a hostile
    name's undecodable bytes) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # A worker sends each report to the controller as UTF-8: a captured log line holding a
    # hostile file name's surrogates would stop the whole run there, not fail one test.
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    report.sections = [(title, _encodable(text)) for title, text in report.sections]
    if report.longrepr is not None:
        text = str(report.longrepr)
        if _encodable(text) != text:
            report.longrepr = _encodable(text)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--alone-tests",
        choices=("run", "later", "only"),
        default="run",
        help="the tests marked alone (a wall-clock bound, the host untouched): run them with "
        "the rest (run), leave them for a run of their own (later) or run only them (only); "
        "scripts/test.sh runs the parallel workers with later, then one process with only",
    )
    parser.addoption(
        "--max-examples",
        type=int,
        default=None,
        metavar="N",
        help="run at most N examples of every hypothesis property, its own settings included "
        "(the fast lane's: scripts/test.sh --fast)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _select_alone(config, items)
    cap = config.getoption("max_examples")
    if cap is not None:
        for item in items:
            _cap_examples(item, cap)


def _select_alone(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A bound on wall-clock time holds on a machine that runs the test alone, not beside
    several workers sharing its cores: those tests run in a phase of their own."""
    choice = config.getoption("alone_tests")
    if choice == "run":
        return
    keep_alone = choice == "only"
    kept = [item for item in items if (item.get_closest_marker("alone") is not None) == keep_alone]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def _cap_examples(item: pytest.Item, cap: int) -> None:
    """At most ``cap`` examples for ``item`` if it is a hypothesis property. Most properties
    name their number of examples in their own ``@settings``, which a profile cannot lower:
    the settings hypothesis runs the test with are those it keeps on the test function."""
    function = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
    own = getattr(function, "_hypothesis_internal_use_settings", None)
    if isinstance(own, settings) and own.max_examples > cap:
        function._hypothesis_internal_use_settings = settings(own, max_examples=cap)  # type: ignore[union-attr]
