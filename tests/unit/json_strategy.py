"""Arbitrary JSON values, for the fuzz tests of the readers of JSON documents."""

from __future__ import annotations

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
