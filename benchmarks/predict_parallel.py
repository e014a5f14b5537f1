"""natsim.partition's model of a step under Ulysses against the steps benchmarks/diffusers_parallel.py measured:

    python benchmarks/predict_parallel.py --out DIR [--results benchmarks/results] [--gpu NVIDIA_H200] [--date D]

From the one-GPU launch's compiled step (each attention: natsim's and the model's own), its one attention call
(`attention_ms`) and the interconnect measured on the same machine (natsim.distributed.calibrate_link: the
user's file, else natsim's shipped natsim/links/link-<gpu>-x<P>.json; `--links DIR` reads a folder instead), `ulysses_step_seconds` predicts the step on P GPUs: one
GPU's step over P plus, per attention layer, the two all-to-alls, overlapped with a rank's share of the attention
where natsim attends its heads in groups ("natsim"; "natsim-serial", from the same one-GPU step, and diffusers'
own "dense" in one piece).
Prints predicted against measured at every P with a measurement and a link, and predicted beyond (8 GPUs with the
largest measured link, said so); writes `predict-parallel-<gpu>-<date>.json`. Runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from natsim.partition import head_groups, heads_per_rank, ulysses_step_seconds
from natsim.stored import link_for

HEADS = 12
WAN_1_3B = dict(layers=30, channels=HEADS * 128, element_bytes=2)  # benchmarks/diffusers_parallel.py's model, bf16


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--gpu", default="NVIDIA_H200", help="the device part of the results' file names")
    parser.add_argument("--date", default="2026-11-27")
    parser.add_argument("--tag", default="", help="the suffix of the results' file names (after the date)")
    parser.add_argument("--links", type=Path, default=None,
                        help="folder of the link files (default: the user's calibrations, then natsim's shipped ones)")
    parser.add_argument("--beyond", type=int, nargs="*", default=[6, 8],
                        help="GPU counts to predict without a measurement (where they do not divide the 12 heads, "
                             "natsim's Ulysses pads them with zero heads)")
    args = parser.parse_args(argv)
    measured, attention = {}, 0.0
    for path in sorted(args.results.glob(f"diffusers-parallel-{args.gpu}-P*-{args.date}{args.tag}.json")):
        record = json.loads(path.read_text())
        measured[record["ranks"]] = {r["mode"]: r["compiled_step_ms"] / 1e3 for r in record["records"]
                                     if "compiled_step_ms" in r}
        attention = next((r["attention_ms"] / 1e3 for r in record["records"] if record["ranks"] == 1
                          and "attention_ms" in r), attention)
        latent = record["latent"]
    if 1 not in measured:
        raise SystemExit(f"no one-GPU launch among {args.results}/diffusers-parallel-{args.gpu}-P*-{args.date}{args.tag}.json")
    tokens = latent[0] * (latent[1] // 2) * (latent[2] // 2)  # Wan's 1x2x2 patches
    gpu = args.gpu.replace("_", " ")
    linked = {p: link_for(gpu, p, args.links) for p in (*sorted(measured), *args.beyond)}
    largest = max((p for p in linked if linked[p].source != "default"), default=None)
    if largest is None:
        raise SystemExit(f"no measured interconnect for {gpu} at {sorted(linked)} GPUs: run natsim calibrate-link "
                         "on that machine, or pass --links DIR")
    rows = []
    for ranks in (*sorted(measured), *args.beyond):
        link = linked[ranks] if ranks == 1 or linked[ranks].source != "default" else linked[largest]
        modes = dict.fromkeys((*measured[1], *measured.get(ranks, {})))
        for mode in modes:
            one_gpu = measured[1].get(mode, measured[1].get("natsim") if mode == "natsim-serial" else None)
            if one_gpu is None:
                continue
            grouped = mode == "natsim" and attention > 0
            groups = head_groups(heads_per_rank(HEADS, ranks)) if grouped else (heads_per_rank(HEADS, ranks),)
            predicted = ulysses_step_seconds(one_gpu, tokens=tokens, world_size=ranks, link=link,
                                             attention_seconds=attention if grouped else 0.0, groups=groups,
                                             heads=HEADS, **WAN_1_3B)
            seen = measured.get(ranks, {}).get(mode)
            rows.append(dict(ranks=ranks, mode=mode, predicted_ms=predicted * 1e3, groups=list(groups),
                             link=link.source if ranks > 1 else "none (one GPU)",
                             measured_ms=None if seen is None else seen * 1e3,
                             error=None if seen is None else predicted / seen - 1))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"predict-parallel-{args.gpu}-{args.date}{args.tag}.json"
    path.write_text(json.dumps(dict(gpu=gpu, latent=latent, tokens=tokens, model=WAN_1_3B, attention_ms=attention * 1e3,
                                    rows=rows), indent=1))
    print("| GPUs | attention | predicted ms | measured ms | error | link |\n|---|---|---|---|---|---|")
    for r in rows:
        seen = "-" if r["measured_ms"] is None else f"{r['measured_ms']:.1f}"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        predicted = "-" if r["predicted_ms"] is None else f"{r['predicted_ms']:.1f}"
        print(f"| {r['ranks']} | {r['mode']} | {predicted} | {seen} | {error} | {r['link']} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
