"""Problem and TileConfig: normalisation (scalars broadcast) and validation (errors name the argument)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from natsim import Problem, TileConfig


# ----------------------------------------------------------------------------------------------------------
# Problem: normalisation


def test_scalars_broadcast():
    p = Problem((6, 8, 10), window=3, stride=2, dilation=2, causal=True)
    assert p.shape == (6, 8, 10)
    assert p.window == (3, 3, 3)
    assert p.stride == (2, 2, 2)
    assert p.dilation == (2, 2, 2)
    assert p.causal == (True, True, True)
    assert p.ndim == 3 and p.num_tokens == 480


def test_defaults():
    p = Problem((6, 8), (3, 5))
    assert p.stride == (1, 1) and p.dilation == (1, 1) and p.causal == (False, False)


def test_scalar_shape_is_1d():
    p = Problem(12, 5)
    assert p.shape == (12,) and p.window == (5,) and p.ndim == 1


def test_sequences_are_tuples_of_plain_types():
    p = Problem([np.int64(6), 8], [np.int32(3), 4], stride=[1, 2], dilation=(2, 1), causal=[1, 0])
    assert p.shape == (6, 8) and p.window == (3, 4) and p.stride == (1, 2) and p.dilation == (2, 1)
    assert p.causal == (True, False)
    assert all(type(v) is int for v in p.shape + p.window + p.stride + p.dilation)
    assert all(type(v) is bool for v in p.causal)
    # numpy's booleans, as an array, its items or one scalar, read as bools too
    assert Problem((6, 8), 3, causal=np.array([True, False])).causal == (True, False)
    assert Problem((6, 8), 3, causal=(np.True_, np.False_)).causal == (True, False)
    assert Problem((6, 8), 3, causal=np.bool_(True)).causal == (True, True)
    assert all(type(v) is bool for v in Problem((6, 8), 3, causal=np.array([True, False])).causal)
    with pytest.raises(TypeError, match="causal must hold booleans"):
        Problem((6, 8), 3, causal=np.array([0.5, 1.0]))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_valid_problems_are_accepted(data):
    n = data.draw(st.integers(1, 3))
    shape, window, stride, dilation = [], [], [], []
    for _ in range(n):
        L = data.draw(st.integers(1, 100))
        d = data.draw(st.integers(1, L))
        w = data.draw(st.integers(1, L // d))
        s = data.draw(st.integers(1, w))
        shape.append(L), window.append(w), stride.append(s), dilation.append(d)
    causal = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    p = Problem(tuple(shape), tuple(window), tuple(stride), tuple(dilation), tuple(causal))
    assert p.window == tuple(window) and p.stride == tuple(stride) and p.dilation == tuple(dilation)
    assert p.with_stride(1).stride == (1,) * n


def test_boundary_values_are_accepted():
    Problem(10, window=10)  # window = length
    Problem(10, window=5, dilation=2)  # window * dilation = length
    Problem(10, window=4, stride=4)  # stride = window
    Problem(1, window=1)


# ----------------------------------------------------------------------------------------------------------
# Problem: validation; every error names the offending argument

BAD_PROBLEMS = [
    # (kwargs, exception, words the message must contain)
    (dict(shape=10, window=0), ValueError, ["window"]),
    (dict(shape=(10, 10), window=(3, -1)), ValueError, ["window"]),
    (dict(shape=10, window=11), ValueError, ["window", "dilation"]),
    (dict(shape=10, window=4, dilation=3), ValueError, ["window", "dilation"]),
    (dict(shape=(10, 9), window=(5, 5), dilation=(2, 2)), ValueError, ["window", "dilation"]),
    (dict(shape=10, window=3, stride=0), ValueError, ["stride"]),
    (dict(shape=10, window=3, stride=-2), ValueError, ["stride"]),
    (dict(shape=10, window=3, stride=4), ValueError, ["stride", "window"]),
    (dict(shape=(10, 10), window=(3, 3), stride=(1, 4)), ValueError, ["stride", "window"]),
    (dict(shape=10, window=3, dilation=0), ValueError, ["dilation"]),
    (dict(shape=10, window=3, dilation=-1), ValueError, ["dilation"]),
    # mismatched dimension counts
    (dict(shape=(10, 10), window=(3, 3, 3)), ValueError, ["window"]),
    (dict(shape=(10, 10), window=3, stride=(1, 1, 1)), ValueError, ["stride"]),
    (dict(shape=(10, 10), window=3, dilation=(1,)), ValueError, ["dilation"]),
    (dict(shape=(10, 10), window=3, causal=(True,)), ValueError, ["causal"]),
    (dict(shape=(10, 10, 10), window=(3, 3)), ValueError, ["window"]),
    # shapes: zero, negative, empty, more than 3 dims
    (dict(shape=0, window=1), ValueError, ["shape"]),
    (dict(shape=(10, -4), window=1), ValueError, ["shape"]),
    (dict(shape=(), window=1), ValueError, ["shape"]),
    (dict(shape=(4, 4, 4, 4), window=1), ValueError, ["shape"]),
    # non-integers: floats, bools, strings, None
    (dict(shape=10.0, window=3), TypeError, ["shape"]),
    (dict(shape=(10, 10.5), window=3), TypeError, ["shape"]),
    (dict(shape=True, window=1), TypeError, ["shape"]),
    (dict(shape=(10, False), window=1), TypeError, ["shape"]),
    (dict(shape="10", window=3), TypeError, ["shape"]),
    (dict(shape=None, window=3), TypeError, ["shape"]),
    (dict(shape=10, window=3.0), TypeError, ["window"]),
    (dict(shape=(10, 10), window=(3, 3.0)), TypeError, ["window"]),
    (dict(shape=10, window=True), TypeError, ["window"]),
    (dict(shape=10, window=None), TypeError, ["window"]),
    (dict(shape=10, window=3, stride=1.5), TypeError, ["stride"]),
    (dict(shape=10, window=3, stride=True), TypeError, ["stride"]),
    (dict(shape=(10, 10), window=3, stride=(1, True)), TypeError, ["stride"]),
    (dict(shape=10, window=3, dilation=2.0), TypeError, ["dilation"]),
    (dict(shape=10, window=3, dilation=False), TypeError, ["dilation"]),
    (dict(shape=10, window=3, causal=2), TypeError, ["causal"]),
    (dict(shape=10, window=3, causal=0.5), TypeError, ["causal"]),
    (dict(shape=10, window=3, causal="yes"), TypeError, ["causal"]),
    (dict(shape=(10, 10), window=3, causal=(True, None)), TypeError, ["causal"]),
]


@pytest.mark.parametrize("kwargs, exc, words", BAD_PROBLEMS, ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_bad_problems_raise(kwargs, exc, words):
    with pytest.raises(exc) as info:
        Problem(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not named in {message!r}"
    assert message.endswith(".") and len(message.split()) >= 5, f"not a sentence: {message!r}"


def test_problem_is_frozen():
    p = Problem(10, 3)
    with pytest.raises(Exception):
        p.window = (5,)  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------------------
# TileConfig


def test_tiles_normalise():
    t = TileConfig((4, 8, 8), (2, 8, 8))
    assert t.q_tile == (4, 8, 8) and t.kv_tile == (2, 8, 8)
    assert t.tiling == "multi" and t.kv_tiling == "static"
    assert t.q_tokens == 256 and t.kv_tokens == 128
    s = TileConfig(64, 32, tiling="1d")
    assert s.q_tile == (64,) and s.kv_tile == (32,) and s.q_tokens == 64


def test_scalar_tiles_broadcast_to_the_problem():
    p = Problem((6, 8, 10), 3)
    assert TileConfig(4, 2).dims(p) == ((4, 4, 4), (2, 2, 2))
    assert TileConfig((1, 2, 3), 2).dims(p) == ((1, 2, 3), (2, 2, 2))
    with pytest.raises(ValueError, match="kv_tile"):
        TileConfig(4, (2, 2)).dims(p)


def test_dynamic_multi_d_is_accepted():
    assert TileConfig((4, 4), (2, 2), tiling="multi", kv_tiling="dynamic").kv_tiling == "dynamic"


BAD_TILES = [
    (dict(q_tile=0, kv_tile=4), ValueError, ["q_tile"]),
    (dict(q_tile=4, kv_tile=-1), ValueError, ["kv_tile"]),
    (dict(q_tile=(4, 0, 4), kv_tile=4), ValueError, ["q_tile"]),
    (dict(q_tile=(), kv_tile=4), ValueError, ["q_tile"]),
    (dict(q_tile=(1, 1, 1, 1), kv_tile=1), ValueError, ["q_tile"]),
    (dict(q_tile=4, kv_tile=(1, 1, 1, 1)), ValueError, ["kv_tile"]),
    (dict(q_tile=4.0, kv_tile=4), TypeError, ["q_tile"]),
    (dict(q_tile=4, kv_tile=(2, 2.5)), TypeError, ["kv_tile"]),
    (dict(q_tile=True, kv_tile=4), TypeError, ["q_tile"]),
    (dict(q_tile=4, kv_tile=(2, False)), TypeError, ["kv_tile"]),
    (dict(q_tile="4", kv_tile=4), TypeError, ["q_tile"]),
    (dict(q_tile=None, kv_tile=4), TypeError, ["q_tile"]),
    (dict(q_tile=(2, 2), kv_tile=(2, 2, 2)), ValueError, ["q_tile", "kv_tile"]),
    (dict(q_tile=(4, 4), kv_tile=16, tiling="1d"), ValueError, ["q_tile"]),
    (dict(q_tile=16, kv_tile=(4, 4), tiling="1d"), ValueError, ["kv_tile"]),
    (dict(q_tile=16, kv_tile=16, tiling="1d", kv_tiling="dynamic"), ValueError, ["kv_tiling", "dynamic"]),
    (dict(q_tile=4, kv_tile=4, tiling="2d"), ValueError, ["tiling"]),
    (dict(q_tile=4, kv_tile=4, tiling="1D"), ValueError, ["tiling"]),
    (dict(q_tile=4, kv_tile=4, tiling=None), ValueError, ["tiling"]),
    (dict(q_tile=4, kv_tile=4, kv_tiling="fixed"), ValueError, ["kv_tiling"]),
    (dict(q_tile=4, kv_tile=4, kv_tiling=""), ValueError, ["kv_tiling"]),
]


@pytest.mark.parametrize("kwargs, exc, words", BAD_TILES, ids=lambda v: repr(v) if isinstance(v, dict) else "")
def test_bad_tiles_raise(kwargs, exc, words):
    with pytest.raises(exc) as info:
        TileConfig(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not named in {message!r}"
    assert message.endswith(".") and len(message.split()) >= 5, f"not a sentence: {message!r}"
