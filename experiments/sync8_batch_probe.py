"""Probe of the open 8-device defect (paper_repro.md, "Known defect at 8 devices"): final
latents of `single` against `sync_patch` on 8 fake devices for the fmnist model, one batch of
B images (10 class prompts x B/10 seeds), and which images differ by more than 1e-3.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        .venv/bin/python experiments/sync8_batch_probe.py --batch 100 --steps 5

Measured with the code of commit f813c47: batch 100 or 80 with 5 steps -> images 0-3 wrong (max 0.355); batch 40
or 60 -> none; batch 100 with 1-3 steps -> none, 4 steps -> images 0-3 (0.013).
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
