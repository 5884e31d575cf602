"""bfloat16 against float32 compute on the trained `fmnist` model: the same prompts, seeds and
sampler in both dtypes, PSNR of the bf16 images against the float32 ones (README states it).

    .venv/bin/python experiments/bf16_psnr.py                    # 10 classes x 4 seeds
    .venv/bin/python experiments/bf16_psnr.py --seeds 0 1 --out /tmp/bf16

One record (mean, median, min PSNR over images, and the standard error of the mean) goes to
<out>/records.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="fmnist")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sampler", default="ddim")
    p.add_argument("--out", type=Path, default=Path("runs/bf16"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    import jax.numpy as jnp
    import numpy as np

    from patchpar.lab.defaults import default_guidance
    from patchpar.lab.results import append_record, provenance
    from patchpar.measure.classifier import FASHION_MNIST_CLASSES
    from patchpar.measure.quality import psnr_per_image
    from patchpar.pipelines import load_pipeline

    prompts = [f"a photo of a {c}" for c in FASHION_MNIST_CLASSES]
    guidance = default_guidance(a.model)
    images = {}
    for dtype in ("float32", "bfloat16"):
        pipe = load_pipeline(a.model, getattr(jnp, dtype))
        images[dtype] = np.concatenate(
            [
                pipe(
                    prompts, steps=a.steps, guidance_scale=guidance, seed=s, sampler=a.sampler
                ).images
                for s in a.seeds
            ]
        )
    psnr = psnr_per_image(images["bfloat16"], images["float32"])
    finite = psnr[np.isfinite(psnr)]
    rec = {
        "model": a.model, "images": int(psnr.size), "seeds": a.seeds, "steps": a.steps,
        "sampler": a.sampler, "guidance_scale": guidance,
        "psnr_bf16_vs_fp32_mean": float(finite.mean()),
        "psnr_bf16_vs_fp32_median": float(statistics.median(psnr.tolist())),
        "psnr_bf16_vs_fp32_min": float(psnr.min()),
        "psnr_bf16_vs_fp32_sem": float(finite.std(ddof=1) / np.sqrt(finite.size)),
        "identical_images": int((~np.isfinite(psnr)).sum()),
        "command": "python experiments/bf16_psnr.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **provenance(),
    }  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    append_record(a.out / "records.jsonl", rec)
    print(
        f"bf16 vs float32 on {a.model}, {rec['images']} images: PSNR mean "
        f"{rec['psnr_bf16_vs_fp32_mean']:.2f} dB (± {rec['psnr_bf16_vs_fp32_sem']:.2f} s.e.), "
        f"median {rec['psnr_bf16_vs_fp32_median']:.2f}, min {rec['psnr_bf16_vs_fp32_min']:.2f} dB"
    )
    return rec


if __name__ == "__main__":
    main()
