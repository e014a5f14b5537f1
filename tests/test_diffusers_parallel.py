"""natsim inside diffusers' context parallelism (integrations/diffusers/parallel.py).

In the main process: how the ranks' shares of a joint sequence are put into one process's order and back
(against a brute-force gather), and the refusals. In a gloo world of 2 processes (`run_world`, run by
tests/test_distributed.py::test_gloo_worlds in the processes it spawns), on tiny random models:
with `apply` before or after `enable_parallelism(ContextParallelConfig(ulysses_degree=2))` the model computes what
the same model computes in one process with natsim (and not the dense model's output: natsim is not bypassed),
for Wan (video self-attention; also under ulysses_anything, with padded heads), FLUX (joint attention, text first,
split over the ranks; in both orders) and QwenImage (joint attention with a text key mask), in FP8, and with
content-adaptive masks, each rank's verdicts made for the whole call as in one process (the joined text tokens,
not a rank's share); a training step's parameter gradients, summed over the ranks, equal one process's, with GNA and through
content-adaptive masks; the blocks compile with fullgraph=True; ring attention and tile_order=True are refused at
whichever call comes second; `remove` gives the model diffusers' own context-parallel attention back;
examples/diffusers_parallel.py runs; the interconnect calibration (natsim.distributed.calibrate_link) gives every
rank the same link.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import logging
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

pytest.importorskip("diffusers")

import diffusers_models  # noqa: E402
from natsim.integrations.diffusers import parallel  # noqa: E402
from natsim.integrations.diffusers.attention import Router  # noqa: E402

WORLD = 2
WORLD_DEADLINE_S = 240
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WAN, WAN_LAYOUT, WAN_WINDOW = "WanTransformer3DModel", (2, 4, 8), (1, 3, 3)
SIX_HEADS = dict(num_attention_heads=6)  # three heads a rank in a world of 2
JOINT = {"FluxTransformer2DModel": ((8, 8), (3, 3)), "QwenImageTransformer2DModel": ((8, 8), (3, 3))}


# -- the shares of a joint sequence ------------------------------------------------------------------------


@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("size, other, image", [(2, 3, 5), (3, 0, 4), (4, 2, 1)])
def test_shares_put_the_gathered_sequence_in_one_process_order(size, other, image, text_first):
    """Each rank's share is its part of the text then its part of the image (or the reverse), as a processor
    concatenates them; gathered in rank order and put in order, the text and the image are whole again."""
    text = torch.arange(size * other).float() + 1000
    img = torch.arange(size * image).float()
    parts = [(text[r * other:(r + 1) * other], img[r * image:(r + 1) * image]) for r in range(size)]
    gathered = torch.cat([torch.cat(p if text_first else p[::-1]) for p in parts])[None, :, None]
    shares = parallel.Shares(size, other + image, other, text_first)
    expected = torch.cat([text, img] if text_first else [img, text])[None, :, None]
    assert torch.equal(shares.to_sequence(gathered), expected)
    assert torch.equal(shares.to_shares(expected), gathered)
    assert torch.equal(shares.to_sequence(gathered.transpose(1, 2), dim=2), expected.transpose(1, 2))


def _config(**options):
    values = dict(ring_degree=1, ulysses_degree=2, ulysses_anything=False)
    values.update(options)
    return SimpleNamespace(**values)


def test_refusals_name_what_natsim_cannot_run():
    router = Router(None, text_first=True)
    assert parallel.refusal(_config(), router, None) is None
    assert "ring_degree=2" in parallel.refusal(_config(ring_degree=2), router, None)
    assert parallel.refusal(_config(ulysses_anything=True), router, None) is None  # served at the call
    assert "tile_order=True" in parallel.refusal(_config(), router, True)
    assert parallel.refusal(_config(), router, False) is None
    router.views.append(object())
    assert "splits its attention" in parallel.refusal(_config(), router, None)


def test_a_parallel_call_natsim_was_not_told_of_raises():
    router = Router(None, text_first=True)
    router.set_layout((4,))
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="not told of"):
        parallel.attend(router, q, q, q, None, None)


def test_joint_attention_under_a_plan_of_the_users_own_is_refused():
    """Self-attention over the video tokens alone needs no plan's word; a joint sequence under a cp_plan natsim
    has not checked does."""
    router = Router(None, text_first=True)
    router.set_layout((2, 2))
    theirs = parallel.Ulysses(None, 0, 2, own_plan=False)
    assert parallel.shares(router, theirs, 2).other == 0
    with pytest.raises(ValueError, match="cp_plan of its own"):
        parallel.shares(router, theirs, 5)
    assert parallel.shares(router, parallel.Ulysses(None, 0, 2), 5).other == 3


def test_shares_under_ulysses_anything_follow_tensor_split():
    """45 image tokens over 2 ranks: 23 and 22, as torch.tensor_split cuts them; a call with more tokens than a
    rank's image share (joint attention) is refused on every rank, one with fewer is not natsim's; no key mask."""
    router = Router(None, text_first=True)
    router.set_layout((3, 3, 5))
    cut = [len(part) for part in torch.arange(45).tensor_split(2)]
    for rank in range(2):
        ulysses = parallel.Ulysses(None, rank, 2, anything=True)
        layout = parallel.shares(router, ulysses, cut[rank])
        assert layout.tokens == tuple(cut) and layout.other == 0
        x = torch.randn(1, 45, 2, 4)
        assert torch.equal(layout.to_sequence(x), x)
        with pytest.raises(ValueError, match="does not run under ulysses_anything"):
            parallel.shares(router, ulysses, cut[rank] + 1)
        assert parallel.shares(router, ulysses, cut[rank] - 1) is None
        with pytest.raises(ValueError, match="under ulysses_anything takes no key mask"):
            parallel._gathered_key_mask(torch.ones(1, 1, 1, cut[rank], dtype=torch.bool), layout, ulysses)


def test_uneven_image_shares_are_refused():
    router = Router(None, text_first=False)
    router.set_layout((3, 3))
    with pytest.raises(ValueError, match="same share of the image tokens"):
        parallel.shares(router, parallel.Ulysses(None, 0, 2), 6)
    assert parallel.shares(router, parallel.Ulysses(None, 0, 2), 4) is None  # 8 tokens: not a call natsim serves


# -- a gloo world ------------------------------------------------------------------------------------------


def _cp_config(**options):
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(**{"ulysses_degree": WORLD, **options})


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float = 1e-5) -> None:
    error = float((got - want).abs().max() / want.abs().max())
    assert error <= tolerance, f"{what}: relative difference {error:.3g}"


def _differs(got: torch.Tensor, dense: torch.Tensor, what: str) -> None:
    assert float((got - dense).abs().max() / dense.abs().max()) > 1e-3, f"{what}: natsim's window changed nothing"


def _outputs(name: str, layout, window, batch: int, enable_first: bool, config: Optional[dict] = None,
             cp: Optional[dict] = None, **options) -> None:
    """One model (`config`: entries of its tiny configuration to change) with natsim (`apply`'s `options`), in one
    process and under Ulysses (`cp`: entries of the ContextParallelConfig; apply and enable in the order asked),
    against natsim in one process and the dense model; the verdicts are made for the whole call on every rank, as
    in one process (the layout and, in joint attention, the joined tokens: not a rank's share of them)."""
    from natsim.integrations import diffusers as nd

    inputs = diffusers_models.inputs(name, layout, batch=batch)
    model = diffusers_models.build(name, **(config or {}))
    with torch.no_grad():
        dense = model(**inputs)[0]
        alone = nd.apply(model, window=window, **options)
        single = model(**inputs)[0]
        nd.remove(model)
        if enable_first:
            model.enable_parallelism(config=_cp_config(**(cp or {})))
            applied = nd.apply(model, window=window, **options)
        else:
            applied = nd.apply(model, window=window, **options)
            model.enable_parallelism(config=_cp_config(**(cp or {})))
        out = model(**inputs)[0]
    what = f"{name} {options} {cp or ''}, {'enable then apply' if enable_first else 'apply then enable'}"
    _close(out, single, what)
    _differs(out, dense, what)
    assert list(applied.verdicts) == list(alone.verdicts), (what, list(applied.verdicts), list(alone.verdicts))


def _anything() -> None:
    """ulysses_anything: Wan with 3 heads (padded by natsim and diffusers to 2 a rank), apply after and before
    enable_parallelism, and under content-adaptive masks: one process's output; FLUX's joint attention refused on
    every rank alike. The shares are
    even here: with uneven ones diffusers' own gather of the model's output needs NCCL (gloo's all_gather takes
    equal sizes only); natsim's split of uneven shares is tested without a world above."""
    from natsim.integrations import diffusers as nd

    anything = dict(ulysses_anything=True)
    for enable_first in (True, False):
        _outputs(WAN, WAN_LAYOUT, WAN_WINDOW, 1, enable_first, config=dict(num_attention_heads=3), cp=anything)
    masks = nd.Masks(steps=2, block=16, sub_block=8, dense_fraction=0.5, initial_budget=0.5, min_budget=0.5,
                     merges=("none",), min_speedup=0.0)
    inputs, outputs = diffusers_models.inputs(WAN, WAN_LAYOUT), []
    for enable in (False, True):  # content-adaptive masks: a dense pass, then one under predicted masks
        model = diffusers_models.build(WAN, num_attention_heads=3)
        if enable:
            model.enable_parallelism(config=_cp_config(**anything))
        applied = nd.apply(model, masks=masks)
        with torch.no_grad():
            outputs.append([model(**{**inputs, "timestep": torch.full((1,), t)})[0] for t in (900.0, 700.0)])
        assert applied.masked.stats.predictions > 0, applied.masked.stats  # the second pass ran predicted masks
    for index, (want, got) in enumerate(zip(*outputs)):
        _close(got, want, f"masks under ulysses_anything with padded heads, pass {index}")
    name, (layout, window) = next(iter(JOINT.items()))
    model = diffusers_models.build(name)
    nd.apply(model, window=window)
    model.enable_parallelism(config=_cp_config(**anything))
    with pytest.raises(ValueError, match="does not run under ulysses_anything"):
        with torch.no_grad():
            model(**diffusers_models.inputs(name, layout))


def _kept_under_ulysses() -> None:
    """A layout on which natsim's call is priced slower than the model's own (a cost model whose host takes a
    second to issue natsim's call) keeps the model's attention under Ulysses too: diffusers' own parallel attention
    runs it, on every rank alike, and the output is the dense model's."""
    import warnings
    from dataclasses import replace

    from natsim.integrations import diffusers as nd
    from natsim.planner import cost_model_for

    slow_host = replace(cost_model_for("NVIDIA H100 80GB HBM3"), host_seconds={"triton": 1.0, "sdpa": 0.0})
    inputs = diffusers_models.inputs(WAN, WAN_LAYOUT)
    model = diffusers_models.build(WAN)
    with torch.no_grad():
        dense = model(**inputs)[0]
        applied = nd.apply(model, window=WAN_WINDOW, cost_model=slow_host)
        model.enable_parallelism(config=_cp_config())
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            out = model(**inputs)[0]
    assert [v.serves for v in applied.verdicts.values()] == [False]
    assert any("keeps the model's own attention" in str(w.message) for w in said)
    _close(out, dense, "a kept layout under Ulysses")


def _training_and_compile(rank: int) -> None:
    """A training step of Wan under Ulysses (each rank's three heads attended in three groups, natsim.distributed's
    pipeline): the output, and the parameter gradients summed over the ranks (each rank's share of the tokens
    contributes its part), equal one process's; then its blocks compiled with
    fullgraph=True (Dynamo's capture, run as captured) compute the same, and a second step recompiles nothing."""
    from natsim.integrations import diffusers as nd

    inputs = diffusers_models.inputs(WAN, WAN_LAYOUT)
    model = diffusers_models.build(WAN, **SIX_HEADS).train()  # three heads a rank: three groups
    nd.apply(model, window=WAN_WINDOW, training=True)
    single = model(**inputs)[0]
    single.square().mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.enable_parallelism(config=_cp_config())
    out = model(**inputs)[0]
    out.square().mean().backward()
    _close(out, single, "training forward")
    for name, p in model.named_parameters():
        if name in grads:
            summed = p.grad.clone()
            torch.distributed.all_reduce(summed)
            _close(summed, grads[name], f"gradient of {name}", 1e-4)
    model.eval()
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(fullgraph=True, backend="eager")
    with torch.no_grad():
        compiled = model(**inputs)[0]
        with torch._dynamo.config.patch(error_on_recompile=True):  # the next step compiles nothing again
            again = model(**inputs)[0]
    _close(compiled, single.detach(), "compiled blocks")
    assert torch.equal(again, compiled)


def _masks() -> None:
    """Content-adaptive masks under Ulysses (each rank predicts and runs the masks of its heads over every token),
    training: a dense warm-up pass, then a pass under predicted masks; each pass's output, and its parameter
    gradients summed over the ranks, equal one process's."""
    from natsim.integrations import diffusers as nd

    masks = nd.Masks(steps=2, block=16, sub_block=8, dense_fraction=0.5, initial_budget=0.5, min_budget=0.5,
                     merges=("none",), min_speedup=0.0)
    inputs = diffusers_models.inputs(WAN, (2, 4, 8))
    runs = []
    for enable in (False, True):
        model = diffusers_models.build(WAN).train()
        if enable:
            model.enable_parallelism(config=_cp_config())
        applied = nd.apply(model, masks=masks, training=True)
        passes = []
        for t in (900.0, 700.0):
            model.zero_grad()
            out = model(**{**inputs, "timestep": torch.full((1,), t)})[0]
            out.square().mean().backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
            for grad in grads.values() if enable else ():
                torch.distributed.all_reduce(grad)
            passes.append((out.detach(), grads))
        assert applied.masked.stats.dense_calls == 2 and applied.masked.stats.predictions == 2, applied.masked.stats
        runs.append(passes)
    for index, ((out, single), (parallel_out, summed)) in enumerate(zip(*runs)):
        _close(parallel_out, out, f"masks, pass {index}")
        assert single.keys() == summed.keys()
        for name, want in single.items():
            if want.abs().max() > 0:
                _close(summed[name], want, f"masks training, pass {index}, gradient of {name}", 1e-4)


def _refusals_and_remove() -> None:
    """Ring attention and tile_order=True refused at whichever call comes second, the model untouched; heads that
    ulysses_degree does not divide refused at the call, on every rank; after `remove`, diffusers' own
    context-parallel attention (the dense model's output)."""
    from natsim.integrations import diffusers as nd

    model = diffusers_models.build(WAN)
    inputs = diffusers_models.inputs(WAN, WAN_LAYOUT)
    with torch.no_grad():
        dense = model(**inputs)[0]
    nd.apply(model, window=WAN_WINDOW)
    with pytest.raises(ValueError, match="ring_degree=2"):
        model.enable_parallelism(config=_cp_config(ring_degree=2, ulysses_degree=1))
    assert model._parallel_config is None
    nd.remove(model)
    model.enable_parallelism(config=_cp_config(ring_degree=2, ulysses_degree=1))
    with pytest.raises(ValueError, match="ring_degree=2"):
        nd.apply(model, window=WAN_WINDOW)
    assert not hasattr(model, "_natsim")

    model = diffusers_models.build(WAN, num_attention_heads=3)
    nd.apply(model, window=WAN_WINDOW)
    model.enable_parallelism(config=_cp_config())
    with pytest.raises(ValueError, match=r"the 3 heads over ulysses_degree=2 ranks: heads must divide by it"):
        with torch.no_grad():
            model(**inputs)

    model = diffusers_models.build(WAN)
    model.enable_parallelism(config=_cp_config())
    with pytest.raises(ValueError, match="tile_order=True"):
        nd.apply(model, window=WAN_WINDOW, tile_order=True)
    nd.apply(model, window=WAN_WINDOW)
    nd.remove(model)
    with torch.no_grad():
        _close(model(**inputs)[0], dense, "diffusers' own attention after remove")


def _example() -> None:
    """examples/diffusers_parallel.py at a tiny size in this world (its `main` adds only the process group torchrun
    sets up): its first step equals one process's."""
    spec = importlib.util.spec_from_file_location("diffusers_parallel", EXAMPLES / "diffusers_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    arguments = example.arguments(["--device", "cpu", "--layers", "1", "--heads", "2", "--head-dim", "32",
                                   "--latent", "2x8x16", "--window", "1x3x3", "--text", "8", "--steps", "2",
                                   "--train-steps", "1"])
    with contextlib.redirect_stdout(io.StringIO()):
        assert example.run(arguments) < 1e-5


def _link() -> None:
    """natsim.distributed.calibrate_link over gloo: every rank gets the same link, with positive rates (sizes 16x
    apart, so that a loaded machine's noise does not hide the growth of the times with the bytes)."""
    from natsim.distributed import calibrate_link

    link = calibrate_link(sizes_mb=(1.0, 16.0), repeats=3)
    assert link.all_to_all.bytes_per_second > 0 and link.point_to_point.bytes_per_second > 0
    gathered = [None] * WORLD
    torch.distributed.all_gather_object(gathered, link)
    assert all(other == link for other in gathered), gathered


def run_world(rank: int, world: int, port: int) -> None:
    """One rank of the gloo world of this file's docstring. tests/test_distributed.py runs it in the processes it
    spawns for natsim.distributed's own worlds (each spawned process spends seconds importing torch and diffusers:
    one spawn for both saves that)."""
    # diffusers 0.42.1 on a machine without a GPU: its mesh's device index is `rank % device_count()` (0 here), and
    # it warns through `Logger.warning_once`, which only transformers defines (users' pipelines import it).
    torch.accelerator.device_count = lambda: 1
    logging.Logger.warning_once = functools.lru_cache(None)(logging.Logger.warning)
    os.environ["TRITON_INTERPRET"] = "0"  # the torch reference path (kernels/common/backend.py): routing is tested
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                         timeout=timedelta(seconds=60))
    try:
        for enable_first in (False, True):
            _outputs(WAN, WAN_LAYOUT, WAN_WINDOW, 1, enable_first)
        for name, (layout, window) in JOINT.items():
            _outputs(name, layout, window, 2, enable_first=False)
        _outputs("FluxTransformer2DModel", *JOINT["FluxTransformer2DModel"], 2, enable_first=True)
        # FP8 with six heads: each rank attends its three in three groups (natsim.distributed's pipeline)
        _outputs(WAN, WAN_LAYOUT, WAN_WINDOW, 1, enable_first=False, config=SIX_HEADS, precision="fp8")
        _kept_under_ulysses()
        _anything()
        _training_and_compile(rank)
        _masks()
        _refusals_and_remove()
        _example()
        _link()
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.gpu
def test_the_example_on_two_gpus_equals_one():
    """examples/diffusers_parallel.py under torchrun on two GPUs (NCCL, bf16): its first step against one GPU."""
    import re
    import subprocess
    import sys

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               str(EXAMPLES / "diffusers_parallel.py"), "--layers", "2", "--latent", "5x32x64", "--window", "3x7x7",
               "--steps", "2", "--train-steps", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=WORLD_DEADLINE_S,
                          env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    difference = float(re.search(r"relative difference ([0-9.e+-]+)", done.stdout).group(1))
    assert difference < 2e-2, done.stdout
