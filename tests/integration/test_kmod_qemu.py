"""nvlink_counter.ko in a real Debian kernel: kmod/tests/run-qemu.sh builds it against Debian's
headers with warnings as errors, boots the matching kernel under QEMU (TCG) with the host root
shared read-only and an ivshmem BAR of fake registers, and runs kmod/tests/test_guest.py in the
guest. Its status is the verdict (success marker on the console, no BUG/WARNING/Call Trace);
here the guest's pytest summary and figures are checked too.

Takes about 2 minutes (boot ≈7 s, the guest tests ≈90 s under emulation).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

# The guest's sampling rate and cost per sample are bounds: a machine of its own.
pytestmark = [pytest.mark.integration, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "kmod" / "tests" / "run-qemu.sh"
TOOLS = ("qemu-system-x86_64", "insmod", "depmod", "busybox", "cpio", "gcc", "make")


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (apt-get download, depmod into the work dir, 9p export of /)"
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path("/bin", t).exists()]
    if missing:
        return f"missing {', '.join(missing)} (scripts/lib.sh installs the kmod test packages)"
    return None


def test_module_in_a_real_kernel(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    res = subprocess.run(
        [str(SCRIPT)],
        env={**os.environ, "NVLC_TIMEOUT": "240"},
        capture_output=True,
        text=True,
        timeout=480,
    )
    console = res.stdout
    assert res.returncode == 0, res.stderr[-4000:] + console[-8000:]
    assert "=== GUEST_RC=0" in console
    assert not re.search(r"BUG:|WARNING:|Call Trace", console)
    summary = re.search(r"(\d+) passed", console)
    assert summary and int(summary.group(1)) >= 18
    assert not re.search(r"\d+ failed", console)
    sampling = re.search(r"SAMPLING: (\d+) samples in ([\d.]+) s = (\d+) Hz", console)
    assert sampling, "guest did not report the sampling figures"
    assert 2_000 <= int(sampling.group(3)) <= 10_300
    # The timer's cost per sample with every file open, against one reader.
    cost = re.search(r"SAMPLE COST: (\d+) links, ([\d.]+) us per sample with 1 reader, "
                     r"([\d.]+) us with (\d+)", console)  # fmt: skip
    assert cost, "guest did not report the sampling cost"
    assert float(cost.group(3)) <= 1.5 * float(cost.group(2))
