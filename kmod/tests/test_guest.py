"""Tests of nvlink_counter.ko against the real module, run inside the QEMU guest.

kmod/tests/run-qemu.sh boots a Debian kernel with the host root shared read-only and runs this
file as root; ``NVLC_KO`` is the module to load. Fake registers for the mmio source: the
ivshmem-plain device (1af4:1110) whose BAR2 kmod/tests/host_registers.py writes on the host.
Tests run in file order; the last ones unload and remove things.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import random
import select
import signal
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nodescope import kmod_abi as abi
from nodescope.assembly import default_config
from nodescope.collect import Collector
from nodescope.kmod_abi import Device, DeviceRefused, MmioLink, MmioReg, Params, SimLink
from nodescope.roots import Roots
from nodescope.sources.nvlink_kmod import NvlinkKmodSource, make_source
from nodescope.sources.registry import SOURCE_TABLE
from nodescope_exporters.prometheus import render

KO = os.environ.get("NVLC_KO", "")
DEV = "/dev/nvlink_stats"
SYSFS = Path("/sys/class/misc/nvlink_stats")
PARAMS = Path("/sys/module/nvlink_counter/parameters")
REPO = Path(__file__).resolve().parents[2]
GB = 1_000_000_000

REGS_MAGIC = 0x53474552434C564E
CMD_COUNT, CMD_ALL_ONES = 1, 2

pytestmark = pytest.mark.skipif(not KO, reason="runs in the QEMU guest (NVLC_KO unset)")


def loaded() -> bool:
    return Path("/sys/module/nvlink_counter").exists()


def insmod(*params: str) -> None:
    subprocess.run(["insmod", KO, *params], check=True, capture_output=True, text=True)
    for _ in range(100):  # devtmpfs creates the node asynchronously
        if os.path.exists(DEV):
            return
        time.sleep(0.01)
    raise AssertionError("no /dev/nvlink_stats after insmod")


@pytest.fixture(autouse=True)
def module() -> Iterator[None]:
    if not loaded():
        insmod()
    yield
    if loaded():
        with Device(DEV) as d:
            d.clear_source()
            d.set_params(Params(100_000, 2000, abi.UTIL_ONE * 9 // 10))


def sim(device: int, link: int, tx: int, rx: int = 0, stall_per_us: int = 0, **kw: int) -> SimLink:
    return SimLink(device, link, 25 * GB, (tx, rx, stall_per_us * 1_000_000, 0, 0), **kw)


def snapshot_when(
    d: Device, ready: Callable[[abi.NvlcSnapshot], bool], seconds: float = 10.0
) -> abi.NvlcSnapshot:
    """The first snapshot that is ``ready``, or the last one taken in ``seconds``. What the
    sampler does shows at its next tick, and the guest is emulated on a loaded host, where
    the vCPU that runs the sampler can be held off for tens of milliseconds: a test waits for
    the tick with a deadline rather than for a fixed time."""
    deadline = time.monotonic() + seconds
    snap = d.snapshot()
    while not ready(snap) and time.monotonic() < deadline:
        time.sleep(0.02)
        snap = d.snapshot()
    return snap


def raw_ioctl(fd: int, name_or_cmd: str | int, payload: bytes) -> int:
    cmd = abi.IOCTLS[name_or_cmd] if isinstance(name_or_cmd, str) else name_or_cmd
    try:
        fcntl.ioctl(fd, cmd, payload)
    except OSError as exc:
        return exc.errno or 0
    return 0


# --------------------------------------------------------------------------------------------
# ABI, read, pread


def test_version_matches_the_header() -> None:
    with Device(DEV) as d:
        v = d.version()
        assert v.abi_version == abi.ABI_VERSION
        assert (v.header_size, v.record_size) == (abi.HEADER_SIZE, abi.RECORD_SIZE)
        assert (v.max_links, v.hist_buckets, v.num_counters) == (
            abi.MAX_LINKS,
            abi.HIST_BUCKETS,
            abi.NUM_COUNTERS,
        )
        assert d.params().period_ns == 100_000


def test_read_pread_and_partial_reads() -> None:
    with Device(DEV) as d:
        d.set_sim([sim(0, 0, GB), sim(0, 1, 2 * GB)])
        time.sleep(0.05)
        whole = d.read_bytes()
        snap = abi.parse_snapshot(whole, DEV)
        assert snap.header.record_count == 2 and snap.header.source_name == "sim"
        assert len(whole) == abi.HEADER_SIZE + 2 * abi.RECORD_SIZE
        # read() continues the snapshot taken at offset 0 and ends with EOF.
        os.lseek(d.fd, 0, os.SEEK_SET)
        first = os.read(d.fd, 10)
        rest = os.read(d.fd, 1 << 20)
        assert len(first) + len(rest) == len(whole)
        assert os.read(d.fd, 100) == b""
        assert abi.parse_snapshot(first + rest, DEV).header.magic == abi.MAGIC
        # pread at 0 is always a fresh snapshot: a later one shows the samples taken since
        # (a snapshot cached at open or at the first read would never change).
        a = d.snapshot()
        b = snapshot_when(d, lambda s: s.header.sequence != a.header.sequence)
        assert b.header.sequence > a.header.sequence
        assert b.header.timestamp_ns > a.header.timestamp_ns


def test_sim_rates_are_exact_functions_of_time() -> None:
    with Device(DEV) as d:
        d.set_sim([sim(0, 0, GB, GB // 4, stall_per_us=600), sim(3, 7, 2 * GB)])
        time.sleep(0.05)
        a = d.snapshot()
        time.sleep(1.0)
        b = d.snapshot()
        secs = (b.header.timestamp_ns - a.header.timestamp_ns) / 1e9
        r0a, r0b = a.records[0], b.records[0]
        assert (r0b.device, r0b.link, b.records[1].device, b.records[1].link) == (0, 0, 3, 7)
        tx = (r0b.counter("tx_bytes") - r0a.counter("tx_bytes")) / secs
        rx = (r0b.counter("rx_bytes") - r0a.counter("rx_bytes")) / secs
        stall = (r0b.counter("stall_cycles") - r0a.counter("stall_cycles")) / secs / 1e6
        tx1 = (b.records[1].counter("tx_bytes") - a.records[1].counter("tx_bytes")) / secs
        assert tx == pytest.approx(GB, rel=1e-6)
        assert rx == pytest.approx(GB / 4, rel=1e-6)
        assert stall == pytest.approx(600, rel=1e-6)
        assert tx1 == pytest.approx(2 * GB, rel=1e-6)
        assert all(r.has_counter("tx_bytes") for r in b.records)


def test_sampling_at_10khz_loses_no_samples_between_reads_at_10hz() -> None:
    with Device(DEV) as d:
        d.set_sim([sim(0, 0, GB)])
        first = d.snapshot()
        snaps = []
        for _ in range(30):
            time.sleep(0.1)
            snaps.append(d.snapshot())
        last = snaps[-1]
        samples = sum(s.header.window_samples for s in snaps)
        ticks = sum(s.header.window_ticks for s in snaps)
        link_samples = sum(s.records[0].window_samples for s in snaps)
        window_ns = sum(s.header.window_ns for s in snaps)
        # Exact accounting: every sample and every period is in exactly one window.
        assert samples == last.header.sequence - first.header.sequence
        assert ticks == last.header.ticks - first.header.ticks
        assert link_samples == last.records[0].samples - first.records[0].samples
        assert window_ns == last.header.timestamp_ns - first.header.timestamp_ns
        rate = samples / (window_ns / 1e9)
        period_rate = ticks / (window_ns / 1e9)
        missed = ticks - samples
        print(
            f"SAMPLING: {samples} samples in {window_ns / 1e9:.3f} s = {rate:.0f} Hz, "
            f"{ticks} periods = {period_rate:.0f} Hz, {missed} missed ({missed / ticks:.2%}), "
            f"30 reads at 10 Hz"
        )
        # Periods follow the guest's clock exactly; samples taken depend on how fast TCG
        # emulates a loaded host (9-10 kHz on an idle one): wide tolerance there, none on the
        # accounting.
        assert period_rate == pytest.approx(10_000, rel=0.03)
        assert 2_000 <= rate <= 10_300


def test_window_statistics_see_bursts() -> None:
    with Device(DEV) as d:
        # 1 GB/s on a 10 GB/s link (10 %), bursts of 8x (80 %) for 2 ms every 10 ms.
        link = SimLink(
            0, 0, 10 * GB, (GB, 0, 0, 0, 0), burst_period_ns=10_000_000, burst_len_ns=2_000_000,
            burst_pct=800,
        )  # fmt: skip
        d.set_params(Params(100_000, 2000, abi.UTIL_ONE // 2))
        d.set_sim([link])
        d.snapshot()
        time.sleep(0.5)
        s = d.snapshot()
        r = s.records[0]
        assert r.window_samples > 100
        assert r.window_max_util / abi.UTIL_ONE == pytest.approx(0.8, rel=0.05)
        util_10 = (abi.UTIL_ONE // 10).bit_length()  # bucket of 10 %
        util_80 = (abi.UTIL_ONE * 8 // 10).bit_length()  # bucket of 80 %
        assert r.window_util_hist[util_10] > 0 and r.window_util_hist[util_80] > 0
        assert sum(r.window_util_hist) == r.window_samples
        assert 0 < r.window_over_util < r.window_samples
        # Per-sample TX delta peaks at 8 GB/s times one period (wide: timer jitter).
        assert r.window_max_delta[0] >= 8 * GB * 100e-6 * 0.9
        assert sum(r.util_hist) == r.samples


def test_poll_wakes_on_threshold_crossing() -> None:
    with Device(DEV) as d:
        d.set_params(Params(100_000, 2000, abi.UTIL_ONE))
        d.set_sim([sim(0, 0, GB, stall_per_us=100)])
        d.snapshot()
        p = select.poll()
        p.register(d.fd, select.POLLIN | select.POLLPRI)
        assert p.poll(300) == []
        # Stall bursts of 30x (3,000 cycles/µs) for 1 ms every 50 ms cross the 2,000 threshold.
        d.set_sim([sim(0, 0, GB, stall_per_us=100, burst_period_ns=50_000_000,
                       burst_len_ns=1_000_000, burst_pct=3000)])  # fmt: skip
        t0 = time.monotonic()
        events = p.poll(2000)
        assert events and events[0][1] & select.POLLIN
        print(f"POLL: woken {1000 * (time.monotonic() - t0):.1f} ms after the bursts began")
        s = d.snapshot()
        assert s.header.threshold_event
        assert s.records[0].window_over_stall > 0
        assert s.records[0].window_max_stall >= 2000


# --------------------------------------------------------------------------------------------
# Hardening


def test_bad_ioctls_give_the_right_errno() -> None:
    with Device(DEV) as d:
        fd = d.fd
        params = abi.ffi.new("struct nvlc_params *")
        params.period_ns, params.stall_threshold, params.util_threshold = 100_000, 1, 1
        good = bytes(abi.ffi.buffer(params))
        assert raw_ioctl(fd, "NVLC_IOC_SET_PARAMS", good) == 0
        for period in (abi.lib.NVLC_PERIOD_MIN_NS - 1, abi.lib.NVLC_PERIOD_MAX_NS + 1):
            params.period_ns = period
            assert (
                raw_ioctl(fd, "NVLC_IOC_SET_PARAMS", bytes(abi.ffi.buffer(params))) == errno.EINVAL
            )
        params.period_ns = 100_000
        params.reserved[4] = 1
        assert raw_ioctl(fd, "NVLC_IOC_SET_PARAMS", bytes(abi.ffi.buffer(params))) == errno.EINVAL
        # Unknown number, other type: ENOTTY. Known number with another size: EINVAL.
        assert raw_ioctl(fd, abi.ioc(0, 0xB7, 0x3F, 0), b"") == errno.ENOTTY
        assert raw_ioctl(fd, abi.ioc(2, ord("T"), 0, 40), bytes(40)) == errno.ENOTTY
        assert raw_ioctl(fd, abi.ioc(1, 0xB7, 2, 48), bytes(48)) == errno.EINVAL
        assert raw_ioctl(fd, abi.ioc(2, 0xB7, 2, 64), bytes(64)) == errno.ENOTTY  # direction
        # SET_SIM: empty, duplicate, bad pointer, burst longer than its period.
        with pytest.raises(OSError) as e:
            d.set_sim([])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:
            d.set_sim([sim(0, 0, GB), sim(0, 0, GB)])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:
            d.set_sim([sim(0, 0, GB, burst_period_ns=1000, burst_len_ns=2000, burst_pct=200)])
        assert e.value.errno == errno.EINVAL
        with pytest.raises(OSError) as e:
            d.set_sim([SimLink(0, 0, 0, (GB, 0, 0, 0, 0))])
        assert e.value.errno == errno.EINVAL
        cfg = abi.ffi.new("struct nvlc_sim_config *")
        cfg.nlinks, cfg.links = 1, 0x10
        assert raw_ioctl(fd, "NVLC_IOC_SET_SIM", bytes(abi.ffi.buffer(cfg))) == errno.EFAULT
        # Configuration needs CAP_SYS_ADMIN; reading does not.
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                with Device(DEV) as u:
                    u.version()
                    u.snapshot()
                    code = raw_ioctl(u.fd, "NVLC_IOC_SET_PARAMS", good)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == errno.EPERM


def test_ten_thousand_random_ioctls() -> None:
    rng = random.Random(4)
    allowed = {0, errno.ENOTTY, errno.EINVAL, errno.EFAULT, errno.EPERM, errno.ENODEV,
               errno.ERANGE, errno.E2BIG, errno.ENOMEM}  # fmt: skip
    seen: dict[int, int] = {}
    with Device(DEV) as d:
        for i in range(10_000):
            kind = rng.random()
            if kind < 0.7:  # our type, any number, direction and size
                cmd = abi.ioc(rng.randrange(4), 0xB7, rng.randrange(12), rng.randrange(0, 200))
            elif kind < 0.9:  # the real commands
                cmd = rng.choice(list(abi.IOCTLS.values()))
            else:
                cmd = rng.getrandbits(32)
            size = (cmd >> 16) & 0x3FFF
            payload = bytearray(rng.getrandbits(8) for _ in range(min(size, 256)))
            if size > 256:
                payload.extend(bytes(size - 256))
            if rng.random() < 0.5 and len(payload) >= 16:  # plausible counts and pointers
                struct.pack_into("<IIQ", payload, 0, rng.randrange(3), rng.randrange(3),
                                 rng.choice([0, 8, 1 << 47, rng.getrandbits(64)]))  # fmt: skip
            try:
                if cmd in abi.IOCTLS.values() and cmd & 0x3FFF0000 == 0:
                    fcntl.ioctl(d.fd, cmd, 0)
                else:
                    fcntl.ioctl(d.fd, cmd, bytes(payload) if payload else 0)
                rc = 0
            except OSError as exc:
                rc = exc.errno or 0
            except (OverflowError, ValueError):
                continue
            seen[rc] = seen.get(rc, 0) + 1
            assert rc in allowed, (i, hex(cmd), rc)
        print(f"IOCTLS: 10000 random, errno counts {dict(sorted(seen.items()))}")
        d.clear_source()
        assert d.snapshot().header.magic == abi.MAGIC


def test_concurrent_readers() -> None:
    with Device(DEV) as admin:
        admin.set_sim([sim(0, i, GB * (i + 1)) for i in range(8)])
    errors: list[BaseException] = []
    shared = Device(DEV)

    def reader(own: bool) -> None:
        try:
            d = Device(DEV) if own else shared
            first = d.snapshot()
            prev = first
            total = 0
            for _ in range(100):
                s = d.snapshot()
                assert s.header.record_count == 8
                assert s.header.sequence >= prev.header.sequence
                for a, b in zip(prev.records, s.records, strict=True):
                    assert b.counter("tx_bytes") >= a.counter("tx_bytes")
                    # Folded from the shared segment: every window sample is in one bucket.
                    assert sum(b.window_util_hist) == b.window_samples
                total += s.header.window_samples
                prev = s
            if own:
                assert total == prev.header.sequence - first.header.sequence
                d.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i < 4,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    assert not errors, errors


class Holder:
    """A process of another user that opens the device up to ``count`` times, stopping at the
    first refusal, and holds what it opened until :meth:`close` kills it."""

    def __init__(self, uid: int, count: int) -> None:
        up_r, up_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                os.close(up_r)
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                fds, refused = [], 0
                for _ in range(count):
                    try:
                        fds.append(os.open(DEV, os.O_RDONLY))
                    except OSError as exc:
                        refused = exc.errno or 0
                        break
                if fds:  # an unprivileged reader reads
                    assert os.pread(fds[0], abi.HEADER_SIZE, 0)[:4] == b"NVLC"
                os.write(up_w, struct.pack("<ii", len(fds), refused))
                while True:
                    signal.pause()
            finally:
                os._exit(0)
        os.close(up_w)
        self.pid = pid
        self.opened, self.refused = struct.unpack("<ii", os.read(up_r, 8))
        os.close(up_r)

    def close(self) -> None:
        """Kill the process (a pipe would not do: later children inherit its other end)."""
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0


def open_files() -> int:
    return int((SYSFS / "open_files").read_text())


def limits() -> tuple[int, int, int]:
    """The module's max_open, max_open_per_user and root_reserve."""
    max_open, per_user, reserve = (
        int((PARAMS / name).read_text())
        for name in ("max_open", "max_open_per_user", "root_reserve")
    )
    return max_open, per_user, reserve


def test_other_users_cannot_keep_root_out() -> None:
    max_open, per_user, reserve = limits()
    assert (max_open, per_user, reserve) == (64, 4, 16)
    holders: list[Holder] = []
    mine: list[Device] = []
    try:
        # One user: its own limit, then EMFILE.
        nobody = Holder(65534, 10)
        holders.append(nobody)
        assert (nobody.opened, nobody.refused) == (per_user, errno.EMFILE)
        # Many users take every file that is not root's: 48 = 64 - 16, then EBUSY for anyone.
        for uid in range(1000, 1000 + (max_open - reserve) // per_user - 1):
            holders.append(Holder(uid, per_user))
            assert holders[-1].opened == per_user, holders[-1].refused
        assert open_files() == max_open - reserve
        late = Holder(2000, 1)
        holders.append(late)
        assert (late.opened, late.refused) == (0, errno.EBUSY)
        # Root, the daemon's user, still opens, configures and reads...
        with Device(DEV) as d:
            d.set_sim([sim(0, 0, GB)])
            time.sleep(0.02)
            assert d.snapshot().header.record_count == 1
        # ... and so does the daemon's source.
        source = NvlinkKmodSource()
        data = source.collect(Roots())
        assert data.kind == "device" and data.serving
        source.close()
        # Root's reserve is its own: 16 files, then EBUSY for root too.
        with pytest.raises(DeviceRefused) as e:
            for _ in range(reserve + 4):
                mine.append(Device(DEV))
        assert e.value.errno == errno.EBUSY and len(mine) == reserve
        assert open_files() == max_open
        # A user who closes frees files for the others, up to the pool shared by all but root.
        nobody.close()
        again = Holder(2000, per_user + 1)
        holders.append(again)
        assert (again.opened, again.refused) == (per_user, errno.EBUSY)
    finally:
        for h in holders:
            h.close()
        for d in mine:
            d.close()
    assert open_files() == 0


def test_daemon_source_down_while_refused_then_up() -> None:
    with Device(DEV) as admin:
        admin.set_sim([sim(0, 0, GB), sim(0, 1, GB)])
    held: list[Device] = []
    collector = Collector.from_config(default_config(), [make_source()])
    try:
        while len(held) < limits()[0]:  # root itself takes every file
            held.append(Device(DEV))
        snap = collector.run_cycle(force=True)
        sample = snap.current["nvlink_kmod"]
        assert sample.data is None and sample.error
        assert "DeviceRefused" in sample.error and "open refused (EBUSY)" in sample.error
        held.pop().close()
        time.sleep(0.05)
        snap = collector.run_cycle(force=True)
        sample = snap.current["nvlink_kmod"]
        assert sample.error is None, sample.error
        assert sample.data.kind == "device" and len(sample.data.snapshot.records) == 2
    finally:
        collector.close()
        for d in held:
            d.close()


def sampler() -> tuple[int, int]:
    return int((SYSFS / "samples").read_text()), int((SYSFS / "sample_busy_ns").read_text())


def cost_per_sample(windows: int = 5, seconds: float = 0.4) -> float:
    """The timer's time per sample, the least of several windows: the emulated CPU is shared
    with the host's other work, which only ever adds time."""
    costs = []
    for _ in range(windows):
        n0, ns0 = sampler()
        time.sleep(seconds)
        n1, ns1 = sampler()
        assert n1 > n0
        costs.append((ns1 - ns0) / (n1 - n0))
    return min(costs)


def test_sampling_cost_does_not_grow_with_readers() -> None:
    # 144 links (an HGX H100's 8 GPUs x 18 NVLinks) at 1 kHz: time left for the readers.
    links = [sim(g, n, GB * (n + 1), stall_per_us=100) for g in range(8) for n in range(18)]
    with Device(DEV) as admin:
        admin.set_params(Params(1_000_000, 2000, abi.UTIL_ONE * 9 // 10))
        admin.set_sim(links)
        admin.snapshot()
        alone = cost_per_sample()
        others = [Device(DEV) for _ in range(limits()[0] - 1)]
        try:
            assert open_files() == limits()[0]
            crowded = cost_per_sample()
            # Readers still get exact windows out of the shared segment.
            first = [d.snapshot() for d in others[:4]]
            time.sleep(0.2)
            last = [d.snapshot() for d in others[:4]]
            for a, b in zip(first, last, strict=True):
                assert b.header.window_samples == b.header.sequence - a.header.sequence
                for r in b.records:
                    assert sum(r.window_stall_hist) == r.window_samples
        finally:
            for d in others:
                d.close()
        admin.set_params(Params(100_000, 2000, abi.UTIL_ONE * 9 // 10))
    print(
        f"SAMPLE COST: {len(links)} links, {alone / 1000:.1f} us per sample with 1 reader, "
        f"{crowded / 1000:.1f} us with {limits()[0]}"
    )
    # Before the shared segment the timer updated every open file's window: 64 readers cost
    # several times one.
    assert crowded <= 1.5 * alone


# --------------------------------------------------------------------------------------------
# mmio on an ivshmem BAR written by a host process


def ivshmem() -> Path:
    for dev in Path("/sys/bus/pci/devices").iterdir():
        if (dev / "vendor").read_text().strip() == "0x1af4" and (
            dev / "device"
        ).read_text().strip() == "0x1110":
            return dev
    pytest.fail("no ivshmem device (1af4:1110) in the guest")


class Bar:
    """BAR2 of the ivshmem device through sysfs: what the guest test reads and commands."""

    def __init__(self, dev: Path) -> None:
        self.fd = os.open(dev / "resource2", os.O_RDWR | os.O_SYNC)
        self.map = mmap.mmap(self.fd, 1 << 20)

    def u64(self, offset: int) -> int:
        return int(struct.unpack_from("<Q", self.map, offset)[0])

    def command(self, cmd: int) -> None:
        struct.pack_into("<Q", self.map, 0x800, cmd)
        deadline = time.monotonic() + 5
        while self.u64(0x808) != cmd:
            assert time.monotonic() < deadline, "host writer did not acknowledge"
            time.sleep(0.005)
        time.sleep(0.02)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


def address(dev: Path) -> tuple[int, int, int]:
    domain, bus, slot_fn = dev.name.split(":")
    slot, fn = slot_fn.split(".")
    return int(domain, 16), int(bus, 16), (int(slot, 16) << 3) | int(fn, 16)


def mmio_map(dev: Path) -> tuple[list[MmioLink], list[MmioReg]]:
    dom, bus, devfn = address(dev)

    def reg(offset: int, width: int, counter: int, link: int) -> MmioReg:
        return MmioReg(dom, bus, devfn, 2, offset, width, counter, 0, link)

    links = [MmioLink(0, 0, 25 * GB), MmioLink(0, 1, 25 * GB)]
    regs = [
        reg(0x100, 64, 0, 0),
        reg(0x108, 64, 1, 0),
        reg(0x110, 32, 2, 0),
        reg(0x114, 32, 3, 0),
        reg(0x118, 32, 4, 0),
        reg(0x200, 64, 0, 1),
        reg(0x208, 64, 1, 1),
    ]
    return links, regs


@pytest.fixture
def bar() -> Iterator[Bar]:
    b = Bar(ivshmem())
    deadline = time.monotonic() + 10
    while b.u64(0) != REGS_MAGIC:
        assert time.monotonic() < deadline, "host register writer not running"
        time.sleep(0.01)
    b.command(CMD_COUNT)
    yield b
    b.command(CMD_COUNT)
    b.close()


def test_mmio_reads_registers_the_host_writes(bar: Bar) -> None:
    dev = ivshmem()
    links, regs = mmio_map(dev)
    with Device(DEV) as d:
        d.set_mmio(links, regs)
        time.sleep(0.05)
        a = d.snapshot()
        time.sleep(1.0)
        b = d.snapshot()
        direct_tx = bar.u64(0x100)
        secs = (b.header.timestamp_ns - a.header.timestamp_ns) / 1e9
        r0a, r0b = a.records[0], b.records[0]
        assert b.header.source_name == "mmio" and not b.header.device_gone
        tx = (r0b.counter("tx_bytes") - r0a.counter("tx_bytes")) / secs
        stall = (r0b.counter("stall_cycles") - r0a.counter("stall_cycles")) / secs / 1e6
        tx1 = (b.records[1].counter("tx_bytes") - a.records[1].counter("tx_bytes")) / secs
        print(f"MMIO: link0 tx {tx / GB:.3f} GB/s stall {stall:.0f}/us, link1 tx {tx1 / GB:.3f}")
        # The host writes by its own clock: wide tolerance.
        assert tx == pytest.approx(GB, rel=0.3)
        assert tx1 == pytest.approx(2 * GB, rel=0.3)
        # 5,000 cycles/µs on a 32-bit register wraps every 0.86 s: at least once in this
        # window, so only a correct 64-bit extension gives the right rate.
        assert stall == pytest.approx(5000, rel=0.3)
        # The host updates every ~1 ms, so single 100 µs samples see steps: peaks >= mean.
        assert r0b.window_max_stall >= 0.7 * 5000
        assert r0b.counter("tx_bytes") <= direct_tx
        assert r0b.has_counter("stall_cycles") and not b.records[1].has_counter("stall_cycles")
        assert r0b.window_samples > 1000


def test_mmio_map_is_checked(bar: Bar) -> None:
    dev = ivshmem()
    links, regs = mmio_map(dev)
    dom, bus, devfn = address(dev)
    cases = [
        (MmioReg(dom, bus, devfn, 2, 1 << 20, 64, 0, 0, 0), errno.ERANGE),  # past the BAR
        (MmioReg(dom, bus, devfn, 2, 0x104, 64, 0, 0, 0), errno.EINVAL),  # unaligned
        (MmioReg(dom, bus, devfn, 2, 0x100, 48, 0, 0, 0), errno.EINVAL),  # width
        (MmioReg(dom, bus, devfn, 1, 0x0, 32, 0, 0, 0), errno.EINVAL),  # no such memory BAR
        (MmioReg(dom, bus, devfn, 2, 0x0, 32, 9, 0, 0), errno.EINVAL),  # counter kind
        (MmioReg(dom, bus, devfn, 2, 0x0, 32, 0, 5, 5), errno.EINVAL),  # undeclared link
        (MmioReg(dom, bus, 0xF8, 2, 0x0, 32, 0, 0, 0), errno.ENODEV),  # no such device
    ]
    with Device(DEV) as d:
        for reg, expected in cases:
            with pytest.raises(OSError) as e:
                d.set_mmio(links[:1], [reg])
            assert e.value.errno == expected, reg
        with pytest.raises(OSError) as e:
            d.set_mmio(links[:1], [regs[0], regs[0]])  # the same counter twice
        assert e.value.errno == errno.EINVAL


def test_all_ones_is_device_gone(bar: Bar) -> None:
    links, regs = mmio_map(ivshmem())
    with Device(DEV) as d:
        d.set_mmio(links, regs)
        time.sleep(0.05)
        d.snapshot()
        p = select.poll()
        p.register(d.fd, select.POLLIN)
        bar.command(CMD_ALL_ONES)
        assert p.poll(2000), "no wake-up on device gone"
        a = d.snapshot()
        assert a.header.device_gone
        assert all(r.device_gone for r in a.records)
        time.sleep(0.2)
        b = d.snapshot()
        assert [r.counters for r in b.records] == [r.counters for r in a.records]
        assert all(r.window_samples == 0 for r in b.records)
        bar.command(CMD_COUNT)
        d.set_mmio(links, regs)  # a new map reads the device again
        time.sleep(0.1)
        assert not d.snapshot().header.device_gone


def test_pci_remove_while_mapped() -> None:
    dev = ivshmem()
    links, regs = mmio_map(dev)
    with Device(DEV) as d:
        d.set_mmio(links, regs)
        time.sleep(0.05)
        d.snapshot()
        (dev / "remove").write_text("1")
        # The links are marked at the sampler's next tick after the notifier saw the removal.
        s = snapshot_when(d, lambda s: s.header.device_gone)
        assert s.header.device_gone and all(r.device_gone for r in s.records)
        with pytest.raises(OSError) as e:
            d.set_mmio(links, regs)
        assert e.value.errno == errno.ENODEV
        d.clear_source()
    Path("/sys/bus/pci/rescan").write_text("1")
    time.sleep(0.2)
    assert ivshmem() == dev


# --------------------------------------------------------------------------------------------
# The daemon reading the module


def test_nodescope_snapshot_json_shows_module_metrics() -> None:
    with Device(DEV) as d:
        d.set_sim([sim(0, 0, 5 * GB, stall_per_us=700), sim(1, 0, GB)])
        # Only this source: the others have nothing to read in the guest and cost start-up.
        config = Path(os.environ.get("TMPDIR", "/tmp")) / "nodescope-kmod.toml"
        config.write_text(
            "".join(
                f"[sources.{info.name}]\nenabled = {str(info.name == 'nvlink_kmod').lower()}\n"
                for info in SOURCE_TABLE
            )
        )
        t0 = time.monotonic()
        out = subprocess.run(
            [
                str(REPO / ".venv/bin/nodescope"),
                "snapshot",
                "--json",
                "--interval",
                "0.5",
                "--config",
                str(config),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        doc = json.loads(out)
        entry = doc["sources"]["nvlink_kmod"]
        assert entry["ok"], entry["error"]
        assert entry["data"]["kind"] == "device"
        records = entry["data"]["snapshot"]["records"]
        assert [(r["device"], r["link"]) for r in records] == [(0, 0), (1, 0)]
        links = entry["derived"]["links"]
        assert links[0]["tx_bytes_per_second"] == pytest.approx(5 * GB, rel=1e-3)
        assert links[0]["utilisation"] == pytest.approx(0.2, rel=1e-3)
        assert links[0]["stall_cycles_per_microsecond"] == pytest.approx(700, rel=1e-3)
        assert links[0]["window_samples"] > 0
        print(f"SNAPSHOT: nodescope snapshot --json took {time.monotonic() - t0:.1f} s")
        # The exposition of the same source, as the daemon serves it (in this process: a
        # second interpreter start costs ~15 s under emulation).
        collector = Collector.from_config(default_config(), [make_source()])
        collector.run_cycle(force=True)
        time.sleep(0.3)
        text = render(collector.run_cycle(force=True)).decode()
        collector.close()
        assert 'nodescope_nvlink_data_source_info{source="kmod"} 1.0' in text
        # Byte counters and burst histograms per device; stall cycles and peaks per link.
        assert 'nodescope_nvlink_kmod_transmit_bytes_total{device="0"}' in text
        assert 'nodescope_nvlink_kmod_stall_cycles_total{device="0",link="0"}' in text
        assert 'nodescope_nvlink_kmod_stall_samples_total{below="1024",device="0"}' in text


# --------------------------------------------------------------------------------------------
# Unloading


def test_rmmod_while_open_is_refused_then_works() -> None:
    d = Device(DEV)
    d.set_sim([sim(0, 0, GB)])
    res = subprocess.run(["rmmod", "nvlink_counter"], capture_output=True, text=True)
    assert res.returncode != 0 and loaded()
    assert d.snapshot().header.record_count == 1
    d.close()
    subprocess.run(["rmmod", "nvlink_counter"], check=True)
    assert not loaded() and not os.path.exists(DEV)
    # Module parameter bounds.
    res = subprocess.run(["insmod", KO, "period_ns=5"], capture_output=True, text=True)
    assert res.returncode != 0 and not loaded()
    insmod("period_ns=50000")
    with Device(DEV) as d2:
        assert d2.params().period_ns == 50_000
        d2.set_params(Params(100_000, 2000, abi.UTIL_ONE * 9 // 10))
    subprocess.run(["rmmod", "nvlink_counter"], check=True)
    # Limits on open files: checked at load, and in force as given.
    refused_limits = (
        "max_open=1",
        "max_open=2000",
        "root_reserve=0",
        "root_reserve=64",
        "max_open_per_user=0",
        "max_open=8 root_reserve=4 max_open_per_user=5",
    )
    for bad in refused_limits:
        res = subprocess.run(["insmod", KO, *bad.split()], capture_output=True, text=True)
        assert res.returncode != 0 and not loaded(), bad
    insmod("max_open=8", "root_reserve=2", "max_open_per_user=3")
    nobody = Holder(65534, 5)
    other = Holder(1000, 5)
    try:
        assert (nobody.opened, nobody.refused) == (3, errno.EMFILE)
        assert (other.opened, other.refused) == (3, errno.EBUSY)
        with Device(DEV) as d3, Device(DEV) as d4:
            assert d3.snapshot().header.magic == d4.snapshot().header.magic == abi.MAGIC
            with pytest.raises(DeviceRefused) as e:
                Device(DEV)
            assert e.value.errno == errno.EBUSY
    finally:
        nobody.close()
        other.close()
