"""Push firing and resolved alerts to Alertmanager (API v2, ``POST /api/v2/alerts``).

The format is Alertmanager's OpenAPI ``postableAlerts``
(https://github.com/prometheus/alertmanager/blob/main/api/v2/openapi.yaml): a JSON list of
``{labels, annotations, startsAt, endsAt, generatorURL}``. Alertmanager identifies an alert by
its label set, expects a firing alert to be sent again while it lasts and forgets it at
``endsAt``; so, like Prometheus, every batch carries ``endsAt = now + 4 × resend interval`` for
firing alerts (a dead daemon's alerts expire by themselves) and the resolution time for
resolved ones, which are sent again for a while (15 minutes) in case a send was lost.

Labels, the same names the shipped Prometheus rules (exporters/prometheus/alerts.yml) give
their copies of these alerts, so one Alertmanager inhibit rule can match both paths:

* ``alertname`` (``Nodescope`` + the finding kind in CamelCase), ``severity``, ``instance``
  (``[alerts] instance``, by default the host name), ``kind``;
* ``subject``: the hardware roles of the finding's subjects (``bdf=0000:bb:00.0,gpu=5``), the
  string the ``subject`` label of ``nodescope_alert_active`` carries;
* ``workload``: its workload roles (``job=81780``), so two findings that differ only by job
  stay two alerts; ``gpu``: the subject's GPU index, for inhibit rules keyed on a GPU;
* ``origin="daemon"`` and ``scope="node"``: the rules path says ``origin="prometheus"``.

A label whose value would be empty is left out, as Prometheus leaves out its empty labels. A
severity change is a new label set: the old one is sent as resolved, the new one as firing.

The collection loop never waits on the network: :meth:`AlertmanagerPusher.submit` hands the
whole current batch to a background thread through a one-slot mailbox, where a newer batch
replaces one not yet sent (it holds everything the older one did). Failures are counted and
logged once per change between working and failing.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodescope.model.alert import Alert, AlertState, Transition, TransitionKind
from nodescope_exporters.alert_metrics import bounded_subject, workload_subject

log = logging.getLogger("nodescope.push")

#: How long resolved alerts are sent again (Prometheus's resolvedRetention).
RESOLVED_RETENTION_SECONDS = 15 * 60.0

Post = Callable[[str, bytes, float], None]


def alertname(kind: str) -> str:
    """``pcie_contention`` → ``NodescopePcieContention``."""
    return "Nodescope" + "".join(part.capitalize() for part in kind.split("_") if part)


def rfc3339(unix_seconds: float) -> str:
    stamp = datetime.datetime.fromtimestamp(unix_seconds, tz=datetime.UTC)
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _numbers(evidence: Mapping[str, float]) -> str:
    return " ".join(f"{name}={value:g}" for name, value in evidence.items())


#: Constant labels of every pushed alert: which path raised it, and that it is about the node
#: (a job-wide alert, from the job rules, says ``scope="job"``).
ORIGIN = "daemon"
SCOPE = "node"


def labels_of(alert: Alert, instance: str) -> dict[str, str]:
    """The label set of ``alert`` pushed as ``instance`` (see the module's docstring)."""
    labels = {
        "alertname": alertname(alert.kind),
        "severity": alert.severity.label,
        "instance": instance,
        "kind": alert.kind,
        "subject": bounded_subject(alert.subjects),
        "workload": workload_subject(alert.subjects),
        "gpu": alert.subjects.get("gpu", ""),
        "origin": ORIGIN,
        "scope": SCOPE,
    }
    return {name: value for name, value in labels.items() if value}


def alert_document(
    alert: Alert, instance: str, ends_at: float, generator_url: str = "", action: str = ""
) -> dict[str, Any]:
    """One ``postableAlert``; ``action`` is what nodescope did about it (annotation
    ``nodescope_action``: drained, held back, ...)."""
    annotations = {
        "summary": alert.message or f"{alert.kind} on {alert.subject or instance}",
        "evidence": _numbers(alert.evidence_last),
        "evidence_peak": _numbers(alert.evidence_peak),
        "evidence_start": _numbers(alert.evidence_start),
        "nodescope_action": action,
    }
    document: dict[str, Any] = {
        "labels": labels_of(alert, instance),
        "annotations": {k: v for k, v in annotations.items() if v},
        "startsAt": rfc3339(
            alert.fired_wall if alert.fired_wall is not None else alert.started_wall
        ),
        "endsAt": rfc3339(ends_at),
    }
    if generator_url:
        document["generatorURL"] = generator_url
    return document


def _http_post(url: str, body: bytes, timeout: float) -> None:
    # urllib.request pulls in http.client, email and ssl (megabytes of a daemon's memory):
    # loaded only once an Alertmanager is configured and an alert is pushed.
    import urllib.request

    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    # No proxy from the environment: Alertmanager is reached directly, as Prometheus does.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        response.read()


@dataclass(frozen=True, slots=True)
class PushCounts:
    sent: int
    errors: int
    dropped: int


def _label_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


class AlertmanagerPusher:
    """Keeps Alertmanager told about the firing alerts; one background thread.

    ``url`` is Alertmanager's base URL (``http://host:9093``). ``post`` and ``clock`` are
    injectable for tests.
    """

    def __init__(
        self,
        url: str,
        instance: str = "",
        resend_seconds: float = 60.0,
        timeout_seconds: float = 5.0,
        generator_url: str = "",
        post: Post | None = None,
        retry_seconds: float | None = None,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.instance = instance or socket.gethostname()
        self.resend_seconds = resend_seconds
        self.timeout_seconds = timeout_seconds
        self.generator_url = generator_url
        self.retry_seconds = min(resend_seconds, 10.0) if retry_seconds is None else retry_seconds
        self._post = post or _http_post
        # Loop side: what Alertmanager has been told.
        self._firing: dict[str, tuple[tuple[tuple[str, str], ...], Alert]] = {}
        self._resolved: dict[tuple[tuple[str, str], ...], tuple[dict[str, Any], float]] = {}
        self._last_batch: float | None = None
        # Alert key -> the action annotation Alertmanager was last sent for it.
        self._actions: dict[str, str] = {}
        # Shared with the thread, under the condition's lock.
        self._cond = threading.Condition()
        self._slot: bytes | None = None
        self._stop = False
        self._sent = 0
        self._errors = 0
        self._dropped = 0
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="alertmanager-push", daemon=True)
        self._thread.start()

    # -- the loop's side -------------------------------------------------------------------
    def submit(
        self,
        active: Iterable[Alert],
        transitions: Iterable[Transition],
        now_monotonic: float,
        now_wall: float,
        actions: Mapping[str, str] | None = None,
    ) -> bool:
        """Queue a batch if something changed or the resend interval passed; never blocks.
        Returns whether a batch was queued. ``actions``: alert key -> what nodescope did about
        it; a new action is a change (the annotation goes out at once)."""
        actions = actions or {}
        resolved_at = {
            t.key: t.alert.resolved_wall
            for t in transitions
            if t.kind is TransitionKind.RESOLVED and t.alert.resolved_wall is not None
        }
        firing = {a.key: a for a in active if a.state is AlertState.FIRING}
        changed = False
        for key, (label_key, old) in list(self._firing.items()):
            new = firing.get(key)
            new_key = _label_key(labels_of(new, self.instance)) if new is not None else None
            if new_key == label_key:
                continue
            del self._firing[key]
            ends = resolved_at.get(key, now_wall)
            self._resolved[label_key] = (
                alert_document(
                    old, self.instance, ends, self.generator_url, self._actions.pop(key, "")
                ),
                now_monotonic + RESOLVED_RETENTION_SECONDS,
            )
            changed = True
        for key, alert in firing.items():
            label_key = _label_key(labels_of(alert, self.instance))
            if key not in self._firing:
                changed = True
                # A label set that fires again is no longer resolved.
                self._resolved.pop(label_key, None)
            self._firing[key] = (label_key, alert)
            action = actions.get(key, "")
            if action != self._actions.get(key, ""):
                changed = True
                self._actions[key] = action
        for label_key, (_, until) in list(self._resolved.items()):
            if until <= now_monotonic:
                del self._resolved[label_key]
        if not self._firing and not self._resolved:
            return False
        due = (
            changed
            or self._last_batch is None
            or now_monotonic - self._last_batch >= self.resend_seconds
        )
        if not due:
            return False
        ends_firing = now_wall + 4 * self.resend_seconds
        batch = [
            alert_document(
                alert, self.instance, ends_firing, self.generator_url, self._actions.get(key, "")
            )
            for key, (_, alert) in self._firing.items()
        ] + [document for document, _ in self._resolved.values()]
        self._last_batch = now_monotonic
        body = json.dumps(batch).encode()
        with self._cond:
            if self._slot is not None:
                self._dropped += 1
            self._slot = body
            self._cond.notify()
        return True

    def counts(self) -> PushCounts:
        with self._cond:
            return PushCounts(self._sent, self._errors, self._dropped)

    def close(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        retry: bytes | None = None
        while True:
            with self._cond:
                deadline = time.monotonic() + self.retry_seconds
                while self._slot is None and not self._stop:
                    if retry is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        self._cond.wait()
                if self._stop:
                    return
                body = self._slot if self._slot is not None else retry
                self._slot = None
            if body is None:
                continue
            try:
                self._post(self.endpoint, body, self.timeout_seconds)
            except Exception as exc:  # any failure of the push is the push's alone
                retry = body
                self._failed(exc)
                continue
            retry = None
            self._succeeded()

    def _failed(self, exc: BaseException) -> None:
        with self._cond:
            self._errors += 1
            first = not self._failing
            self._failing = True
        if first:
            reason = f"{type(exc).__name__}: {exc}"
            import urllib.error  # already loaded by the failed request

            if isinstance(exc, urllib.error.HTTPError):
                reason = f"HTTP {exc.code} {exc.reason}"
            log.warning("push=alertmanager state=failing url=%s error=%r", self.endpoint, reason)

    def _succeeded(self) -> None:
        with self._cond:
            self._sent += 1
            recovered = self._failing
            self._failing = False
        if recovered:
            log.info("push=alertmanager state=ok url=%s", self.endpoint)
