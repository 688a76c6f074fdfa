from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nodescope.model.counters import column_rates, counter_delta, counter_rate


def test_plain_increase() -> None:
    assert counter_delta(100, 250) == 150
    assert counter_rate(100, 300, 2.0) == 100.0


def test_wrap_of_a_32_bit_counter() -> None:
    # An IB port_xmit_data counter just below 2^32 that wrapped to 10.
    assert counter_delta(2**32 - 6, 10, bits=32) == 16


def test_decrease_from_low_value_is_a_reset_not_a_wrap() -> None:
    # Someone reset NVLink error counters: 5000 -> 3 is no wrap of a 64-bit counter.
    assert counter_delta(5000, 3, bits=64) is None
    assert counter_rate(5000, 3, 1.0) is None


def test_unknown_width_never_assumes_a_wrap() -> None:
    assert counter_delta(2**63, 1, bits=None) is None


def test_rate_needs_positive_time() -> None:
    assert counter_rate(0, 10, 0.0) is None
    assert counter_rate(0, 10, -1.0) is None


def test_values_beyond_the_width_are_not_wraps() -> None:
    assert counter_delta(2**33, 5, bits=32) is None


@given(
    bits=st.sampled_from([8, 16, 32, 64]),
    start=st.integers(min_value=0),
    step=st.integers(min_value=0),
)
def test_wrapped_counter_recovers_the_true_increase(bits: int, start: int, step: int) -> None:
    modulus = 1 << bits
    start %= modulus
    step %= modulus // 2  # one poll never sees more than half the range
    cur = (start + step) % modulus
    delta = counter_delta(start, cur, bits)
    if cur >= start or start >= modulus // 2:
        assert delta == step
    else:
        assert delta is None


@given(st.integers(), st.integers(), st.sampled_from([None, 8, 16, 32, 64]))
def test_delta_is_never_negative(prev: int, cur: int, bits: int | None) -> None:
    delta = counter_delta(prev, cur, bits)
    assert delta is None or delta >= 0


@given(
    pairs=st.lists(
        st.tuples(st.integers(min_value=-5, max_value=2**64 + 5), st.integers(-5, 2**64 + 5)),
        max_size=20,
    ),
    seconds=st.sampled_from([-1.0, 0.0, 0.25, 1.0, 3.0]),
    bits=st.sampled_from([32, 64, None]),
)
def test_a_column_s_rates_are_each_pair_s_counter_rate(
    pairs: list[tuple[int, int]], seconds: float, bits: int | None
) -> None:
    """Wraps, resets, negative readings and a bad interval included: one policy."""
    before = [a for a, _ in pairs]
    now = [b for _, b in pairs]
    assert column_rates(before, now, seconds, bits) == tuple(
        counter_rate(a, b, seconds, bits) for a, b in pairs
    )
