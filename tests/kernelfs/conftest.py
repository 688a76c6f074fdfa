"""The ``kernelfs`` fixture: mount a backing tree with kernel read semantics."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from tests.kernelfs.mount import KernelFsMount, fuse_unavailable_reason, kernelfs

MountTree = Callable[..., KernelFsMount]


@pytest.fixture
def mount_kernelfs(tmp_path: Path) -> Iterator[MountTree]:
    """``mount_kernelfs(backing, **layout)`` serves ``backing`` through a fresh mount with
    kernel read semantics; every mount is taken down when the test ends."""
    reason = fuse_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with ExitStack() as stack:
        count = 0

        def mount(backing: Path, **layout: str) -> KernelFsMount:
            nonlocal count
            count += 1
            return stack.enter_context(kernelfs(backing, tmp_path / f"kernelfs-{count}", **layout))

        yield mount
