"""The Slurm hooks' side of the daemon: the socket they call, who may call it, the health gate,
the job's report and the job tracker.

* :mod:`~nodescope.hooks.transport`: the socket's protocol, its client (:func:`call`) and its
  server (:class:`HookServer`);
* :mod:`~nodescope.hooks.auth`: who may reach the socket (directory and ACL entries, peer
  credentials, :func:`allowed_uids`);
* :mod:`~nodescope.hooks.request`: the job a hook names, every field of a request bounded;
* :mod:`~nodescope.hooks.health`: the health gate (:func:`gate_checks`), the GPUs a job left
  held, and the record of uncleared Xids that outlives the daemon;
* :mod:`~nodescope.hooks.stops`: the record of a job the gate stopped, kept for its epilog,
  and the record of the gate's drain in the remediation record;
* :mod:`~nodescope.hooks.reports`: the job's end-of-job report (:func:`build_report`);
* :mod:`~nodescope.hooks.tracker`: registrations written by the prolog and removed by the
  epilog, and what the daemon remembers of a job in between (:class:`JobTracker`);
* :mod:`~nodescope.hooks.daemon`: the server and the tracker as the service starts and feeds
  them (:class:`Hooks`);
* :mod:`~nodescope.hooks.jobdrain`: the daemon draining the node on a finding during a job,
  through the remediation's pass and gateway (imported by the service, not here). The
  remediation imports nothing of the hooks: the hooks call it, never the other way.

When the daemon is down, :mod:`nodescope.cli.slurm` calls the same functions with what it can
read itself.

The package imports none of its modules: a caller imports the one it needs, so that the hook's
client (the socket and who may reach it) does not load the tracker, the analysis and the
exporters the daemon's side needs.
"""
