"""Host side of the fake registers: writes NVLink-like counters into the ivshmem file.

The guest sees this file as BAR2 of PCI device 1af4:1110 and the module reads it with
readq/readl. Counters are functions of the time since start (so rates are exact whatever
the loop's jitter); the guest steers the writer through a command word it writes into the
same BAR (through the sysfs resource file, never through the module, which only reads).

Layout (little-endian), offsets in bytes:

====== ====== ===========================================================
0x000  u64    REGS_MAGIC once the writer runs
0x008  u64    heartbeat: milliseconds since start
0x100  u64    link 0 TX bytes (1 GB/s)
0x108  u64    link 0 RX bytes (250 MB/s)
0x110  u32    link 0 stall cycles (5,000 per us: wraps every 0.86 s), starts 100 M below 2^32
0x114  u32    link 0 replay errors (1 per ms)
0x118  u32    link 0 CRC errors (0)
0x200  u64    link 1 TX bytes (2 GB/s)
0x208  u64    link 1 RX bytes (2 GB/s)
0x800  u64    command from the guest: 1 count, 2 all-ones (a device that fell off the bus)
0x808  u64    the last command the writer carried out
====== ====== ===========================================================
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
import time

REGS_MAGIC = 0x53474552434C564E  # "NVLCREGS"
CMD_COUNT = 1
CMD_ALL_ONES = 2
STALL_START = (1 << 32) - 100_000_000


def counters(ms: float) -> dict[int, tuple[type[ctypes.c_uint32 | ctypes.c_uint64], int]]:
    ns = ms * 1_000_000
    return {
        0x100: (ctypes.c_uint64, int(ns * 1.0)),
        0x108: (ctypes.c_uint64, int(ns * 0.25)),
        0x110: (ctypes.c_uint32, (STALL_START + int(ns * 5)) & 0xFFFFFFFF),
        0x114: (ctypes.c_uint32, int(ms) & 0xFFFFFFFF),
        0x118: (ctypes.c_uint32, 0),
        0x200: (ctypes.c_uint64, int(ns * 2.0)),
        0x208: (ctypes.c_uint64, int(ns * 2.0)),
    }


def store(
    regs: mmap.mmap, offset: int, kind: type[ctypes.c_uint32 | ctypes.c_uint64], value: int
) -> None:
    """One aligned store of the register's full width, as hardware updates a counter: a
    byte-wise copy could let the guest read a torn value, which looks like a decrease (a
    false wrap of a 32-bit counter)."""
    kind.from_buffer(regs, offset).value = value


def main(path: str) -> int:
    fd = os.open(path, os.O_RDWR)
    regs = mmap.mmap(fd, 1 << 20)
    start = time.monotonic()
    struct.pack_into("<Q", regs, 0x808, CMD_COUNT)
    struct.pack_into("<Q", regs, 0x000, REGS_MAGIC)
    while True:
        ms = (time.monotonic() - start) * 1000.0
        (command,) = struct.unpack_from("<Q", regs, 0x800)
        if command == CMD_ALL_ONES:
            regs[0x100:0x300] = b"\xff" * 0x200
        else:
            for offset, (kind, value) in counters(ms).items():
                store(regs, offset, kind, value)
        struct.pack_into("<Q", regs, 0x008, int(ms))
        struct.pack_into("<Q", regs, 0x808, command or CMD_COUNT)
        time.sleep(0.001)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
