"""Where ``nodescope demo`` keeps its files: all of them under the demo's own directory.

A demo is something to try on any machine, a Slurm node included, so it must leave the host
as it found it. Its daemon is configured here from nothing but the demo's directory: every
path the daemon may write is derived from it, whatever a ``--config`` file says (a demo
takes only that file's ``[alerts]`` and ``[detectors]`` tables).

The directory, ``ROOT`` (``nodescope-demo-*`` under the temporary directory), holds:

* ``ROOT/sys``, ``ROOT/proc``, ``ROOT/dev``, ``ROOT/run``: the simulated node's trees, the
  daemon's roots;
* ``ROOT/run/nodescope/``: what a daemon keeps under its run root — the hooks' socket
  (``nodescope.sock``), job registrations (``jobs/``), the gate's state, stopped jobs'
  records, the remediation record, the last probe report, trace refusal records;
* ``ROOT/var/lib/nodescope/jobs/``: the epilog's job reports (``[slurm] reports_dir``);
* ``ROOT/etc/nodescope/nodescope.toml``: a configuration for the Slurm hooks run against the
  demo (``nodescope slurm prolog --config ROOT/etc/nodescope/nodescope.toml``): the demo's
  roots and reports directory, and no scontrol.

Neither the daemon nor a hook asking it drains through ``scontrol`` (``[slurm] scontrol`` is
empty): the node is simulated, and a ``SLURMD_NODENAME`` in a hook's environment names a
real node of whatever cluster the host belongs to. The demo removes the whole directory when
it stops.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import replace
from pathlib import Path

from nodescope.assembly import default_config
from nodescope.config import Config, SlurmSettings
from nodescope.roots import ROOT_NAMES, Roots

#: The reports directory and the hooks' configuration file, relative to the demo's directory
#: (laid out like a host's, so that the tree reads as one).
REPORTS_SUBDIR = Path("var/lib/nodescope/jobs")
HOOK_CONFIG = Path("etc/nodescope/nodescope.toml")


def reports_dir(root: Path) -> Path:
    return root / REPORTS_SUBDIR


def hook_config_path(root: Path) -> Path:
    return root / HOOK_CONFIG


def _own_user() -> str | None:
    """The name of the user running the demo, when it is not root and has one: the demo's
    hook socket answers it (as the SlurmUser's), so the hooks can be tried without root."""
    uid = os.getuid()
    if uid == 0:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def sandbox_slurm(root: Path) -> SlurmSettings:
    """The demo's ``[slurm]`` settings: reports under ``root``, no scontrol."""
    slurm = replace(SlurmSettings(), reports_dir=str(reports_dir(root)), scontrol="")
    user = _own_user()
    return slurm if user is None else replace(slurm, slurm_user=user)


def sandbox_config(root: Path, roots: Roots, listen: str, settings: Config) -> Config:
    """The demo daemon's configuration: ``settings``' alert and detector tables, everything
    else the demo's own, every path under ``root`` (``roots`` are the simulated node's)."""
    outside = [name for name in ROOT_NAMES if not getattr(roots, name).is_relative_to(root)]
    if outside:
        raise ValueError(f"the simulated node's roots {', '.join(outside)} are not under {root}")
    return default_config(
        listen=listen,
        tick_seconds=1.0,
        log_level="warning",
        roots=roots,
        alerts=settings.alerts,
        detectors=settings.detectors,
        slurm=sandbox_slurm(root),
    )


def _toml_string(text: str) -> str:
    """A TOML literal string (no escapes: a path holds no single quote or newline here)."""
    if "'" in text or "\n" in text:
        raise ValueError(f"cannot write {text!r} as a TOML literal string")
    return f"'{text}'"


def hook_config_text(config: Config) -> str:
    """The hooks' configuration for the demo configured as ``config``: its roots (the hooks
    then read the simulated node, and find the daemon's socket), its reports directory (a
    hook whose daemon does not answer writes the report itself) and no scontrol."""
    lines = ["# The Slurm hooks against this demo: every path is the demo's own.", "[roots]"]
    roots = config.roots.as_dict()
    lines += [f"{name} = {_toml_string(path)}" for name, path in roots.items()]
    lines += [
        "",
        "[slurm]",
        f"reports_dir = {_toml_string(config.slurm.reports_dir)}",
        "scontrol = ''",
        f"slurm_user = {_toml_string(config.slurm.slurm_user)}",
    ]
    return "\n".join(lines) + "\n"


def prepare(root: Path, config: Config) -> Path:
    """Create the reports directory and write the hooks' configuration under ``root``;
    returns the configuration file's path."""
    reports_dir(root).mkdir(mode=0o750, parents=True, exist_ok=True)
    path = hook_config_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(hook_config_text(config), encoding="utf-8")
    return path
