"""Train `fmnist-clip`: a small CLIP on Fashion-MNIST, the model behind the `clip_score` metric
of `fmnist` runs (patchpar/weights/fmnist-clip/).

    .venv/bin/python experiments/train_clip_fmnist.py      # ~10 minutes on 2 cores; resumable

- open_clip's own classes and loss: the architecture is a custom model config in open_clip's
  local-dir format (`open_clip_config.json`, loaded as `local-dir:<folder>`): a small ResNet
  image tower on 32x32 images (open_clip's ModifiedResNet) and a text transformer over open_clip's BPE tokenizer (context
  16 tokens), trained with `open_clip.ClipLoss` (symmetric InfoNCE, learned temperature).
- Images: Fashion-MNIST train, padded 28 -> 32 with background as the `fmnist` diffusion model
  was trained (train_fmnist.py), shifted by up to 2 pixels and flipped left-right at random.
  The preprocessing is open_clip's own (the config sets mean and std 0.5), checked at start
  against `preprocess` on PIL images.
- Captions: each image gets one of TRAIN_TEMPLATES at random ("a photo of a sneaker", "a black
  and white picture of a sneaker", ...). HELD_OUT_TEMPLATES are never seen in training; the
  zero-shot accuracy is measured with them on the 10,000 test images (padded the same way),
  one text embedding per class (the mean over those templates, as CLIP's prompt ensembles),
  and also per template.
- Deterministic from --seed (torch's generator and a NumPy order per epoch); a checkpoint is
  saved after every epoch in --work (git-ignored) and a rerun resumes from it (a work folder
  made with a different recipe is refused).
- Export: open_clip_config.json, the weights as float16 `open_clip_model.safetensors` (the
  token embedding alone is 49,408 x 64), and training.json with the accuracies, measured on the exported checkpoint loaded
  through `patchpar.measure.features.clip` (what the metric uses).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro
from tqdm import tqdm

from patchpar.lab.datasets import fashion_mnist, pad32
from patchpar.measure.classifier import FASHION_MNIST_CLASSES

NAME = "fmnist-clip"
MODEL_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {  # open_clip's ModifiedResNet (a list of layers), 32 -> 1x1 + attention pool
        "image_size": 32,
        "layers": [1, 1, 1, 1],
        "width": 16,
    },
    "text_cfg": {
        "context_length": 16,  # the longest caption is 12 tokens with start and end
        "vocab_size": 49408,  # open_clip's BPE vocabulary
        "width": 64,
        "heads": 2,
        "layers": 3,
    },
}
PREPROCESS = {"mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}  # grey [0, 1] -> [-1, 1]
TRAIN_TEMPLATES = (
    "a photo of a {}",
    "a picture of a {}",
    "an image of a {}",
    "a {}",
    "a black and white picture of a {}",
    "a grey photo of a {}",
    "a photo of the {}",
    "a small picture of a {}",
    "a centered photo of a {}",
)
HELD_OUT_TEMPLATES = (
    "a black and white photo of the {}",
    "a small image of the {}",
    "a picture of the {}",
    "a grey image of a {}",
)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 15
    """Passes over the 60,000 training images in all (resume continues to this)."""
    batch: int = 256
    lr: float = 1e-3
    """AdamW peak learning rate, after a linear warm-up, cosine decay to 0 at the last step."""
    warmup_steps: int = 200
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 2
    """torch threads (CPU)."""
    max_epochs_now: int = 0
    """Train at most this many epochs in this invocation (0: to --epochs); for tests."""
    train_limit: int = 0
    """Use only the first N training images (0: all); for tests."""
    test_limit: int = 0
    """Evaluate on the first N test images (0: all 10,000); for tests."""
    work: Path = Path("runs/train_clip_fmnist/work")
    """Checkpoint and loss log (git-ignored)."""
    out: Path = Path("runs/train_clip_fmnist/weights")
    """The exported model: open_clip_config.json, open_clip_model.safetensors, training.json
    (the shipped one is patchpar/weights/fmnist-clip: written only when named here)."""
    plots: Path = Path("runs/train_clip_fmnist/plots")


def captions(templates) -> list[str]:
    """Caption c * len(templates) + t is template t filled with class c."""
    return [t.format(c) for c in FASHION_MNIST_CLASSES for t in templates]


def pad_shift(x: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
    """(N, 28, 28) uint8 -> (N, 32, 32): padded with background, centred (rng None) or shifted
    by up to 2 pixels each way and flipped left-right at random."""
    if rng is None:
        return pad32(x)
    n = len(x)
    out = np.zeros((n, 32, 32), np.uint8)
    dy, dx = rng.integers(0, 5, n), rng.integers(0, 5, n)
    flip = rng.random(n) < 0.5
    for i in range(n):
        im = x[i, :, ::-1] if flip[i] else x[i]
        out[i, dy[i] : dy[i] + 28, dx[i] : dx[i] + 28] = im
    return out


def to_tensor(x: np.ndarray, mean, std) -> torch.Tensor:
    """(N, 32, 32) uint8 grey -> (N, 3, 32, 32) normalised, as open_clip's preprocess of the
    same image converted to RGB."""
    t = torch.from_numpy(x).float().div(255.0)[:, None].expand(-1, 3, -1, -1)
    return (t - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]


def write_config(folder: Path) -> Path:
    """open_clip's local-dir format: open_clip_config.json (model and preprocess config)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_cfg": MODEL_CONFIG, "preprocess_cfg": PREPROCESS}
    (folder / "open_clip_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def create(folder: Path):
    """(model, preprocess, tokenizer) of a fresh, seeded fmnist-clip (config only in `folder`)."""
    import open_clip

    spec = f"local-dir:{write_config(folder)}"
    model, _, preprocess = open_clip.create_model_and_transforms(spec, device="cpu")
    return model, preprocess, open_clip.get_tokenizer(spec)


def check_preprocess(model, preprocess, x: np.ndarray) -> None:
    """The training transform must be open_clip's preprocess (what the metric applies)."""
    from PIL import Image

    pp = model.visual.preprocess_cfg
    ours = to_tensor(x[:4], pp["mean"], pp["std"])
    theirs = torch.stack([preprocess(Image.fromarray(im).convert("RGB")) for im in x[:4]])
    if not torch.allclose(ours, theirs, atol=1e-6):
        raise SystemExit("training transform differs from open_clip's preprocess")


@torch.no_grad()
def zero_shot(model, tokenizer, images: np.ndarray, labels: np.ndarray, templates) -> dict:
    """Accuracy of the class whose mean caption embedding is nearest, over `templates`
    together (prompt ensemble) and each alone."""
    model.eval()
    pp = model.visual.preprocess_cfg
    img = torch.cat(
        [
            model.encode_image(to_tensor(images[i : i + 1000], pp["mean"], pp["std"]))
            for i in range(0, len(images), 1000)
        ]
    )
    img = img / img.norm(dim=-1, keepdim=True)
    txt = model.encode_text(tokenizer(captions(templates)))
    txt = (txt / txt.norm(dim=-1, keepdim=True)).reshape(10, len(templates), -1)

    def accuracy(emb):  # emb (10, D)
        emb = emb / emb.norm(dim=-1, keepdim=True)
        return float(((img @ emb.T).argmax(1).numpy() == labels).mean())

    return {
        "ensemble": accuracy(txt.mean(1)),
        "per_template": {t: accuracy(txt[:, j]) for j, t in enumerate(templates)},
    }


def recipe(cfg: TrainConfig) -> dict:
    keep = ("epochs", "batch", "lr", "warmup_steps", "weight_decay", "seed", "train_limit")
    return {
        "model": MODEL_CONFIG,
        "train_templates": list(TRAIN_TEMPLATES),
        "held_out_templates": list(HELD_OUT_TEMPLATES),
        **{k: getattr(cfg, k) for k in keep},
    }


def check_recipe(cfg: TrainConfig) -> None:
    path = cfg.work / "recipe.json"
    want = json.loads(json.dumps(recipe(cfg)))
    if path.is_file():
        have = json.loads(path.read_text())
        if have != want:
            diff = sorted(k for k in {*have, *want} if have.get(k) != want.get(k))
            raise SystemExit(
                f"{cfg.work} holds a checkpoint of a different recipe (differs in {diff}); "
                f"pass a fresh --work folder or restore those settings"
            )
    else:
        cfg.work.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(want, indent=2))


def main(cfg: TrainConfig) -> dict:
    import open_clip

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    check_recipe(cfg)
    model, preprocess, tokenizer = create(cfg.work / "arch")
    x, y = fashion_mnist("train")
    if cfg.train_limit:
        x, y = x[: cfg.train_limit], y[: cfg.train_limit]
    check_preprocess(model, preprocess, pad_shift(x[:4], None))
    tokens = tokenizer(captions(TRAIN_TEMPLATES))  # (10 x templates, 16)
    longest = int((tokens != 0).sum(1).max())
    if longest >= MODEL_CONFIG["text_cfg"]["context_length"]:
        raise SystemExit(f"a caption takes {longest} tokens: raise context_length")
    n_t = len(TRAIN_TEMPLATES)
    per_epoch = len(x) // cfg.batch
    total = cfg.epochs * per_epoch
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / cfg.warmup_steps)
            * 0.5
            * (1 + math.cos(math.pi * min(s, total) / total))
        ),
    )
    loss_fn = open_clip.ClipLoss()
    state = {"epoch": 0, "losses": [], "seconds": 0.0}
    ckpt = cfg.work / "checkpoint.pt"
    if ckpt.is_file():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        torch.set_rng_state(saved["torch_rng"])
        state = saved["state"]
        print(f"resuming after epoch {state['epoch']} ({state['seconds'] / 60:.1f} minutes)")
    pp = model.visual.preprocess_cfg
    stop = (
        cfg.epochs
        if not cfg.max_epochs_now
        else min(cfg.epochs, state["epoch"] + cfg.max_epochs_now)
    )
    while state["epoch"] < stop:
        epoch = state["epoch"]
        rng = np.random.default_rng([cfg.seed, epoch])
        order = rng.permutation(len(x))
        model.train()
        t0 = time.monotonic()
        bar = tqdm(range(per_epoch), desc=f"fmnist-clip epoch {epoch + 1}/{cfg.epochs}")
        for i in bar:
            idx = order[i * cfg.batch : (i + 1) * cfg.batch]
            images = to_tensor(pad_shift(x[idx], rng), pp["mean"], pp["std"])
            cap = torch.from_numpy(y[idx] * n_t + rng.integers(0, n_t, len(idx)))
            img = model.encode_image(images, normalize=True)
            txt = model.encode_text(tokens, normalize=True)[cap]  # 90 captions, gathered
            loss = loss_fn(img, txt, model.logit_scale.exp())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, math.log(100))
            if i % 10 == 0:
                state["losses"].append(float(loss))
                bar.set_postfix(loss=f"{float(loss):.3f}")
        state["epoch"] += 1
        state["seconds"] += time.monotonic() - t0
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "sched": sched.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "state": state,
            },
            tmp,
        )
        os.replace(tmp, ckpt)
    if state["epoch"] < cfg.epochs:
        print(f"stopped after epoch {state['epoch']} of {cfg.epochs}; rerun to continue")
        return state
    return export(cfg, model, state)


def export(cfg: TrainConfig, model, state: dict) -> dict:
    from safetensors.torch import save_file

    from patchpar.lab.results import git_commit
    from patchpar.measure.features import clip

    write_config(cfg.out)
    weights = cfg.out / "open_clip_model.safetensors"
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(half, str(weights))
    # Measured on what was written, loaded as the metric loads it.
    clip.cache_clear()
    net, _, tokenizer = clip(str(cfg.out))
    xt, yt = fashion_mnist("test")
    if cfg.test_limit:
        xt, yt = xt[: cfg.test_limit], yt[: cfg.test_limit]
    test = pad_shift(xt, None)
    info = {
        "model": NAME,
        "epochs": state["epoch"],
        "images_seen": state["epoch"]
        * (len(fashion_mnist("train")[0]) if not cfg.train_limit else cfg.train_limit)
        // cfg.batch
        * cfg.batch,
        "train_minutes": round(state["seconds"] / 60, 2),
        "final_loss_mean_last_20": float(np.mean(state["losses"][-20:])),
        "zero_shot_held_out": zero_shot(net, tokenizer, test, yt, HELD_OUT_TEMPLATES),
        "zero_shot_train_templates": zero_shot(net, tokenizer, test, yt, TRAIN_TEMPLATES),
        "test_images": len(test),
        "weights_dtype": "float16",
        "parameters": sum(p.numel() for p in net.parameters()),
        "recipe": recipe(cfg),
        "git_commit": git_commit(),
        "command": "python experiments/train_clip_fmnist.py",
    }
    (cfg.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    plot_losses(state["losses"], cfg.plots / "loss.png")
    acc = info["zero_shot_held_out"]["ensemble"]
    print(f"zero-shot accuracy, held-out templates: {acc:.4f} ({len(test)} test images)")
    return info


def plot_losses(losses, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(np.arange(len(losses)) * 10, losses, alpha=0.6)
    ax.set(xlabel="step", ylabel="CLIP loss", title="fmnist-clip training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
