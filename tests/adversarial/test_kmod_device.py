"""``/dev/nvlink_stats`` refused or replaced: the ``nvlink_kmod`` source is down with a reason
that says why, holds nothing, and opens the device again on its next run; nothing blocks.

The module's own limits (EBUSY for every file taken, EMFILE for a user's limit) are tested in
a real kernel by kmod/tests/test_guest.py; here the same refusals come from this machine's
kernel: a node another user may not open (EACCES) and a process out of descriptors (EMFILE).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodescope.kmod_abi import Device, DeviceRefused
from nodescope.roots import Roots
from nodescope.sources import nvlink_kmod

NOBODY = 65534


def _outcome(source: nvlink_kmod.NvlinkKmodSource, roots: Roots) -> dict[str, object]:
    try:
        data = source.collect(roots)
    except Exception as exc:
        return {
            "type": type(exc).__name__,
            "errno": getattr(exc, "errno", None),
            "message": str(exc),
        }
    return {"type": "ok", "kind": data.kind}


@pytest.fixture
def device_dir() -> Iterator[Path]:
    """A directory other users can enter (pytest's own temporary directories are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="nodescope-kmod-"))
    path.chmod(0o755)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def _character_node(path: Path, mode: int) -> None:
    # /dev/null's numbers: a real character device that is not the module (GET_VERSION fails).
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(1, 3))
    path.chmod(mode)


def _run_child(body: Callable[[Callable[[object], None], Callable[[], None]], None],
               between: Callable[[], None]) -> list[dict[str, object]]:  # fmt: skip
    """Fork ``body``; after its first report run ``between`` here, then let it go on."""
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.close(up_r)
            os.close(down_w)

            def report(value: object) -> None:
                os.write(up_w, json.dumps(value).encode() + b"\n")

            def wait() -> None:
                os.read(down_r, 1)

            body(report, wait)
            code = 0
        finally:
            os._exit(code)
    os.close(up_w)
    os.close(down_r)
    reports: list[dict[str, object]] = []
    with os.fdopen(up_r, "rb") as up:
        first = up.readline()
        if first:
            reports.append(json.loads(first))
            between()
        os.write(down_w, b"x")
        os.close(down_w)
        reports.extend(json.loads(line) for line in up)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    return reports


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a device node and switch user")
def test_eacces_open_is_the_source_down_with_its_reason_then_retried(device_dir: Path) -> None:
    node = device_dir / nvlink_kmod.DEVICE_NAME
    _character_node(node, 0o000)
    roots = Roots(dev=device_dir)

    def as_nobody(report: Callable[[object], None], wait: Callable[[], None]) -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        source = nvlink_kmod.NvlinkKmodSource()
        report(_outcome(source, roots))
        wait()
        report(_outcome(source, roots))

    refused, retried = _run_child(as_nobody, lambda: node.chmod(0o444))
    assert refused["type"] == "DeviceRefused" and refused["errno"] == errno.EACCES
    assert "open refused (EACCES)" in str(refused["message"])
    assert "mode, owner or group" in str(refused["message"])
    # The next run opens again: now it gets in, and finds a device that is not the module.
    assert retried["type"] == "RuntimeError"
    assert "not the nvlink_counter module (GET_VERSION failed: ENOTTY)" in str(retried["message"])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a device node")
def test_emfile_open_is_the_source_down_with_its_reason_then_retried(device_dir: Path) -> None:
    node = device_dir / nvlink_kmod.DEVICE_NAME
    _character_node(node, 0o444)
    roots = Roots(dev=device_dir)

    def out_of_descriptors(report: Callable[[object], None], wait: Callable[[], None]) -> None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE
        source = nvlink_kmod.NvlinkKmodSource()
        report(_outcome(source, roots))
        wait()
        os.close(held.pop())
        report(_outcome(source, roots))

    refused, retried = _run_child(out_of_descriptors, lambda: None)
    assert refused["type"] == "DeviceRefused" and refused["errno"] == errno.EMFILE
    assert "open refused (EMFILE)" in str(refused["message"])
    assert "max_open_per_user" in str(refused["message"])
    assert retried["type"] == "RuntimeError" and "ENOTTY" in str(retried["message"])


def test_a_fifo_in_the_devices_place_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / nvlink_kmod.DEVICE_NAME
    os.mkfifo(fifo)

    def give_up(signum: int, frame: object) -> None:
        raise TimeoutError("opening the FIFO blocked")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(5)
    try:
        with pytest.raises(OSError) as refused:
            Device(fifo)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert refused.value.errno == errno.ENODEV
    assert "not a character device" in str(refused.value)
    assert not isinstance(refused.value, DeviceRefused)
