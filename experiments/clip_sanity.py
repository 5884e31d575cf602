"""Sanity of the CLIP score on Fashion-MNIST: real test images against the `fmnist` model's
single-device outputs and the random-weight `fmnist-random` outputs, all scored by the shipped
fmnist-clip with "a photo of a <class>" captions. The check is the order real >= trained >>
random.

    .venv/bin/python experiments/clip_sanity.py [RECORDS_ROOT]     # default runs

Real images: the first 50 test images of each class (500), padded 28 -> 32 as the model's
frame. Generated: the newest `ok` records with a clip_score of <root>/fmnist_quality (strategy
single) and <root>/fmnist_random (made by the commands in experiments/configs/fmnist.yaml and
experiments/sweeps/quality.yaml; root `results` reads the published ones). Writes
<root>/fmnist_clip/sanity.json and sanity.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from patchpar.lab.datasets import fashion_mnist, pad32, to_rgb
from patchpar.lab.results import provenance
from patchpar.measure import quality as q
from patchpar.measure.classifier import FASHION_MNIST_CLASSES
from patchpar.models.presets import CLIP_MODELS


def newest(path: Path, where) -> dict | None:
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["status"] == "ok" and where(r)]
    rows = [r for r in rows if r["metrics"].get("clip_score") is not None]
    return rows[-1] if rows else None


def main(root: Path = Path("runs")) -> dict:
    out_dir = root / "fmnist_clip"
    x, y = fashion_mnist("test")
    pick = np.concatenate([np.flatnonzero(y == k)[:50] for k in range(10)])
    images = to_rgb(pad32(x[pick]))
    prompts = [f"a photo of a {FASHION_MNIST_CLASSES[k]}" for k in y[pick]]
    cos = q.clip_cosines(images, prompts, str(CLIP_MODELS["fmnist-clip"]))
    rows = [
        ("real Fashion-MNIST test images", max(float(cos.mean()), 0.0), q.sem(cos), len(cos), None)
    ]
    for label, path, where in (
        ("fmnist outputs (single device)", root / "fmnist_quality/runs.jsonl",
         lambda r: r["config"]["strategy"]["name"] == "single"),
        ("fmnist-random outputs (single device)", root / "fmnist_random/runs.jsonl",
         lambda r: r["config"]["model"]["name"] == "fmnist-random"),
    ):  # fmt: skip
        rec = newest(Path(path), where)
        if rec is None:
            rows.append((label, None, None, 0, f"no ok record with clip_score in {path}"))
            continue
        m = rec["metrics"]
        rows.append(
            (label, m["clip_score"], m.get("clip_score_sem"), m["quality_samples"], rec["run_id"])
        )
    out = {
        "clip_model": "fmnist-clip",
        "captions": "a photo of a <class>",
        "rows": [
            {"images": a, "clip_score": b, "clip_score_sem": c, "samples": n, "run_id": rid}
            for a, b, c, n, rid in rows
        ],
        "provenance": provenance(),
        "command": f"python experiments/clip_sanity.py {root}",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "sanity.json.tmp"
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    os.replace(tmp, out_dir / "sanity.json")
    lines = ["| images | CLIP score | ± s.e. | samples |", "|---|---|---|---|"]
    for a, b, c, n, _ in rows:
        lines.append(
            f"| {a} | {'—' if b is None else f'{b:.2f}'} | {'—' if c is None else f'{c:.2f}'} | {n} |"
        )
    (out_dir / "sanity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    import sys

    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs"))
