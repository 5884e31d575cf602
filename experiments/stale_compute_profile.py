"""One device's compute in each strategy's step, on one core, with a profile per XLA op kind:
where the stale path's compute goes (docs/design.md §4, "Measuring").

Each point is the per-device program of an N-way plan with every collective replaced by a local
stand-in of the same shape (`Plan(comm=False)`), run on a one-device mesh in this process with
one XLA thread: the compute a device does in the real multi-process run, without the
communication. The steady program (the warm-up one for exact strategies) is timed as the
denoising loop runs it: its stale buffers donated, so that their new values may alias the old.

    .venv/bin/python experiments/stale_compute_profile.py                       # tiny 512², N=2
    .venv/bin/python experiments/stale_compute_profile.py --model fmnist --height 32 --batch 20
    PYTHONPATH=/path/to/other/checkout .venv/bin/python experiments/stale_compute_profile.py

Writes <out>/records.jsonl (one record per strategy, with provenance) and <out>/profile.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

POINTS = (  # the defaults (comm_groups=1: packed), then per-site exchanges
    ("sync_patch", {}),
    ("distrifusion", {}),
    ("pcpp", {"send": "band"}),
    ("distrifusion", {"comm_groups": "per_site"}),
    ("pcpp", {"send": "band", "comm_groups": "per_site"}),
)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--height", type=int, default=512, help="image size in pixels (square)")
    p.add_argument("--batch", type=int, default=2, help="images per UNet call (CFG pair: 2)")
    p.add_argument("--devices", type=int, default=2, help="N of the N-way plan")
    p.add_argument("--attention", default="auto", help="the attention kernel (model.attention)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/stale_compute"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    # one device, one XLA thread, one core: as a launched worker runs (patchpar.lab.launch)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, "--xla_cpu_multi_thread_eigen=false"])
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_unet import profile

    from patchpar.lab.config import build_plan
    from patchpar.lab.generation import get_pipeline
    from patchpar.lab.results import append_record, provenance
    from patchpar.models.attention import AttentionSpec
    from patchpar.parallel.engine import make_step, phase_steps
    from patchpar.parallel.mesh import make_mesh
    from patchpar.sampling.guidance import Conditioning

    pipe = get_pipeline(a.model, "auto", AttentionSpec(a.attention))
    unet, params = pipe.unet, pipe.unet_params
    f = pipe.latent_factor
    n = a.devices
    latent = a.height // f
    rng = np.random.RandomState(0)
    cfg = unet.config
    x = jnp.asarray(rng.randn(a.batch // 2, latent // n, latent, cfg.in_channels), jnp.float32)
    ctx = jnp.asarray(rng.randn(2, a.batch // 2, 77, cfg.cross_attention_dim), jnp.float32)
    cond = Conditioning(ctx)
    t = jnp.asarray(500.0, jnp.float32)
    mesh = make_mesh(1, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, options in POINTS:
        try:
            plan = build_plan(name, options, n, 1, comm=False)
        except ValueError as e:  # an older checkout without the option
            print(f"skip {name} {options}: {e}", file=sys.stderr)
            continue
        phases = list(phase_steps(plan, 20))
        phase = phases[-1]  # steady for the stale strategies, the one exact phase otherwise
        warm = make_step(unet, plan, phases[0], "row", 2.0, mesh)
        _, shapes = jax.eval_shape(warm, params, x, t, cond, None)
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        step = jax.jit(make_step(unet, plan, phase, "row", 2.0, mesh), donate_argnums=(4,))
        compiled = step.lower(params, x, t, cond, state if phase == "steady" else None).compile()
        carry = {"state": state if phase == "steady" else None}

        def run(compiled=compiled, carry=carry, steady=phase == "steady"):
            out, new = compiled(params, x, t, cond, carry["state"])
            if steady:
                carry["state"] = new
            jax.block_until_ready(out)

        run()
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        prof = profile(run, compiled.as_text())
        label = " ".join([name] + [f"{k}={v}" for k, v in options.items()])
        rec = {
            "model": a.model,
            "height": a.height,
            "batch": a.batch,
            "devices": n,
            "attention": pipe.unet.module.attn.impl,
            "strategy": plan.strategy.describe(),
            "label": label,
            "phase": phase,
            "step_s_median": float(np.median(times)),
            "step_s_all": times,
            "profile": prof,
            **provenance(),
        }
        append_record(a.out / "records.jsonl", rec)
        print(f"{label}: {1e3 * rec['step_s_median']:.1f} ms per {phase} step", flush=True)
        lines += [f"## {label} ({phase}): {1e3 * rec['step_s_median']:.1f} ms", ""]
        lines += ["| op kind | ms per step | count |", "|---|---|---|"]
        lines += [f"| {k} | {ms} | {c} |" for k, ms, c in prof] + [""]
    (a.out / "profile.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
