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
"""

from __future__ import annotations

from nodescope.hooks.auth import Peer, allowed_uids, prepare_directory, slurm_uid
from nodescope.hooks.daemon import Hooks
from nodescope.hooks.health import (
    Check,
    GateInputs,
    count_dev_gpus,
    dev_gpu_minors,
    gate_checks,
    gate_state_path,
    gpu_holders,
    local_gate_inputs,
    missing_modules,
    read_gate_state,
    unfit_reason,
    write_gate_state,
)
from nodescope.hooks.reports import JobWindow, build_report
from nodescope.hooks.request import JobRequest
from nodescope.hooks.tracker import (
    JobTracker,
    local_sample,
    read_registration,
    remove_registration,
    write_registration,
)
from nodescope.hooks.transport import (
    SOCKET_NAME,
    HookServer,
    HookUnavailable,
    Request,
    Response,
    call,
    run_dir,
    socket_path,
)

__all__ = [
    "SOCKET_NAME",
    "Check",
    "GateInputs",
    "HookServer",
    "HookUnavailable",
    "Hooks",
    "JobRequest",
    "JobTracker",
    "JobWindow",
    "Peer",
    "Request",
    "Response",
    "allowed_uids",
    "build_report",
    "call",
    "count_dev_gpus",
    "dev_gpu_minors",
    "gate_checks",
    "gate_state_path",
    "gpu_holders",
    "local_gate_inputs",
    "local_sample",
    "missing_modules",
    "prepare_directory",
    "read_gate_state",
    "read_registration",
    "remove_registration",
    "run_dir",
    "slurm_uid",
    "socket_path",
    "unfit_reason",
    "write_gate_state",
    "write_registration",
]
