"""Train the `fmnist` preset: a small text-to-image diffusion model on Fashion-MNIST, with
patchpar's own SD-style UNet (cross-attention) in pixel space at 32x32, and the Fashion-MNIST
classifier behind the `prompt_accuracy` metric.

    .venv/bin/python experiments/train_fmnist.py --minutes 60      # resumable; Ctrl-C is safe

- Captions "a photo of a {class}" (and three other templates) are tokenized with the CLIP
  tokenizer and encoded by a small CLIP-style text encoder (the `tiny` preset's shape) that stays
  FROZEN at its seeded random weights. The captions are a closed set (10 classes x 4 templates,
  plus "" for classifier-free guidance), so their embeddings are computed once and every
  training FLOP goes to the UNet; the cross-attention learns to read the frozen embeddings, and
  inference sees exactly the encoder training saw.
- Images: Fashion-MNIST train, padded 28 -> 32 with background, scaled to [-1, 1], one channel.
  No VAE: at 32x32 a latent autoencoder would save little compute and add a second model to
  train; the pipeline treats a folder without vae/ as pixel space.
- Diffusion: DDPM linear betas 1e-4..0.02 over 1000 steps, epsilon prediction, 10% empty
  captions (for CFG), AdamW, EMA of the weights (the EMA weights are exported).
- Checkpoints and the loss log go to --work (git-ignored); the loss curve PNG to
  results/train_fmnist/plots/; the diffusers-format folder to patchpar/weights/fmnist/.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import serialization
from tqdm import tqdm

from patchpar.datasets import FASHION_MNIST_CLASSES, fashion_mnist
from patchpar.measure import classifier as clf
from patchpar.models import api
from patchpar.models.clip import CLIPTextConfig, CLIPTextModel
from patchpar.models.loading import write_component
from patchpar.models.presets import PRESETS
from patchpar.models.tokenizer import load_tokenizer, write_clip_tokenizer
from patchpar.models.unet import UNet2DConditionModel, UNetConfig
from patchpar.sampling.schedulers import SchedulerConfig

TEMPLATES = ("a photo of a {}", "a picture of a {}", "an image of a {}", "a {}")
ARCH = PRESETS[
    "fmnist-random"
]  # the architecture, with random weights (patchpar/models/presets.py)
UNET, TEXT, SCHEDULER = ARCH["unet"], ARCH["text_encoder"], ARCH["scheduler"]


@dataclass(frozen=True)
class TrainConfig:
    minutes: float = 70.0
    """Wall-clock budget for the diffusion model in this invocation (resume adds to it)."""
    max_steps: int = 0
    """Stop at this many steps in all (0: only the time budget)."""
    batch: int = 32
    """Small batches, more updates: the budget is wall-clock on 2 CPU cores (~2.2 s per step)."""
    lr: float = 4e-4
    ema: float = 0.995
    p_uncond: float = 0.1
    """Share of empty captions (classifier-free guidance)."""
    seed: int = 0
    classifier_epochs: int = 3
    work: Path = Path("results/train_fmnist/work")
    """Checkpoints and loss log (git-ignored)."""
    out: Path = Path("patchpar/weights/fmnist")
    """The diffusers-format folder (the `fmnist` preset)."""
    plots: Path = Path("results/train_fmnist/plots")
    export_only: bool = False
    """Export the last checkpoint without training."""


def padded_train_images() -> tuple[np.ndarray, np.ndarray]:
    x, y = fashion_mnist("train")
    x = np.pad(x, ((0, 0), (2, 2), (2, 2)))  # (N, 32, 32), background 0
    return (x.astype(np.float32) / 127.5 - 1.0)[..., None], y


def caption_table(folder: Path, seed: int):
    """Frozen text encoder: embeddings (10 * len(TEMPLATES) + 1, 77, D) of every caption; the
    last row is the empty caption. Returns (table, text params, captions)."""
    write_clip_tokenizer(folder)
    tok = load_tokenizer(folder)
    te = api.TextEncoderFn(CLIPTextModel(CLIPTextConfig.from_transformers(TEXT)))
    params = te.init(seed + 2)
    captions = [t.format(c) for c in FASHION_MNIST_CLASSES for t in TEMPLATES] + [""]
    table = jax.jit(te.__call__)(params, jnp.asarray(tok(captions)))["last_hidden_state"]
    return np.asarray(table), params, captions


def train_classifier(cfg: TrainConfig) -> tuple[dict, float]:
    x, y = fashion_mnist("train")
    xt, yt = fashion_mnist("test")
    module = clf.FashionCNN()
    params = module.init(jax.random.key(cfg.seed), jnp.zeros((1, 28, 28, 1)))["params"]
    opt = optax.adam(1e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        def loss_fn(p):
            logits = module.apply({"params": p}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    rng = np.random.default_rng(cfg.seed)
    xin = np.asarray(clf.to_input(x))
    for epoch in range(cfg.classifier_epochs):
        order = rng.permutation(len(x))
        for i in tqdm(range(0, len(x) - 127, 128), desc=f"classifier epoch {epoch + 1}"):
            idx = order[i : i + 128]
            params, state, _ = step(params, state, xin[idx], y[idx])
    apply = jax.jit(lambda p, xb: module.apply({"params": p}, xb).argmax(-1))
    xtin = clf.to_input(xt)
    pred = np.concatenate(
        [np.asarray(apply(params, xtin[i : i + 1000])) for i in range(0, len(xt), 1000)]
    )
    return params, float((pred == yt).mean())


def main(cfg: TrainConfig) -> None:
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.plots.mkdir(parents=True, exist_ok=True)
    unet = api.UNetFn(UNet2DConditionModel(UNetConfig.from_diffusers(UNET), jnp.float32))
    table, text_params, captions = caption_table(cfg.work / "tokenizer", cfg.seed)
    n_cap = len(TEMPLATES)
    alphas = jnp.asarray(SchedulerConfig.from_diffusers(SCHEDULER).alphas_cumprod(), jnp.float32)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(0.0, cfg.lr, 200), weight_decay=0.0),
    )
    params = unet.init(cfg.seed)
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
    def train_step(params, ema, opt_state, x0, ctx, key):
        kt, kn = jax.random.split(key)
        t = jax.random.randint(kt, (x0.shape[0],), 0, alphas.shape[0])
        noise = jax.random.normal(kn, x0.shape)
        a = alphas[t][:, None, None, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise

        def loss_fn(p):
            return jnp.mean((unet(p, xt, t, ctx) - noise) ** 2)

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
        bar = tqdm(desc="fmnist UNet", unit="step", initial=int(state["step"]))
        params, ema, opt_state = state["params"], state["ema"], state["opt"]
        while time.monotonic() < deadline and not (
            cfg.max_steps and state["step"] >= cfg.max_steps
        ):
            idx = rng.integers(0, len(x), cfg.batch)
            cap = y[idx] * n_cap + rng.integers(0, n_cap, cfg.batch)
            cap = np.where(rng.random(cfg.batch) < cfg.p_uncond, len(captions) - 1, cap)
            key, sub = jax.random.split(key)
            params, ema, opt_state, loss = train_step(
                params, ema, opt_state, x[idx], table[cap], sub
            )
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
    cls_params, acc = train_classifier(cfg)
    print(f"classifier test accuracy: {acc:.4f}")
    export(cfg, state, losses, text_params, cls_params, acc)


def export(cfg: TrainConfig, state, losses, text_params, cls_params, acc: float) -> None:
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    write_component(out / "unet", UNET, state["ema"])
    write_component(out / "text_encoder", TEXT, text_params)
    write_clip_tokenizer(out / "tokenizer")
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2))
    clf.save(out / "classifier", cls_params, clf.FashionCNN().width, acc)
    index = {
        "_class_name": "StableDiffusionPipeline",
        "_comment": "pixel space (no vae/): 32x32 grey images in [-1, 1]",
        "unet": ["diffusers", "UNet2DConditionModel"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", "DDIMScheduler"],
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    info = {
        "trained_steps": int(state["step"]),
        "batch": cfg.batch,
        "images_seen": int(state["step"]) * cfg.batch,
        "final_loss_mean_last_20": float(np.mean(losses[-20:])) if losses else None,
        "classifier_test_accuracy": acc,
        "command": "python experiments/train_fmnist.py",
    }
    (out / "training.json").write_text(json.dumps(info, indent=2))


def plot_losses(losses, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not losses:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = np.arange(1, len(losses) + 1) * 50
    ax.plot(steps, losses, alpha=0.3, label="loss (every 50th step)")
    k = min(20, len(losses))
    ax.plot(steps[k - 1 :], np.convolve(losses, np.ones(k) / k, "valid"), label=f"mean of {k}")
    ax.set(xlabel="step", ylabel="epsilon MSE", title="fmnist UNet training", yscale="log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
