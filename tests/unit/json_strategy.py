"""Arbitrary JSON values, for the fuzz tests of the readers of JSON documents."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hypothesis import strategies as st


def json_values(max_text: int, max_key: int = 10) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars (strings up to ``max_text`` characters) and lists and objects
    of up to four of them (keys up to ``max_key`` characters), nested."""
    return st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=max_text),
        lambda inner: (
            st.lists(inner, max_size=4)
            | st.dictionaries(st.text(max_size=max_key), inner, max_size=4)
        ),
        max_leaves=20,
    )


def json_paths(
    value: Any, prefix: tuple[Any, ...] = (), skip: Collection[str] = ()
) -> list[tuple[Any, ...]]:
    """Every path into ``value`` (keys and indexes from the root; the root is ``()``), for
    fuzz tests that replace or delete what one path names; objects under a key in ``skip``
    are not entered."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            if key not in skip:
                found.extend(json_paths(child, (*prefix, key), skip))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found.extend(json_paths(child, (*prefix, index), skip))
    return found
