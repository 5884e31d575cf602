"""TeaCache's rescaling polynomial fitted on a trained model: patchpar's own fit for a family
without a published one (PixArt: the trained `fmnist-dit`). TeaCache (Liu et al., CVPR 2025)
skips a step's blocks while the accumulated *rescaled* relative L1 change of the first block's
modulated input stays under its threshold; the rescaling is a polynomial from that input change
to the relative L1 change of the model's output, fitted per model on sampled trajectories
(TeaCache4FLUX's published one is FLUX.1-dev's). Here: exact one-device trajectories of the
model (its preset sampler, steps and guidance), on prompts x seeds apart from the evaluation
seeds, every consecutive pair of steps one point (x: the modulated input's change, y: the
model output's change, both over the whole guidance stack as the cache measures them:
sum |a - b| / sum |b|); a least-squares polynomial of
degree 4, as TeaCache's.

    .venv/bin/python experiments/teacache_fit.py                         # -> runs/teacache_fit/
    .venv/bin/python experiments/teacache_fit.py --out results/teacache_fit
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PROMPTS = [f"a photo of a {c}" for c in (
    "T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
    "ankle boot",
)]  # fmt: skip


def trajectories(model: str, seeds: list[int], steps: int, guidance: float, sampler: str):
    """(x, y) of every consecutive step pair of each seed's batch of the 10 class prompts."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from patchpar.models.sites import IDENTITY
    from patchpar.pipelines import load_pipeline
    from patchpar.sampling.loop import guided
    from patchpar.sampling.schedulers import get_sampler

    pipe = load_pipeline(model)
    fn, params = pipe.unet, pipe.unet_params
    module = fn.module.clone(ops=IDENTITY)
    v = {"params": params}
    size = fn.config.sample_size * pipe.latent_factor
    cond = pipe.encode_prompt(PROMPTS, None, guidance, size, size)
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    added = {k: flat(a) for k, a in cond.added().items()}
    smp = get_sampler(sampler)
    latents0 = pipe.initial_latents(len(PROMPTS), size, size, 0)
    sched = smp.schedule(pipe.scheduler_at(*latents0.shape[1:3]), steps)
    scale = float(pipe.text.loop_scale(guidance))

    @jax.jit
    def call(x_in, t):
        xs = jnp.broadcast_to(x_in[None], (g,) + x_in.shape).reshape((g * b,) + x_in.shape[1:])
        ts = jnp.broadcast_to(t, (g * b,))
        hs, aux = module.apply(v, xs, ts, flat(cond.context), **added, method="prologue")
        m = module.apply(v, hs, aux, method="modulated")
        hs = module.apply(v, 0, module.num_blocks, hs, aux, method="blocks")
        out = fn.prediction(module.apply(v, hs, aux, method="epilogue"))
        return m.astype(jnp.float32), out.astype(jnp.float32)

    def rel(a, b):
        return float(jnp.sum(jnp.abs(a - b)) / jnp.sum(jnp.abs(b)))

    xs, ys = [], []
    for seed in tqdm(seeds, desc="trajectories", unit="seed"):
        lat = pipe.initial_latents(len(PROMPTS), size, size, seed) * sched.init_noise_sigma
        carry, prev = smp.init_carry(lat), None
        for i in range(steps):
            m, out = call(smp.scale_input(sched, i, lat), sched.timesteps[i])
            if prev is not None:
                xs.append(rel(m, prev[0]))
                ys.append(rel(out, prev[1]))
            prev = (m, out)
            eps = guided(out.reshape((g, b) + out.shape[1:]), scale)
            lat, carry = smp.step(sched, i, lat, eps, carry)
    return np.asarray(xs), np.asarray(ys)


def main() -> None:
    from patchpar.lab.results import provenance

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/teacache_fit"))
    ap.add_argument("--model", default="fmnist-dit")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(100, 120)))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=2.0)
    ap.add_argument("--sampler", default="dpmpp_2m")
    ap.add_argument("--degree", type=int, default=4)
    args = ap.parse_args()
    x, y = trajectories(args.model, args.seeds, args.steps, args.guidance, args.sampler)
    coef = np.polyfit(x, y, args.degree)
    fitted = np.polyval(coef, x)
    r2 = 1.0 - float(np.sum((y - fitted) ** 2) / np.sum((y - y.mean()) ** 2))
    record = {
        "model": args.model,
        "seeds": args.seeds,
        "prompts": PROMPTS,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "sampler": args.sampler,
        "degree": args.degree,
        "points": int(x.size),
        "coefficients": [float(c) for c in coef],  # highest power first (np.polyval's order)
        "r2": r2,
        "x_range": [float(x.min()), float(x.max())],
        "y_range": [float(y.min()), float(y.max())],
        "pairs": [[float(a), float(b)] for a, b in zip(x, y, strict=True)],
        "provenance": provenance(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fit.json"
    if path.exists():
        raise SystemExit(f"{path} exists: a published fit is not overwritten; use another --out")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    print(f"{args.model}: {x.size} step pairs, x in [{x.min():.4f}, {x.max():.4f}], "
          f"y in [{y.min():.4f}, {y.max():.4f}]; R^2 {r2:.3f}")  # fmt: skip
    print("coefficients (highest power first):", ", ".join(f"{c:.8e}" for c in coef))


if __name__ == "__main__":
    main()
