"""Options shared by every subcommand."""

from __future__ import annotations

import argparse
from collections.abc import Callable

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


def seconds_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number of seconds in ``[low, high]`` (NaN and infinities refused),
    said in one line when it is not."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not low <= value <= high:  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g}..{high:g} seconds")
        return value

    return parse
