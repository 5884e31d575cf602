"""A whole image on one device, stage by stage: the text encoders, the denoising loop and the
VAE decode of a full-size pipeline with random weights (no download), warm per image, and a
fresh process's first image cold (empty compile cache) and warm (the cache filled).

    device run: bash experiments/device/tpu_suite.sh pipeline        (SDXL and PixArt-α, 1024²)
    here, in miniature: python experiments/device/pipeline_timing.py --models tiny-xl \
        --resolution 64 --steps 2 --dtype float32 --repeats 2 --out /tmp/pipeline

Per model: its folder written once under `--work` (`random_folder.py`, bf16 unless
`--dtype float32`); then two fresh processes, each `patchpar generate` of one image with the
persistent compile cache in a folder of this run (`cold`: empty, `warm`: what `cold` left):
the process's wall time from its start to its image on disk (`ready_s`: imports, loading,
every compile or cache read, the image) and the stages its record names (`stages_s`); then in
this process `--repeats` images after one untimed, each stage waited for (`Pipeline.__call__`'s
`stages`), with their medians and the image's (encode + denoise + decode, the compile apart:
what a served image costs, as MLPerf's per-image figure; each call's lowering and cache read
is `compile_s_median`, the persistent cache on in this process too). Records: <out>/records.jsonl (one per
model; a failed one with its error, one after `--budget-s` skipped); table: <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

STAGES = ("encode_s", "compile_s", "denoise_s", "decode_s")
PROMPT = "a photo of an astronaut riding a horse on the moon"


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["sdxl", "pixart-alpha"])
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sampler", default=None, help="default: the family's")
    p.add_argument("--dtype", default="bfloat16", help="weights stored and computed")
    p.add_argument("--attention", default="auto", help="the kernel, impl[:QxKV]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", type=Path, default=Path("/tmp/pipeline_timing"),
                   help="the random folders and the compile caches (kept between runs)")  # fmt: skip
    p.add_argument("--hardware", default="tpu-v5e", help="the profile the records name")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no model after this")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "pipeline_timing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    from patchpar import compile_cache
    from patchpar.lab.results import append_record, provenance

    start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    # this process's own images: each call lowers its phases again, their executables read
    # back from here after the untimed first (never compiled once per image)
    compile_cache.enable(a.work / "cache-in-process")
    rows = []
    for model in a.models:
        rec = {"hardware": a.hardware, "model": model, "resolution": a.resolution,
               "steps": a.steps, "dtype": a.dtype, "attention": a.attention}  # fmt: skip
        if time.perf_counter() - start > a.budget_s:
            rec.update(status="skipped", error=f"time budget {a.budget_s:.0f} s spent")
        else:
            try:
                rec.update(one_model(a, model))
                rec["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - every model gets a record
                rec.update(status="error", error=f"{type(e).__name__}: {str(e)[:500]}")
        append_record(a.out / "records.jsonl", {**rec, **provenance()})
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    (a.out / "table.md").write_text(table(rows))
    print(table(rows))
    return 0


def one_model(a, model: str) -> dict:
    """The folder, the two fresh processes and the warm images of one model."""
    from family_timing import kernel_spec
    from random_folder import main as random_folder

    out = {}
    folder = a.work / f"{model}-{a.dtype}"
    if not (folder / "model_index.json").is_file():
        t0 = time.perf_counter()
        random_folder(["--model", model, "--out", str(folder), "--dtype", a.dtype])
        out["folder_write_s"] = time.perf_counter() - t0
    cache = a.work / f"cache-{model}-{a.dtype}-{a.resolution}-{time.strftime('%Y%m%d%H%M%S')}"
    for run in ("cold", "warm"):  # the first with an empty cache, the second with its programs
        gen = a.work / f"generate-{model}-{run}"
        spec = kernel_spec(a.attention)
        cmd = [sys.executable, "-m", "patchpar.lab.cli", "generate", "--model", str(folder),
               "--prompt", PROMPT, "--height", str(a.resolution), "--width", str(a.resolution),
               "--steps", str(a.steps), "--dtype", a.dtype, "--model.attention", spec.impl,
               "--model.block-q", str(spec.block_q), "--model.block-kv", str(spec.block_kv),
               "--out", str(gen)] + (["--sampler.name", a.sampler] if a.sampler else [])  # fmt: skip
        env = {**os.environ, "PATCHPAR_COMPILE_CACHE": str(cache)}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{run} generate failed: {(done.stderr or done.stdout)[-400:]}")
        out[f"{run}_ready_s"] = time.perf_counter() - t0
        out[f"{run}_stages_s"] = json.loads((gen / "generate.json").read_text())["stages_s"]
    out.update(warm_images(a, folder))
    return out


def warm_images(a, folder: Path) -> dict:
    """`--repeats` images in this process after an untimed one: each stage's median, and the
    image's (encode + denoise + decode)."""
    import jax.numpy as jnp
    from family_timing import kernel_spec

    from patchpar.models.attention import resolve
    from patchpar.pipelines import load_pipeline

    dtype = getattr(jnp, a.dtype)
    pipe = load_pipeline(str(folder), dtype, resolve(kernel_spec(a.attention), dtype))
    runs = []
    for _ in range(a.repeats + 1):
        out = pipe(PROMPT, a.resolution, a.resolution, steps=a.steps, sampler=a.sampler,
                   log=lambda msg: None)  # fmt: skip
        runs.append(out.stages)
    runs = runs[1:]  # the first carries every compile
    med = {k: statistics.median(r[k] for r in runs) for k in STAGES}
    image = [r["encode_s"] + r["denoise_s"] + r["decode_s"] for r in runs]
    return {
        **{f"{k.removesuffix('_s')}_s_median": v for k, v in med.items()},
        "image_s_median": statistics.median(image),
        "image_s_all": image,
        "attention_impl": pipe.unet.module.attn.impl,
    }


def table(rows) -> str:
    lines = [
        "One image per model on one device, random weights: warm per-image stages (medians), and a",
        "fresh process's first image with an empty and a filled compile cache",
        "",
        "| model | resolution | steps | image s | encode s | denoise s | decode s | "
        "ready cold s | ready warm s | status |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = lambda k, r=r: "-" if r.get(k) is None else f"{r[k]:.2f}"  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['resolution']} | {r['steps']} | {f('image_s_median')} | "
            f"{f('encode_s_median')} | {f('denoise_s_median')} | {f('decode_s_median')} | "
            f"{f('cold_ready_s')} | {f('warm_ready_s')} | {r['status']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
