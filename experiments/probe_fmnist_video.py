"""Does a `fmnist-video` checkpoint read its caption's class, motion axis and motion direction?
The caption-swap probe: the training loss on held-out test clips at a few noise levels, with
each clip's own caption, with its motion reversed ("moving left" for "moving right", "zooming
out" for "zooming in"), with its motion turned a quarter ("moving up" for "moving left") and with
another class. A model that ignores a part of the caption has the same loss with it swapped: the
gap says what it has learned long before sampled clips show it. With it, how far the model is
from equivariant under playing its input backwards (a model that cannot tell the frames' order)
and under a mirror image.

    .venv/bin/python experiments/probe_fmnist_video.py \\
        --checkpoint runs/train_fmnist_video/work/checkpoint.msgpack

Reads the training checkpoint (its EMA weights; the recipe's architecture), appends a record to
<out>/records.jsonl and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

REVERSED = np.array([1, 0, 3, 2, 5, 4])  # left <-> right, up <-> down, in <-> out
TURNED = np.array([2, 3, 0, 1, 5, 4])  # left -> up, right -> down, up -> left, ... (zooms reversed)
LEVELS = (0.9, 0.7, 0.5, 0.3)


def caption_swap(params: dict, work: Path, count: int = 96, seed: int = 0) -> dict:
    """{swap: [loss at each of LEVELS]} for swap in right, motion_reversed, motion_turned,
    other_class, of a checkpoint's EMA `params` ({"wan", "t5"}) from the work folder `work`;
    `count` test clips at the recipe's pace, one noise draw per level from `seed`."""
    import jax
    import jax.numpy as jnp
    import train_fmnist_video as recipe

    from patchpar.lab.clips import MOTIONS, clips

    wan, t5 = recipe.models()
    _, ids, mask = recipe.captions_and_tokens(work)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    ctx = t5(params["t5"], ids, mask)["last_hidden_state"] * mask[..., None]
    made = json.loads((work / "recipe.json").read_text())
    profile = made.get("motion_profile", "constant")
    x, labels, motions, _ = clips("test", count, seed=seed, profile=profile)
    x0 = jnp.asarray(x.astype(np.float32)[..., None] / 127.5 - 1.0)
    n = len(MOTIONS)
    caps = {
        "right": labels * n + motions,
        "motion_reversed": labels * n + REVERSED[motions],
        "motion_turned": labels * n + TURNED[motions],
        "other_class": ((labels + 5) % 10) * n + motions,
    }
    row = wan.row_multiple
    predict = jax.jit(lambda xs, s, c: wan(params["wan"], wan.video.to_tall(xs, row), 1000 * s, c))
    out = {k: [] for k in caps}
    for i, s in enumerate(LEVELS):
        noise = jax.random.normal(jax.random.key(seed * 100 + i), x0.shape)
        xs = (1 - s) * x0 + s * noise
        target = wan.video.to_tall(noise - x0, row)
        for name, cap in caps.items():
            loss = jnp.mean((predict(xs, jnp.full((count,), s), ctx[cap]) - target) ** 2)
            out[name].append(round(float(loss), 5))
    return out


def symmetry_gaps(params: dict, seed: int = 0) -> dict:
    """How far the model is from equivariant under playing its input backwards, and under a
    mirror image (left-right): max |f(g x) - g f(x)| / max |f(x)| on noise inputs at s = 0.5
    with random contexts. Relative positions alone (Wan's RoPE) give the frames no first one;
    0 would mean the model cannot tell a clip from itself played backwards. `params`: the
    checkpoint's EMA weights ({"wan", "t5"})."""
    import jax
    import jax.numpy as jnp
    import train_fmnist_video as recipe

    wan, _ = recipe.models()
    params = params["wan"]
    row = wan.row_multiple
    x = jax.random.normal(jax.random.key(seed + 1), (2, recipe.FRAMES, 32, 32, 1))
    ctx = jax.random.normal(jax.random.key(seed + 2), (2, recipe.TOKENS, recipe.TEXT["d_model"]))

    def f(v):
        out = wan(params, wan.video.to_tall(v, row), jnp.full((2,), 500.0), ctx)
        return wan.video.from_tall(out, row)

    out = f(x)
    scale = float(jnp.abs(out).max())
    backwards = float(jnp.abs(f(x[:, ::-1]) - out[:, ::-1]).max()) / scale
    mirror = float(jnp.abs(f(x[:, :, :, ::-1]) - out[:, :, :, ::-1]).max()) / scale
    return {"played_backwards": round(backwards, 5), "mirrored": round(mirror, 5)}


def main(argv=None) -> int:
    from patchpar.lab.results import append_record, provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a work folder's msgpack")
    ap.add_argument("--clips", type=int, default=96, help="held-out test clips")
    ap.add_argument("--out", type=Path, default=Path("runs/probe_fmnist_video"))
    args = ap.parse_args(argv)
    if not args.checkpoint.is_file():
        raise SystemExit(f"--checkpoint {args.checkpoint}: no such file (a training work "
                         f"folder's checkpoint.msgpack)")  # fmt: skip
    from flax import serialization

    state = serialization.msgpack_restore(args.checkpoint.read_bytes())
    step = int(state["step"])
    record = {
        "checkpoint": str(args.checkpoint),
        "trained_steps": step,
        "recipe": json.loads((args.checkpoint.parent / "recipe.json").read_text()),
        "noise_levels": list(LEVELS),
        "clips": args.clips,
        "loss": caption_swap(state["ema"], args.checkpoint.parent, args.clips),
        "equivariance_gap": symmetry_gaps(state["ema"]),
        "provenance": provenance(),
    }
    append_record(args.out / "records.jsonl", record)
    print({"trained_steps": step, "noise_levels": list(LEVELS), **record["loss"],
           **record["equivariance_gap"]})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
