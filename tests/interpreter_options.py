"""Triton's CPU interpreter without the work it does and then throws away or does again.

- `skip_discarded_overflow_checks`: for every `+`, `-` and `*` on integer tensors narrower than 64 bits the
  interpreter redoes the operation in int64 and compares it with the type's range (`sanitize_overflow`, on by
  default), then hands the comparison to `device_assert`, which does nothing unless the options' `debug` is on;
  the interpreter's options never turn it on. That dead arithmetic was close to half of the interpreter's time
  in the kernel tests. Turned off only while `debug` is off, nothing that was checked stops being checked.
- `patch_the_language_once_per_launch`: a `@triton.jit` helper called from a kernel patches triton.language
  again, which the launch already did (about half of what was left).
- `remember_numpy_dtypes`: the numpy dtype of a Triton dtype, looked up on nearly every operation through a table
  built anew each time (a fifth of what was left).
- `remember_block_types`: a block type's shape, element count and name, and the shape of constexprs a tensor of it
  holds, made anew for every operand and result of every operation (a quarter of what was left).
- `call_builtins_directly`: each interpreted operation called its function through two wrappers, one of which
  copied its keyword arguments into a new dict.
- `remember_computation_types`: the type two operands compute in, worked out again on every operation from the
  same pair of types.
- `pass_same_typed_operands`: two tensors of one element type, each cast to that type (which gives it back as it
  is) before every operation on them.
- `compare_dtypes_by_name`: two dtypes compared through a constexpr unwrap and an isinstance check, on nearly
  every operation.
The last four together: about a quarter of what was left.

tests/test_interpreter_options.py checks that each changes no result, and fails where the interpreter stops doing
what it skips, so that the function can be dropped then.

`prepare_the_interpreter` applies all eight: tests/conftest.py calls it, and so should the processes tests spawn
that run kernels in the interpreter (they do not load the conftest).
"""

from __future__ import annotations

from dataclasses import replace


def prepare_the_interpreter() -> None:
    """Everything this module skips, as tests/conftest.py has it in pytest's processes."""
    skip_discarded_overflow_checks()
    patch_the_language_once_per_launch()
    remember_numpy_dtypes()
    remember_block_types()
    call_builtins_directly()
    remember_computation_types()
    pass_same_typed_operands()
    compare_dtypes_by_name()


def skip_discarded_overflow_checks() -> None:
    """Turn `sanitize_overflow` off in the interpreter's options where `debug` is off (its checks go nowhere)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", False):
        return
    builder.options = replace(options, sanitize_overflow=False)


def patch_the_language_once_per_launch() -> None:
    """Skip the interpreter's re-patching of triton.language on every call of a `@triton.jit` helper inside a
    kernel, where the launch has already patched it.

    A launch (`GridExecutor.__call__`) replaces triton.language's builtins with interpreted ones for the duration
    of the run, then restores them. A helper called from the kernel (`InterpretedFunction.__call__`) calls
    `_patch_lang` again, each time: it walks every member of tl, tl.core, tl.math, tl.tensor and
    tl.core.tensor_descriptor_base (`inspect.getmembers`) to wrap the builtins, finds them wrapped already, and
    sets a dozen other attributes to new functions that do what the launch's do; its scope is thrown away.
    That walk was about half of the interpreter's time in the kernel tests (a few helper calls per tile).

    Skipped only where it changes nothing: the call comes from a helper, and every part it would patch (each
    triton.language module among the helper's globals, tl.tensor, tl.math where tl is there, the descriptors)
    already holds interpreted builtins. Otherwise (a helper called outside a launch, or one seeing a module the
    launch did not patch) the interpreter's own `_patch_lang` runs as before. tests/test_interpreter_options.py
    checks that a kernel calling helpers computes the same with and without this, and that the launch still
    restores triton.language.
    """
    import inspect
    import sys

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "skips_patched_helpers", False):
        return
    helper_call = getattr(getattr(interpreter, "InterpretedFunction", None), "__call__", None)
    if helper_call is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    helper_code = helper_call.__code__
    is_builtin = tl.core.is_builtin

    def interpreted(lang) -> bool:
        """Every part `_patch_lang` patches for `lang` holds interpreted builtins (one probe per part: a scope
        patches all of a part's builtins or none)."""
        probes = [(lang, "load"), (lang.tensor, "__add__"), (tl.core.tensor_descriptor_base, "load")]
        if lang is tl:
            probes.append((tl.math, "exp"))
        return not any(is_builtin(getattr(part, name)) for part, name in probes)

    found: dict = {}  # helper -> (its globals' size when looked at, the triton.language modules among them)

    def languages(fn) -> list:
        size = len(fn.__globals__)  # the interpreter adds names to a helper's globals when it rewrites it
        if found.get(fn, (None,))[0] != size:
            found[fn] = size, [value for value in fn.__globals__.values()
                               if inspect.ismodule(value) and (value is tl or value is tl.core)]
        return found[fn][1]

    def patch_lang(fn):
        if sys._getframe(1).f_code is helper_code:
            langs = languages(fn)
            if langs and all(interpreted(lang) for lang in langs):
                patch_lang.skipped += 1
                return interpreter._LangPatchScope()
        return original(fn)

    patch_lang.skips_patched_helpers = True
    patch_lang.skipped = 0
    patch_lang.original = original
    interpreter._patch_lang = patch_lang


def remember_numpy_dtypes() -> None:
    """Look up the numpy dtype of a Triton dtype once, not build the interpreter's table again on every lookup.

    `_get_np_dtype` (the numpy dtype that holds a Triton tensor's values) builds a dict of nineteen Triton dtypes,
    hashing each, on every call: about 11 us, paid on nearly every interpreted operation (a fifth of the kernel
    tests' time once the two above are skipped). Its answer depends only on the scalar dtype (a block's is its element's, a pointer's is
    uint64), so it is asked once per scalar dtype and remembered; pointers (unhashable) go to it every time.
    tests/test_interpreter_options.py checks the remembered answers against the interpreter's own for every dtype.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._get_np_dtype
    if getattr(original, "remembers", False):
        return
    known: dict = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return original(scalar)
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = original(scalar)
            return found

    get_np_dtype.remembers = True
    get_np_dtype.original = original
    interpreter._get_np_dtype = get_np_dtype


def remember_block_types() -> None:
    """Make a block type's shape, element count and name once per element type and shape, and the shape of
    constexprs a tensor of that type holds once too, not anew on every operation.

    Every interpreted operation makes the types of its operands and result again (`block_type(...)`; `to_ir`,
    `with_element_ty` and broadcasting make more): each turns its shape into a triton.language tuple, whose type
    holds a constexpr type per dimension, checks it and formats its name; each tensor made of one turns that shape
    into constexprs and another tuple. Both depend only on what they are made from, and nothing changes them after
    (block types are compared by element type and shape, not by identity). A type of anything but a plain dtype or
    a pointer to one, or a shape of anything but integers, is made as before. That was about a quarter of the
    interpreter's time in the kernel tests once the shortcuts above were in. tests/test_interpreter_options.py
    checks the remembered types and tensor shapes against freshly made ones, and a kernel's results bit for bit.
    """
    from triton.language import core

    block_type, tensor, constexpr, pointer_type, dtype = (core.block_type, core.tensor, core.constexpr,
                                                          core.pointer_type, core.dtype)
    make_block, make_tensor = block_type.__init__, tensor.__init__
    if getattr(make_block, "remembers", False):
        return
    # What is remembered is all they hold: where Triton's types or tensors come to hold more, nothing is skipped.
    probe = core.block_type(core.float32, [2, 4])
    if set(vars(probe)) != {"element_ty", "shape", "numel", "name"} or set(
            vars(core.tensor(None, probe))) != {"handle", "shape", "numel", "type", "dtype"}:
        return

    def key_of(element_ty):
        if type(element_ty) is dtype:
            return element_ty.name
        if type(element_ty) is pointer_type:
            inner = key_of(element_ty.element_ty)
            return None if inner is None else ("pointer", inner, element_ty.address_space, element_ty.const)
        return None

    blocks: dict = {}  # (element, *dims) -> [shape, numel, name, a tensor's (shape, numel) or None]

    def block_init(self, element_ty, shape):
        element = key_of(element_ty)
        if element is None or not isinstance(shape, (list, core.tuple)):  # what the interpreter's own takes
            return make_block(self, element_ty, shape)
        dims = []
        for size in shape:
            if type(size) is constexpr:
                size = size.value
            if type(size) is not int:
                return make_block(self, element_ty, shape)
            dims.append(size)
        key = (element, *dims)
        made = blocks.get(key)
        if made is None:
            make_block(self, element_ty, shape)
            made = blocks[key] = [self.shape, self.numel, self.name, None]
        else:
            self.element_ty = element_ty
            self.shape, self.numel, self.name = made[:3]
        self._remembered = made

    def tensor_init(self, handle, type):
        made = type.__dict__.get("_remembered")
        if made is None:  # a scalar type: remembered on its object
            made = type.__dict__["_remembered"] = [None] * 4
        if made[3] is None:
            make_tensor(self, handle, type)
            made[3] = self.shape, self.numel
            return
        self.handle = handle
        self.shape, self.numel = made[3]
        self.type = type
        self.dtype = type.scalar

    block_init.remembers = True
    block_init.original = make_block
    tensor_init.original = make_tensor
    block_type.__init__ = block_init
    tensor.__init__ = tensor_init


def call_builtins_directly() -> None:
    """Have a launch call each triton.language builtin's own function with the interpreter's semantic.

    A launch replaces every builtin with a lambda (`_patch_attr`) that copies the call's keyword arguments into a
    new dict without `_semantic`, then calls the builtin with the interpreter's `_semantic`: `builtin`'s wrapper,
    which checks that `_semantic` was given and calls the function it wraps. The replacement passes the
    interpreter's `_semantic` in place of a given one, as the lambda does, and calls the wrapped function itself
    where the member is `builtin`'s wrapper (its check cannot fail: `_semantic` is always given); any other member
    is called as the lambda calls it. tests/test_interpreter_options.py checks that the builtins are still
    `builtin`'s wrappers, and natsim's kernels bit for bit.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_attr
    if getattr(original, "calls_directly", False):
        return
    wrapper_code = tl.core.builtin(lambda _semantic=None: None).__code__

    def patch_attr(obj, name, member, builder, scope):
        function = member.__wrapped__ if getattr(member, "__code__", None) is wrapper_code else member
        semantic = interpreter.interpreter_semantic  # made once, when the interpreter is imported

        def interpreted(*args, **kwargs):
            kwargs["_semantic"] = semantic
            return function(*args, **kwargs)

        scope.set_attr(obj, name, interpreted)

    patch_attr.calls_directly = True
    patch_attr.original = original
    patch_attr.wrapper_code = wrapper_code
    interpreter._patch_attr = patch_attr


def remember_computation_types() -> None:
    """Work out the type two operands compute in (`computation_type_impl`) once per pair of dtypes, scalar flags
    and division, not again on every operation: the answer depends on nothing else. Only plain dtypes are
    remembered (pointers and blocks go to the interpreter's own every time), and a pair it refuses is refused
    every time. tests/test_interpreter_options.py checks the remembered answers against the interpreter's own for
    every pair of dtypes.
    """
    from triton.language import core, semantic

    cls = semantic.TritonSemantic
    original = cls.computation_type_impl
    if getattr(original, "remembers", False):
        return
    dtype = core.dtype
    known: dict = {}

    def computation_type_impl(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod):
        if a_ty.__class__ is not dtype or b_ty.__class__ is not dtype:
            return original(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        key = (a_ty.name, a_is_scalar, b_ty.name, b_is_scalar, div_or_mod)
        found = known.get(key)
        if found is None:
            found = known[key] = original(self, a_ty, a_is_scalar, b_ty, b_is_scalar, div_or_mod)
        return found

    computation_type_impl.remembers = True
    computation_type_impl.original = original
    cls.computation_type_impl = computation_type_impl


def pass_same_typed_operands() -> None:
    """Skip the casts and pointer checks before a binary operation (`binary_op_type_checking_impl`) of two tensors of
    one element type that compute in it: each cast would give its operand back, and neither is a pointer. Two
    tensors of one shape come back as they are (broadcasting them changes nothing either); a block and a scalar, or
    blocks of two shapes, are broadcast as the checks broadcast them. Anything else (a Python number, a pointer, two
    element types, an operation computing in another type such as a division of halves) goes through the
    interpreter's own checks. tests/test_interpreter_options.py checks the operands against those the
    interpreter's own checks give, and natsim's kernels bit for bit.
    """
    from triton.language import core, semantic

    cls = semantic.TritonSemantic
    original = cls.binary_op_type_checking_impl
    if getattr(original, "passes_same_types", False):
        return
    tensor, dtype = core.tensor, core.dtype

    def binary_op_type_checking_impl(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False,
                                     arithmetic_check=True, div_or_mod=False):
        if lhs.__class__ is tensor and rhs.__class__ is tensor:
            lhs_ty, rhs_ty = lhs.type, rhs.type
            scalar = lhs_ty.scalar
            if scalar.__class__ is dtype and rhs_ty.scalar == scalar and (
                    not arithmetic_check
                    or self.computation_type_impl(scalar, False, scalar, False, div_or_mod) == scalar):
                return (lhs, rhs) if lhs_ty == rhs_ty else self.broadcast_impl_value(lhs, rhs)
        return original(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)

    binary_op_type_checking_impl.passes_same_types = True
    binary_op_type_checking_impl.original = original
    cls.binary_op_type_checking_impl = binary_op_type_checking_impl


def compare_dtypes_by_name() -> None:
    """Compare a dtype with a plain dtype by name directly, as `dtype.__eq__` does after unwrapping a constexpr and
    checking the other's class; anything else (a constexpr, a pointer or block type, another object) goes to
    `dtype.__eq__` itself. Pointer and block types keep their own `__eq__`. tests/test_interpreter_options.py
    checks every pair of a set of types against `dtype.__eq__`.
    """
    from triton.language import core

    dtype = core.dtype
    original = dtype.__eq__
    if getattr(original, "compares_names", False):
        return

    def __eq__(self, other) -> bool:
        if other.__class__ is dtype:
            return self.name == other.name
        return original(self, other)

    __eq__.compares_names = True
    __eq__.original = original
    dtype.__eq__ = __eq__
