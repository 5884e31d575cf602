"""Train the `fmnist-video` model: a pixel-space Wan (the `fmnist-video-random` architecture) by
rectified flow on Fashion-MNIST clips (`patchpar/lab/clips.py`: 8 frames of 32 x 32, one item
moving left, right, up or down, or zooming in or out, accelerating from rest; captioned "a
sneaker moving left"), with a umT5 of width 32 trained jointly.

    .venv/bin/python experiments/train_fmnist_video.py    # resumable, Ctrl-C is safe

- Pixel space, not a latent: the Wan VAE is causal in time and 4x temporal (8 frames would be 3
  latent frames, too few to split over 4 or 8 devices by frames), and a 4 x 4 token grid a
  frame already comes from 8 x 8 pixel patches; without a VAE the clips are what the study
  measures, with no decoder's error in them and nothing else to train.
- The transformer: WanTransformer3DModel, 6 blocks of 4 heads x 24 (3-D RoPE 8 + 8 + 8), 1 grey
  channel, patches 1 x 8 x 8 (4 x 4 tokens a frame, 128 a clip: with 4 x 4 patches, 512 tokens
  a clip, a step costs 8x more, 1.9 s at batch 16 on 2 cores); adaLN-Zero: its blocks start as
  the identity and its output at zero.
- The text: a sentencepiece BPE on the 60 captions and a 2-layer umT5 of width 32, its states
  zeroed after each caption's own tokens (WanPipeline's), 16 tokens.
- Rectified flow (Wan's): x_s = (1 - s) x0 + s eps, the network predicts eps - x0, s ~
  uniform(0, 1) (--noise-levels: or logit-normal(0, 1), as SD3 and Wan train), the
  transformer's timestep 1000 s; 10% empty captions (classifier-free
  guidance). The scheduler shipped is the flow UniPC with shift 1.
- The class measure's classifier (`classifier/`): the fmnist CNN refitted to items cut out of
  clip frames (`clip_classifier`), made first.
- Adam with clipping and warm-up, EMA of the weights (exported; its decay warms up as
  (1 + t) / (10 + t) to 0.999: after 926 steps a plain 0.999 EMA is still 40% the initial
  weights, whose output is zero); deterministic from --seed, resumed or not
  (step t's clips and noise come from (seed, t)). --work holds the checkpoint and loss log (a
  folder of another recipe is refused); --out the WanPipeline folder without vae/.
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
from train_fmnist import check_work, fit_classifier, plot_losses  # noqa: E402
from train_fmnist_flux import save_atomic  # noqa: E402

from patchpar.lab.clips import FRAMES, MOTIONS, PROFILES, caption, clips  # noqa: E402
from patchpar.measure import classifier as clf  # noqa: E402
from patchpar.measure.classifier import FASHION_MNIST_CLASSES  # noqa: E402
from patchpar.measure.motion import item_crops  # noqa: E402
from patchpar.models.components import T5EncoderFn  # noqa: E402
from patchpar.models.loading import write_component  # noqa: E402
from patchpar.models.t5 import T5Config, T5EncoderModel  # noqa: E402
from patchpar.models.tokenizer import T5Tokenizer, write_t5_tokenizer  # noqa: E402
from patchpar.models.wan import FAMILY, Video  # noqa: E402
from patchpar.models.wan import _renamed as diffusers_names  # noqa: E402
from patchpar.models.wan.presets import PRESETS  # noqa: E402

ARCH = PRESETS["fmnist-video-random"]
TRANSFORMER, TEXT, SCHEDULER = ARCH["transformer"], ARCH["text_encoder"], ARCH["scheduler"]
TOKENS = ARCH["pipeline"]["max_sequence_length"]
CROPS_PER_CLIP, CLASSIFIER_EPOCHS = 2, 2


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 60000
    """Updates in all (a larger count resumes a shorter run's work): 0.5-0.7 s each on 2 CPU
    cores at batch 32 (about 9 hours; resumable), 51-69 a second on a TPU v5e chip (with each
    milestone's compile and export: results/fmnist_video_recipe/tpu_accelerating). The motion
    accuracy passes 80% by 10,000, the class accuracy 75% between 40,000 and 50,000; the
    shipped weights trained 60,001 (results/fmnist_video_recipe)."""
    minutes: float = 720.0
    """Wall-clock budget for this invocation (a resume adds to it): the default lets 60,000
    updates finish on 2 CPU cores at 0.7 s an update."""
    batch: int = 32
    lr: float = 1e-3
    ema: float = 0.999
    p_uncond: float = 0.1
    """Share of empty captions (classifier-free guidance)."""
    motion_profile: str = "accelerating"
    """The clips' pace (`lab.clips.PROFILES`): "accelerating" (from rest), or "constant" (a
    clip played backwards is then the reversed motion's: the model learned the motion's axis
    but not its direction in 44,000 updates; results/fmnist_video_recipe)."""
    noise_levels: str = "uniform"
    """How s is drawn: "uniform" on (0, 1), or "logit-normal" (0, 1) as SD3 and Wan (rarely near
    0 or 1); at 3,500 updates the two measured alike (results/fmnist_video_recipe)."""
    seed: int = 0
    clips: int = 0
    """Train on the clips of the first N training images (0: all 60,000; tests use a few)."""
    work: Path = Path("runs/train_fmnist_video/work")
    """Checkpoint and loss log (git-ignored)."""
    out: Path = Path("runs/train_fmnist_video/weights")
    """The WanPipeline folder (the `fmnist-video` preset's weights)."""
    plots: Path = Path("runs/train_fmnist_video/plots")
    export_only: bool = False
    """Export the last checkpoint without training."""


def recipe(cfg: TrainConfig) -> dict:
    """What the checkpoint depends on; resuming with anything else would mix two models."""
    keep = ("batch", "lr", "ema", "p_uncond", "seed", "noise_levels", "motion_profile")
    return {
        "recipe": "fmnist-video",
        "transformer": TRANSFORMER,
        "text_encoder": TEXT,
        "scheduler": SCHEDULER,
        "motions": list(MOTIONS),
        "frames": FRAMES,
        "tokens": TOKENS,
        "flow": "rectified, eps - x0 target, timestep 1000 s",
        "init": "flax, adaLN-Zero (time_proj and proj_out zero)",
        "ema_warmup": "decay min(ema, (1 + t) / (10 + t)) at step t",
        "classifier": f"FashionCNN on item_crops, {CROPS_PER_CLIP} frames a clip, "
        f"{CLASSIFIER_EPOCHS} epochs",
        **{k: getattr(cfg, k) for k in keep},
        **({"clips": cfg.clips} if cfg.clips else {}),  # all of them unless told
    }


def training_clips(cfg: TrainConfig):
    """(clips (N, F, 32, 32, 1) float32 in [-1, 1], caption index (N,)), cached in --work."""
    n = cfg.clips or 60_000
    path = cfg.work / f"clips-{n}-{cfg.motion_profile}.npz"
    if path.is_file():
        data = np.load(path)
        x, cap = data["x"], data["cap"]
    else:
        x, labels, motions, _ = clips("train", n, seed=cfg.seed, profile=cfg.motion_profile)
        cap = labels * len(MOTIONS) + motions
        with open(path.with_suffix(".tmp"), "wb") as f:
            np.savez(f, x=x, cap=cap)
        os.replace(path.with_suffix(".tmp"), path)
    return x, cap


def clip_classifier(cfg: TrainConfig, x: np.ndarray, caps: np.ndarray) -> Path:
    """The classifier of the class measure, in --work/classifier (made once): the fmnist CNN
    fitted to the items cut out of clip frames by `item_crops` (CROPS_PER_CLIP frames of each
    training clip), tested on every frame of 10,000 test clips (--clips of them if set).
    fmnist's own classifier, trained on whole 28 x 28 items, reads an item of 12-24 pixels
    blown up to 28 right only ~80% of the time on ground-truth clips."""
    folder = cfg.work / "classifier"
    if (folder / "model.safetensors").is_file():
        return folder
    frames = np.arange(CROPS_PER_CLIP) * (FRAMES // CROPS_PER_CLIP)
    crops = [item_crops(v)[(frames + i) % FRAMES] for i, v in
             enumerate(tqdm(x, desc="item crops", unit="clip"))]  # fmt: skip
    xt, yt, _, _ = clips("test", cfg.clips or 10_000, seed=cfg.seed, profile=cfg.motion_profile)
    crops_t = np.concatenate([item_crops(v) for v in tqdm(xt, desc="test crops", unit="clip")])
    params, acc = fit_classifier(np.concatenate(crops), np.repeat(caps // len(MOTIONS),
                                 CROPS_PER_CLIP), crops_t, np.repeat(yt, FRAMES),
                                 CLASSIFIER_EPOCHS, cfg.seed)  # fmt: skip
    print(f"clip classifier: {acc:.4f} of the test clips' frames")
    clf.save(folder, params, clf.FashionCNN().width, acc)
    return folder


def captions_and_tokens(folder: Path):
    """Every caption (class-major, one per motion; the last is ""), its umT5 ids and mask."""
    captions = [caption(c, m) for c in range(len(FASHION_MNIST_CLASSES))
                for m in range(len(MOTIONS))] + [""]  # fmt: skip
    write_t5_tokenizer(folder / "tokenizer", captions[:-1], vocab_size=TEXT["vocab_size"],
                       model_type="bpe")  # fmt: skip
    ids, mask = T5Tokenizer(folder / "tokenizer", lower=False)(captions, TOKENS)
    return captions, np.asarray(ids), np.asarray(mask)


def models():
    wan = FAMILY.denoiser(TRANSFORMER, "transformer").with_video(Video(FRAMES, "frames"))
    t5 = T5EncoderFn(T5EncoderModel(T5Config.from_transformers(TEXT)))
    return wan, t5


def initial_params(wan, t5, seed: int) -> dict:
    """Flax's initialisers, adaLN-Zero (DiT's): the timestep's projection to the blocks'
    modulation at zero, so that every block starts as the identity (its gates 0; the
    `scale_shift_table`s start at 0), and the output projection at zero (the model starts
    predicting 0)."""
    flat = flatten_dict(wan.init(seed))
    for path in flat:
        if path[0] == "proj_out" or path[:2] == ("condition_embedder", "time_proj"):
            flat[path] = jnp.zeros_like(flat[path])
    t5_p = t5.module.init(jax.random.key(seed + 2), jnp.zeros((1, TOKENS), jnp.int32))["params"]
    return {"wan": unflatten_dict(flat), "t5": t5_p}


def train(cfg: TrainConfig, x: np.ndarray, caps: np.ndarray):
    """-> (state with the EMA weights, losses). Resumable from checkpoint.msgpack."""
    wan, t5 = models()
    captions, ids, mask = captions_and_tokens(cfg.work)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(optax.linear_schedule(0.0, cfg.lr, 200))
    )
    params = initial_params(wan, t5, cfg.seed)
    state = {"params": params, "ema": params, "opt": opt.init(params), "step": 0,
             "losses": np.zeros(0)}  # fmt: skip
    ckpt = cfg.work / "checkpoint.msgpack"
    if ckpt.is_file():
        state = serialization.from_bytes(state, ckpt.read_bytes())
        print(f"resumed at step {int(state['step'])}")
    step = int(state["step"])
    row = wan.row_multiple

    @jax.jit
    def update(params, ema, opt_state, x0, cap, key, t):
        ks, kn = jax.random.split(key)
        if cfg.noise_levels == "uniform":
            s = jax.random.uniform(ks, (x0.shape[0],))
        else:
            s = jax.nn.sigmoid(jax.random.normal(ks, (x0.shape[0],)))  # logit-normal(0, 1)
        noise = jax.random.normal(kn, x0.shape)
        xs = (1 - s)[:, None, None, None, None] * x0 + s[:, None, None, None, None] * noise
        target = wan.video.to_tall(noise - x0, row)

        def loss_fn(p):
            ctx = t5(p["t5"], ids, mask)["last_hidden_state"]
            ctx = (ctx * mask[..., None].astype(ctx.dtype))[cap]  # zeros past each caption
            out = wan(p["wan"], wan.video.to_tall(xs, row), 1000.0 * s, ctx)
            return jnp.mean((out - target) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, upd)
        decay = jnp.minimum(cfg.ema, (1.0 + t) / (10.0 + t))  # a short run's EMA is not its init
        ema = jax.tree.map(lambda e, q: decay * e + (1 - decay) * q, ema, params)
        return params, ema, opt_state, loss

    key = jax.random.key(cfg.seed)
    params, ema, opt_state = state["params"], state["ema"], state["opt"]
    losses = list(state["losses"])
    deadline, last_save = time.monotonic() + 60 * cfg.minutes, time.monotonic()
    bar = tqdm(desc="fmnist-video", unit="step", initial=step, total=cfg.max_steps)
    while step < cfg.max_steps and time.monotonic() < deadline:
        rng = np.random.default_rng([cfg.seed, step])  # step t's batch, however many resumes
        idx = rng.integers(0, len(x), cfg.batch)
        cap = np.where(rng.random(cfg.batch) < cfg.p_uncond, len(captions) - 1, caps[idx])
        x0 = x[idx].astype(np.float32)[..., None] / 127.5 - 1.0  # (B, F, 32, 32, 1)
        sub = jax.random.fold_in(key, step)
        params, ema, opt_state, loss = update(params, ema, opt_state, x0, cap, sub,
                                              jnp.float32(step))  # fmt: skip
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


def export(cfg: TrainConfig, state, losses) -> None:
    """A WanPipeline folder without vae/ (pixel space): transformer/ (diffusers' key names),
    text_encoder/ + tokenizer/ (umT5), scheduler/, classifier/ (the class measure's CNN),
    model_index.json, training.json."""
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    trained = {**TRANSFORMER, "trained_frames": [FRAMES]}  # other lengths: a warning
    write_component(out / "transformer", trained, state["ema"]["wan"],
                    lambda s: diffusers_names(s, to_module=False))  # fmt: skip
    write_component(out / "text_encoder", TEXT, state["ema"]["t5"])
    shutil.copytree(cfg.work / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    shutil.copytree(cfg.work / "classifier", out / "classifier", dirs_exist_ok=True)
    (out / "scheduler").mkdir(exist_ok=True)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER, indent=2))
    index = {
        "_class_name": "WanPipeline",
        "_comment": "8 grey frames of 32x32 in pixel space (no vae/): patchpar's fmnist-video",
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "scheduler": ["diffusers", SCHEDULER["_class_name"]],
        "max_sequence_length": TOKENS,
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    info = {
        "trained_steps": int(state["step"]),
        "batch": cfg.batch,
        "clips_seen": int(state["step"]) * cfg.batch,
        "recipe": recipe(cfg),
        "final_loss_mean_last_20": float(np.mean(losses[-20:])) if losses else None,
        "classifier_test_accuracy": json.loads(
            (cfg.work / "classifier" / "config.json").read_text()
        )["test_accuracy"],
        "command": "python experiments/train_fmnist_video.py",
    }
    (out / "training.json").write_text(json.dumps(info, indent=2))


def main(cfg: TrainConfig) -> None:
    if cfg.noise_levels not in ("uniform", "logit-normal"):
        raise SystemExit(f"--noise-levels {cfg.noise_levels!r}: use 'uniform' or 'logit-normal'")
    if cfg.motion_profile not in PROFILES:
        raise SystemExit(f"--motion-profile {cfg.motion_profile!r}: one of {list(PROFILES)}")
    cfg.work.mkdir(parents=True, exist_ok=True)
    cfg.plots.mkdir(parents=True, exist_ok=True)
    check_work(cfg.work, recipe(cfg))
    x, caps = training_clips(cfg)
    clip_classifier(cfg, x, caps)
    if cfg.export_only:
        state = serialization.msgpack_restore((cfg.work / "checkpoint.msgpack").read_bytes())
        losses = list(state["losses"])
    else:
        state, losses = train(cfg, x, caps)
    plot_losses(losses, cfg.plots / "loss.png")
    print(f"exporting step {int(state['step'])} (EMA weights) to {cfg.out}")
    export(cfg, state, losses)


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
