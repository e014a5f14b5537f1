"""End-to-end speedup estimate (gna-semantics.md, section 3)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from natsim import end_to_end_speedup


def test_known_values():
    # Half the time in attention made 2x faster: 1 / (0.5 + 0.25).
    assert end_to_end_speedup(0.5, 2.0) == pytest.approx(4 / 3)
    # Every step kept dense: no speedup at all.
    assert end_to_end_speedup(0.8, 10.0, dense_steps=50, steps=50) == pytest.approx(1.0)
    # 15 of 50 steps dense, attention 60% of the time, 11.1x faster attention.
    expected = 1 / (0.4 + 0.6 * 0.3 + 0.6 * 0.7 / 11.1)
    assert end_to_end_speedup(0.6, 11.1, dense_steps=15, steps=50) == pytest.approx(expected)


@given(
    st.floats(0, 1), st.floats(1, 100), st.integers(1, 100).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n)))
)
def test_bounded_by_amdahl(share, speedup, steps):
    dense, total = steps
    value = end_to_end_speedup(share, speedup, dense, total)
    assert 1.0 - 1e-12 <= value <= speedup + 1e-9
    if share < 1:
        assert value <= 1.0 / (1.0 - share) + 1e-9


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"attention_share": 1.5, "attention_speedup": 2.0}, "attention_share must lie in"),
        ({"attention_share": 0.5, "attention_speedup": 0.0}, "attention_speedup must be positive"),
        ({"attention_share": 0.5, "attention_speedup": 2.0, "steps": 0}, "steps must be at least 1"),
        ({"attention_share": 0.5, "attention_speedup": 2.0, "dense_steps": 3, "steps": 2}, "dense_steps must lie in"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        end_to_end_speedup(**kwargs)


def test_steps_must_be_integers():
    with pytest.raises(TypeError, match="steps must be an integer"):
        end_to_end_speedup(0.5, 2.0, dense_steps=0, steps=2.5)
