"""One denoiser call per family on one accelerator: ms per call, the model's FLOPs from its
program, MFU against the chip's data-sheet peak, memory and compile seconds, per attention
kernel (random weights drawn on the device, bf16).

    device run (TPU): bash experiments/device/tpu_suite.sh      (this is its `families` part)
    one model:  python experiments/device/family_timing.py --models pixart-alpha \
        --attention xla splash splash:512x1024 --hardware tpu-v5e
    here, in miniature: python experiments/device/family_timing.py --models tiny-dit \
        --resolutions 64 --attention xla chunked --dtype float32 --repeats 2 \
        --hardware cpu-gloo --out /tmp/families

A model is a preset or a folder, with config.json keys replaced after a colon: FLUX.1-dev at a
quarter of its depth is `flux-dev:num_layers=4,num_single_layers=8` (bf16 FLUX.1-dev does not fit
one 16 GB chip; the full model's time follows from two depths, as results/tpu_v5e/README.md
says). A kernel is `xla`, `chunked` or `splash`, with block sizes after a colon
(`splash:512x1024`: block_q x block_kv). CFG batch 2 for every family that samples with
classifier-free guidance, 1 for FLUX.1 (guidance-distilled).

FLOPs are the model's: XLA's count of the program with `xla` attention (lowered, not compiled;
patchpar/measure/flops.py), the same for every kernel of a point, since a splash or cuDNN kernel
is a custom call whose FLOPs XLA does not count. MFU = FLOPs / median seconds / the profile's
peak (`--hardware`). Weights that cannot fit the device are refused before anything is drawn
(patchpar.measure.cost.check_weights_fit); a program that cannot fit after compiling, before it
runs. Every point appends its record at once (<out>/records.jsonl), a failed one with its error;
a point after `--budget-s` is recorded as skipped. Table: <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import median, needs, random_inputs, sized, timed  # noqa: E402

CFG_BATCH = {"flux": 1}  # family -> images per call; the rest run CFG's batch of 2


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["pixart-alpha", "sd3.5-medium", "sdxl"])
    p.add_argument(
        "--resolutions",
        nargs="+",
        default=["1024"],
        help="pixels of a square image, or HxWxF: a video model's F frames of H x W",
    )
    p.add_argument("--attention", nargs="+", default=["xla", "splash"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hardware", default="tpu-v5e", help="the profile whose peak MFU is of")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no point after this")
    p.add_argument(
        "--flops-only", action="store_true",
        help="only each point's FLOPs: lowered with abstract weights, nothing drawn or compiled",
    )  # fmt: skip
    p.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="trace two more calls of every point with jax.profiler into DIR/<point>/ "
        "(read them with experiments/device/profile_ops.py)",
    )  # fmt: skip
    p.add_argument(
        "--scan", nargs="+", choices=["off", "on"], default=["off"],
        help="the blocks unrolled (off) and/or scanned (on: model.scan_blocks, one loop per "
        "stack of identical blocks); `on` runs after `off`, on the weights stacked in place",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("results/tpu_v5e/families"))
    return p.parse_args(argv)


def model_spec(text: str) -> tuple[str, dict]:
    """`name[:key=value,...]` -> (name, config overrides); integers and floats as numbers."""
    name, _, rest = text.partition(":")
    overrides = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"model {text!r}: {pair!r} is not KEY=VALUE (num_layers=4, say)")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def kernel_spec(text: str):
    """`impl[:QxKV]` -> AttentionSpec (one-line SystemExit for a malformed one)."""
    from patchpar.models.attention import AttentionSpec

    impl, _, blocks = text.partition(":")
    if not blocks:
        return AttentionSpec(impl)
    try:
        q, kv = (int(b) for b in blocks.split("x"))
    except ValueError:
        raise SystemExit(f"kernel {text!r}: blocks are QxKV (splash:512x1024, say)") from None
    return AttentionSpec(impl, q, kv)


def main(argv=None) -> None:
    a = parse(argv)
    needs("jax", "flax", "numpy", "yaml")
    import jax
    import jax.numpy as jnp

    from patchpar import compile_cache
    from patchpar.hardware import load as load_profile
    from patchpar.lab.results import append_record, provenance
    from patchpar.measure.cost import (
        check_weights_fit,
        param_bytes,
    )
    from patchpar.measure.flops import program_flops
    from patchpar.models.attention import resolve
    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import abstract_denoiser, model_family

    start = time.perf_counter()
    compile_cache.enable()
    peak = load_profile(a.hardware).peak_flops
    dtype = getattr(jnp, a.dtype)
    dev = jax.devices()[0]
    specs = [kernel_spec(k) for k in a.attention]
    a.out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    rows = []

    def emit(rec):
        append_record(a.out / "records.jsonl", {**rec, **prov})
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "call_s_all"}), flush=True)

    for text in a.models:
        name, overrides = model_spec(text)
        base = {"model": text, "dtype": a.dtype, "hardware": a.hardware,
                "device_kind": dev.device_kind, "peak_flops": peak}  # fmt: skip
        try:
            fn = abstract_denoiser(name, dtype, overrides=overrides)
            batch = CFG_BATCH.get(model_family(name).name, 2)
            abstract = fn.abstract_params()
            base.update(batch=batch, weight_bytes=param_bytes(abstract))
            if a.flops_only:
                params = abstract
            else:
                check_weights_fit(abstract, text)
                t0 = time.perf_counter()
                params = jax.block_until_ready(random_params_on_device(abstract, 0))
                base["init_s"] = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - the model's record says why, the next one runs
            emit({**base, "status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"})
            continue
        points = []  # (point, its denoiser, its inputs) per resolution
        for res in a.resolutions:
            point = {**base, "resolution": res if "x" in res else int(res)}
            at, size = sized(fn, name, res)
            x, t, ctx, added = random_inputs(at, name, size, dtype, batch)
            try:  # the model's FLOPs: the xla-attention program, lowered only
                t0 = time.perf_counter()
                low = jax.jit(at.with_attention(resolve(kernel_spec("xla"), dtype)))
                point["flops"] = program_flops(low.lower(abstract, x, t, ctx, **added))
                point["flops_s"] = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                point["flops_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if a.flops_only:
                emit({**point, "status": "ok" if point.get("flops") else "error"})
                continue
            points.append((point, at, (x, t, ctx), added))
        for scanned in sorted({v == "on" for v in a.scan} if points else ()):  # unrolled first
            stack_s = 0.0
            if scanned:  # once per model, after every unrolled point: the unrolled weights go
                t0 = time.perf_counter()
                with warnings.catch_warnings():  # the unrolled buffers are not reused: freed
                    warnings.simplefilter("ignore")
                    params = jax.jit(fn.with_scan().prepare, donate_argnums=0)(params)
                params = jax.block_until_ready(params)
                stack_s = time.perf_counter() - t0
            for point, at, (x, t, ctx), added in points:
                g = at.with_scan() if scanned else at
                for spec in specs:
                    rec = {**point, "attention": spec.impl, "block_q": spec.block_q,
                           "block_kv": spec.block_kv, "scan_blocks": scanned}  # fmt: skip
                    if time.perf_counter() - start > a.budget_s:
                        emit({**rec, "status": "skipped",
                              "error": f"budget {a.budget_s:.0f} s spent"})  # fmt: skip
                        continue
                    if stack_s:
                        rec["stack_s"] = stack_s  # in this point's first call, once
                    run_point(a, rec, g, spec, (params, x, t, ctx), added, stack_s, emit)
                    stack_s = 0.0
        del params
    write_table(a.out, rows, dev.device_kind)
    print(f"{len(rows)} points in {time.perf_counter() - start:.0f} s -> {a.out}")


def run_point(a, rec, fn, spec, args, added, stack_s, emit) -> None:
    """Compile and time one point into `rec` (emitted, a failed one with its error):
    `first_call_s` is the weights' stacking (scanned), the compile and the first call."""
    import jax

    from patchpar.hardware import load as load_profile
    from patchpar.measure.cost import check_fits, memory_per_device
    from patchpar.models.attention import resolve

    dev = jax.devices()[0]
    try:
        f = jax.jit(fn.with_attention(resolve(spec, getattr(jax.numpy, a.dtype))))
        t0 = time.perf_counter()
        compiled = f.lower(*args, **added).compile()
        rec["compile_s"] = time.perf_counter() - t0
        rec["memory_compiled"] = memory_per_device(compiled)
        check_fits(rec["memory_compiled"], f"{rec['model']} at {rec['resolution']}px")
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args, **added))
        rec["first_call_s"] = stack_s + rec["compile_s"] + time.perf_counter() - t0
        _, times = timed(compiled, args, added, a.repeats)
        rec["call_s_median"] = median(times)
        rec["call_s_all"] = times
        if rec.get("flops"):
            rec["mfu"] = rec["flops"] / rec["call_s_median"] / load_profile(a.hardware).peak_flops
        rec["peak_bytes_in_use"] = (dev.memory_stats() or {}).get("peak_bytes_in_use")
        if a.profile:
            rec["profile"] = trace(a.profile, rec, compiled, args, added)
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - every kernel gets a record
        rec["status"] = "error"
        rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
    emit(rec)


def trace(root: Path, rec: dict, compiled, args, kwargs) -> str:
    """Two calls of `compiled` traced by jax.profiler into root/<point>/; the folder's name."""
    import jax

    kernel = rec["attention"]
    if kernel in ("splash", "chunked"):
        kernel += f"-{rec['block_q']}x{rec['block_kv']}"
    name = "".join(c if c.isalnum() or c in "-." else "_" for c in rec["model"])
    name = f"{name}-{rec['resolution']}-{kernel}"
    with jax.profiler.trace(str(root / name)):
        for _ in range(2):
            jax.block_until_ready(compiled(*args, **kwargs))
    return name


def write_table(out: Path, rows: list[dict], kind: str) -> None:
    gib = 2**30
    lines = [
        f"One denoiser call on one {kind} (random weights): ms per call, MFU against the "
        "profile's peak, memory (XLA's buffer assignment; the device's peak), compile s",
        "",
        "| model | px | batch | attention | ms | TFLOP | MFU | compiled GiB | peak GiB | "
        "compile s | first call s | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def num(v, fmt, scale=1.0):
        return "-" if v is None else format(v * scale, fmt)

    for r in rows:
        kernel = r.get("attention", "-")
        if kernel in ("splash", "chunked"):
            kernel += f" {r['block_q']}x{r['block_kv']}"
        if r.get("scan_blocks"):
            kernel += ", scanned"
        lines.append(
            f"| {r['model']} | {r.get('resolution', '-')} | {r.get('batch', '-')} | {kernel} | "
            f"{num(r.get('call_s_median'), '.1f', 1e3)} | {num(r.get('flops'), '.2f', 1e-12)} | "
            f"{num(r.get('mfu'), '.0%')} | "
            f"{num((r.get('memory_compiled') or {}).get('total'), '.2f', 1 / gib)} | "
            f"{num(r.get('peak_bytes_in_use'), '.2f', 1 / gib)} | "
            f"{num(r.get('compile_s'), '.0f')} | {num(r.get('first_call_s'), '.1f')} | "
            f"{r['status']} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
