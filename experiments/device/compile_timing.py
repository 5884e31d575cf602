"""Compile seconds of a stale strategy's phase programs against sync_patch's one program, on
the device, with the blocks unrolled and scanned (`model.scan_blocks`), and the stale phases
compiled one after the other or both at once in two threads.

    device run: bash experiments/device/tpu_suite.sh compile       (PixArt-α at 1024²)
    here, in miniature: python experiments/device/compile_timing.py --models tiny-dit \
        --resolution 64 --dtype float32 --out /tmp/compile_timing

Each program is one device's program of an N-way step (`--patches`, default 2), collectives
stood in by local copies of the same shapes (`Plan(comm=False)` on a one-device mesh, as
`shard_timing.py` runs them), lowered with abstract weights (nothing drawn: compile only):
sync_patch's step (its one phase), DistriFusion's warm-up step (the exact exchange that also
writes the stale buffers) and its steady step (the stale reads and the packed sends). A stale
run compiles both of its phases before it starts: `sequential` is their sum, `threads` the
wall time of compiling them in two threads at once (XLA's compile releases the GIL). The
persistent compile cache is off, and every program is traced anew (no in-process cache hit).
Records: <out>/records.jsonl (one per model and scan setting), <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import needs  # noqa: E402
from family_timing import kernel_spec, model_spec  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["pixart-alpha"])
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--patches", type=int, default=2)
    p.add_argument("--scan", nargs="+", choices=["off", "on"], default=["off", "on"])
    p.add_argument("--attention", default="auto", help="impl[:QxKV] (auto: the backend's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hardware", default=None, help="unused here (the suite passes it)")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no model after this")
    p.add_argument("--out", type=Path, default=Path("results/compile_device"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    needs("jax", "flax", "numpy", "yaml")
    import jax
    import jax.numpy as jnp

    from patchpar.lab.config import build_plan
    from patchpar.lab.results import append_record, provenance
    from patchpar.models.attention import resolve
    from patchpar.models.presets import abstract_denoiser, latent_factor
    from patchpar.parallel.engine import abstract_inputs, make_step
    from patchpar.parallel.mesh import make_mesh

    start = time.perf_counter()
    dtype = getattr(jnp, a.dtype)
    kernel = resolve(kernel_spec(a.attention), dtype)
    mesh = make_mesh(1, 1)
    dev = jax.devices()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    n = a.patches
    for model in a.models:
        name, overrides = model_spec(model)
        base = abstract_denoiser(name, dtype, overrides=overrides).with_attention(kernel)
        for scanned in sorted({v == "on" for v in a.scan}):
            rec = {"model": model, "resolution": a.resolution, "patches": n, "dtype": a.dtype,
                   "attention": kernel.impl, "block_q": kernel.block_q,
                   "block_kv": kernel.block_kv, "scan_blocks": scanned,
                   "device_kind": dev.device_kind}  # fmt: skip
            try:
                if time.perf_counter() - start > a.budget_s:
                    raise TimeoutError(f"budget {a.budget_s:.0f} s spent before this point")
                unet = base.with_scan(scanned)
                params = jax.eval_shape(unet.prepare, unet.abstract_params())
                latent = a.resolution // latent_factor(name)
                x, t, cond = abstract_inputs(unet, (latent // n, latent), 1)

                def lowered(strategy, phase, unet=unet, params=params, x=x, t=t, cond=cond):
                    """(the lowered step program, seconds to trace and lower it)."""
                    plan = build_plan(strategy, {}, n, 1, comm=False)
                    axis = plan.strategy.patch_axis(0)
                    state = None
                    if phase == "steady":
                        warm = make_step(unet, plan, "warmup", axis, 5.0, mesh)
                        _, state = jax.eval_shape(warm, params, x, t, cond, None)
                    step = make_step(unet, plan, phase, axis, 5.0, mesh)
                    t0 = time.perf_counter()
                    low = jax.jit(step).lower(params, x, t, cond, state)
                    return low, time.perf_counter() - t0

                def compiled_s(low) -> float:
                    t0 = time.perf_counter()
                    low.compile()
                    return time.perf_counter() - t0

                low, rec["sync_lower_s"] = lowered("sync_patch", "warmup")
                rec["sync_compile_s"] = compiled_s(low)
                lows = [lowered("distrifusion", ph) for ph in ("warmup", "steady")]
                rec["stale_lower_s"] = sum(s for _, s in lows)
                rec["stale_compile_s"] = [compiled_s(lo) for lo, _ in lows]
                lows = [lowered("distrifusion", ph)[0] for ph in ("warmup", "steady")]
                t0 = time.perf_counter()
                with ThreadPoolExecutor(2) as pool:
                    list(pool.map(compiled_s, lows))
                rec["stale_threads_s"] = time.perf_counter() - t0
                seq = sum(rec["stale_compile_s"])
                rec["ratio_sequential"] = seq / rec["sync_compile_s"]
                rec["ratio_threads"] = rec["stale_threads_s"] / rec["sync_compile_s"]
                rec["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - every point gets a record
                rec["status"] = "error"
                rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            append_record(a.out / "records.jsonl", {**rec, **provenance()})
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    lines = [
        f"Compile seconds of one device's step programs ({n}-way, stand-in collectives, "
        f"abstract weights), {a.dtype}, {dev.device_kind}, attention {kernel.impl}",
        "",
        "| model | blocks | sync_patch | distrifusion warm-up + steady | in two threads | "
        "x sync (sequential) | x sync (threads) | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        blocks = "scanned" if r["scan_blocks"] else "unrolled"
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {blocks} | - | - | - | - | - | {r['status']} |")
            continue
        w, s = r["stale_compile_s"]
        lines.append(
            f"| {r['model']} | {blocks} | {r['sync_compile_s']:.1f} | {w:.1f} + {s:.1f} | "
            f"{r['stale_threads_s']:.1f} | {r['ratio_sequential']:.2f} | "
            f"{r['ratio_threads']:.2f} | ok |"
        )
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} points in {time.perf_counter() - start:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
