"""Train the `fmnist-dit` preset: a PixArt-architecture text-to-image DiT on Fashion-MNIST (the
same data, caption templates and classifier as `fmnist`), in pixel space at 32x32, with a small
T5 text encoder of patchpar's own trained jointly with it.

    .venv/bin/python experiments/train_fmnist_dit.py     # 55 minutes; resumable, Ctrl-C is safe

- The DiT: PixArt's block (adaLN-single, self-attention, cross-attention to the text, GELU
  feed-forward), 8 blocks of width 96 (4 heads of 24), patch 4 (8 x 8 tokens; patch 2's
  16 x 16 took 1.25 s per step at width 64, so the budget would see ~2,600 updates), one channel
  in and out, no micro-conditions, no learned sigma. 8 blocks divide into 2, 4 or 8 pipeline
  stages.
  adaLN's projection and the output projection start at zero (DiT's adaLN-Zero): every block
  starts as the identity.
- The text: a sentencepiece BPE model trained on the 41 captions (10 classes x 4 templates + "")
  and a 2-layer T5 encoder (width 32) trained with the DiT; the captions are encoded once per
  step with their mask (16 tokens; a longer padding gives the same states, the pads being
  masked), then gathered for the batch.
- Diffusion, optimiser, EMA and checkpoints as experiments/train_fmnist.py (DDPM linear betas,
  epsilon prediction, 10% empty captions, Adam with clipping, EMA exported). The Fashion-MNIST
  classifier of `prompt_accuracy` is the `fmnist` preset's (`patchpar.lab.defaults.CLASSIFIER_OF`).
- --work holds checkpoints and the loss log (git-ignored; another recipe's folder is refused);
  --out the diffusers-format PixArt folder (default runs/train_fmnist_dit/weights; the shipped
  model is patchpar/weights/fmnist-dit/, written only with --out patchpar/weights/fmnist-dit).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import serialization
from flax.traverse_util import flatten_dict, unflatten_dict
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fmnist import (  # noqa: E402
    SCHEDULER,
    TEMPLATES,
    check_work,
    padded_train_images,
    plot_losses,
)

from patchpar.measure.classifier import FASHION_MNIST_CLASSES  # noqa: E402
from patchpar.models import api  # noqa: E402
from patchpar.models.loading import write_component  # noqa: E402
from patchpar.models.pixart import PixArtConfig, PixArtTransformer2DModel  # noqa: E402
from patchpar.models.t5 import T5Config, T5EncoderModel  # noqa: E402
from patchpar.models.tokenizer import T5Tokenizer, write_t5_tokenizer  # noqa: E402
from patchpar.sampling.schedulers import SchedulerConfig  # noqa: E402

TOKENS = 16  # T5 tokens per caption in training (the longest caption has fewer)
TRANSFORMER = {
    "_class_name": "PixArtTransformer2DModel",
    "activation_fn": "gelu-approximate",
    "attention_bias": True,
    "attention_head_dim": 24,
    "num_attention_heads": 4,
    "cross_attention_dim": 96,
    "caption_channels": 32,
    "in_channels": 1,
    "out_channels": 1,
    "num_layers": 8,
    "norm_elementwise_affine": False,
    "norm_eps": 1e-6,
    "norm_type": "ada_norm_single",
    "num_embeds_ada_norm": 1000,
    "patch_size": 4,
    "sample_size": 32,
    "interpolation_scale": 1,
    "use_additional_conditions": False,
}
TEXT = {
    "architectures": ["T5EncoderModel"],
    "model_type": "t5",
    "d_model": 32,
    "d_ff": 64,
    "d_kv": 8,
    "num_heads": 4,
    "num_layers": 2,
    "feed_forward_proj": "gated-gelu",
    "dense_act_fn": "gelu_new",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-6,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "vocab_size": 128,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TrainConfig:
    minutes: float = 55.0
    """Wall-clock budget for this invocation (resume adds to it); the export takes seconds."""
    max_steps: int = 0
    """Stop at this many steps in all (0: only the time budget)."""
    batch: int = 32
    lr: float = 7e-4
    ema: float = 0.999
    p_uncond: float = 0.1
    """Share of empty captions (classifier-free guidance)."""
    seed: int = 0
    work: Path = Path("runs/train_fmnist_dit/work")
    """Checkpoints and loss log (git-ignored)."""
    out: Path = Path("runs/train_fmnist_dit/weights")
    """The diffusers-format PixArt folder (the `fmnist-dit` preset)."""
    plots: Path = Path("runs/train_fmnist_dit/plots")
    export_only: bool = False
    """Export the last checkpoint without training."""


def captions_and_tokens(folder: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Every training caption (class-major, len(TEMPLATES) per class; the last is the empty
    caption), its T5 ids and mask (len, TOKENS)."""
    captions = [t.format(c) for c in FASHION_MNIST_CLASSES for t in TEMPLATES] + [""]
    write_t5_tokenizer(folder, captions[:-1], vocab_size=TEXT["vocab_size"], model_type="bpe")
    ids, mask = T5Tokenizer(folder)(captions, TOKENS)
    return captions, ids, mask


def models():
    dit = api.PixArtFn(PixArtTransformer2DModel(PixArtConfig.from_diffusers(TRANSFORMER)))
    t5 = api.T5EncoderFn(T5EncoderModel(T5Config.from_transformers(TEXT)))
    return dit, t5


def initial_params(dit, t5, seed: int) -> dict:
    """Flax's initialisers (PixArt's modulation tables ~ N(0, 1/D)), then adaLN-Zero: the
    timestep's modulation projection and the output projection at zero."""
    args, added = dit.example_inputs(1, seq=TOKENS)
    zeros = [jnp.zeros(a.shape, a.dtype) for a in args]
    kw = {k: jnp.ones(v.shape, v.dtype) for k, v in added.items()}
    p = dit.module.init(jax.random.key(seed), *zeros, **kw)["params"]
    flat = flatten_dict(p)
    for path in flat:
        if path[0] in ("adaln_single", "proj_out") and path[-2] in ("linear", "proj_out"):
            flat[path] = jnp.zeros_like(flat[path])
    ids = jnp.zeros((1, TOKENS), jnp.int32)
    text = t5.module.init(jax.random.key(seed + 1), ids)["params"]
    return {"dit": unflatten_dict(flat), "text": text}


def main(cfg: TrainConfig) -> None:
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.plots.mkdir(parents=True, exist_ok=True)
    check_recipe(cfg)
    dit, t5 = models()
    captions, ids, mask = captions_and_tokens(cfg.work / "tokenizer")
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    n_cap = len(TEMPLATES)
    alphas = jnp.asarray(SchedulerConfig.from_diffusers(SCHEDULER).alphas_cumprod(), jnp.float32)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adam(optax.linear_schedule(0.0, cfg.lr, 200)),
    )
    params = initial_params(dit, t5, cfg.seed)
    state = {"params": params, "ema": params, "opt": opt.init(params), "step": 0}
    ckpt, loss_log = cfg.work / "checkpoint.msgpack", cfg.work / "losses.json"
    losses: list[float] = []
    if ckpt.is_file():
        state = serialization.from_bytes(state, ckpt.read_bytes())
        state["step"] = int(state["step"])
        losses = (
            json.loads(loss_log.read_text())[: state["step"] // 50] if loss_log.is_file() else []
        )
        print(f"resumed at step {state['step']}")

    @jax.jit
    def train_step(params, ema, opt_state, x0, cap, key):
        kt, kn = jax.random.split(key)
        t = jax.random.randint(kt, (x0.shape[0],), 0, alphas.shape[0])
        noise = jax.random.normal(kn, x0.shape)
        a = alphas[t][:, None, None, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise

        def loss_fn(p):
            ctx = t5(p["text"], ids, mask)["last_hidden_state"][cap]
            out = dit(p["dit"], xt, t.astype(jnp.float32), ctx, mask[cap])
            return jnp.mean((out - noise) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, upd)
        ema = jax.tree.map(lambda e, p: cfg.ema * e + (1 - cfg.ema) * p, ema, params)
        return params, ema, opt_state, loss

    def save_checkpoint():
        for path, data in (
            (ckpt, serialization.to_bytes(state)),
            (loss_log, json.dumps(losses).encode()),
        ):
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        plot_losses(losses, cfg.plots / "loss.png")

    if not cfg.export_only:
        x, y = padded_train_images()
        rng = np.random.default_rng(cfg.seed + int(state["step"]))
        key = jax.random.key(cfg.seed + int(state["step"]))
        deadline = time.monotonic() + 60 * cfg.minutes
        last_save = time.monotonic()
        bar = tqdm(desc="fmnist DiT", unit="step", initial=int(state["step"]))
        params, ema, opt_state = state["params"], state["ema"], state["opt"]
        while time.monotonic() < deadline and not (
            cfg.max_steps and state["step"] >= cfg.max_steps
        ):
            idx = rng.integers(0, len(x), cfg.batch)
            cap = y[idx] * n_cap + rng.integers(0, n_cap, cfg.batch)
            cap = np.where(rng.random(cfg.batch) < cfg.p_uncond, len(captions) - 1, cap)
            key, sub = jax.random.split(key)
            params, ema, opt_state, loss = train_step(params, ema, opt_state, x[idx], cap, sub)
            state["step"] += 1
            if state["step"] % 50 == 0:
                losses.append(float(loss))
                bar.set_postfix(loss=f"{float(loss):.4f}")
            bar.update(1)
            if time.monotonic() - last_save > 300:
                state.update(params=params, ema=ema, opt=opt_state)
                save_checkpoint()
                last_save = time.monotonic()
        bar.close()
        state.update(params=params, ema=ema, opt=opt_state)
        save_checkpoint()

    print(f"exporting step {int(state['step'])} (EMA weights) to {cfg.out}")
    export(cfg, state, losses)


def recipe(cfg: TrainConfig) -> dict:
    """What a checkpoint depends on; resuming with anything else would mix two models."""
    keep = ("batch", "lr", "ema", "p_uncond", "seed")
    return {
        "transformer": TRANSFORMER,
        "text_encoder": TEXT,
        "scheduler": SCHEDULER,
        "templates": list(TEMPLATES),
        "tokens": TOKENS,
        "init": "flax, adaLN-Zero",
        **{k: getattr(cfg, k) for k in keep},
    }


def check_recipe(cfg: TrainConfig) -> None:
    check_work(cfg.work, recipe(cfg))


def export(cfg: TrainConfig, state, losses) -> None:
    """A diffusers-format PixArt folder in pixel space (no vae/): transformer/, text_encoder/
    (T5), tokenizer/ (the sentencepiece model), scheduler/, model_index.json, training.json."""
    import shutil

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    write_component(out / "transformer", TRANSFORMER, state["ema"]["dit"])
    write_component(out / "text_encoder", TEXT, state["ema"]["text"])
    shutil.copytree(cfg.work / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2))
    index = {
        "_class_name": "PixArtAlphaPipeline",
        "_comment": "pixel space (no vae/): 32x32 grey images in [-1, 1]",
        "transformer": ["diffusers", "PixArtTransformer2DModel"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5Tokenizer"],
        "scheduler": ["diffusers", "DDIMScheduler"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    info = {
        "trained_steps": int(state["step"]),
        "batch": cfg.batch,
        "images_seen": int(state["step"]) * cfg.batch,
        "recipe": recipe(cfg),
        "final_loss_mean_last_20": float(np.mean(losses[-20:])) if losses else None,
        "command": "python experiments/train_fmnist_dit.py",
    }
    (out / "training.json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
