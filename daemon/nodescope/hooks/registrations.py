"""Registrations kept bounded: the cap the prolog checks before it registers a job, and the
expiry of registrations whose epilog never came (a node rebooted mid-job, a killed slurmd).

A registration (``<run>/nodescope/jobs/<id>.json``) expires when the job is known to neither
side: it has no cgroup on the node (the latest ``jobs`` record) and Slurm no longer knows it
as running (``scontrol show job``, at most :data:`MAX_ASKED` jobs per pass, each call bounded
by its timeout), or, when Slurm gives no answer, once it is ``[slurm]
registration_max_age_seconds`` old. A registration younger than :data:`GRACE_SECONDS` is
never expired: the job's cgroup may appear after its prolog.

The daemon runs a pass at most every :data:`EXPIRY_INTERVAL_SECONDS` on a thread of its own
(:class:`RegistrationExpiry`), never on the collection cycle. The prolog that finds the cap
reached expires what the cgroups and the age allow (no Slurm call: a prolog must not wait on
Slurm) and, when still full, registers nothing and says why: the job runs, without its
per-job series.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from nodescope.config import Config, SlurmSettings
from nodescope.model.job_records import JOBS, registrations_dir
from nodescope.model.snapshot import Snapshot
from nodescope.remediation.slurm import Scontrol, SlurmError
from nodescope.roots import Roots

log = logging.getLogger("nodescope.hooks")

#: A registration this young is kept whatever the cgroups and Slurm say.
GRACE_SECONDS = 600.0
#: Jobs asked of Slurm in one expiry pass (the oldest registrations first).
MAX_ASKED = 8
#: Seconds between two expiry passes of the daemon.
EXPIRY_INTERVAL_SECONDS = 300.0
#: The longest one ``scontrol show job`` of a pass may take.
SCONTROL_SECONDS = 5.0


class RegistrationRefused(Exception):
    """The node holds ``[slurm] max_registrations`` registrations: the job is not registered."""


def registered(roots: Roots) -> dict[str, float]:
    """Job id → modification time of each registration (``{}`` without the directory)."""
    found: dict[str, float] = {}
    try:
        with os.scandir(registrations_dir(roots)) as entries:
            for entry in entries:
                name = entry.name
                if not name.endswith(".json") or name.startswith("."):
                    continue
                try:
                    found[name[: -len(".json")]] = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue  # removed meanwhile
    except OSError:
        return {}
    return found


def expire_registrations(
    roots: Roots,
    cgroup_jobs: frozenset[str],
    now: float,
    max_age: float,
    slurm_active: Callable[[str], bool | None] | None = None,
) -> list[str]:
    """Remove the registrations of jobs that have no cgroup and that Slurm says have ended
    (``slurm_active`` answers ``False``), or that are ``max_age`` old when Slurm gives no
    answer (``None``, or no ``slurm_active``); the job ids removed, oldest first."""
    removed: list[str] = []
    asked = 0
    for job, mtime in sorted(registered(roots).items(), key=lambda item: item[1]):
        age = now - mtime
        if job in cgroup_jobs or age < GRACE_SECONDS:
            continue
        active: bool | None = None
        if slurm_active is not None and asked < MAX_ASKED:
            asked += 1
            active = slurm_active(job)
        if active is True or (active is None and age < max_age):
            continue
        try:
            os.unlink(registrations_dir(roots) / f"{job}.json")
        except FileNotFoundError:
            continue
        removed.append(job)
    return removed


def make_room(
    roots: Roots,
    job_id: str,
    settings: SlurmSettings,
    cgroup_jobs: frozenset[str] | None,
    now: float,
) -> None:
    """Check that ``job_id`` may be registered: it is already, or the node holds fewer than
    ``max_registrations``, after expiring (cgroups and age only) when it is full and the
    cgroups are known; :class:`RegistrationRefused` saying why otherwise."""
    cap = settings.max_registrations
    jobs = registered(roots)
    if job_id in jobs or len(jobs) < cap:
        return
    if cgroup_jobs is not None:
        removed = expire_registrations(
            roots, cgroup_jobs, now, settings.registration_max_age_seconds
        )
        if removed:
            log.info("event=registrations_expired count=%d by=prolog", len(removed))
        if len(jobs) - len(removed) < cap:
            return
    raise RegistrationRefused(
        f"nodescope: job {job_id} not registered: the node holds {len(jobs)} registrations,"
        f" the cap ([slurm] max_registrations) is {cap}; the job runs without per-job series"
        " (registrations of ended jobs expire once Slurm and the cgroups no longer know them)"
    )


def cgroup_jobs_of(snapshot: Snapshot | None) -> frozenset[str] | None:
    """The job ids with cgroups in the snapshot's latest ``jobs`` record (``None``: none)."""
    data = None if snapshot is None else snapshot.latest(JOBS)
    if data is None:
        return None
    return frozenset(j.job_id for j in data.jobs if j.job_id is not None)


class RegistrationExpiry:
    """The daemon's expiry passes: started from :meth:`observe` (every analysed snapshot) at
    most every ``interval`` seconds, one at a time, each on its own daemon thread."""

    def __init__(
        self,
        config: Callable[[], Config],
        interval: float = EXPIRY_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self.interval = interval
        self._clock = clock
        self._next = 0.0
        self._thread: threading.Thread | None = None

    def observe(self, snapshot: Snapshot) -> None:
        now = self._clock()
        if now < self._next or (self._thread is not None and self._thread.is_alive()):
            return
        jobs = cgroup_jobs_of(snapshot)
        if jobs is None:
            return
        self._next = now + self.interval
        self._thread = threading.Thread(
            target=self.run_pass,
            args=(self._config(), jobs),
            name="nodescope-registrations",
            daemon=True,
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @staticmethod
    def run_pass(config: Config, cgroup_jobs: frozenset[str]) -> list[str]:
        scontrol = Scontrol(
            config.slurm.scontrol,
            min(config.remediation.scontrol_timeout_seconds, SCONTROL_SECONDS),
        )

        def ask(job: str) -> bool | None:
            try:
                return scontrol.job_active(job)
            except SlurmError as exc:
                log.info("event=registration_unchecked job=%s error=%r", job, str(exc))
                return None

        try:
            removed = expire_registrations(
                config.roots,
                cgroup_jobs,
                time.time(),
                config.slurm.registration_max_age_seconds,
                ask if config.slurm.scontrol else None,
            )
        except OSError as exc:
            log.error("event=registrations_unreadable error=%r", str(exc))
            return []
        if removed:
            log.info(
                "event=registrations_expired count=%d jobs=%s by=daemon",
                len(removed),
                ",".join(removed[:16]),
            )
        return removed


__all__ = [
    "EXPIRY_INTERVAL_SECONDS",
    "GRACE_SECONDS",
    "MAX_ASKED",
    "RegistrationExpiry",
    "RegistrationRefused",
    "cgroup_jobs_of",
    "expire_registrations",
    "make_room",
    "registered",
]
