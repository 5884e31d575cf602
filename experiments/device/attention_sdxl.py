"""Issue 14 on a lent GPU: one SDXL UNet call (random weights, bf16, CFG batch 2) at 1024x1024
with each attention kernel, timed, with its memory: XLA's buffer assignment for the compiled
program and the device's own peak (`memory_stats`, where the backend has it).

    device run: python experiments/device/attention_sdxl.py            (under 5 minutes)
    here, in miniature: python experiments/device/attention_sdxl.py --model tiny \
        --resolution 128 --attention xla chunked --repeats 2 --out /tmp/attn

Every kernel the backend has (`auto` resolved, then xla, chunked, cudnn on a GPU, splash on a
TPU) runs in this one process, in that order; a kernel that fails (out of memory, say) gets a
record with its error and the next one runs. Records: <out>/records.jsonl; <out>/table.md.
Needs only jax, flax and numpy (the device machine has no tyro/diffusers): weights are random
(patchpar's own initialiser), shapes from the preset.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import compile_and_time, random_inputs  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="sdxl")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--attention", nargs="+", default=None, help="default: all the backend has")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=Path("results/attention_device"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import patchpar  # noqa: F401
    from patchpar.lab.results import append_record, provenance
    from patchpar.models.attention import AttentionSpec, available, resolve
    from patchpar.models.presets import abstract_denoiser

    dtype = getattr(jnp, a.dtype)
    impls = a.attention or available()
    unet = abstract_denoiser(a.model, dtype)
    t0 = time.perf_counter()
    params = unet.init(0)  # NumPy draws, then one transfer
    init_s = time.perf_counter() - t0
    x, t, ctx, added = random_inputs(unet, a.model, a.resolution, dtype)
    dev = jax.devices()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    rows, ref = [], None
    seen = set()
    for impl in impls:
        concrete = resolve(AttentionSpec(impl), dtype).impl if impl != "cudnn" else impl
        if concrete in seen:  # auto is one of the others
            continue
        seen.add(concrete)
        rec = {
            "model": a.model,
            "resolution": a.resolution,
            "dtype": a.dtype,
            "batch": 2,
            "attention_requested": impl,
            "device_kind": dev.device_kind,
            "init_s": init_s,
        }
        try:
            spec = resolve(AttentionSpec(impl), dtype)
            rec["attention"] = spec.impl
            f = jax.jit(unet.with_attention(spec))
            out = compile_and_time(f, (params, x, t, ctx), added, a.repeats, rec)
            stats = dev.memory_stats() or {}
            rec["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
            o = np.asarray(out, np.float32)
            if ref is None:
                ref = o
            rec["max_abs_diff_vs_first"] = float(np.abs(o - ref).max())
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - every kernel gets a record, also a failed one
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        append_record(a.out / "records.jsonl", {**rec, **provenance()})
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "step_s_all"}), flush=True)
    gib = 2**30
    lines = [
        f"{a.model} UNet call, {a.resolution}px, {a.dtype}, CFG batch 2, {dev.device_kind}",
        "",
        "| attention | ms per call | compiled GiB | peak GiB | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ms = f"{r['step_s_median'] * 1e3:.1f}" if "step_s_median" in r else "-"
        mem = (r.get("memory_compiled") or {}).get("total")
        peak = r.get("peak_bytes_in_use")
        lines.append(
            f"| {r.get('attention', r['attention_requested'])} | {ms} | "
            f"{mem / gib if mem else float('nan'):.2f} | "
            f"{peak / gib if peak else float('nan'):.2f} | {r['status']} |"
        )
    (a.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
