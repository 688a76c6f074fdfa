"""The composition root: config, sources, collector, exporter, HTTP server, signals, systemd.

The HTTP server is a serving process of its own (:mod:`nodescope.httpserver`): the daemon
binds the socket, starts it, and publishes the documents to it after every cycle; READY=1 is
sent once the first cycle's documents were published. Only the daemon talks to systemd.

Signal handlers only set flags; the loop acts on them. SIGHUP reloads: the new config is read
and validated first and swapped in only when valid — on error the old config stays and the
reason is logged. SIGTERM/SIGINT stop the loop; the daemon exits within two seconds.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from types import FrameType

from nodescope import assembly, logs
from nodescope import config as config_mod
from nodescope.analysis import Analyzer, alerts_document
from nodescope.collect import Collector
from nodescope.config import Config
from nodescope.cycle import Cycle, OutsideParts
from nodescope.errors import ConfigError
from nodescope.hooks.daemon import Hooks
from nodescope.hooks.jobdrain import JobDrain
from nodescope.httpserver import JsonCache, MetricsHTTPServer
from nodescope.model.snapshot import Snapshot
from nodescope.roots import ROOT_NAMES
from nodescope.sdnotify import Notifier
from nodescope.selfstats import ProcessMeter
from nodescope.timing import Timing
from nodescope.webconfig import WebConfig
from nodescope_exporters.prometheus import MetricsCache
from nodescope_exporters.push import AlertmanagerPusher

log = logging.getLogger("nodescope.service")

ConfigLoader = Callable[[], Config]
CollectorFactory = Callable[[Config], Collector]


def _is_local(host: str) -> bool:
    """Whether ``host`` names no address another machine can reach: a wildcard (0.0.0.0,
    ``::``) or a loopback address or name."""
    if host == "" or host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_unspecified or address.is_loopback


def generator_url(config: Config, hostname: Callable[[], str] = socket.gethostname) -> str:
    """Where a pushed alert links back to: ``<[alerts] external_url>/api/v1/alerts``; without
    one, this daemon's ``/api/v1/alerts`` at the host name and the listen port. A listen address
    of 127.0.0.1 or 0.0.0.0 means nothing to whoever reads the alert on another machine; a
    specific non-loopback one is where the daemon is reached, so it is used as it is.

    A host name that is no valid URL host (Alertmanager rejects a whole batch whose
    ``generatorURL`` is not a URI) leaves the listen address instead."""
    external = config.alerts.external_url
    if external:
        return external.rstrip("/") + "/api/v1/alerts"
    host, port = config.listen_address
    if _is_local(host):
        name = hostname()
        if name and config_mod.is_host(name):
            host = name
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/api/v1/alerts"


def alertmanager_pusher(config: Config) -> AlertmanagerPusher | None:
    """The Alertmanager push ``[alerts] alertmanager_url`` asks for; ``None`` without a URL.
    Its alerts link back to this daemon's ``/api/v1/alerts`` (:func:`generator_url`)."""
    settings = config.alerts
    if not settings.alertmanager_url:
        return None
    return AlertmanagerPusher(
        settings.alertmanager_url,
        instance=settings.instance,
        resend_seconds=settings.resend_seconds,
        timeout_seconds=settings.push_timeout_seconds,
        generator_url=generator_url(config),
    )


class Service:
    """One daemon instance. ``load_config`` re-reads the file and applies the CLI overrides,
    so a reload sees the same flags as the start.

    ``make_collector`` builds the collector for a config (at start and when a reload changes
    the sources or roots); by default the registry's sources. ``nodescope demo`` hands in one
    that runs the simulated node's sources (its fake NVML instead of pynvml).

    The cycle itself is :class:`~nodescope.cycle.Cycle`, the one a replay runs too; the
    service hands it the parts that act outside the process (the hooks' job tracker once the
    hooks listen, the job drain, the process meter) and its exporters. ``timing`` is the one
    source of every figure that follows from the tick (:mod:`nodescope.timing`); a reload
    replaces it and hands it to the serving process.
    """

    def __init__(
        self,
        load_config: ConfigLoader,
        notifier: Notifier | None = None,
        make_collector: CollectorFactory | None = None,
    ) -> None:
        self._load_config = load_config
        self._make_collector: CollectorFactory = make_collector or Collector.from_config
        self.config = load_config()
        self.timing = Timing.of(self.config)
        #: The staleness bound of the tick the last completed cycle ran on: the next cycle
        #: is judged by it, as the serving process judges it (a reload that shortens the
        #: tick must not make the cycle of the old, longer one late).
        self._stale_after = self.timing.stale_after
        self.notifier = notifier or Notifier()
        self.cache = MetricsCache()
        self.alerts_cache = JsonCache()
        self.server: MetricsHTTPServer | None = None
        #: TLS, basic auth and headers for the HTTP endpoint (``--web-config-file``), read
        #: at start; the serving process is started with it.
        self.web_config: WebConfig | None = None
        self._hooks: Hooks | None = None
        #: Drains the node on a finding the policy drains for while a job is on it.
        self.job_drain = JobDrain(lambda: self.config)
        #: Measures this process and the serving process for the self-metrics, every cycle.
        self.process_meter = ProcessMeter()
        self.cycle = Cycle(
            self._make_collector(self.config),
            Analyzer.from_config(self.config, make_pusher=alertmanager_pusher),
            self._offer,
            self._publish,
            OutsideParts(
                job_drain=self.job_drain,
                process_meter=self.process_meter,
                serving_pid=self._serving_pid,
            ),
        )
        #: SIGHUP reloads by outcome, both from 0 so increase() sees the first failure.
        self.cycle.config_reloads.update(success=0, failure=0)
        self._wake = threading.Event()
        #: Held by a cycle, and by a render a request asked for (see render_on_request).
        self._cycle_lock = threading.Lock()
        self._stop = False
        self._reload = False

    @property
    def collector(self) -> Collector:
        return self.cycle.collector

    @property
    def analyzer(self) -> Analyzer:
        return self.cycle.analyzer

    @property
    def hooks(self) -> Hooks | None:
        """The Slurm hooks' socket and job tracker, once they listen; the cycle feeds them."""
        return self._hooks

    @hooks.setter
    def hooks(self, hooks: Hooks | None) -> None:
        self._hooks = hooks
        self.cycle.outside.jobs = hooks

    @property
    def cycle_errors(self) -> dict[str, int]:
        return self.cycle.errors

    @property
    def config_reloads(self) -> dict[str, int]:
        return self.cycle.config_reloads

    # -- signals: flags only -------------------------------------------------------------
    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self._stop = True
        self._wake.set()

    def _on_reload(self, signum: int, frame: FrameType | None) -> None:
        self._reload = True
        self._wake.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_reload)

    def stop_requested(self) -> bool:
        return self._stop

    def request_stop(self) -> None:
        self._stop = True
        self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------
    def start_server(self) -> None:
        self.server = MetricsHTTPServer(
            self.config.listen_address,
            self.cache,
            self.alerts_cache,
            self.web_config,
            timing=self.timing,
            render=self.render_on_request,
        )
        self.server.start()
        log.info("event=listening address=%s", self.server.bound)
        if self.hooks is None:
            self.hooks = Hooks.start(lambda: self.config)

    def reload(self) -> bool:
        """Validate the new config, then swap. Returns whether the new config took effect.

        A reload that fails for any reason — a file that is invalid, unreadable or refused, a
        listener or collector that cannot be built for it, a bug — keeps the running config,
        server and collector: the daemon goes on as before, says why and counts it
        (``nodescope_config_reloads_total{result="failure"}``)."""
        self.notifier.reloading()
        try:
            new = self._load_config()
            self._switch_to(new)
        except Exception as exc:
            self.config_reloads["failure"] += 1
            reason = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            log.error("event=reload_failed reason=%r kept=previous_config", reason)
            self.notifier.ready("reload failed; previous configuration kept")
            return False
        self.config_reloads["success"] += 1
        log.info("event=reloaded config=%s", new.path or "<defaults>")
        self.notifier.ready("reloaded")
        return True

    def _switch_to(self, new: Config) -> None:
        """Build what ``new`` needs, then swap. Everything that can fail happens before the
        swap, and what was built for ``new`` is closed again when something does, so a failure
        part-way leaves the running server, collector and config as they were."""
        old = self.config
        timing = Timing.of(new)
        server: MetricsHTTPServer | None = None
        collector: Collector | None = None
        try:
            if new.listen != old.listen:
                try:
                    server = MetricsHTTPServer(
                        new.listen_address,
                        self.cache,
                        self.alerts_cache,
                        self.web_config,
                        timing=timing,
                        render=self.render_on_request,
                    )
                except OSError as exc:
                    raise OSError(exc.errno, f"listen on {new.listen}: {exc.strerror}") from exc
                server.start()
            if new.sources != old.sources or new.roots != old.roots:
                collector = self._make_collector(new)
            self.cycle.analyzer.configure(new)
        except BaseException:
            if server is not None:
                server.stop()
            if collector is not None:
                collector.close()
            raise
        if server is not None:
            if self.server is not None:
                self.server.stop()
            self.server = server
            log.info("event=listening address=%s", server.bound)
        if collector is not None:
            self.cycle.collector.close()
            self.cycle.collector = collector
        logs.setup(new.log_level, new.log_format)
        self.config = new
        self.timing = timing
        if self.server is not None:
            # The serving process judges /healthz by the new tick from the next cycle on.
            self.server.retime(timing)

    def _render_documents(self) -> None:
        self.cache.render_latest()
        self.alerts_cache.render_latest()

    def render_on_request(self) -> None:
        """Render the newest cycle's documents for a request that waits for them (the
        server's render thread). Between cycles only: what a snapshot refers to may change
        while the next one is made."""
        with self._cycle_lock:
            try:
                self._render_documents()
            except Exception as exc:
                self.cycle.survived("export", exc)

    def _offer(self, snapshot: Snapshot) -> None:
        """The cycle's export: both documents offered, rendered now while scrapes come every
        cycle, otherwise when one asks."""
        self.cache.offer(snapshot)
        self.alerts_cache.offer(partial(alerts_document, snapshot))
        if self.server is None or self.server.rendering_wanted():
            self._render_documents()

    def _publish(self) -> None:
        if self.server is not None:
            # Hands both documents to the serving process, or tells it that a newer cycle's
            # exist (the alerts update may have published already, so this is also a check
            # that the process is alive; a dead one is restarted here).
            self.server.publish()

    def _serving_pid(self) -> int | None:
        serving = self.server.process if self.server is not None else None
        return serving.pid if serving is not None else None

    def run_cycle(self) -> bool:
        """One cycle (:meth:`Cycle.run`); whether it completed: collected and published."""
        with self._cycle_lock:
            completed = self.cycle.run()
        if completed:
            self._stale_after = self.timing.stale_after
        return completed

    def cycles_on_time(self) -> bool:
        """Whether cycles still complete: the last one within its tick and a grace. The
        watchdog is fed only while this holds, so systemd restarts a daemon whose cycles
        stopped even though its loop still turns."""
        return time.monotonic() - self.cycle.last_completed <= self._stale_after

    def run(self) -> int:
        """The loop. Returns the exit status."""
        if self.server is None:
            self.start_server()
        self.run_cycle()
        # What exists now (modules, configuration, the topology) lives as long as the daemon:
        # keep it out of the garbage collector's full scans, which otherwise cost several ms
        # per cycle on a node with thousands of series.
        gc.freeze()
        self.notifier.ready("collecting")
        self.notifier.detach_environment()
        log.info(
            "event=ready sources=%s", ",".join(s.source.name for s in self.collector.scheduled)
        )
        next_tick = time.monotonic() + self.timing.tick_seconds
        try:
            while not self.stop_requested():
                sleep = self.timing.sleep_seconds(self.notifier.watchdog_seconds)
                self._wake.wait(max(0.0, min(sleep, next_tick - time.monotonic())))
                self._wake.clear()
                if self.stop_requested():
                    break
                if self._reload:
                    self._reload = False
                    if self.reload():
                        # A shorter tick takes effect now, not after the old one ran out.
                        next_tick = min(next_tick, time.monotonic() + self.timing.tick_seconds)
                if self.cycles_on_time():
                    self.notifier.watchdog()
                now = time.monotonic()
                if now >= next_tick:
                    self.run_cycle()
                    # Keep a fixed cadence on the monotonic clock; skip ticks we overran.
                    next_tick += self.timing.tick_seconds
                    if next_tick <= time.monotonic():
                        next_tick = time.monotonic() + self.timing.tick_seconds
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        self.notifier.stopping()
        log.info("event=stopping")
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.hooks is not None:
            self.hooks.stop()
            self.hooks = None
        self.job_drain.stop()
        self.cycle.collector.close()
        self.cycle.analyzer.close()
        self.notifier.close()


def config_loader(path: str | None, overrides: dict[str, object]) -> ConfigLoader:
    """A loader that reads ``path`` (or the defaults) and applies CLI overrides each time."""

    def load() -> Config:
        cfg = assembly.load(path) if path else assembly.default_config()
        roots = {k: v for k, v in overrides.items() if k in ROOT_NAMES and v is not None}
        if roots:
            cfg = replace(cfg, roots=cfg.roots.with_overrides(**roots))  # type: ignore[arg-type]
        listen = overrides.get("listen")
        if isinstance(listen, str):
            try:
                config_mod.parse_listen(listen)
            except ValueError as exc:
                raise ConfigError("--listen", "listen", str(exc)) from None
            cfg = replace(cfg, listen=listen)
        # The command line's log settings hold over the file's, through reloads too (argparse
        # has checked them against the same choices).
        level, form = overrides.get("log_level"), overrides.get("log_format")
        if isinstance(level, str):
            cfg = replace(cfg, log_level=level)
        if isinstance(form, str):
            cfg = replace(cfg, log_format=form)
        return cfg

    return load
