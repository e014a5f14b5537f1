"""What tests/interpreter_options.py relies on: in Triton's interpreter, the integer-overflow checks report
nothing, so turning them off (tests/conftest.py) changes no result and hides no error. If an interpreter starts
reporting overflows, the first test fails: drop skip_discarded_overflow_checks then."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's CPU interpreter only")


@triton.jit
def _arithmetic(X, Y, SUM, DIFFERENCE, PRODUCT, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    x, y = tl.load(X + i), tl.load(Y + i)
    tl.store(SUM + i, x + y)
    tl.store(DIFFERENCE + i, x - y)
    tl.store(PRODUCT + i, x * y)


def _run(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(3)]
    _arithmetic[(1,)](x, y, *out, BLOCK=x.numel())
    return out


def test_overflowing_int32_arithmetic_wraps_silently_with_the_overflow_checks_on(monkeypatch):
    from dataclasses import replace

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    checked = replace(builder.options, sanitize_overflow=True)
    assert not checked.debug
    big = 2**31 - 1
    x = torch.tensor([big, -big, 2**20, 7], dtype=torch.int32)
    y = torch.tensor([big, big, 2**12, -3], dtype=torch.int32)
    unchecked = _run(x, y)
    monkeypatch.setattr(builder, "options", checked)
    with_checks = _run(x, y)  # no error: the checks' device_assert does nothing without debug
    a, b = x.numpy().astype(np.int64), y.numpy().astype(np.int64)
    wrapped = [((v + 2**31) % 2**32 - 2**31).astype(np.int32) for v in (a + b, a - b, a * b)]
    for got, other, want in zip(unchecked, with_checks, wrapped):
        assert torch.equal(got, other)
        np.testing.assert_array_equal(got.numpy(), want)


def test_the_conftest_turned_the_discarded_checks_off():
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
