"""The two engine checks behind issue 12's items 1 and 2, on the tests' micro SD UNet (fp32,
4 fake devices, CFG pair in the batch), so their before/after figures can be re-measured:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python experiments/review_checks.py

1. warm-up covering every step (3 DPM-Solver++ steps, warmup_steps=2): max |distrifusion -
   sync_patch| of the final latent for each GroupNorm mode (0 up to rounding when warm-up is
   exact in every mode);
2. 8 DDIM steps, warm-up 1 (2 exact steps, 6 stale): mean |distrifusion - sync_patch| of the
   final latent (conv_in's halo fresh or stale changes it).

Run it on another commit's library (e.g. a `git worktree` of 89f8dcd with PYTHONPATH pointing
at it) for the figures before the fix; it uses only `patchpar.parallel` and `patchpar.sampling`,
which kept their paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from parallel_helpers import GUIDANCE, inputs, micro_unet  # noqa: E402

from patchpar.parallel.engine import Plan, denoise  # noqa: E402
from patchpar.parallel.strategies import make_strategy  # noqa: E402
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler  # noqa: E402


def final_latent(strategy: str, steps: int, sampler: str, devices: int = 4, **options):
    unet, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    plan = Plan(make_strategy(strategy, **options), devices, 1)
    smp = get_sampler(sampler)
    sched = smp.schedule(SchedulerConfig(), steps)
    out, _ = denoise(unet, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    return np.asarray(out)


def main() -> None:
    import patchpar

    print(f"library: {Path(patchpar.__file__).parent}")
    ref = final_latent("sync_patch", 3, "dpmpp_2m")
    for gn in ("separate", "stale", "corrected", "sync"):
        out = final_latent("distrifusion", 3, "dpmpp_2m", warmup_steps=2, gn=gn)
        print(
            f"1. warm-up covering all steps, gn={gn:9s}: max |diff| = {np.abs(out - ref).max():.3g}"
        )
    ref = final_latent("sync_patch", 8, "ddim")
    out = final_latent("distrifusion", 8, "ddim", warmup_steps=1)
    print(f"2. 8 DDIM steps, warm-up 1, gn=corrected: mean |diff| = {np.abs(out - ref).mean():.4f}")


if __name__ == "__main__":
    main()
