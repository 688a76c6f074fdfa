"""Options shared by every subcommand."""

from __future__ import annotations

import argparse

from nodescope.roots import ROOT_NAMES, Roots


def roots_parent() -> argparse.ArgumentParser:
    """``--sysfs DIR --procfs DIR --dev DIR --cgroupfs DIR --run DIR`` for every subcommand."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("filesystem roots")
    for name in ROOT_NAMES:
        group.add_argument(
            f"--{name}",
            metavar="DIR",
            default=None,
            help=f"read {name} from DIR instead of {getattr(Roots(), name)}",
        )
    return parent


def roots_from_args(args: argparse.Namespace, base: Roots | None = None) -> Roots:
    """The roots to use: ``base`` (the config's, or the defaults) with the flags applied."""
    overrides = {name: getattr(args, name, None) for name in ROOT_NAMES}
    return (base or Roots()).with_overrides(**overrides)
