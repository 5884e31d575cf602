"""Projected latency of quantized models with patch parallelism at full size (issue: int8 and
fp8 with Qwix): `patchpar project --quant` at 1024² on each model's usual sampler length, one
device and 4 devices (DistriFusion; FLUX.1 with one synchronous step, xDiT's; and Ulysses for
the DiTs), unquantized bf16, int8 and fp8, on H100 and H200 (int8 and fp8 units, 1979 dense
TFLOPS) and A100 (int8 624 TOPS; fp8 emulated at its bf16 peak). A model, not a measurement:
the quantized program's int8/fp8 products are counted apart (`measure.flops.quantized_flops`)
and priced at the chip's int8/fp8 peak with the bf16 profile's fitted efficiency; the rest
(attention, convolutions, quantizing the activations) at its bf16 peak; collectives as ever.
Weight-only modes change no FLOP (their gain, reading fewer weight bytes, is not modelled).

    .venv/bin/python experiments/quant_projection.py                       # -> runs/quant_projection/
    .venv/bin/python experiments/quant_projection.py --out results/quant_projection
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# model -> (steps, distrifusion's options, strategies beside it)
POINTS = {
    "sdxl": (50, {}, ["distrifusion"]),
    "pixart-alpha": (20, {}, ["distrifusion", "ulysses"]),
    "flux-dev": (28, {"warmup_steps": 1}, ["distrifusion", "ulysses"]),
}
MODES = ("none", "int8", "fp8")
HARDWARE = ("h100-sxm", "h200-sxm", "a100-sxm")


def main() -> None:
    from patchpar.lab.project import ProjectConfig, run_project

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/quant_projection"))
    ap.add_argument("--models", nargs="+", default=list(POINTS), choices=list(POINTS))
    ap.add_argument("--devices", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in args.models:
        steps, options, strategies = POINTS[model]
        for strategy in ["single", *strategies]:
            for mode in MODES:
                print(f"{model}: {strategy} {mode}", flush=True)
                extra = options if strategy == "distrifusion" else {}
                config = ProjectConfig.from_flags(
                    model=model, resolution=1024, steps=steps, strategy=strategy,
                    devices=1 if strategy == "single" else args.devices, quant=mode,
                    hardware="all", workloads=args.out / "workloads.jsonl", **extra,
                )  # fmt: skip
                for r in run_project(config, log=lambda m: print("  " + m, flush=True)):
                    if r["hardware"] in HARDWARE:
                        rows.append(r)
    lines = [
        "1024², decode on one device, speedup against the unquantized bf16 single device on "
        "the same chip (projected; `experiments/quant_projection.py`). `emulated`: the chip has "
        "no units of the mode (priced at its bf16 peak).",
        "",
        "| model | steps | strategy | devices | quant | "
        + " | ".join(f"{h} s (speedup)" for h in HARDWARE)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(HARDWARE),
    ]
    by = {(r["model"], r["strategy"], r["quant"], r["hardware"]): r for r in rows}
    for (model, strategy, mode, hw), r in by.items():
        if hw != HARDWARE[0]:
            continue
        cells = []
        for h in HARDWARE:
            x = by[(model, strategy, mode, h)]
            cells.append(
                f"{x['latency_s']:.2f} ({x['speedup']:.2f}x{', emulated' if x['quant_emulated'] else ''})"
            )
        lines.append(
            f"| {model} | {r['steps']} | {strategy.split('(')[0]} | {r['devices']} | {mode} | "
            + " | ".join(cells)
            + " |"
        )
    (args.out / "projection.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print(f"-> {args.out / 'table.md'}")


if __name__ == "__main__":
    main()
