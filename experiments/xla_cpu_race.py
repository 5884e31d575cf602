"""The XLA:CPU race behind `patchpar/xla_flags.py`'s multi-device option, reproduced.

The fmnist UNet called `--calls` times in one jitted loop (x <- x - 0.1 eps, t = 900, 800, ...)
on `--batch` random latents, on one device and under `sync_patch`'s site ops on `--devices`
CPU devices of this process. Exact ops: the two must agree to float rounding. Each setting of
`xla_cpu_experimental_ynn_fusion_type` runs in a fresh process (XLA reads its flags once);
`jaxlib` means the flag unset, `none` means set to empty (no YNNPACK).

    .venv/bin/python experiments/xla_cpu_race.py                       # the table below
    .venv/bin/python experiments/xla_cpu_race.py --devices 8 --batch 200 --calls 5

Writes runs/xla_cpu_race/runs.jsonl (--out) and table_d<devices>_b<batch>_c<calls>.md: per
setting, the images off by > 1e-3 and the largest difference. With jaxlib 0.10.2 on 2 cores:
`individual_dot` (patchpar's one-device default), `dot`, `none` and `reduce` give the first
images of the batch wrong; `individual_dot,eltwise` and `jaxlib` (patchpar's multi-device
default: the flag unset) give none wrong; `--pin` (the same process on one core) gives none
wrong with every setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = ("individual_dot", "dot", "none", "reduce", "individual_dot,eltwise", "jaxlib")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--batch", type=int, default=400)
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS))
    p.add_argument("--pin", action="store_true", help="pin each child to core 0")
    p.add_argument("--out", type=Path, default=Path("runs/xla_cpu_race"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, least in (("devices", 2), ("batch", 1), ("calls", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name} {getattr(args, name)}: must be >= {least}")
    return args


def child(args) -> dict:
    """In the child: both programs, the per-image differences."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from patchpar.lab.configio import load_config
    from patchpar.lab.runner import get_pipeline
    from patchpar.parallel.mesh import PATCH
    from patchpar.parallel.sites import patch_ops

    cfg = load_config(Path(__file__).parent / "configs" / "fmnist.yaml")
    pipe = get_pipeline(cfg.model.name, cfg.sampler.dtype, cfg.model.attention_spec())
    module, params = pipe.unet.module, pipe.unet_params
    n, b = args.devices, args.batch
    rng = np.random.default_rng(0)
    x = rng.standard_normal((b, 32, 32, 1)).astype(np.float32)
    ctx = rng.standard_normal((b, 16, module.config.cross_attention_dim)).astype(np.float32)

    def loop(call, x):
        def body(i, x):
            return x - 0.1 * call(x, jnp.full((b,), 900.0, jnp.float32) - 100.0 * i)

        return jax.lax.fori_loop(0, args.calls, body, x)

    one = jax.jit(lambda x: loop(lambda x, t: module.apply({"params": params}, x, t, ctx), x))
    sharded_module = module.clone(ops=patch_ops(n))
    mesh = jax.make_mesh((n,), (PATCH,), axis_types=(jax.sharding.AxisType.Explicit,))
    step = jax.shard_map(
        lambda x, t, c: sharded_module.apply({"params": params}, x, t, c),
        mesh=mesh,
        in_specs=(P(None, PATCH), P(), P()),
        out_specs=P(None, PATCH),
        check_vma=False,
    )
    many = jax.jit(lambda x: loop(lambda x, t: step(x, t, ctx), x))
    ref = np.asarray(one(x))
    got = np.asarray(many(jax.device_put(x, NamedSharding(mesh, P(None, PATCH)))))
    d = np.abs(ref - got).reshape(b, -1).max(1)
    return {"wrong_images": np.flatnonzero(d > 1e-3).tolist(), "max_abs_diff": float(d.max())}


def run_setting(args, setting: str) -> dict:
    flags = [f"--xla_force_host_platform_device_count={args.devices}"]
    if setting != "jaxlib":
        flags.append(
            f"--xla_cpu_experimental_ynn_fusion_type={'' if setting == 'none' else setting}"
        )
    env = dict(
        os.environ, XLA_FLAGS=" ".join(flags), PATCHPAR_XLA_DEFAULTS="0", JAX_PLATFORMS="cpu"
    )
    cmd = [
        sys.executable,
        __file__,
        "--child",
        setting,
        "--devices",
        str(args.devices),
        "--batch",
        str(args.batch),
        "--calls",
        str(args.calls),
    ]
    if args.pin:
        cmd = ["taskset", "-c", "0", *cmd]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"setting {setting!r} failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        "setting": setting,
        "devices": args.devices,
        "batch": args.batch,
        "calls": args.calls,
        "pinned_to_one_core": args.pin,
        "xla_flags": env["XLA_FLAGS"],
        **row,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> None:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    from patchpar.lab.results import provenance

    prov = provenance()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for setting in args.settings:
        row = {
            **run_setting(args, setting),
            "git_commit": prov["git_commit"],
            "git_dirty": prov["git_dirty"],
            "versions": prov["versions"],
        }
        rows.append(row)
        wrong = row["wrong_images"]
        print(
            f"{setting:>24}: {len(wrong)} images wrong {wrong[:16]}, max |diff| "
            f"{row['max_abs_diff']:.3g} ({row['seconds']} s)",
            flush=True,
        )
    with open(args.out / "runs.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    lines = [
        f"fmnist UNet x {args.calls} calls in one loop, {args.batch} images, {args.devices} CPU "
        f"devices (`sync_patch` ops) vs one device; {'pinned to one core' if args.pin else 'both cores'}",
        "",
        "| ynn_fusion_type | images wrong (> 1e-3) | max abs diff |",
        "|---|---|---|",
        *(f"| {r['setting']} | {len(r['wrong_images'])} | {r['max_abs_diff']:.3g} |" for r in rows),
    ]
    name = f"table_d{args.devices}_b{args.batch}_c{args.calls}{'_pinned' if args.pin else ''}.md"
    (args.out / name).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
