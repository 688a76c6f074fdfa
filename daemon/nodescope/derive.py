"""Figures derived from two samples of one source (rates, iostat columns).

Each source that has rates names a pure function ``(previous, current, seconds) -> record``
here; the snapshot JSON, the CLI views and the detectors all take their rates from this one
place, so every consumer sees the same numbers.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from nodescope.memo import Memo
from nodescope.model.snapshot import Snapshot

log = logging.getLogger("nodescope.derive")

Deriver = Callable[[Any, Any, float], Any]

#: source name -> "module:function"
DERIVERS: dict[str, str] = {
    "disks": "nodescope.sources.diskstats:iostat_figures",
    "infiniband": "nodescope.sources.infiniband:port_rates",
    "netdev": "nodescope.sources.netlink:link_rates",
    "nvml": "nodescope.sources.nvml:gpu_rates",
    "procs": "nodescope.sources.procs:procs_rates",
    "nvlink_kmod": "nodescope.sources.nvlink_kmod:link_rates",
    "mountstats": "nodescope.sources.mountstats:nfs_rates",
}

_loaded: dict[str, Deriver] = {}
#: source -> the derived record of the last pair of samples derived: the detectors and several
#: exporter areas ask for the same pair within a cycle, and a source on a 5 or 10 s interval
#: keeps its pair for several cycles; derivers are pure.
_last: dict[str, Memo[Any]] = {}


def deriver(source: str) -> Deriver | None:
    target = DERIVERS.get(source)
    if target is None:
        return None
    if source not in _loaded:
        module_name, _, function = target.partition(":")
        _loaded[source] = getattr(importlib.import_module(module_name), function)
    return _loaded[source]


def derived(snapshot: Snapshot, source: str) -> Any | None:
    """The derived record of ``source`` for this snapshot, or ``None`` before two good reads."""
    cur = snapshot.current.get(source)
    prev = snapshot.previous.get(source)
    if cur is None or prev is None or cur.data is None or prev.data is None:
        return None
    seconds = cur.monotonic - prev.monotonic
    if seconds <= 0:
        return None
    fn = deriver(source)
    if fn is None:
        return None
    memo = _last.get(source)
    if memo is None:
        memo = _last[source] = Memo()
    try:
        return memo.get((prev, cur), None, lambda: fn(prev.data, cur.data, seconds))
    except Exception as exc:  # a bad pair of samples costs that source's rates, nothing more
        log.warning("source=%s derive_error=%r", source, f"{type(exc).__name__}: {exc}")
        return None
