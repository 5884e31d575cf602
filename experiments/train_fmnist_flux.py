"""Train the `fmnist-flux` preset: a FLUX.1-architecture text-to-image model (double- and
single-stream blocks, RoPE) trained by rectified flow on Fashion-MNIST (the data, captions and
classifier of `fmnist`), on the latent of a small VAE trained first, with a CLIP and a T5 text
encoder of patchpar's own trained jointly with the transformer.

    .venv/bin/python experiments/train_fmnist_flux.py    # ~75 minutes; resumable, Ctrl-C is safe

- The VAE: diffusers' AutoencoderKL with two levels (16, 32 channels, one resnet each), one grey
  channel in and out, 4 latent channels at 16 x 16 (downsampling 2), no quant convs (FLUX's
  VAE has none); trained by MSE with a small KL (1e-6 x, as SD's) on sampled latents. Its
  latents' mean and std over the training set become `shift_factor` and `scaling_factor`.
  Why a latent: FLUX packs 2 x 2 latent pixels into a token, so 32 x 32 pixels would be 256
  tokens; the 16 x 16 latent is 64 tokens (8 x 8), the fmnist-dit's count, at the same budget.
- The transformer: FluxTransformer2DModel, 4 double-stream and 8 single-stream blocks of width
  96 (4 heads of 24, RoPE axes 8 + 8 + 8), 16 channels in (4 x 4 latent channels packed).
  GUIDANCE-FREE (schnell-like: no guidance embedding): trained with 10% empty captions and
  sampled with true classifier-free guidance (`true_cfg_scale`, diffusers' FluxPipeline
  option), whose scale is chosen on held-out seeds (paper_repro.md "The fmnist-flux model").
  adaLN's modulation projections and the output projection start at zero (adaLN-Zero).
- The text: CLIP-L's tokenizer and a 2-layer CLIP text encoder of width 32 (its pooled output
  is `pooled_projections`), a sentencepiece BPE on the captions and a 2-layer T5 of width 32
  (its 16 token states are the context). As diffusers' FluxPipeline, T5 reads no attention
  mask and the transformer attends the padding.
- Rectified flow (SD3 / FLUX): x_s = (1 - s) x0 + s eps, the network predicts eps - x0, the
  noise level s ~ logit-normal(0, 1) (SD3's), the transformer's timestep input is s. The
  scheduler shipped is FlowMatchEulerDiscreteScheduler with shift 1 (no resolution shift).
- Adam with clipping and warm-up, EMA of the weights (exported), deterministic from --seed for
  a given --max-steps. --work holds both phases' checkpoints and the loss logs (git-ignored; a
  folder of another recipe is refused); --out the diffusers-format FluxPipeline folder (the
  shipped model is patchpar/weights/fmnist-flux/, written only with --out
  patchpar/weights/fmnist-flux).
"""

from __future__ import annotations

import json
import os
import shutil
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
from train_fmnist import TEMPLATES, check_work, padded_train_images, plot_losses  # noqa: E402
from train_fmnist import TEXT as CLIP_TEXT  # noqa: E402

from patchpar.measure.classifier import FASHION_MNIST_CLASSES  # noqa: E402
from patchpar.models.clip import CLIPTextConfig, CLIPTextModel  # noqa: E402
from patchpar.models.components import T5EncoderFn, TextEncoderFn, VAEFn  # noqa: E402
from patchpar.models.flux import FAMILY  # noqa: E402
from patchpar.models.loading import write_component  # noqa: E402
from patchpar.models.t5 import T5Config, T5EncoderModel  # noqa: E402
from patchpar.models.tokenizer import (  # noqa: E402
    T5Tokenizer,
    load_tokenizer,
    write_clip_tokenizer,
    write_t5_tokenizer,
)
from patchpar.models.vae import AutoencoderKL, VAEConfig  # noqa: E402

TOKENS = 16  # T5 tokens (the pipeline's max_sequence_length): every caption fits
VAE = {
    "_class_name": "AutoencoderKL",
    "in_channels": 1,
    "out_channels": 1,
    "latent_channels": 4,
    "block_out_channels": [16, 32],
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "act_fn": "silu",
    "sample_size": 32,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
TRANSFORMER = {
    "_class_name": "FluxTransformer2DModel",
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 4,
    "num_single_layers": 8,
    "attention_head_dim": 24,
    "num_attention_heads": 4,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "guidance_embeds": False,
    "axes_dims_rope": [8, 8, 8],
}
T5_TEXT = {
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
SCHEDULER = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}
KL_WEIGHT = 1e-6


@dataclass(frozen=True)
class TrainConfig:
    vae_steps: int = 3000
    """VAE updates (batch 32)."""
    max_steps: int = 8000
    """Transformer updates in all (the run is deterministic for a given count)."""
    minutes: float = 90.0
    """Wall-clock safety budget for this invocation (resume adds to it)."""
    batch: int = 32
    lr: float = 5e-4
    ema: float = 0.999
    p_uncond: float = 0.1
    """Share of empty captions (classifier-free guidance)."""
    seed: int = 0
    images: int = 0
    """Train on the first N Fashion-MNIST training images (0: all 60,000; tests use a few)."""
    work: Path = Path("runs/train_fmnist_flux/work")
    """Checkpoints and loss logs (git-ignored)."""
    out: Path = Path("runs/train_fmnist_flux/weights")
    """The diffusers-format FLUX folder (the `fmnist-flux` preset)."""
    plots: Path = Path("runs/train_fmnist_flux/plots")
    export_only: bool = False
    """Export the last checkpoints without training."""


def recipe(cfg: TrainConfig) -> dict:
    """What the checkpoints depend on; resuming with anything else would mix two models."""
    keep = ("vae_steps", "batch", "lr", "ema", "p_uncond", "seed")
    return {
        "recipe": "fmnist-flux",
        "vae": VAE,
        "transformer": TRANSFORMER,
        "text_encoder": CLIP_TEXT,
        "text_encoder_2": T5_TEXT,
        "scheduler": SCHEDULER,
        "templates": list(TEMPLATES),
        "tokens": TOKENS,
        "kl_weight": KL_WEIGHT,
        "flow": "rectified, logit-normal(0, 1) noise levels, eps - x0 target",
        "init": "flax, adaLN-Zero",
        **{k: getattr(cfg, k) for k in keep},
        **({"images": cfg.images} if cfg.images else {}),  # all of them unless told
    }


def check_recipe(cfg: TrainConfig) -> None:
    check_work(cfg.work, recipe(cfg))


def save_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def train_vae(cfg: TrainConfig, x: np.ndarray):
    """Phase 1 -> (VAEFn, EMA-free params, losses). Resumable from vae.msgpack."""
    vae = VAEFn(AutoencoderKL(VAEConfig.from_diffusers(VAE), jnp.float32))
    params = vae.module.init(jax.random.key(cfg.seed + 10), jnp.zeros((1, 32, 32, 1)))["params"]
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = {"params": params, "opt": opt.init(params), "step": 0, "losses": np.zeros(0)}
    ckpt = cfg.work / "vae.msgpack"
    if ckpt.is_file():
        state = serialization.from_bytes(state, ckpt.read_bytes())
    start = int(state["step"])
    if start >= cfg.vae_steps:
        return vae, state["params"], list(state["losses"])

    @jax.jit
    def update(params, opt_state, xb, key):
        def loss_fn(p):
            mean, logvar = vae.module.apply({"params": p}, xb, method=AutoencoderKL.encode)
            z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
            rec = vae.module.apply({"params": p}, z, method=AutoencoderKL.decode)
            kl = 0.5 * jnp.mean(jnp.sum(mean**2 + jnp.exp(logvar) - 1 - logvar, (1, 2, 3)))
            mse = jnp.mean((rec - xb) ** 2)
            return mse + KL_WEIGHT * kl, mse

        (_, mse), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, mse

    rng = np.random.default_rng(cfg.seed + 10 + start)
    key = jax.random.key(cfg.seed + 10 + start)
    params, opt_state, losses = state["params"], state["opt"], list(state["losses"])
    last_save = time.monotonic()
    for step in tqdm(range(start, cfg.vae_steps), desc="fmnist-flux VAE", initial=start,
                     total=cfg.vae_steps):  # fmt: skip
        key, sub = jax.random.split(key)
        params, opt_state, mse = update(params, opt_state, x[rng.integers(0, len(x), 32)], sub)
        if (step + 1) % 50 == 0:
            losses.append(float(mse))
        if time.monotonic() - last_save > 300 or step + 1 == cfg.vae_steps:
            state = {"params": params, "opt": opt_state, "step": step + 1,
                     "losses": np.asarray(losses, np.float32)}  # fmt: skip
            save_atomic(ckpt, serialization.to_bytes(state))
            last_save = time.monotonic()
    return vae, params, losses


def encode_all(vae: VAEFn, params, x: np.ndarray) -> tuple[np.ndarray, float, float]:
    """The posterior means of every training image (N, 16, 16, 4), and the shift and scale
    that make them zero-mean, unit-std (FLUX's `shift_factor`, `scaling_factor`)."""
    enc = jax.jit(lambda p, xb: vae.encode(p, xb)[0])
    z = np.concatenate([np.asarray(enc(params, x[i : i + 1000])) for i in range(0, len(x), 1000)])
    shift, std = float(z.mean()), float(z.std())
    return (z - shift) / std, shift, 1.0 / std


def captions_and_tokens(folder: Path):
    """Every training caption (class-major, len(TEMPLATES) per class; the last is ""), its CLIP
    ids (len, 77) and T5 ids (len, TOKENS)."""
    captions = [t.format(c) for c in FASHION_MNIST_CLASSES for t in TEMPLATES] + [""]
    write_clip_tokenizer(folder / "tokenizer")
    write_t5_tokenizer(folder / "tokenizer_2", captions[:-1], vocab_size=T5_TEXT["vocab_size"],
                       model_type="bpe")  # fmt: skip
    clip_ids = np.asarray(load_tokenizer(folder / "tokenizer")(captions))
    t5_ids, _ = T5Tokenizer(folder / "tokenizer_2", lower=False)(captions, TOKENS)
    return captions, clip_ids, np.asarray(t5_ids)


def models():
    flux = FAMILY.denoiser(TRANSFORMER, "transformer")
    clip = TextEncoderFn(CLIPTextModel(CLIPTextConfig.from_transformers(CLIP_TEXT)))
    t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(T5_TEXT)))
    return flux, clip, t5


def initial_params(flux, clip, t5, seed: int) -> dict:
    """Flax's initialisers, then adaLN-Zero: every modulation projection (`norm*/linear`) and
    the output projection at zero, so every block starts as the identity."""
    p = flux.init(seed)
    flat = flatten_dict(p)
    for path in flat:
        if (path[-2] == "linear" and path[-3].startswith("norm")) or path[0] == "proj_out":
            flat[path] = jnp.zeros_like(flat[path])
    clip_p = clip.module.init(jax.random.key(seed + 1), jnp.zeros((1, 77), jnp.int32))["params"]
    t5_p = t5.module.init(jax.random.key(seed + 2), jnp.zeros((1, TOKENS), jnp.int32))["params"]
    return {"flux": unflatten_dict(flat), "clip": clip_p, "t5": t5_p}


def train_flux(cfg: TrainConfig, z: np.ndarray, y: np.ndarray):
    """Phase 2 -> (state with the EMA weights, losses). Resumable from checkpoint.msgpack."""
    flux, clip, t5 = models()
    captions, clip_ids, t5_ids = captions_and_tokens(cfg.work)
    clip_ids, t5_ids = jnp.asarray(clip_ids), jnp.asarray(t5_ids)
    n_cap = len(TEMPLATES)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(optax.linear_schedule(0.0, cfg.lr, 200))
    )
    params = initial_params(flux, clip, t5, cfg.seed)
    state = {"params": params, "ema": params, "opt": opt.init(params), "step": 0,
             "losses": np.zeros(0)}  # fmt: skip
    ckpt = cfg.work / "checkpoint.msgpack"
    if ckpt.is_file():
        state = serialization.from_bytes(state, ckpt.read_bytes())
        print(f"resumed at step {int(state['step'])}")
    step = int(state["step"])

    @jax.jit
    def update(params, ema, opt_state, z0, cap, key):
        ks, kn = jax.random.split(key)
        s = jax.nn.sigmoid(jax.random.normal(ks, (z0.shape[0],)))  # logit-normal(0, 1)
        noise = jax.random.normal(kn, z0.shape)
        zs = (1 - s)[:, None, None, None] * z0 + s[:, None, None, None] * noise

        def loss_fn(p):
            pooled = clip(p["clip"], clip_ids)["pooler_output"][cap]
            ctx = t5(p["t5"], t5_ids)["last_hidden_state"][cap]
            out = flux(p["flux"], zs, s, ctx, pooled_projections=pooled)
            return jnp.mean((out - (noise - z0)) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, upd)
        ema = jax.tree.map(lambda e, q: cfg.ema * e + (1 - cfg.ema) * q, ema, params)
        return params, ema, opt_state, loss

    rng = np.random.default_rng(cfg.seed + step)
    key = jax.random.key(cfg.seed + step)
    params, ema, opt_state = state["params"], state["ema"], state["opt"]
    losses = list(state["losses"])
    deadline, last_save = time.monotonic() + 60 * cfg.minutes, time.monotonic()
    bar = tqdm(desc="fmnist-flux transformer", unit="step", initial=step, total=cfg.max_steps)
    while step < cfg.max_steps and time.monotonic() < deadline:
        idx = rng.integers(0, len(z), cfg.batch)
        cap = y[idx] * n_cap + rng.integers(0, n_cap, cfg.batch)
        cap = np.where(rng.random(cfg.batch) < cfg.p_uncond, len(captions) - 1, cap)
        key, sub = jax.random.split(key)
        params, ema, opt_state, loss = update(params, ema, opt_state, z[idx], cap, sub)
        step += 1
        if step % 50 == 0:
            losses.append(float(loss))
            bar.set_postfix(loss=f"{float(loss):.4f}")
        bar.update(1)
        if time.monotonic() - last_save > 300 or step == cfg.max_steps:
            state = {"params": params, "ema": ema, "opt": opt_state, "step": step,
                     "losses": np.asarray(losses, np.float32)}  # fmt: skip
            save_atomic(ckpt, serialization.to_bytes(state))
            last_save = time.monotonic()
    bar.close()
    state = {"params": params, "ema": ema, "opt": opt_state, "step": step,
             "losses": np.asarray(losses, np.float32)}  # fmt: skip
    save_atomic(ckpt, serialization.to_bytes(state))
    return state, losses


def export(cfg, vae_params, shift, scale, state, vae_losses, losses) -> None:
    """A diffusers-format FluxPipeline folder: transformer/, vae/ (with the latents' shift and
    scale), text_encoder/ + tokenizer/ (CLIP), text_encoder_2/ + tokenizer_2/ (T5),
    scheduler/, model_index.json (max_sequence_length), training.json."""
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    write_component(out / "transformer", {**TRANSFORMER, "sample_size": 16}, state["ema"]["flux"])
    vae_cfg = {**VAE, "shift_factor": shift, "scaling_factor": scale}
    write_component(out / "vae", vae_cfg, vae_params)
    write_component(out / "text_encoder", CLIP_TEXT, state["ema"]["clip"])
    write_component(out / "text_encoder_2", T5_TEXT, state["ema"]["t5"])
    for tok in ("tokenizer", "tokenizer_2"):
        shutil.copytree(cfg.work / tok, out / tok, dirs_exist_ok=True)
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2))
    index = {
        "_class_name": "FluxPipeline",
        "_comment": "32x32 grey images; guidance-free: sample with true_cfg_scale",
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "max_sequence_length": TOKENS,
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    info = {
        "trained_steps": int(state["step"]),
        "batch": cfg.batch,
        "images_seen": int(state["step"]) * cfg.batch,
        "recipe": recipe(cfg),
        "vae_final_mse_mean_last_20": float(np.mean(vae_losses[-20:])) if vae_losses else None,
        "final_loss_mean_last_20": float(np.mean(losses[-20:])) if losses else None,
        "command": "python experiments/train_fmnist_flux.py",
    }
    (out / "training.json").write_text(json.dumps(info, indent=2))


def main(cfg: TrainConfig) -> None:
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.plots.mkdir(parents=True, exist_ok=True)
    check_recipe(cfg)
    x, y = padded_train_images()
    if cfg.images:
        x, y = x[: cfg.images], y[: cfg.images]
    vae, vae_params, vae_losses = train_vae(cfg, x)
    z, shift, scale = encode_all(vae, vae_params, x)
    mse = f"{np.mean(vae_losses[-20:]):.5f}" if vae_losses else "(no loss logged yet)"
    print(f"VAE: reconstruction MSE {mse}; latents shift {shift:.4f}, scale {scale:.4f}")
    if cfg.export_only:
        state = serialization.msgpack_restore((cfg.work / "checkpoint.msgpack").read_bytes())
        losses = list(state["losses"])
    else:
        state, losses = train_flux(cfg, z, y)
    plot_losses(losses, cfg.plots / "loss.png")
    print(f"exporting step {int(state['step'])} (EMA weights) to {cfg.out}")
    export(cfg, vae_params, shift, scale, state, vae_losses, losses)


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
