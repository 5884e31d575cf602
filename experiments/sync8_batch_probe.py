"""Final latents of `single` against `sync_patch` on fake CPU devices for the fmnist model, one
batch of B images (10 class prompts x B/10 seeds), and which images differ by more than 1e-3:
the probe that found the XLA:CPU race behind paper_repro.md's "The 8-device defect".

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python experiments/sync8_batch_probe.py --batch 100 --steps 5

With patchpar's multi-device XLA option (`patchpar/xla_flags.py`, since 2026-12-01): no image
off (batch 100, 5 steps: max 9.7e-5; batch 200, 10 steps: 1.5e-4). With the one-device option
forced (XLA_FLAGS="--xla_force_host_platform_device_count=8
--xla_cpu_experimental_ynn_fusion_type=individual_dot"), as every fake-device run had before:
batch 100 or 80 with 5 steps -> images 0-3 wrong (max 0.355); batch 40 or 60 -> none; batch
100 with 1-3 steps -> none, 4 steps -> images 0-3 (0.013); batch 200 with 10 steps -> images
0-12 (1.78). `experiments/xla_cpu_race.py` is the smaller repro.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

from patchpar.lab.config import load_config, with_overrides
from patchpar.lab.generation import batches, inputs
from patchpar.lab.runner import get_pipeline, image_size

CONFIG = Path(__file__).parent / "configs" / "fmnist.yaml"


@dataclass(frozen=True)
class Probe:
    batch: int = 100
    """Images in the one batch (a multiple of 10)."""
    steps: int = 5
    guidance: float = 2.0
    attention: str = "auto"
    devices: int = 8


def final_latents(p: Probe, strategy: str, devices: int) -> np.ndarray:
    cfg = with_overrides(
        load_config(CONFIG),
        {
            "prompts.seeds": list(range(p.batch // 10)),
            "prompts.batch_size": 0,
            "sampler.steps": p.steps,
            "sampler.guidance_scale": p.guidance,
            "strategy": {"name": strategy},
            "mesh.devices": devices,
            "model.attention": p.attention,
        },
    )
    pipe = get_pipeline(cfg.model.name, cfg.sampler.dtype, cfg.model.attention_spec())
    cond, x0 = inputs(pipe, cfg, batches(cfg)[0], image_size(pipe, cfg))
    return np.asarray(pipe.denoise(cond, x0, cfg.sampler.name, p.steps, p.guidance, cfg.plan()))


def main(p: Probe) -> None:
    ref = final_latents(p, "single", 1)
    got = final_latents(p, "sync_patch", p.devices)
    d = np.abs(ref - got).reshape(p.batch, -1).max(1)
    print(f"{p}: images off by > 1e-3: {np.flatnonzero(d > 1e-3).tolist()}; max {d.max():.3g}")


if __name__ == "__main__":
    main(tyro.cli(Probe))
