"""The hooks as the service runs them: the socket server with its commands, and the tracker
it feeds every analysed snapshot.

``ping`` is the server's own; ``prolog``, ``epilog`` and ``clear_xids`` are the tracker's;
``probe`` and ``probe_result`` come from :mod:`nodescope.probe_runner`; ``alerts`` answers the
firing alerts of the last analysed cycle, read-only, for ``nodescope slurm health``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodescope.config import Config
from nodescope.hooks.auth import Peer, allowed_uids, slurm_uid
from nodescope.hooks.registrations import RegistrationExpiry
from nodescope.hooks.stops import gate_stops_dir, remove_stale_gate_stops
from nodescope.hooks.tracker import JobTracker
from nodescope.hooks.transport import HookServer, Request, Response, run_dir, socket_path
from nodescope.model.alert import AlertState
from nodescope.model.job_records import registrations_dir
from nodescope.model.snapshot import Snapshot
from nodescope.probe_runner import ProbeHook
from nodescope_exporters.reports import remove_orphan_temporaries

#: One logger for every part of the hooks: its name is in each line operators search for.
log = logging.getLogger("nodescope.hooks")


class Hooks:
    """The socket server and the tracker, as the service starts and feeds them."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self.tracker = JobTracker(config)
        self.expiry = RegistrationExpiry(config)
        self._config = config
        self.server = HookServer(
            socket_path(config().roots),
            lambda peer: peer.uid in allowed_uids(self._config().slurm),
            lambda: self._config().slurm.timeout_seconds,
            grant_uid=lambda: slurm_uid(self._config().slurm.slurm_user),
        )
        self.server.register("prolog", self.tracker.prolog)
        self.server.register("epilog", self.tracker.epilog)
        self.server.register("clear_xids", self.tracker.clear_xids)
        self.probe = ProbeHook(config)
        self.server.register("probe", self.probe.start)
        self.server.register("probe_result", self.probe.result)
        # The last cycle's firing alerts, replaced whole each cycle: the socket's worker
        # thread reads one complete tuple or the previous one, never a list being built.
        self._firing: tuple[dict[str, Any], ...] = ()
        self._firing_wall: float | None = None
        self.server.register("alerts", self.firing_alerts)

    @classmethod
    def start(cls, config: Callable[[], Config]) -> Hooks | None:
        """Start the socket; a daemon that cannot bind it still collects (and says why)."""
        hooks = cls(config)
        hooks.sweep()
        try:
            hooks.server.start()
        except OSError as exc:
            log.error("event=hooks_unavailable socket=%s error=%r", hooks.server.path, str(exc))
            return None
        log.info("event=hooks_listening socket=%s", hooks.server.path)
        return hooks

    def sweep(self) -> None:
        """Remove temporary files of writers that died (``kill -9``, power loss) and records
        of stopped jobs whose epilog never came, and say now, not at the first epilog, when
        the reports directory is unsafe."""
        config = self._config()
        for directory in (
            registrations_dir(config.roots),
            run_dir(config.roots),
            Path(config.slurm.reports_dir),
        ):
            try:
                removed = remove_orphan_temporaries(directory)
            except OSError as exc:
                log.error("event=directory_unsafe path=%s error=%r", directory, str(exc))
                continue
            if removed:
                log.info("event=orphans_removed path=%s count=%d", directory, len(removed))
        try:
            stale = remove_stale_gate_stops(config.roots)
        except OSError as exc:
            log.error("event=directory_unsafe path=%s error=%r", gate_stops_dir(config.roots),
                      str(exc))  # fmt: skip
        else:
            if stale:
                log.info("event=gate_stops_expired count=%d", len(stale))

    def observe(self, snapshot: Snapshot) -> None:
        # Imported here: every Slurm hook imports this module, and the analysis stage (all
        # detectors) would add a tenth of a second to each job launch; the daemon that calls
        # this has it loaded already.
        from nodescope.analysis import alert_json

        self.tracker.observe(snapshot)
        self.expiry.observe(snapshot)
        self._firing = tuple(alert_json(a) for a in snapshot.alerts if a.state is AlertState.FIRING)
        self._firing_wall = snapshot.wall_time

    def firing_alerts(self, request: Request, peer: Peer) -> Response:
        """``alerts``: the firing alerts of the last cycle (``wall_time`` null before the
        first cycle has been analysed: then nothing is known yet)."""
        return {"ok": True, "wall_time": self._firing_wall, "alerts": list(self._firing)}

    def stop(self) -> None:
        self.server.stop()
