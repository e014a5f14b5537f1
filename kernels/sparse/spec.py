"""One block-mask attention call's every non-tensor argument as one frozen value, normalised once at the public
boundary.

`SparseSpec` is what `sparse_attention` (its eager path) or the operators `natsim::sparse_forward` and
`natsim::sparse_prepared` (from their schemas) hand to the dispatcher (kernels/sparse/dispatch.py) and the launch
(kernels/sparse/forward.py, `run_sparse`). The schemas keep plain ints, floats and strings:
`SparseSpec.mask_arguments` / `work_arguments` and `SparseSpec.from_operator` convert between the two, in one
place. What needs the mask or the tensors (the blocks against the mask, the work against q) is checked where they
meet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..common.checks import check_scale
from ..common.fp8 import Fp8Scales, check_precision, scale_tensors
from ..common.spec import kept
from .checks import SCHEDULES, check_pv_threshold
from .work import MERGES


@dataclass(frozen=True)
class SparseSpec:
    """Every non-tensor argument of one sparse attention call (`sparse_attention`'s), normalised.

    `q_block`, `kv_block`, `merge`: the mask's blocks (tokens per mask row and column) and the grouping of query
    blocks, for a boolean mask; None with prepared work (a `SparseWork` carries its own). `scale`: the score scale
    (None: `head_dim ** -0.5`); `return_lse`: whether the call returns the LSE; `schedule`: "grid" or "lpt";
    `programs`: persistent programs of "lpt" (None: about one per SM slot); `pv_threshold`: None or SpargeAttn's
    negative lambda; `precision`: None or "fp8"; `out_dtype`: the output's dtype for q, k, v given in float8
    (None otherwise).
    """

    q_block: Optional[int] = None
    kv_block: Optional[int] = None
    merge: Optional[str] = None
    scale: Optional[float] = None
    return_lse: bool = False
    schedule: str = "grid"
    programs: Optional[int] = None
    pv_threshold: Optional[float] = None
    precision: Optional[str] = None
    out_dtype: Optional[torch.dtype] = None

    @classmethod
    def of(
        cls,
        *,
        q_block: Optional[int] = None,
        kv_block: Optional[int] = None,
        merge: Optional[str] = None,
        scale: Optional[float] = None,
        return_lse: bool = False,
        schedule: Optional[str] = None,
        programs: Optional[int] = None,
        pv_threshold: Optional[float] = None,
        precision: Optional[str] = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> SparseSpec:
        """The spec of a caller's arguments: the schedule ("grid" for None), merge, PV threshold and precision
        checked with their sentences, the scale and threshold as floats. The blocks are taken as given: the mask
        checks them (kernels/sparse/work.py, `dense_mask`). Made once per distinct arguments
        (kernels/common/spec.py)."""
        return _spec_of(q_block, kv_block, merge, scale, bool(return_lse), schedule, programs, pv_threshold,
                        precision, out_dtype)

    @classmethod
    def from_operator(cls, q_block: Optional[int], kv_block: Optional[int], merge: Optional[str],
                      scale: Optional[float], return_lse: bool, schedule: str, programs: Optional[int],
                      pv_threshold: Optional[float] = None, precision: Optional[str] = None,
                      out_dtype: Optional[torch.dtype] = None) -> SparseSpec:
        """The spec of the operators' schema arguments (`mask_arguments` without the FP8 scales, which are
        tensors), checked as `of` checks a caller's."""
        return cls.of(q_block=q_block, kv_block=kv_block, merge=merge, scale=scale, return_lse=return_lse,
                      schedule=schedule, programs=programs, pv_threshold=pv_threshold, precision=precision,
                      out_dtype=out_dtype)

    def mask_arguments(self, scales: Optional[Fp8Scales] = None) -> tuple:
        """`natsim::sparse_forward`'s arguments after q, k, v and the mask, in schema order, with the FP8 `scales`
        as their three tensors (Nones without)."""
        return (self.q_block, self.kv_block, self.merge, *self.work_arguments(scales))

    def work_arguments(self, scales: Optional[Fp8Scales] = None) -> tuple:
        """`natsim::sparse_prepared`'s arguments after q, k, v and the work's tensors and sizes, in schema order
        (the blocks and merge are the work's own)."""
        return (self.scale, self.return_lse, self.schedule, self.programs, self.pv_threshold, self.precision,
                *scale_tensors(scales), self.out_dtype)


@kept
def _spec_of(q_block: Optional[int], kv_block: Optional[int], merge: Optional[str], scale: Optional[float],
             return_lse: bool, schedule: Optional[str], programs: Optional[int], pv_threshold: Optional[float],
             precision: Optional[str], out_dtype: Optional[torch.dtype]) -> SparseSpec:
    """`SparseSpec.of`'s work."""
    check_precision(precision)
    if precision is not None and pv_threshold is not None:
        raise ValueError("precision='fp8' does not run with the PV skip (pv_threshold): pass one or the other.")
    schedule = "grid" if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be None, 'grid' or 'lpt', got schedule={schedule!r}.")
    if merge not in MERGES:
        raise ValueError(f"merge must be None, 'consecutive' or 'xor', got merge={merge!r}.")
    if programs is not None and (not isinstance(programs, int) or isinstance(programs, bool) or programs < 1):
        raise ValueError(f"programs must be a positive int, got programs={programs!r}.")
    return SparseSpec(q_block, kv_block, merge, check_scale(scale), return_lse, schedule, programs,
                      check_pv_threshold(pv_threshold), precision, out_dtype)
