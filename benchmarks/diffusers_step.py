"""A denoising step of diffusers video and image transformers with natsim, against the model's own attention,
eager and compiled, one run, one JSON:

    python benchmarks/diffusers_step.py --out DIR [--cases wan-480p,wan-720p,hunyuan-720p,flux-2048,...] [--steps 5]
    python benchmarks/diffusers_step.py --out /tmp/x --small      # CPU smoke test: tiny models, seconds

Each model is built from its published configuration with random weights (nothing is downloaded; the large ones
with fewer layers, which leaves each layer's share of the step as it is), on the GPU in bf16, batch 1, with a
random latent, timestep and text states. Per case, side by side in one process:
- the step (one forward pass) with the model's own attention (diffusers' default: torch's SDPA), eager and
  under `compile_repeated_blocks(fullgraph=True)` (the whole model under `torch.compile(fullgraph=True)` for
  the classes that declare no repeated blocks: CogVideoX); where Dynamo cannot trace a step whole (a graph
  break, a data-dependent shape), it is compiled again with graph breaks allowed and the JSON says why
  (`own_graph_break`, `natsim_graph_break`);
- the same with `natsim.integrations.diffusers.apply(model, ...)`: eager and compiled;
- the attention alone at the case's layout: the model's own (SDPA over the q, k, v and mask of the first call
  natsim serves over a whole layout, captured from the step) against natsim's (the call of the router, or split
  view, that served it), its speedup `s`;
- the attention share of the step, `a = calls x the model's own attention / the model's own step` (calls: the
  attention calls natsim serves in a step), and Amdahl's ceiling for the step, `1 / ((1 - a) + a / s)`, and the
  fraction of it the step reaches;
- the relative difference of natsim's step output to the model's own, and the plan natsim made (its backend);
- where the model keeps the plan's tile order (integrations/diffusers/order.py: FlashAttention-4 plans), the
  compiled step again with `tile_order=False` (every attention call permuting its tokens), beside it.
Medians of `--steps` timed steps after warm-up (synchronised wall clock). Each case starts from a reset Dynamo
(it compiles as in a fresh process). Writes `diffusers-step-<device>-<date>.json`; the table comes last.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from natsim.integrations import diffusers as nd

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
HUNYUAN = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
               num_single_layers=40, num_refiner_layers=2, patch_size=2, patch_size_t=1, text_embed_dim=4096,
               pooled_projection_dim=768, rope_axes_dim=(16, 56, 56), guidance_embeds=True)
FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
                    text_embed_dim=4096, num_layers=42, patch_size=2, use_rotary_positional_embeddings=True,
                    sample_width=90, sample_height=60, sample_frames=49)
LTX = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32, attention_head_dim=64,
           cross_attention_dim=2048, num_layers=28, caption_channels=4096)
# name: class, configuration (layers cut where one H100 cannot hold a full step), token layout, text tokens,
# natsim's options.
CASES = {
    "wan-480p": ("WanTransformer3DModel", WAN_1_3B, (21, 30, 52), 512, dict(sparsity=0.9)),
    "wan-720p": ("WanTransformer3DModel", WAN_1_3B, (21, 45, 80), 512, dict(sparsity=0.9)),
    "hunyuan-720p": ("HunyuanVideoTransformer3DModel", {**HUNYUAN, "num_layers": 4, "num_single_layers": 8},
                     (30, 48, 80), 256, dict(window=(18, 24, 24))),
    "flux-2048": ("FluxTransformer2DModel", {**FLUX, "num_layers": 4, "num_single_layers": 8}, (128, 128), 512,
                  dict(sparsity=0.9)),
    "cogvideox-5b": ("CogVideoXTransformer3DModel", {**COGVIDEOX_5B, "num_layers": 10}, (13, 30, 45), 226,
                     dict(sparsity=0.9)),
    "ltx-video": ("LTXVideoTransformer3DModel", {**LTX, "num_layers": 10}, (33, 22, 38), 128, dict(sparsity=0.9)),
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
SMALL_TEXT = 6
SMALL = {
    "WanTransformer3DModel": dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=32, text_dim=32, freq_dim=32,
                                  ffn_dim=64, num_layers=2, rope_max_seq_len=32),
    "HunyuanVideoTransformer3DModel": dict(HUNYUAN, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                                           num_single_layers=1, num_refiner_layers=1, text_embed_dim=32,
                                           pooled_projection_dim=16, rope_axes_dim=(8, 12, 12)),
    "FluxTransformer2DModel": dict(FLUX, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=32,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                   axes_dims_rope=(8, 12, 12)),
    "CogVideoXTransformer3DModel": dict(COGVIDEOX_5B, num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                        out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=2,
                                        sample_width=16, sample_height=16, sample_frames=13),
    "LTXVideoTransformer3DModel": dict(LTX, in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32,
                                       cross_attention_dim=64, num_layers=2, caption_channels=32),
}


def small_case(name: str) -> tuple:
    """The case with a tiny model and layout (CPU smoke test in Triton's interpreter)."""
    cls_name, _, layout, _, options = CASES[name]
    small_layout = (8, 8) if len(layout) == 2 else (2, 4, 8)
    if "window" in options:
        options = dict(window=tuple(max(1, n // 2) for n in small_layout))
    return cls_name, SMALL[cls_name], small_layout, SMALL_TEXT, dict(options, dtype=torch.float16)


def build(cls_name: str, config: dict):
    """A model of class `cls_name` from `config` with random weights, on DEVICE in DTYPE, in eval mode."""
    import diffusers

    with torch.device(DEVICE):
        model = getattr(diffusers, cls_name)(**config)
    return model.to(DTYPE).eval()


@dataclass(frozen=True)
class Draw:
    """Random forward arguments for a model of `config` whose latent patches into the token `layout`, with
    `text` prompt tokens: batch 1, on DEVICE, in the model's dtype (bf16 on the GPU)."""

    config: dict
    layout: tuple
    text: int

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, device=DEVICE, dtype=DTYPE)

    def ones(self, *shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.ones(shape, device=DEVICE, dtype=dtype)

    def full(self, value: float) -> torch.Tensor:
        """A batch of one timestep (or guidance): int64 for an int `value`, float32 for a float."""
        return torch.full((1,), value, device=DEVICE)

    def sizes(self) -> tuple:
        """The latent's sizes before patching: the layout times the config's patch sizes (`patch_size`, a
        number or a (t, h, w) tuple, and `patch_size_t` for video)."""
        patch = self.config.get("patch_size", 1)
        if not isinstance(patch, (tuple, list)):
            patch = (patch, patch) if len(self.layout) == 2 else (self.config.get("patch_size_t") or 1, patch, patch)
        return tuple(n * p for n, p in zip(self.layout, patch))

    def latent(self, channels: int) -> torch.Tensor:
        """A `[1, channels, (F,) H, W]` latent."""
        return self.randn(1, channels, *self.sizes())

    def prompt(self, dim: int) -> torch.Tensor:
        """`[1, text, dim]` text encoder states."""
        return self.randn(1, self.text, dim)


def _wan(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["text_dim"]), return_dict=False)


def _hunyuan(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.latent(c["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(c["text_embed_dim"]), encoder_attention_mask=d.ones(1, d.text),
                pooled_projections=d.randn(1, c["pooled_projection_dim"]), guidance=d.full(6000.0), return_dict=False)


def _cogvideox(d: Draw) -> dict:
    frames, height, width = d.sizes()  # CogVideoX's latent is [B, F, C, H, W]
    return dict(hidden_states=d.randn(1, frames, d.config["in_channels"], height, width), timestep=d.full(500),
                encoder_hidden_states=d.prompt(d.config["text_embed_dim"]), return_dict=False)


def _ltx(d: Draw) -> dict:
    frames, height, width = d.sizes()  # LTX-Video's latent comes as tokens, its sizes as arguments
    return dict(hidden_states=d.randn(1, math.prod(d.layout), d.config["in_channels"]), timestep=d.full(500),
                encoder_hidden_states=d.prompt(d.config["caption_channels"]), encoder_attention_mask=d.ones(1, d.text),
                num_frames=frames, height=height, width=width, return_dict=False)


def _image_ids(layout: tuple) -> torch.Tensor:
    """FLUX's (index, row, column) position ids of an image's tokens, row-major, the index zero."""
    rows, cols = torch.meshgrid(*(torch.arange(n, device=DEVICE) for n in layout), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def _flux(d: Draw) -> dict:
    c = d.config
    return dict(hidden_states=d.randn(1, math.prod(d.layout), c["in_channels"]),
                encoder_hidden_states=d.prompt(c["joint_attention_dim"]),
                pooled_projections=d.randn(1, c["pooled_projection_dim"]), timestep=d.full(0.5),
                img_ids=_image_ids(d.layout), txt_ids=torch.zeros(d.text, 3, device=DEVICE),
                guidance=d.full(3.5), return_dict=False)


INPUTS = {
    "WanTransformer3DModel": _wan,
    "HunyuanVideoTransformer3DModel": _hunyuan,
    "CogVideoXTransformer3DModel": _cogvideox,
    "LTXVideoTransformer3DModel": _ltx,
    "FluxTransformer2DModel": _flux,
}


def inputs(cls_name: str, config: dict, layout: tuple, text: int) -> dict:
    """Random forward arguments for a model of class `cls_name` built from `config`, whose latent patches into
    `layout`, with `text` prompt tokens (batch 1, on DEVICE, bf16 on the GPU), as its pipeline passes them."""
    if cls_name not in INPUTS:
        raise ValueError(f"no inputs for {cls_name}")
    return INPUTS[cls_name](Draw(config, tuple(layout), text))


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of `fn()` over `repeats` synchronised calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def step_ms(model, args: dict, steps: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of a forward pass (after two warm-up passes) and its output."""
    with torch.no_grad():
        return median_ms(lambda: model(**args), steps), model(**args)[0]


@dataclass
class Captured:
    """The first attention call of a forward pass that natsim served over its router's whole layout (q, k, v and
    the mask as the model's processor hands them over), the router or split view that served it, and how many
    calls natsim served in the pass (the model's calls that natsim leaves to the model not counted)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    router: object
    calls: int


def captured_qkv(model, args: dict, applied) -> Captured:
    """What natsim replaces in a forward pass: its first call over a whole layout (Latte's: over a frame's
    (height, width), its temporal split being the model's), and the number of calls it serves."""
    routers = [applied.router, *applied.router.views]
    seen, calls = [], []

    def capturing(router):
        attend = router.attend

        def attend_and_capture(q, k, v, mask, scale):
            out = attend(q, k, v, mask, scale)
            if out is not None:
                calls.append(q.shape)
                if not seen and q.shape[1] >= math.prod(router.layout):
                    seen.append((q.clone(), k.clone(), v.clone(), mask, router))
            return out
        return attend_and_capture

    for router in routers:
        router.attend = capturing(router)
    try:
        with torch.no_grad():
            model(**args)
    finally:
        for router in routers:
            del router.attend  # the class's method again
    if not seen:
        raise ValueError(f"natsim served no attention call of {type(model).__name__} over its layout.")
    return Captured(*seen[0], calls=len(calls))


def compile_step(model, fullgraph: bool = True):
    """The model compiled as the step is measured: `compile_repeated_blocks` where the class declares repeated
    blocks, else the whole model under `torch.compile` (aot_eager on the CPU)."""
    backend = {} if DEVICE == "cuda" else {"backend": "aot_eager"}
    if model._repeated_blocks:
        model.compile_repeated_blocks(fullgraph=fullgraph, **backend)
        return model
    return torch.compile(model, fullgraph=fullgraph, **backend)


def compiled_step_ms(model, args: dict, steps: int) -> tuple[float, torch.Tensor, Optional[str]]:
    """`step_ms` of the compiled model under `fullgraph=True`, or, where Dynamo cannot trace the step whole (a
    graph break, a data-dependent shape), compiled again with graph breaks allowed; then with the reason."""
    try:
        return (*step_ms(compile_step(model), args, steps), None)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as error:
        torch._dynamo.reset()
        return (*step_ms(compile_step(model, fullgraph=False), args, steps), break_reason(error))


def break_reason(error: Exception) -> str:
    """Dynamo's error in a line: its first, and the user code line it stopped at."""
    lines = str(error).splitlines()
    where = [line.strip() for line in lines if line.strip().startswith('File "')]
    return lines[0] + (f" ({where[-1]})" if where else "")


def run_case(name: str, steps: int, small: bool = False) -> dict:
    cls_name, config, layout, text, options = small_case(name) if small else CASES[name]
    torch.manual_seed(0)
    model = build(cls_name, config)
    args = inputs(cls_name, config, layout, text)
    record = dict(case=name, model=cls_name, layout=list(layout), text_tokens=text,
                  options={k: str(v) if isinstance(v, torch.dtype) else v for k, v in options.items()},
                  layers={k: v for k, v in config.items() if "layers" in k})
    own_ms, own_out = step_ms(model, args, steps)

    applied = nd.apply(model, **options)
    with torch.no_grad():  # the first step of a layout: planning and the kernels' first compile
        start = time.perf_counter()
        model(**args)
        synchronize()
        record["first_step_ms"] = (time.perf_counter() - start) * 1e3
    natsim_ms, natsim_out = step_ms(model, args, steps)
    plan = next(iter(applied.plans.values()))
    record["plan"] = dict(window=list(plan.problem.window), stride=list(plan.problem.stride),
                          q_tile=list(plan.tiles.q_tile), kv_tile=list(plan.tiles.kv_tile),
                          kv_tiling=plan.tiles.kv_tiling, sparsity=plan.sparsity, tile_speedup=plan.tile_speedup,
                          backend=plan.backend)
    orders = [] if applied.order is None else [o for o in applied.order.decided.values() if o is not None]
    record["tile_order"] = list(orders[0].tile) if orders else None
    record["output_relative_difference"] = float((natsim_out.float() - own_out.float()).norm()
                                                 / own_out.float().norm())

    # The attention alone: the model's own over the routed q, k, v, against natsim's; its share of the steps.
    captured = captured_qkv(model, args, applied)
    q, k, v, mask = captured.q, captured.k, captured.v, captured.mask
    with torch.no_grad():
        own_attention = median_ms(lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask), 5)
        natsim_attention = median_ms(lambda: captured.router.attend(q, k, v, mask, None), 5)
    speedup = own_attention / natsim_attention
    calls = record["attention_calls"] = captured.calls
    del captured, q, k, v, mask

    nd.remove(model)
    record["compiled"] = "repeated blocks" if model._repeated_blocks else "whole model"
    own_compiled_ms, _, record["own_graph_break"] = compiled_step_ms(model, args, steps)
    nd.apply(model, **options)
    natsim_compiled_ms, compiled_out, record["natsim_graph_break"] = compiled_step_ms(model, args, steps)
    if record["tile_order"] is not None:  # the same plan with every call permuting its tokens (no model order)
        nd.remove(model)
        nd.apply(model, **options, tile_order=False)
        record["natsim_compiled_row_major_step_ms"], _, _ = compiled_step_ms(model, args, steps)
    share = min(1.0, calls * own_attention / own_ms)
    share_compiled = min(1.0, calls * own_attention / own_compiled_ms)

    def ceiling(a: float) -> float:
        return 1 / ((1 - a) + a / speedup)

    record.update(
        own_step_ms=own_ms, natsim_step_ms=natsim_ms, step_speedup=own_ms / natsim_ms,
        own_compiled_step_ms=own_compiled_ms, natsim_compiled_step_ms=natsim_compiled_ms,
        compiled_step_speedup=own_compiled_ms / natsim_compiled_ms,
        attention_share=share, attention_share_compiled=share_compiled,
        own_attention_ms=own_attention, natsim_attention_ms=natsim_attention, attention_speedup=speedup,
        ceiling=ceiling(share), ceiling_compiled=ceiling(share_compiled),
        compiled_output_relative_difference=float((compiled_out.float() - own_out.float()).norm()
                                                  / own_out.float().norm()),
    )
    record["fraction_of_ceiling"] = record["step_speedup"] / record["ceiling"]
    record["fraction_of_ceiling_compiled"] = record["compiled_step_speedup"] / record["ceiling_compiled"]
    return record


def fresh() -> None:
    """Forget the previous case: Dynamo's compiled code (each case compiles as in a fresh process, static
    shapes) and the GPU memory it held."""
    torch._dynamo.reset()
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def run_header(kind: str, out: Path) -> tuple[dict, Path]:
    """A diffusers benchmark's result record (device, versions, date, no records yet) and where it is written:
    `out/diffusers-<kind>-<device>-<date>.json`."""
    import diffusers
    import triton

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, diffusers=diffusers.__version__,
                  date=datetime.date.today().isoformat(), records=[])
    return result, out / f"diffusers-{kind}-{device.replace(' ', '_')}-{result['date']}.json"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median)")
    parser.add_argument("--small", action="store_true", help="tiny models on the CPU (a smoke test of the script)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result, path = run_header("step", args.out)
    for name in args.cases.split(","):
        fresh()
        record = run_case(name, args.steps, args.small)
        print(json.dumps(record), flush=True)
        result["records"].append(record)
        path.write_text(json.dumps(result, indent=1))
    print(f"\n{'case':14s} {'share e/c':>10s} {'attn x':>7s} {'eager x':>8s} {'ceil':>6s} {'compiled x':>10s} {'ceil':>6s}"
          f" {'of ceil':>8s} {'diff':>8s} {'backend':>8s} {'order ms / row-major ms':>24s}")
    for r in result["records"]:
        ordered = (f"{r['natsim_compiled_step_ms']:.1f} / {r['natsim_compiled_row_major_step_ms']:.1f}"
                   if r["tile_order"] is not None else "-")
        print(f"{r['case']:14s} {r['attention_share']:.2f}/{r['attention_share_compiled']:.2f} "
              f"{r['attention_speedup']:7.2f} {r['step_speedup']:8.2f} {r['ceiling']:6.2f} "
              f"{r['compiled_step_speedup']:10.2f} {r['ceiling_compiled']:6.2f} "
              f"{r['fraction_of_ceiling_compiled']:8.2f} {r['output_relative_difference']:8.1e} "
              f"{r['plan']['backend']:>8s} {ordered:>24s}")


if __name__ == "__main__":
    main()
