"""The values a call crosses the kernels' layers as: `GnaSpec` and `SparseSpec` (a call's every non-tensor argument,
normalised once at the public boundary, and their operator schema forms) and `LaunchOptions` (a launch's options,
with a caller's checked overrides).
"""

from __future__ import annotations

import pytest
import torch

import natsim
from natsim.kernels import Fp8Scales, GnaSpec, LaunchOptions, SparseSpec, gna_attention_permuted, permute
from natsim.kernels.common.headdim import head_split
from natsim.kernels.common.launch import launch_config, launch_overrides
from natsim.kernels.gna.spec import FrameRange
from natsim.kernels.sparse.backward import sparse_backward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_gna_spec_broadcasts_scalars_and_keys_equal_calls_alike():
    spec = GnaSpec.of(3, 5, [1, 2, 2], causal=True, scale=1, q_tile=4, kv_tiling="static", frame_offsets=[2, 0, 9],
                      return_lse=1)
    assert spec == GnaSpec((5, 5, 5), (1, 2, 2), (1, 1, 1), (True, True, True), 1.0, (4, 4, 4), None, "static",
                           FrameRange(2, 0, 9), None, None, True)
    assert hash(spec) == hash(GnaSpec.of(3, (5, 5, 5), (1, 2, 2), 1, (True,) * 3, scale=1.0, q_tile=(4, 4, 4),
                                         kv_tiling="static", frame_offsets=(2, 0, 9), return_lse=True))
    assert isinstance(spec.scale, float) and spec.frames.q0 == 2 and spec.frames.frames == 9


def test_a_gna_spec_crosses_the_operator_schema_and_back():
    scales = Fp8Scales(*(torch.ones(()) for _ in range(3)))
    for spec in (GnaSpec.of(2, (3, 5), 1, causal=(True, False)),
                 GnaSpec.of(1, 7, 2, q_tile=16, kv_tile=32, kv_tiling="dynamic", return_lse=True, scale=0.5),
                 GnaSpec.of(3, 3, frame_offsets=(1, 0, 8)),
                 GnaSpec.of(2, 3, precision="fp8", out_dtype=torch.float16)):
        arguments = spec.operator_arguments(scales)
        schema, tensors = arguments[:11], arguments[11:14]
        assert all(not isinstance(a, tuple) for a in schema)  # the schema takes lists
        assert tensors == (scales.q_scale, scales.k_scale, scales.v_scale)
        assert GnaSpec.from_operator(*schema, out_dtype=arguments[14]) == spec


@pytest.mark.parametrize("arguments, message", [
    (dict(kv_tiling="grid"), r"kv_tiling must be one of .* got kv_tiling='grid'"),
    (dict(precision="fp16"), r"precision must be None .* or 'fp8', got precision='fp16'"),
    (dict(frame_offsets=(1, -1, 4)), "frame_offsets must be three non-negative ints"),
    (dict(frame_offsets=(1, 0, 4), precision="fp8"), "does not run with frame_offsets"),
    (dict(kv_tiling="dynamic", precision="fp8"), "static KV tiling only, got kv_tiling='dynamic'"),
    (dict(kv_tiling="dynamic", frame_offsets=(1, 0, 4)), "static KV tiling only, got kv_tiling='dynamic'"),
])
def test_a_gna_spec_refuses_what_no_layout_runs_with_a_sentence(arguments, message):
    with pytest.raises(ValueError, match=message):
        GnaSpec.of(2, 3, **arguments)


def test_a_gna_spec_leaves_the_window_against_the_layout_to_its_problem():
    spec = GnaSpec.of(2, (3, 9))
    assert spec.problem((8, 16)) == natsim.Problem((8, 16), (3, 9))
    with pytest.raises(ValueError, match="window \\* dilation cannot be larger"):
        spec.problem((8, 8))
    with pytest.raises(TypeError, match="window must be an int or a sequence of ints, got window='ab'"):
        GnaSpec.of(2, "ab")


@pytest.mark.parametrize("refused, valid", [
    (dict(window=5.0), dict(window=5)), (dict(window=True), dict(window=1)), (dict(stride=1.0), dict(stride=1)),
    (dict(causal=2), dict(causal=1)), (dict(q_tile=4.0), dict(q_tile=4)),
])
def test_a_refused_argument_leaves_nothing_kept_for_the_valid_one_it_equals(refused, valid):
    """Specs are kept per distinct arguments, and 5.0 == 5, True == 1: a refused value must not be kept as the
    spec of the valid value it equals, in either order. (Inside a tuple, where the cache does not tell types
    apart, a float equal to an int that a kept call held takes that call's spec: (5, 3.0) then runs as (5, 3).)"""
    arguments = dict(window=3) | refused
    for _ in range(2):
        with pytest.raises(TypeError):
            GnaSpec.of(2, **arguments)
        spec = GnaSpec.of(2, **(dict(window=3) | valid))
        assert all(type(v) is int for v in spec.window + spec.stride + (spec.q_tile or ()))


@pytest.mark.parametrize("scale", [0, 0.0, -0.25, float("nan"), float("inf"), "x", True])
def test_a_scale_that_is_not_a_positive_finite_number_is_a_sentence_on_every_path(scale, reference_path):
    """The kernels' online softmax is right for positive scales only (a zero scale gave NaN where the reference
    gave uniform weights): every entry point refuses the rest, on the CPU path too."""
    from natsim.kernels import gna_attention, sparse_attention

    message = f"scale must be a positive finite number .* got scale={scale!r}"
    for make in (lambda: GnaSpec.of(2, 3, scale=scale), lambda: SparseSpec.of(scale=scale)):
        with pytest.raises(ValueError, match=message):
            make()
    q = torch.randn(1, 4, 4, 1, 16)
    with pytest.raises(ValueError, match=message):
        gna_attention(q, q, q, 3, scale=scale)
    flat = q.flatten(1, 2)
    with pytest.raises(ValueError, match=message):
        sparse_attention(flat, flat, flat, torch.ones(1, 1, 1, 1, dtype=torch.bool), 16, 16, scale=scale)
    assert GnaSpec.of(2, 3, scale=0.5).scale == 0.5 and SparseSpec.of(scale=2).scale == 2.0


def test_a_sparse_spec_checks_its_arguments_and_crosses_both_schemas():
    spec = SparseSpec.of(q_block=16, kv_block=32, merge="xor", scale=1, schedule=None, pv_threshold=-2)
    assert spec.schedule == "grid" and spec.scale == 1.0 and spec.pv_threshold == -2.0
    arguments = spec.mask_arguments()
    assert arguments[3:] == spec.work_arguments()
    assert SparseSpec.from_operator(*arguments[:9], out_dtype=arguments[12]) == spec
    with pytest.raises(ValueError, match="schedule must be None, 'grid' or 'lpt', got schedule='fifo'"):
        SparseSpec.of(schedule="fifo")
    with pytest.raises(ValueError, match="merge must be None, 'consecutive' or 'xor'"):
        SparseSpec.of(merge="best")
    with pytest.raises(ValueError, match="pv_threshold must be None or a negative finite number"):
        SparseSpec.of(pv_threshold=0.5)
    with pytest.raises(ValueError, match="does not run with the PV skip"):
        SparseSpec.of(precision="fp8", pv_threshold=-1.0)
    for programs in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"programs must be a positive int, got programs={programs!r}"):
            SparseSpec.of(schedule="lpt", programs=programs)


def test_launch_options_take_checked_overrides():
    default = launch_config(64, 64, head_split(64), masked=True, tma=False)
    assert isinstance(default, LaunchOptions)
    tuned = default.overridden(launch_overrides({"num_warps": 2, "HEAD_MAJOR": True}, "config"))
    assert (tuned.num_warps, tuned.HEAD_MAJOR, tuned.num_stages) == (2, True, default.num_stages)
    assert tuned.triton_options() == {"num_warps": 2, "num_stages": default.num_stages}
    assert default.overridden(launch_overrides(None, "config")) is default
    with pytest.raises(ValueError, match="config names an unknown launch option, 'num_warp': the known options "
                                         "are num_warps, num_stages, MASKED, USE_TMA, WARP_SPECIALIZE, HEAD_MAJOR, "
                                         "CHUNK_A, CHUNK_B."):
        launch_overrides({"num_warp": 4}, "config")


def test_unknown_launch_options_of_the_tuning_entry_points_are_sentences():
    problem, tile = natsim.Problem((8, 16), (4, 8)), (4, 8)
    q = permute(torch.randn(1, 8, 16, 2, 32, device=DEVICE).half(), tile)
    with pytest.raises(ValueError, match="config names an unknown launch option, 'STAGES'"):
        gna_attention_permuted(q, q, q, problem, tile, tile, config={"STAGES": 2})
    x = torch.randn(1, 32, 1, 32, device=DEVICE).half()
    lse = torch.zeros(1, 32, 1, device=DEVICE)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="options names an unknown launch option, 'MASKED': the known options "
                                         "are num_warps, num_stages, USE_TMA."):
        sparse_backward(x, x, x, x, lse, x, None, mask, 16, 16, options={"MASKED": True})
