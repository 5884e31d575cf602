"""Memory per device of a quantized full-size denoiser (SDXL, PixArt-α, FLUX.1-dev) at 1024²,
one image (its guidance halves), on 1/2/4/8 devices, and which configurations fit a 24 GB and an
80 GB device.

    .venv/bin/python experiments/quant_memory.py            # -> results/quant_memory/

What is measured and what is derived:
- the weights per device are exact: the quantized parameter tree of each mode (`quantize_abstract`:
  Qwix's layout, int8/fp8 values, int4 at half a byte, bfloat16 per-channel scales, what stays in
  bfloat16: convolutions, norms, biases, embeddings) under the strategy's placement rules
  (whole on every device for the patch strategies; `/ n` of the sharded dimensions with FSDP);
- everything else a device holds (latent, conditioning, stale buffers, activations and the
  compiler's temporaries) is the compiled bf16 program's of the unquantized model at the same
  point (experiments/memory_table.py's records: results/memory, results/memory_pixart,
  results/memory_flux), less its bfloat16 weights. Quantized activations (int8/fp8 modes) are
  smaller than that in a real program: the figures are upper bounds for them.
A quantized program compiled on this CPU would not say more: XLA:CPU has no int8/fp8 matrix units
and keeps a dequantized copy of each weight as a temporary, which no GPU program does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # model -> the folder of its compiled unquantized records
    "sdxl": ROOT / "results/memory",
    "pixart-alpha": ROOT / "results/memory_pixart",
    "flux-dev": ROOT / "results/memory_flux",
}
MODES = ("none", "w8", "w4", "int8", "fp8")
STRATEGIES = ("single", "sync_patch", "distrifusion")
GIB, GB = 2**30, 1e9
FITS = (24, 80)  # device memory in GB (decimal, as vendors quote it)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "results/quant_memory")
    p.add_argument("--resolution", type=int, default=1024)
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import jax.numpy as jnp

    from patchpar.lab.results import provenance, read_records
    from patchpar.models.presets import abstract_denoiser
    from patchpar.parallel.mesh import PATCH
    from patchpar.parallel.rules import RULES, weight_bytes_per_device
    from patchpar.quant import quantize_abstract, weight_dtypes

    rows = []
    for model, folder in MODELS.items():
        fn = abstract_denoiser(model, jnp.bfloat16)
        params = fn.abstract_params()
        bf16 = weight_bytes_per_device(params, {}, {}, fn.logical)
        compiled = {}
        path = folder / "records.jsonl"
        for r in read_records(path) if path.is_file() else []:
            if (r["resolution"], r["attention"], r.get("fsdp", False)) == (
                a.resolution, "chunked", False
            ):  # fmt: skip
                compiled[(r["strategy"], r["devices"])] = r
        for mode in MODES:
            qf, qp = quantize_abstract(fn, params, mode)
            whole = weight_bytes_per_device(qp, {}, {}, qf.logical)
            for strategy in STRATEGIES:
                for n in (1,) if strategy == "single" else (2, 4, 8):
                    r = compiled.get((strategy, n))
                    rest = None if r is None else r["bf16_estimate_bytes"] - bf16
                    fsdp = None
                    if n > 1:
                        fsdp = weight_bytes_per_device(qp, RULES["fsdp"], {PATCH: n}, qf.logical)
                    rows.append({
                        "model": model, "mode": mode, "strategy": strategy, "devices": n,
                        "resolution": a.resolution, "weight_bytes": whole,
                        "weight_bytes_fsdp": fsdp, "weight_bytes_by_dtype": weight_dtypes(qp),
                        "rest_bytes": rest,
                        "total_bytes": None if rest is None else rest + whole,
                        "compiled_record": None if r is None else r.get("run_id"),
                        "compiled_commit": None if r is None else r.get("git_commit"),
                    })  # fmt: skip
            print(f"{model} {mode}: weights {whole / GIB:.2f} GiB", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python experiments/quant_memory.py", **provenance()}
    with open(a.out / "records.jsonl", "w") as f:  # derived: rewritten whole from the records
        for row in rows:
            f.write(json.dumps({**row, **meta}, sort_keys=True) + "\n")
    (a.out / "table.md").write_text(table(rows, a.resolution))
    print(f"-> {a.out / 'table.md'}")


def _fit(total: float | None) -> str:
    if total is None:
        return "-"
    marks = [f"{g}" for g in FITS if total <= g * GB]
    return f"{total / GIB:.1f}" + (f" ({'/'.join(marks)})" if marks else " (none)")


def table(rows: list[dict], resolution: int) -> str:
    lines = [
        f"Memory per device at {resolution}² (one image, its guidance halves), GiB: the "
        "quantized weights (exact, from the parameter tree) + the rest of the compiled bf16 "
        "program of the unquantized model (experiments/quant_memory.py). In brackets: the "
        "devices it fits, 24 GB and/or 80 GB. `-`: no compiled record of that point.",
        "",
        "| model | quant | weights | single | sync_patch 2 | sync_patch 4 | sync_patch 8 | "
        "distrifusion 2 | distrifusion 4 | distrifusion 8 | weights with fsdp 2 / 4 / 8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    at = {(r["model"], r["mode"], r["strategy"], r["devices"]): r for r in rows}
    for model in MODELS:
        for mode in MODES:
            one = at[(model, mode, "single", 1)]
            cells = [_fit(one["total_bytes"])]
            for s in STRATEGIES[1:]:
                cells += [_fit(at[(model, mode, s, n)]["total_bytes"]) for n in (2, 4, 8)]
            fsdp = " / ".join(
                f"{at[(model, mode, 'sync_patch', n)]['weight_bytes_fsdp'] / GIB:.2f}"
                for n in (2, 4, 8)
            )
            lines.append(
                f"| {model} | {mode} | {one['weight_bytes'] / GIB:.2f} | "
                + " | ".join(cells)
                + f" | {fsdp} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
