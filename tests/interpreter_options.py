"""Triton's CPU interpreter without the integer-overflow checks it computes and then throws away.

For every `+`, `-` and `*` on integer tensors narrower than 64 bits the interpreter redoes the operation in
int64 and compares it with the type's range (`sanitize_overflow`, on by default), then hands the comparison to
`device_assert`, which does nothing unless the options' `debug` is on; the interpreter's options never turn it
on. That dead arithmetic was close to half of the interpreter's time in the kernel tests. Turned off only
while `debug` is off, nothing that was checked stops being checked; tests/test_interpreter_options.py fails if
an interpreter ever starts reporting those overflows with the checks on, so that this can be dropped then.

Called by tests/conftest.py, and by the processes tests spawn that run kernels in the interpreter (they do
not load the conftest).
"""

from __future__ import annotations

from dataclasses import replace


def skip_discarded_overflow_checks() -> None:
    """Turn `sanitize_overflow` off in the interpreter's options where `debug` is off (its checks go nowhere)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", False):
        return
    builder.options = replace(options, sanitize_overflow=False)
