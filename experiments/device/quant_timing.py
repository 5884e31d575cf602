"""Quantized inference on a lent GPU: one denoiser call (random weights, CFG batch 2) at 1024²
in bf16 against the same call quantized (patchpar/quant.py: w8, int8, fp8), timed, with its
memory (XLA's buffer assignment and the device's peak) and its difference from bf16.

    device run: python experiments/device/quant_timing.py              (PixArt-α, ~2 minutes)
                python experiments/device/quant_timing.py --models sd3.5-medium flux-dev
    here, in miniature: python experiments/device/quant_timing.py --model tiny-dit \
        --resolution 64 --dtype float32 --repeats 2 --out /tmp/quant_timing

The device machine needs qwix (pure Python; its wheel carried in .whl/ with the others that
experiments/device/speedup_cores.sh lists). On a GPU without fp8 (or int8) matrix units the
mode runs emulated and its record says so (`emulated`). Records: <out>/records.jsonl (one per
mode, a failed one with its error); <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import compile_and_time, needs, random_inputs  # noqa: E402
from family_timing import CFG_BATCH, kernel_spec, model_spec  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--models", dest="models", nargs="+", default=["pixart-alpha"])
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--modes", nargs="+", default=["none", "w8", "int8", "fp8"])
    p.add_argument(
        "--attention", default="auto",
        help="the kernel, impl[:QxKV] (auto: the backend's default; records name it)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hardware", default=None, help="unused here (the suite passes it)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no mode after this")
    p.add_argument("--out", type=Path, default=Path("results/quant_device"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    needs("jax", "flax", "numpy", "yaml", "qwix")
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np

    from patchpar.lab.results import append_record, provenance
    from patchpar.models.attention import resolve
    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import abstract_denoiser, model_family
    from patchpar.quant import emulated, quantize, weight_dtypes

    dtype = getattr(jnp, a.dtype)
    kernel = resolve(kernel_spec(a.attention), dtype)
    dev = jax.devices()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    start = time.perf_counter()
    for model in a.models:
        name, overrides = model_spec(model)
        try:
            fn = abstract_denoiser(name, dtype, overrides=overrides).with_attention(kernel)
            batch = CFG_BATCH.get(model_family(name).name, 2)
            params = random_params_on_device(fn.abstract_params(), 0)
            x, t, ctx, added = random_inputs(fn, name, a.resolution, dtype, batch)
        except Exception as e:  # noqa: BLE001 - the model's record says why, the next one runs
            rec = {"model": model, "resolution": a.resolution, "status": "error",
                   "error": f"{type(e).__name__}: {str(e)[:500]}"}  # fmt: skip
            append_record(a.out / "records.jsonl", {**rec, **provenance()})
            print(json.dumps(rec), flush=True)
            continue
        ref = qp = None
        for mode in a.modes:
            rec = {"model": model, "resolution": a.resolution, "dtype": a.dtype, "batch": batch,
                   "mode": mode, "attention": kernel.impl,
                   "block_q": kernel.block_q, "block_kv": kernel.block_kv, "device_kind": dev.device_kind,
                   "emulated": emulated(mode)}  # fmt: skip
            try:
                if time.perf_counter() - start > a.budget_s:
                    raise TimeoutError(f"budget {a.budget_s:.0f} s spent before this mode")
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # `emulated` says it in the record
                    qf, qp = quantize(fn, params, mode)
                rec["quantize_s"] = time.perf_counter() - t0
                rec["weight_bytes_by_dtype"] = weight_dtypes(qp)
                out = compile_and_time(jax.jit(qf), (qp, x, t, ctx), added, a.repeats, rec)
                rec["peak_bytes_in_use"] = (dev.memory_stats() or {}).get("peak_bytes_in_use")
                o = np.asarray(out, np.float32)
                ref = o if ref is None else ref
                rec["rel_diff_vs_first"] = float(
                    np.abs(o - ref).max() / max(np.abs(ref).max(), 1e-30)
                )
                rec["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - every mode gets a record, also a failed one
                rec["status"] = "error"
                rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            append_record(a.out / "records.jsonl", {**rec, **provenance()})
            rows.append(rec)
            print(json.dumps({k: v for k, v in rec.items() if k != "step_s_all"}), flush=True)
        del params, qp
    gib = 2**30
    lines = [
        f"One denoiser call, {a.resolution}px, {a.dtype}, {dev.device_kind}; each model's "
        "modes against its first (experiments/device/quant_timing.py)",
        "",
        "| model | batch | attention | quant | ms per call | vs first | weights GiB | "
        "compiled GiB | rel. diff | emulated | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r.get("step_s_median")
        first = next(
            (q["step_s_median"] for q in rows if q["model"] == r["model"] and "step_s_median" in q),
            None,
        )
        w = sum((r.get("weight_bytes_by_dtype") or {}).values()) / gib
        mem = (r.get("memory_compiled") or {}).get("total")
        kern = f"{r['attention']} {r['block_q']}x{r['block_kv']}"
        head = f"| {r['model']} | {r['batch']} | {kern} | {r['mode']} |"
        lines.append(
            f"{head} {ms * 1e3:.1f} | {first / ms:.2f}x | {w:.2f} | "
            f"{(mem or 0) / gib:.2f} | {r.get('rel_diff_vs_first', float('nan')):.3g} | "
            f"{'yes' if r['emulated'] else 'no'} | {r['status']} |"
            if ms
            else f"{head} - | - | - | - | - | - | {r['status']} |"
        )
    (a.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
