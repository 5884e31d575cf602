"""One device's program of an N-way patch-parallel step, timed alone (random weights drawn on
the device, bf16), for N = 1, 2, 4, 8 patches, per model (default SDXL; any family), resolution
(1024 and 2048, 3840 if memory and time allow) and strategy. The projection (`patchpar project
--timings`) then uses these seconds as the measured compute instead of the fitted efficiency
curve; N x a device's time over `single`'s is the efficiency that bounds every speedup.

    device run: python experiments/device/shard_timing.py              (a GPU: under 8 minutes)
                bash experiments/device/tpu_suite.sh shards            (a TPU: PixArt-α at 1024²)
    here, in miniature: python experiments/device/shard_timing.py --models tiny tiny-dit \
        --resolutions 128 --patches 1 2 --strategies sync_patch distrifusion ulysses \
        --repeats 2 --hardware cpu-gloo --out /tmp/shard

Each point runs the per-device program of a strategy (default distrifusion's steady step: 1/N
of the rows, attention over all N patches' keys from the stale buffer; sync_patch, pcpp,
ulysses and ring alike; PipeFusion and AsyncDiff own their programs and are not timed here) on
one device with every collective replaced by a local stand-in of the same shape
(`Plan(comm=False)`; the stand-in K/V gather repeats the local part N times), on a one-device
mesh; N = 1 is `single`. Where N does not divide the token rows, the program is the largest
patch's (the rows rounded up to whole token rows: an uneven split computes every patch padded to
it); records name its rows (`patch_rows`). A size is a square image's pixels or, for a video
model, HxWxF (its latent frames laid out as one tall image, frame after frame). A point is skipped (recorded as such) once `--budget-s` has passed.
Every program runs `--attention` (default `auto`, the backend's kernel; records name it).
A stale strategy's steady program is timed twice (`--stale-exchange both`, the default): with
its stale exchanges stood in by local copies on the core (`stand_in`, as every collective), and
with them left out, the sends returned and the buffers kept as given (`left_out`,
`Plan(stale_exchange=False)`): on a TPU or GPU those exchanges overlap the step on the
interconnect's DMA engines, so `left_out` is the per-device compute the projection should use
for them; records name which (`stale_exchange`). `--stale-exchange dropped` times the steady
program with the stale exchange left out and its sends dropped too (the next state not
returned): on a DiT, whose only stale site is its K/V, that is sync_patch's program with its
gathers' results fed in as inputs (own fresh K/V, the others' read from a buffer the program
did not make): beside sync_patch's stood-in program, what a gather delivered from outside
the program costs the attention that reads it.
Records: <out>/records.jsonl (hardware = the profile name given, device kind, model,
resolution, patches, strategy, phase, seconds per denoiser call); table: <out>/table.md. Needs
only jax, flax, numpy and pyyaml.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import sized  # noqa: E402
from family_timing import kernel_spec, model_spec  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--models", dest="models", nargs="+", default=["sdxl"])
    p.add_argument(
        "--resolutions",
        nargs="+",
        default=["1024", "2048", "3840"],
        help="pixels of a square image, or HxWxF: a video model's F frames of H x W",
    )
    p.add_argument("--patches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument(
        "--strategy", "--strategies", dest="strategies", nargs="+", default=["distrifusion"]
    )
    p.add_argument(
        "--option", action="append", default=[], metavar="KEY=VALUE",
        help="a strategy option (e.g. comm_groups=per_site); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--attention", default="auto",
        help="the kernel of every program, impl[:QxKV] (auto: the backend's default)",
    )  # fmt: skip
    p.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="trace two more calls of every point with jax.profiler into DIR/<point>/ "
        "(read them with experiments/device/profile_ops.py)",
    )  # fmt: skip
    p.add_argument(
        "--scan", action="store_true",
        help="every program with its runs of identical blocks scanned (model.scan_blocks)",
    )  # fmt: skip
    p.add_argument(
        "--stale-exchange", choices=("stand_in", "left_out", "both", "dropped"), default="both",
        help="a stale strategy's steady exchanges stood in on the core, left out, both, or "
        "left out with the sends dropped",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hardware", default="h200-sxm", help="the profile these timings belong to")
    p.add_argument("--budget-s", type=float, default=420.0, help="start no point after this")
    p.add_argument("--out", type=Path, default=Path("results/shard_timing"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import patchpar  # noqa: F401
    from patchpar import compile_cache
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import append_record, provenance
    from patchpar.measure.cost import abstract_inputs
    from patchpar.models.attention import resolve
    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import abstract_denoiser, latent_factor
    from patchpar.parallel.engine import make_step
    from patchpar.parallel.mesh import make_mesh
    from patchpar.parallel.strategies import make_strategy
    from patchpar.parallel.strategies.base import StaleStrategy

    start = time.perf_counter()
    compile_cache.enable()
    dtype = getattr(jnp, a.dtype)
    mesh = make_mesh(1, 1)
    dev = jax.devices()[0]
    a.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    kernel = resolve(kernel_spec(a.attention), dtype)
    rows = []
    weights = {}  # the model whose weights are on the device
    for model, r, n, strategy, stale_exchange in _points(a, StaleStrategy, make_strategy):
        name = "single" if n == 1 else strategy
        plan = build_plan(name, {} if n == 1 else _options(a.option), n, 1, comm=False)
        phase = "steady" if isinstance(plan.strategy, StaleStrategy) else "warmup"
        plan = replace(plan, stale_exchange=stale_exchange not in ("left_out", "dropped"))
        rec = {"hardware": a.hardware, "device_kind": dev.device_kind, "model": model,
               "resolution": r, "patches": n, "strategy": plan.strategy.describe(),
               "phase": phase, "dtype": a.dtype, "attention": kernel.impl,
               "block_q": kernel.block_q, "block_kv": kernel.block_kv,
               "scan_blocks": a.scan, "stale_exchange": stale_exchange}  # fmt: skip
        if time.perf_counter() - start > a.budget_s:
            rec.update(status="skipped", error=f"time budget {a.budget_s:.0f} s spent")
            _emit(a, rec, rows, append_record, provenance)
            continue
        try:
            if model not in weights:  # drawn on the device, once per model
                weights.clear()
                name_, overrides = model_spec(model)
                unet = abstract_denoiser(name_, dtype, overrides=overrides).with_attention(kernel)
                params = random_params_on_device(unet.abstract_params(), 0)
                if a.scan:  # each run of identical blocks stacked once, as a run does
                    unet = unet.with_scan()
                    params = jax.block_until_ready(jax.jit(unet.prepare)(params))
                weights[model] = unet, params
            unet, params = weights[model]
            unet, (hp, wp) = sized(unet, model_spec(model)[0], r)  # a video: its tall image
            f = latent_factor(model_spec(model)[0])
            unit = unet.row_multiple  # rows of a token row: the largest patch's token rows
            own = -(-(hp // f) // (n * unit)) * unit  # (an uneven split computes it padded)
            rec["patch_rows"] = own
            # an uneven split: each patch's true rows (the program pads them to `own`)
            padded = plan.row_split(hp // f, unet) if own * n != hp // f else None
            x_abs, _, cond_abs = abstract_inputs(unet, (own, wp // f), 1)
            rec["unet_batch"] = unet.guidance_halves
            fill = lambda s: jnp.asarray(rng.rand(*s.shape), s.dtype)  # noqa: E731
            x, cond = fill(x_abs), jax.tree.map(fill, cond_abs)
            t = jnp.asarray(500.0, jnp.float32)
            axis = plan.strategy.patch_axis(0)
            state = None
            fn = make_step(unet, plan, phase, axis, 5.0, mesh, padded)
            if phase == "steady":  # the state a steady step carries (its own output's)
                warm = make_step(unet, plan, "warmup", axis, 5.0, mesh, padded)
                _, shapes = jax.eval_shape(warm, params, x, t, cond, None)
                _, shapes = jax.eval_shape(fn, params, x, t, cond, shapes)
                state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            # the stale buffers donated, as the denoising loop carries them (updated in place)
            donate = (4,) if state is not None and stale_exchange != "dropped" else ()
            if stale_exchange == "dropped":  # the sends not returned: never computed
                fn = _output_only(fn)
            step = jax.jit(fn, donate_argnums=donate)
            t0 = time.perf_counter()
            compiled = step.lower(params, x, t, cond, state).compile()
            rec["compile_s"] = time.perf_counter() - t0
            out, new = compiled(params, x, t, cond, state)
            jax.block_until_ready(out)
            state = new if donate else state
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                out, new = compiled(params, x, t, cond, state)
                jax.block_until_ready(out)
                times.append(time.perf_counter() - t0)
                state = new if donate else state
            rec["unet_call_s_median"] = statistics.median(times)
            rec["unet_call_s_all"] = times
            if a.profile:
                rec["profile"] = _trace(a.profile, rec, compiled, (params, x, t, cond), state)
            rec["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - every point gets a record, also a failed one
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        _emit(a, rec, rows, append_record, provenance)
    lines = [
        f"Per-device program, {a.dtype}, {dev.device_kind} (profile {a.hardware}), collectives "
        f"replaced by stand-ins, attention {kernel.impl} {kernel.block_q}x{kernel.block_kv}"
        + (", blocks scanned" if a.scan else ""),
        "",
        "| model | resolution | patches | strategy | stale exchange | ms per denoiser call | "
        "status |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in rows:
        ms = rec.get("unet_call_s_median")
        lines.append(
            f"| {rec['model']} | {rec['resolution']} | {rec['patches']} | {rec['strategy']} | "
            f"{rec['stale_exchange'] if rec['phase'] == 'steady' else '-'} | "
            f"{'-' if ms is None else f'{ms * 1e3:.1f}'} | {rec['status']} |"
        )
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} points in {time.perf_counter() - start:.0f} s -> {a.out}")


def _points(a, stale_class, make_strategy):
    """(model, resolution, patches, strategy, stale exchange) in order: per model, its
    resolutions, patch counts and strategies (N = 1 once: `single`), a stale strategy's steady
    program with its exchanges stood in and left out (`--stale-exchange`)."""
    both = ("stand_in", "left_out") if a.stale_exchange == "both" else (a.stale_exchange,)
    for model in a.models:
        for text in a.resolutions:  # a square image's pixels as a number, as records had them
            r = int(text) if text.isdigit() else text
            for n in a.patches:
                for strategy in a.strategies[:1] if n == 1 else a.strategies:
                    stale = n > 1 and isinstance(make_strategy(strategy), stale_class)
                    for how in both if stale else ("stand_in",):
                        yield model, r, n, strategy, how


def _output_only(fn):
    """`fn` returning its output and no next state (`--stale-exchange dropped`)."""

    def out(*args):
        return fn(*args)[0], None

    return out


def _trace(root: Path, rec: dict, compiled, args, state) -> str:
    """Two more calls of the point traced by jax.profiler into root/<point>/ (the stale state
    carried from call to call, as the timed calls do); the folder's name."""
    import jax

    name = "".join(c if c.isalnum() or c in "-." else "_" for c in rec["model"])
    name = f"{name}-{rec['resolution']}-{rec['patches']}-{rec['strategy'].split('(')[0]}"
    with jax.profiler.trace(str(root / name)):
        for _ in range(2):
            out, new = compiled(*args, state)
            jax.block_until_ready(out)
            state = new if new is not None else state  # a dropped next state: the same
    return name


def _options(pairs: list[str]) -> dict:
    """`KEY=VALUE` strategy options; integers as integers."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE (e.g. comm_groups=per_site)")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def _emit(a, rec, rows, append_record, provenance) -> None:
    append_record(a.out / "records.jsonl", {**rec, **provenance()})
    rows.append(rec)
    print(json.dumps({k: v for k, v in rec.items() if k != "unet_call_s_all"}), flush=True)


if __name__ == "__main__":
    main()
