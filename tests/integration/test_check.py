"""``nodescope check`` as a real process: on this machine (its verdict against what the kernel
shows), on simulated nodes with a fault and with its healthy look-alike, with a running demo
daemon whose firing alerts join the verdict, and with bad arguments."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import nodescope_command
from tests.integration.test_demo import Demo

pytestmark = pytest.mark.integration


def check(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*nodescope_command(), "check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_this_machine_gets_a_verdict_whose_exit_status_is_its_word() -> None:
    result = check("--no-daemon", "--json", "--seconds", "2")
    document = json.loads(result.stdout)
    assert result.returncode == document["exit_status"]
    assert document["verdict"] == ("healthy", "degraded", "failed")[result.returncode]
    # The disks component lists what the kernel counts in /proc/diskstats.
    kernel_disks = {line.split()[2] for line in Path("/proc/diskstats").read_text().splitlines()}
    disks = [c for c in document["components"] if c["category"] == "disks"]
    if kernel_disks:
        # "vda, nvme0n1 and 3 more; virtual: 12 loop": the hardware by name, the rest counted.
        fact = disks[0]["facts"][0]
        named, _, virtual = fact.partition("virtual: ")
        shown = [n for n in named.rstrip("; ").split(" and ")[0].split(", ") if n]
        assert set(shown) <= kernel_disks, (fact, kernel_disks)
        for count, kind in (part.split(" ") for part in virtual.split(", ") if part):
            assert kind in ("loop", "ram", "zram"), fact
            assert 0 < int(count) <= sum(name.startswith(kind) for name in kernel_disks), fact
        assert shown or virtual, fact
    # No NVIDIA GPU on this machine's bus: no GPU component, and not degraded for it.
    lspci = subprocess.run(["lspci", "-n", "-d", "10de:"], capture_output=True, text=True)
    if not lspci.stdout.strip():
        assert not [c for c in document["components"] if c["category"] == "gpu"]


def test_text_output_names_every_component_and_ends_with_the_verdict() -> None:
    result = check("--no-daemon", "--seconds", "1")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("nodescope check on ")
    assert lines[-1].startswith(("verdict: healthy", "verdict: degraded", "verdict: failed"))
    assert result.returncode in (0, 1, 2)


def test_a_fault_fails_the_node_and_names_the_gpu_and_the_action() -> None:
    result = check("--scenario", "xid79-fell-off-bus", "--json")
    assert result.returncode == 2, result.stderr
    document = json.loads(result.stdout)
    failed = {c["title"]: c for c in document["components"] if c["status"] == "failed"}
    gpu = next(c for title, c in failed.items() if title.startswith("GPU 5"))
    assert any(k["kind"] == "gpu_fell_off_bus" and k["action"] == "drain" for k in gpu["concerns"])
    # The other GPUs are still listed, healthy.
    healthy_gpus = [
        c for c in document["components"] if c["category"] == "gpu" and c["status"] == "healthy"
    ]
    assert len(healthy_gpus) == 7


def test_the_healthy_look_alike_is_healthy() -> None:
    result = check("--scenario", "gpu-fabric-healthy-control")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith("verdict: healthy")


def test_a_running_daemons_firing_alerts_join_the_verdict(tmp_path: Path) -> None:
    demo = Demo(tmp_path, "nvswitch-sxid-fatal", "--duration", "120")
    try:
        demo.scrape()
        url = f"http://127.0.0.1:{demo.port}"
        deadline = time.monotonic() + 90
        firing: list[dict[str, object]] = []
        while time.monotonic() < deadline and not firing:
            with urllib.request.urlopen(f"{url}/api/v1/alerts", timeout=5) as response:
                alerts = json.loads(response.read())["alerts"]
            firing = [a for a in alerts if a["state"] == "firing"]
            time.sleep(1)
        assert firing, demo.output()
        result = check("--url", url, "--json", "--seconds", "1")
    finally:
        demo.proc.terminate()
        demo.wait(30)
    document = json.loads(result.stdout)
    assert document["daemon"] == url
    from_daemon = [
        (k["kind"], c["category"])
        for c in document["components"]
        for k in c["concerns"]
        if k["origin"] == "daemon"
    ]
    assert {kind for kind, _ in from_daemon} >= {a["kind"] for a in firing}
    assert ("nvswitch_sxid_fatal", "fabric") in from_daemon
    assert result.returncode == 2


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--seconds", "0"), "outside 1..300 seconds"),
        (("--seconds", "-1"), "outside 1..300 seconds"),
        (("--seconds", "100000"), "outside 1..300 seconds"),
        (("--seconds", "soon"), "not a number"),
        (("--at", "5"), "--at needs --scenario"),
        (("--scenario", "no-such-scenario"), "no-such-scenario"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: tuple[str, ...], said: str) -> None:
    result = check(*args, timeout=60)
    assert result.returncode == 2
    assert said in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_configuration_file_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[daemon]\ntick_seconds = -3\n")
    result = check("--config", str(config), "--no-daemon", timeout=60)
    assert result.returncode == 2
    assert "tick_seconds" in result.stderr
