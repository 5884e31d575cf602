"""patchpar's UNet beside a JAX peer on the same chip, in one program: diffusers' last Flax UNet
(0.35.x `FlaxUNet2DConditionModel`, linen) at the same config, random weights drawn on the
device for both, the same inputs, ms per call, each program's FLOPs and MFU.

    device run (TPU): bash experiments/device/tpu_suite.sh peer     (diffusers 0.35.2 travels
        in .whl-tpu: experiments/device/wheels_tpu.sh fetches it)
    here, in miniature (CPU): python experiments/device/peer_unet.py \
        --model tiny:norm_num_groups=32 --resolution 64 --dtype float32 --repeats 2 \
        --ours xla --peer default --hardware cpu-gloo --out /tmp/peer

Peer variants: `default` (diffusers' einsum attention), `split_head_dim` (heads split before the
product, as Google's MLPerf SDXL submission runs it), `memory_efficient` (diffusers' chunked
attention). Ours: patchpar's kernels as family_timing.py writes them (`xla`, `splash:1024x1024`).
FLOPs: each program's own count (`program_flops`, lowered with the CPU backend;
patchpar/measure/flops.py); MFU of every point is of one count, the model's (patchpar's first
program's), so a peer that counts fewer elementwise FLOPs (diffusers' Flax GELU is the tanh
approximation, patchpar's the exact erf of the torch model) is not credited for them.
That count is patchpar's program with `xla` attention, lowered with abstract weights whatever
`--ours` holds (a splash or cuDNN kernel is a custom call XLA does not count). The Flax UNet has GroupNorm with 32 groups
fixed: a config with other groups is refused. Records: <out>/records.jsonl; table <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from calls import median, needs, random_inputs, timed  # noqa: E402
from family_timing import kernel_spec, model_spec, write_table  # noqa: E402

PEERS = {
    "default": {},
    "split_head_dim": {"split_head_dim": True},
    "memory_efficient": {"use_memory_efficient_attention": True},
}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="sdxl")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--peer", nargs="+", default=["default", "split_head_dim"], choices=PEERS)
    p.add_argument("--ours", nargs="+", default=["splash:1024x1024", "xla"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hardware", default="tpu-v5e")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no point after this")
    p.add_argument("--out", type=Path, default=Path("results/tpu_v5e/peer"))
    return p.parse_args(argv)


def peer_class():
    """diffusers' FlaxUNet2DConditionModel, or a one-line SystemExit where diffusers has none."""
    try:
        from diffusers.models.unets.unet_2d_condition_flax import FlaxUNet2DConditionModel
    except ImportError as e:
        import diffusers

        raise SystemExit(
            f"diffusers {diffusers.__version__} has no Flax UNet ({e}); the peer is diffusers "
            f"0.35.2 (experiments/device/wheels_tpu.sh carries it: pip install it into a "
            f"folder of its own and put that first on PYTHONPATH)"
        ) from None
    return FlaxUNet2DConditionModel


def peer_model(cfg: dict, dtype, variant: str):
    """diffusers' Flax UNet at a diffusers UNet config (the keys it takes; a norm it lacks is a
    one-line SystemExit)."""
    import inspect

    FlaxUNet2DConditionModel = peer_class()
    if cfg.get("norm_num_groups", 32) != 32:
        raise SystemExit(
            f"norm_num_groups={cfg['norm_num_groups']}: diffusers' Flax UNet has 32 groups "
            f"fixed; give a model with 32 (tiny:norm_num_groups=32, say)"
        )
    fields = set(inspect.signature(FlaxUNet2DConditionModel).parameters) - {"parent", "name"}
    kwargs = {k: v for k, v in cfg.items() if k in fields}
    return FlaxUNet2DConditionModel(**kwargs, dtype=dtype, **PEERS[variant])


def main(argv=None) -> None:
    a = parse(argv)
    needs("jax", "flax", "numpy", "diffusers")
    import diffusers
    import jax
    import jax.numpy as jnp

    from patchpar import compile_cache
    from patchpar.hardware import load as load_profile
    from patchpar.lab.results import append_record, provenance
    from patchpar.measure.cost import check_fits, memory_per_device, param_bytes
    from patchpar.measure.flops import program_flops
    from patchpar.models.attention import resolve
    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import PRESETS, abstract_denoiser

    start = time.perf_counter()
    compile_cache.enable()
    peak = load_profile(a.hardware).peak_flops
    dtype = getattr(jnp, a.dtype)
    dev = jax.devices()[0]
    name, overrides = model_spec(a.model)
    if name not in PRESETS or "unet" not in PRESETS[name]:
        raise SystemExit(f"--model {name!r}: a UNet preset (sdxl, sd15, tiny) is needed")
    cfg = {**PRESETS[name]["unet"], **overrides}
    peer_model(cfg, dtype, "default")  # a peer that cannot run is said before any work
    a.out.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    rows = []
    base = {"model": a.model, "resolution": a.resolution, "dtype": a.dtype, "batch": 2,
            "hardware": a.hardware, "device_kind": dev.device_kind, "peak_flops": peak}  # fmt: skip

    fn = abstract_denoiser(name, dtype, overrides=overrides)
    x, t, ctx, added = random_inputs(fn, name, a.resolution, dtype, 2)
    # the model's FLOPs, the MFU of every point: patchpar's xla program, abstract weights
    xla = jax.jit(fn.with_attention(resolve(kernel_spec("xla"), dtype)))
    model_flops = program_flops(xla.lower(fn.abstract_params(), x, t, ctx, **added))

    def point(label, impl, make_call, params, args, kwargs):
        rec = {**base, "implementation": impl, "attention": label, "block_q": None,
               "block_kv": None, "weight_bytes": param_bytes(params)}  # fmt: skip
        if time.perf_counter() - start > a.budget_s:
            rec.update(status="skipped", error=f"budget {a.budget_s:.0f} s spent")
        else:
            try:
                f = jax.jit(make_call())
                lowered = f.lower(params, *args, **kwargs)
                rec["program_flops"] = program_flops(lowered)
                rec["flops"] = model_flops
                t0 = time.perf_counter()
                compiled = lowered.compile()
                rec["compile_s"] = time.perf_counter() - t0
                rec["memory_compiled"] = memory_per_device(compiled)
                check_fits(rec["memory_compiled"], f"{a.model} at {a.resolution}px")
                out, times = timed(compiled, (params, *args), kwargs, a.repeats)
                rec["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                rec["call_s_median"] = median(times)
                rec["call_s_all"] = times
                rec["mfu"] = rec["flops"] / rec["call_s_median"] / peak if rec["flops"] else None
                rec["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - every point gets a record
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
        append_record(a.out / "records.jsonl", {**rec, **prov})
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "call_s_all"}), flush=True)

    # patchpar first: its weights, freed before the peer's are drawn
    params = jax.block_until_ready(random_params_on_device(fn.abstract_params(), 0))
    for text in a.ours:
        spec = kernel_spec(text)
        label = text if ":" in text else spec.impl
        point(label, "patchpar", lambda spec=spec: fn.with_attention(resolve(spec, dtype)),
              params, (x, t, ctx), added)  # fmt: skip
    del params

    # the peer: NCHW latent, its added inputs as diffusers' Flax SDXL pipeline passes them
    x_nchw = jnp.transpose(x, (0, 3, 1, 2))
    peer_added = {"added_cond_kwargs": added} if added else {}
    for variant in a.peer:
        model = peer_model(cfg, dtype, variant)
        abstract = jax.eval_shape(
            lambda m=model: m.init(jax.random.key(0), x_nchw, t, ctx, **peer_added)
        )
        abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), abstract)
        params = jax.block_until_ready(random_params_on_device(abstract, 0))

        def call(m=model):
            return lambda p, xs, ts, cs, **kw: m.apply(p, xs, ts, cs, **kw).sample

        point(f"diffusers {variant}", f"diffusers {diffusers.__version__}", call, params,
              (x_nchw, t, ctx), peer_added)  # fmt: skip
        del params

    write_table(a.out, [{**r, "model": f"{r['model']} ({r['implementation']})"} for r in rows],
                dev.device_kind)  # fmt: skip
    print(f"{len(rows)} points in {time.perf_counter() - start:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
