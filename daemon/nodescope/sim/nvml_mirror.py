"""The simulated node's NVML state as a file, so a daemon in another process can see it.

The fake NVML (:class:`nodescope.sim.fake_nvml.FakeNvml`) lives in the process that runs the
simulated node; a daemon started as its own process (the benchmark in ``bench/``) cannot call
into it. :func:`write_state` publishes the fake's GPUs after each tick as one JSON document
(written to a temporary file and renamed, so a reader never sees half of it), and
:class:`MirroredNvml` is a :class:`FakeNvml` in the daemon's process that takes its GPUs from
that file: :meth:`MirroredNvml.refresh` re-reads it when it changed (one ``stat`` otherwise)
and replays the Xid events published since the last refresh into its own event sets.

Format (``nodescope-nvml-state/1``)::

    {"format": "nodescope-nvml-state/1", "t": <simulated seconds>, "epoch": <unix time of t=0>,
     "gpus": [<FakeGpu fields, links and processes as lists of objects>],
     "xids": [[<gpu index>, <xid>], ...]}      # every Xid since the start, in order

The refresh is bookkeeping of the simulation, not work a daemon on a real node does: its
thread CPU time is kept in :attr:`MirroredNvml.refresh_cpu_seconds` so a measurement can
report it and leave it out.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pynvml

from nodescope.errors import ParseError
from nodescope.sim.fake_nvml import FakeGpu, FakeLink, FakeNvml, FakeProcess

FORMAT = "nodescope-nvml-state/1"
#: The file under the node's root that ``python -m nodescope.sim.run_node`` writes and a
#: daemon in another process mirrors.
STATE_FILE = "nvml-state.json"

_GPU_SCALARS = tuple(f.name for f in fields(FakeGpu) if f.name not in ("links", "processes"))
_LINK_SCALARS = tuple(f.name for f in fields(FakeLink) if f.name != "errors")


def state_document(nvml: FakeNvml, t: float, epoch: float, xids: list[tuple[int, int]]) -> bytes:
    """The state of every GPU of ``nvml`` at simulated second ``t``."""
    gpus: list[dict[str, Any]] = []
    # Field by field rather than dataclasses.asdict, which deep-copies every value and made
    # up half of a refresh's cost: the document is published several times a second.
    for gpu in nvml.gpus:
        record = {name: getattr(gpu, name) for name in _GPU_SCALARS}
        record["unsupported"] = sorted(gpu.unsupported, key=str)
        record["links"] = [
            {
                **{name: getattr(link, name) for name in _LINK_SCALARS},
                # JSON object keys are strings; the error counters are keyed by int.
                "errors": [[k, v] for k, v in sorted(link.errors.items())],
            }
            for link in gpu.links
        ]
        record["processes"] = [
            {"pid": process.pid, "used_memory_bytes": process.used_memory_bytes}
            for process in gpu.processes
        ]
        gpus.append(record)
    doc = {"format": FORMAT, "t": t, "epoch": epoch, "gpus": gpus, "xids": xids}
    return json.dumps(doc, separators=(",", ":")).encode()


def write_state(path: Path, data: bytes) -> None:
    """Publish ``data`` at ``path`` atomically (temporary file in the same directory, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _link(obj: dict[str, Any]) -> FakeLink:
    link = FakeLink(**{k: obj[k] for k in _LINK_SCALARS})
    link.errors = {int(k): int(v) for k, v in obj["errors"]}
    return link


def _gpu(obj: dict[str, Any]) -> FakeGpu:
    gpu = FakeGpu(**{k: obj[k] for k in _GPU_SCALARS if k != "unsupported"})
    gpu.unsupported = set(obj["unsupported"])
    gpu.links = [_link(link) for link in obj["links"]]
    gpu.processes = [FakeProcess(p["pid"], p["used_memory_bytes"]) for p in obj["processes"]]
    return gpu


def read_state(path: Path) -> dict[str, Any]:
    text = path.read_bytes()
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ParseError(str(path), f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ParseError(str(path), f"not a {FORMAT} document")
    return doc


class MirroredNvml(FakeNvml):
    """A fake NVML whose GPUs follow the state file another process writes.

    The GPU list (count, identities, links) is taken from the first document; later ones
    update the counters, link and utilisation state, processes and lost flags in place.
    ``wall_clock`` is the simulated node's (its field timestamps and event times).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = read_state(path)
        self.t = float(doc["t"])
        self.epoch = float(doc["epoch"])
        super().__init__([_gpu(g) for g in doc["gpus"]], clock_us=self._clock_us)
        self._xids_seen = len(doc["xids"])
        self._stamp = self._file_stamp()
        self.refresh_cpu_seconds = 0.0
        self.refreshes = 0

    def _clock_us(self) -> int:
        return round((self.epoch + self.t) * 1_000_000)

    def wall_clock(self) -> float:
        return self.epoch + self.t

    def _file_stamp(self) -> tuple[int, int]:
        st = os.stat(self.path)
        return st.st_ino, st.st_mtime_ns

    def refresh(self) -> bool:
        """Take the latest published state; returns whether there was a new one."""
        started = time.thread_time()
        try:
            stamp = self._file_stamp()
            if stamp == self._stamp:
                return False
            doc = read_state(self.path)
            self._stamp = stamp
            self._apply(doc)
            self.refreshes += 1
            return True
        finally:
            # The fake keeps every field request for tests; a long run must not.
            self.field_requests.clear()
            self.refresh_cpu_seconds += time.thread_time() - started

    def _apply(self, doc: dict[str, Any]) -> None:
        self.t = float(doc["t"])
        for gpu, new in zip(self.gpus, doc["gpus"], strict=False):
            for name in _GPU_SCALARS:
                if name != "unsupported":
                    setattr(gpu, name, new[name])
            for link, obj in zip(gpu.links, new["links"], strict=False):
                for name in _LINK_SCALARS:
                    setattr(link, name, obj[name])
                link.errors = {int(k): int(v) for k, v in obj["errors"]}
            gpu.processes = [
                FakeProcess(p["pid"], p["used_memory_bytes"]) for p in new["processes"]
            ]
        xids = doc["xids"]
        for index, xid in xids[self._xids_seen :]:
            self.inject_xid(int(index), int(xid))
        self._xids_seen = len(xids)


class XidRecorder:
    """Collects the Xid events a simulated node injects into its fake NVML, through the
    pynvml event calls (an event set registered for every GPU), for :func:`state_document`."""

    def __init__(self, nvml: FakeNvml) -> None:
        self.nvml = nvml
        self.events: list[tuple[int, int]] = []
        nvml.nvmlInit()
        self._set = nvml.nvmlEventSetCreate()
        for index in range(len(nvml.gpus)):
            try:
                nvml.nvmlDeviceRegisterEvents(
                    nvml.handle(index), pynvml.nvmlEventTypeXidCriticalError, self._set
                )
            except pynvml.NVMLError:
                continue  # a GPU without Xid events (or already lost) has none to publish

    def drain(self) -> list[tuple[int, int]]:
        """Every Xid injected so far (the new ones appended), in order."""
        while True:
            try:
                event = self.nvml.nvmlEventSetWait(self._set, 0)
            except pynvml.NVMLError_Timeout:
                return self.events
            self.events.append((_handle_index(event.device), int(event.eventData)))


def _handle_index(handle: Any) -> int:
    # The fake's handles are a base address plus 0x100 per GPU index.
    address = ctypes.cast(handle, ctypes.c_void_p).value or 0
    return (address & 0xFFFFFFFF) // 0x100


__all__ = ["FORMAT", "MirroredNvml", "XidRecorder", "read_state", "state_document", "write_state"]
