"""What tests/interpreter_options.py relies on: in Triton's interpreter, the integer-overflow checks report
nothing, so turning them off (tests/conftest.py) changes no result and hides no error. If an interpreter starts
reporting overflows, the first test fails: drop skip_discarded_overflow_checks then. And a kernel calling
`@triton.jit` helpers computes the same whether each helper call patches triton.language again or not, the launch
still restores it afterwards; if the interpreter stops re-patching on helper calls, the test saying so fails: drop
patch_the_language_once_per_launch then. The numpy dtypes remembered per Triton dtype are the interpreter's own, and
the block types and tensor shapes remembered per element type and shape are those made afresh. The builtins a launch
calls directly are `builtin`'s wrappers (if they stop being so, the test saying so fails: drop
call_builtins_directly then); the computation types remembered per pair of dtypes are the interpreter's own; two
tensors of one type come back from the interpreter's own type checks as they are wherever the shortcut passes them
(drop pass_same_typed_operands if that test fails); dtypes compare by name as `dtype.__eq__` compares them. natsim's
kernels compute the same bit for bit with every shortcut and without."""

from __future__ import annotations

import os
import re

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


@triton.jit
def _scaled(x, factor):
    return x * factor + tl.exp(x * 0.0)


@triton.jit
def _row_sum(X, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    block = tl.load(X + rows[:, None] * COLS + cols[None, :])
    return tl.sum(_scaled(block, 2.0), axis=1)


@triton.jit
def _helpers(X, OUT, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.zeros((ROWS,), tl.float32)
    for step in tl.range(0, 3):
        total += _row_sum(X + (pid * 3 + step) * ROWS * COLS, ROWS, COLS)
    tl.store(OUT + pid * ROWS + tl.arange(0, ROWS), tl.cumsum(total, 0))


def _language_state() -> list[bool]:
    """Which of the parts `_patch_lang` patches hold Triton's builtins (True) rather than interpreted ones."""
    from triton.language.core import is_builtin

    return [is_builtin(member) for member in (tl.load, tl.core.load, tl.tensor.__add__, tl.math.exp,
                                              tl.core.tensor_descriptor_base.load)]


def _run_helpers(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(2, 16)
    _helpers[(2,)](x, out, ROWS=16, COLS=8)
    return out


def test_helper_calls_compute_the_same_without_patching_the_language_again(monkeypatch):
    """Bit for bit, and the launch leaves triton.language as the interpreter's own patching does: tl and the
    tensor methods restored (tl.core's builtins stay interpreted after a launch either way: the helpers of
    triton.language.standard see tl.core, which the launch did not patch, and their scopes are dropped)."""
    from triton.runtime import interpreter

    shortcut = interpreter._patch_lang
    assert getattr(shortcut, "skips_patched_helpers", False)  # the conftest installed it
    x = torch.randn(2, 3, 16, 8, generator=torch.Generator().manual_seed(0))
    got = _run_helpers(x)
    after_shortcut = _language_state()
    monkeypatch.setattr(interpreter, "_patch_lang", shortcut.original)
    want = _run_helpers(x)
    assert _language_state() == after_shortcut and after_shortcut[0] and after_shortcut[2]
    assert torch.equal(got, want)
    torch.testing.assert_close(got, (2 * x + 1).sum(-1).sum(1).cumsum(-1))


def test_the_interpreter_patches_the_language_again_on_every_helper_call(monkeypatch):
    """The interpreter's own patching runs once for the launch and once per helper call (_row_sum, _scaled and
    triton.language's own: sum, cumsum and their combine functions); the shortcut skips all but the launch's."""
    from triton.runtime import interpreter

    shortcut = interpreter._patch_lang
    x = torch.randn(2, 3, 16, 8)
    skipped = shortcut.skipped
    _run_helpers(x)
    skipped = shortcut.skipped - skipped
    calls = []
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or shortcut.original(fn))
    _run_helpers(x)
    helper_calls = len(calls) - 1
    assert helper_calls >= 2 * 3 * 2 and skipped == helper_calls


def test_the_remembered_numpy_dtypes_are_the_interpreters_own():
    from triton.runtime import interpreter

    remembered = interpreter._get_np_dtype
    assert getattr(remembered, "remembers", False)  # the conftest installed it
    original = remembered.original
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
               tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv, tl.float8e4b15]
    dtypes = scalars + [tl.pointer_type(t) for t in scalars]
    dtypes += [tl.block_type(t, [16, 4]) for t in dtypes]
    for _ in range(2):  # asked, then remembered
        for dtype in dtypes:
            assert remembered(dtype) == original(dtype), dtype


def _fields(value) -> dict:
    """What a type or a tensor holds, shapes as plain values (a triton.language tuple compares by identity inside)."""
    from triton.language import core

    return {name: [getattr(v, "value", v) for v in field] if isinstance(field, core.tuple)
            else getattr(field, "value", field) for name, field in vars(value).items() if name != "_remembered"}


def test_the_remembered_block_types_and_tensor_shapes_are_made_as_fresh_ones():
    from triton.language import core

    remembered, make_tensor = core.block_type.__init__, core.tensor.__init__
    assert getattr(remembered, "remembers", False)  # the conftest installed it
    original = remembered.original

    def fresh(cls, init, *args):
        value = cls.__new__(cls)
        init(value, *args)
        return value

    scalars = [tl.int1, tl.int8, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float8e4nv]
    elements = scalars + [tl.pointer_type(t) for t in scalars] + [tl.pointer_type(tl.float16, const=True),
                                                                  tl.pointer_type(tl.pointer_type(tl.int32))]
    shapes = [[16], [4, 8], [1, 32], [tl.constexpr(2), tl.constexpr(64)], core.tuple([8, 1, 4])]
    for _ in range(2):  # made, then remembered
        for element in elements:
            for shape in shapes:
                got = core.block_type(element, shape)
                want = fresh(core.block_type, original, element, shape)
                assert _fields(got) == _fields(want) and got == want and str(got) == str(want), (element, shape)
                assert got.with_element_ty(tl.int32) == want.with_element_ty(tl.int32)
                for type_ in (got, element):
                    tensor = core.tensor(None, type_)
                    assert _fields(tensor) == _fields(fresh(core.tensor, make_tensor.original, None, type_))
    for element, shape in ((tl.float32, [3, 4]), (tl.float32, [4.0]), (tl.float32, []), (tl.float32, [2**20, 2**20]),
                           (tl.float32, (4, 8))):  # a Python tuple: triton.language's own tuple only
        with pytest.raises((TypeError, ValueError, AssertionError)) as refused:  # as the interpreter's own refuses it
            core.block_type(element, shape)
        with pytest.raises(refused.type, match=f"^{re.escape(str(refused.value))}$"):
            fresh(core.block_type, original, element, shape)


SCALARS = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.float16,
           tl.bfloat16, tl.float32, tl.float64, tl.float8e5, tl.float8e4nv, tl.float8e4b15]


def test_the_builtins_a_launch_calls_directly_are_builtins_wrappers():
    """What call_builtins_directly relies on: the builtins a launch patches (triton.language's, the tensor's
    operators, tl.math's) are `builtin`'s wrappers around the function they check `_semantic` for."""
    from triton.runtime import interpreter

    shortcut = interpreter._patch_attr
    assert getattr(shortcut, "calls_directly", False)  # the conftest installed it
    for member in (tl.load, tl.store, tl.arange, tl.where, tl.dot, tl.core.tensor.__add__, tl.core.tensor.__mul__,
                   tl.core.tensor.__lt__, tl.math.exp):
        assert member.__code__ is shortcut.wrapper_code and callable(member.__wrapped__), member


def test_the_remembered_computation_types_are_the_interpreters_own():
    from itertools import product

    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    remembered = TritonSemantic.computation_type_impl
    assert getattr(remembered, "remembers", False)  # the conftest installed it
    semantic = interpreter.interpreter_semantic
    for _ in range(2):  # asked, then remembered
        for a, b, a_scalar, b_scalar, division in product(SCALARS, SCALARS, (False, True), (False, True),
                                                           (False, True)):
            try:
                want = remembered.original(semantic, a, a_scalar, b, b_scalar, division)
            except TypeError as refused:
                with pytest.raises(TypeError, match=f"^{re.escape(str(refused))}$"):
                    remembered(semantic, a, a_scalar, b, b_scalar, division)
                continue
            got = remembered(semantic, a, a_scalar, b, b_scalar, division)
            assert got.__class__ is want.__class__ and got.name == want.name, (a, b, a_scalar, b_scalar, division)


def _tensor(dtype, shape):
    """A triton.language tensor of the interpreter holding zeros: a scalar where `shape` is None."""
    from triton.runtime import interpreter

    data = np.zeros(shape or [1], dtype=interpreter._get_np_dtype(dtype))
    return tl.core.tensor(interpreter.TensorHandle(data, dtype), tl.block_type(dtype, shape) if shape else dtype)


def test_same_typed_operands_come_back_from_the_interpreters_own_checks_as_they_are():
    """Wherever pass_same_typed_operands skips the checks of two tensors of one element type, the interpreter's own
    checks give back those very tensors where their shapes agree, and the same broadcasts where they do not; where
    it does not skip them (a division of floats narrower than 32 bits computes in float32), they are cast."""
    from itertools import product

    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    shortcut = TritonSemantic.binary_op_type_checking_impl
    assert getattr(shortcut, "passes_same_types", False)  # the conftest installed it
    semantic = interpreter.interpreter_semantic
    shapes = [(None, None), ([4], [4]), ([2, 8], [2, 8]), (None, [4]), ([2, 8], None), ([2, 1], [1, 8]), ([8], [2, 8])]
    passed = broadcast = cast = 0
    for dtype, (lhs_shape, rhs_shape), arithmetic, division in product(SCALARS, shapes, (True, False), (False, True)):
        lhs, rhs = _tensor(dtype, lhs_shape), _tensor(dtype, rhs_shape)
        options = dict(arithmetic_check=arithmetic, div_or_mod=division)
        want = shortcut.original(semantic, lhs, rhs, **options)
        got = shortcut(semantic, lhs, rhs, **options)
        assert [t.type for t in got] == [t.type for t in want], (dtype, lhs_shape, rhs_shape, options)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.handle.data, b.handle.data)
            assert a.handle.dtype == b.handle.dtype
        if got[0] is lhs and got[1] is rhs:
            assert want[0] is lhs and want[1] is rhs, (dtype, lhs_shape, rhs_shape, options)
            passed += 1
        elif got[0].type.scalar == dtype:
            broadcast += 1
        else:
            cast += 1
    assert min(passed, broadcast, cast) > 0


def test_dtypes_compare_by_name_as_dtype_eq_compares_them():
    from triton.language import core

    shortcut = core.dtype.__eq__
    assert getattr(shortcut, "compares_names", False)  # the conftest installed it
    types = SCALARS + [core.dtype("int32"), tl.pointer_type(tl.int32), tl.block_type(tl.int32, [4]),
                       core.slice_type()]
    others = types + [tl.constexpr(tl.int32), tl.constexpr(tl.float16), None, "int32", 3]
    compared = set()
    for a in types:
        if type(a).__eq__ is shortcut:  # dtype's own and slice_type's; pointer and block types have their own
            compared.add(type(a))
            for b in others:
                assert (a == b) is shortcut.original(a, b), (a, b)
    assert compared == {core.dtype, core.slice_type}


def test_kernels_compute_the_same_with_the_shortcuts_and_without(monkeypatch):
    """natsim's GNA forward (static and dynamic KV tiling, pointer loads and descriptors) and its block-sparse
    kernel, bit for bit, with the shortcuts that act on every operation and without them."""
    from triton.language import core
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    from natsim.kernels import gna_attention, sparse_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 5, 2, 16, generator=generator).half() for _ in range(3))
    flat = [t.reshape(1, 120, 2, 16) for t in (q, k, v)]
    mask = torch.rand(1, 2, 8, 8, generator=generator) < 0.5

    def run():
        return [gna_attention(q, k, v, (3, 4, 2), (1, 2, 2), (1, 1, 2), (True, False, False), kv_tiling=tiling)
                for tiling in ("static", "dynamic")] + [sparse_attention(*flat, mask, 16, 16)]

    got = run()
    for owner, name in ((core.block_type, "__init__"), (core.tensor, "__init__"), (interpreter, "_patch_attr"),
                        (TritonSemantic, "computation_type_impl"), (TritonSemantic, "binary_op_type_checking_impl"),
                        (core.dtype, "__eq__")):
        monkeypatch.setattr(owner, name, getattr(owner, name).original)
    for a, b in zip(got, run()):
        assert torch.equal(a, b)
