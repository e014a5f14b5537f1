"""natsim.kernels: what runs on the GPU. GNA (kernels/gna/) and attention under any block mask
(kernels/sparse/), forward and backward, as PyTorch operators that each family registers (kernels/gna/ops.py,
kernels/sparse/ops.py), each with a CPU path through its torch reference, on natsim's Triton kernels or on
FlashAttention-4 (kernels/fa4/, an optional dependency) behind one seam (kernels/backends/: what each backend
runs); kernels/common/ holds what the families share, among it `natsim::attention_resolved`
(kernels/common/resolved.py).

The face that rooms above the kernels import: the entry points, the operators they run through at run time
(`gna_resolved` with `register_resolver`, and `gna_resolved_ordered` on tokens kept in a `TileOrder`, both picked
with their twins without autograd by `resolved_operators`; `attention_resolved` with `register_attention`, run
through `resolved_attention`; `hold` / `held` for what an operator hands its backward by
handle, `autograd_inside_an_operator`), a call's spec
(`GnaSpec`, `SparseSpec`), launch options (`LaunchOptions`), the sentences the operators refuse gradients
with, and what an entry point of their own (natsim.planner's AutoPlan, a model integration) checks at its
boundary as natsim's entry points do (`check_tensors`, `check_qkv`, `autocast_inputs`, `runs_eagerly`,
`needs_gradient`, `check_precision`, `refuse_gradients`, `constants_when_compiled`, `constant_of_the_graph`); and
the process-wide switch of Hopper's tensor descriptors (`set_tensor_descriptors`, `tensor_descriptors_enabled`;
NATSIM_NO_TMA=1 in the environment turns them off at import): off, every kernel runs the path a GPU without them
(Ampere, Ada) runs.
"""

# This folder is natsim.kernels (pyproject.toml's package-dir mapping). Where the repository's root is on sys.path
# (`python -m pytest` there, a script run from it) it is also importable as a top-level package "kernels", a name
# other libraries probe for (transformers imports "kernels", the Hub's kernel package, to read its version).
# Imported so, it stays empty: its modules would otherwise run a second time, and their torch.library operators,
# registered again under the same names with registries of their own, would replace natsim's (a compiled
# natsim::gna_resolved then no longer finds the plans registered with natsim.kernels).
if __name__ == "natsim.kernels":
    from .common.backend import autocast_inputs, runs_eagerly
    from .common.checks import check_tensors
    from .common.fp8 import Fp8Scales, check_precision, refuse_gradients
    from .common.launch import LaunchOptions, set_tensor_descriptors, tensor_descriptors_enabled
    from .common.operators import needs_gradient, refuse_second_order
    from .common.handles import autograd_inside_an_operator, fake_handle, held, hold
    from .common.regroup import pack_head_blocks, place_head_blocks
    from .common.spec import constant_of_the_graph, constants_when_compiled
    from .common.resolved import attention_resolved, register_attention, resolved_attention, unregister_attention
    from .gna import (
        GnaSpec,
        chosen_backend,
        gna_attention,
        gna_attention_permuted,
        gna_tile_counts,
        permute,
        permute_reference,
        reference_attention,
        unpermute,
        unpermute_reference,
    )
    from .gna.checks import check_qkv
    from .gna.ops import (FRAMES_GRADIENT_REFUSAL, gna_resolved, gna_resolved_ordered, register_resolver,
                          resolved_operators)
    from .gna.ordered import TileOrder, tile_order_refusal
    from .sparse import (
        SparseMask,
        SparseSpec,
        SparseTileCounts,
        SparseWork,
        prepare_sparse,
        sparse_attention,
        sparse_reference,
        sparse_tile_counts,
    )
    from .sparse.ops import PV_SKIP_GRADIENT_REFUSAL

    __all__ = [
        "Fp8Scales",
        "LaunchOptions",
        "set_tensor_descriptors",
        "tensor_descriptors_enabled",
        "GnaSpec",
        "SparseSpec",
        "gna_resolved",
        "gna_resolved_ordered",
        "resolved_operators",
        "TileOrder",
        "tile_order_refusal",
        "register_resolver",
        "attention_resolved",
        "register_attention",
        "unregister_attention",
        "resolved_attention",
        "hold",
        "held",
        "fake_handle",
        "autograd_inside_an_operator",
        "refuse_second_order",
        "pack_head_blocks",
        "place_head_blocks",
        "FRAMES_GRADIENT_REFUSAL",
        "PV_SKIP_GRADIENT_REFUSAL",
        "check_tensors",
        "check_qkv",
        "autocast_inputs",
        "constants_when_compiled",
        "constant_of_the_graph",
        "runs_eagerly",
        "needs_gradient",
        "check_precision",
        "refuse_gradients",
        "gna_attention",
        "chosen_backend",
        "gna_attention_permuted",
        "gna_tile_counts",
        "permute",
        "unpermute",
        "permute_reference",
        "unpermute_reference",
        "reference_attention",
        "SparseMask",
        "SparseTileCounts",
        "SparseWork",
        "prepare_sparse",
        "sparse_attention",
        "sparse_reference",
        "sparse_tile_counts",
    ]
