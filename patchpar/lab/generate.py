"""`patchpar generate`: one pipeline run from the command line, images and latent on disk."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from patchpar.lab.config import DTYPES, check_scan, fsdp_unused
from patchpar.lab.launch import is_writer, launch
from patchpar.lab.options import HELP, CachedDecodeFlags


def _sampler_help() -> str:
    """`--sampler`'s help: the samplers, then the default (a trained preset's tuned one, else
    its family's), from the registries."""
    from patchpar.lab.defaults import TUNED_SAMPLER
    from patchpar.models.family import families

    tuned = ", ".join(f"{v} for {k}" for k, v in TUNED_SAMPLER.items())
    family = ", ".join(f"{f.name}: {f.default_sampler}" for f in families().values())
    return (
        f"{HELP['sampler']} Default: the preset's tuned one ({tuned}), else its family's "
        f"({family})."
    )


SAMPLER_HELP = _sampler_help()


@dataclass(frozen=True)
class GenerateConfig(CachedDecodeFlags):
    """Generate images from prompts and save them as PNG, with the final latent as latent.npy."""

    model: Annotated[str, tyro.conf.arg(help=HELP["model"])] = "fmnist"
    prompt: tuple[str, ...] = ("a photo of a red bag",)
    """One or more prompts; one image each."""
    negative_prompt: str = ""
    """Negative prompt for classifier-free guidance ("" = unconditional)."""
    steps: int = 20
    """Denoising steps."""
    sampler: Annotated[str | None, tyro.conf.arg(help=SAMPLER_HELP)] = None
    guidance_scale: float | None = None
    """Classifier-free guidance scale; <= 1 disables CFG (default: the preset's tuned value, 2 for fmnist; 4.5 for PixArt; else 7.5)."""
    true_cfg_scale: float | None = None
    """True classifier-free guidance over a FLUX.1 model (diffusers' true_cfg_scale): > 1 adds
    the negative prompt as a second guidance half; <= 1: off (default: the preset's tuned value,
    fmnist-flux's; else off)."""
    height: int | None = None
    """Image height in pixels (default: the denoiser's sample size x the VAE factor)."""
    width: int | None = None
    """Image width in pixels (default: as height)."""
    seed: int = 0
    """Seed of the initial latent, in [0, 2^32)."""
    dtype: str = "auto"
    """auto, float32 or bfloat16 (auto: bfloat16 for SD, SDXL and PixArt-size models, else float32)."""
    attention: str = "auto"
    """Attention kernel: auto, xla, chunked, cudnn or splash (patchpar/models/attention.py)."""
    quant: str = "none"
    """Quantized denoiser (patchpar/quant.py): none, w8 or w4 (int8 / int4 weights), int8 or
    fp8 (int8 / fp8 e4m3 weights x activations)."""
    scan_blocks: bool = False
    """Run each stack of identical blocks (a DiT's transformer blocks, a UNet transformer's) as
    one scanned loop: a much shorter compile, outputs equal within float rounding
    (patchpar/models/scan.py); not with quant, PipeFusion, AsyncDiff, or fbcache and teacache
    on a DiT."""
    out: Path = Path("runs/generate")
    """Output folder."""
    processes: int = 0
    """0: this process, on the devices it sees. N: launch N processes here, one CPU device,
    core and thread each, joined by jax.distributed (devices must be N)."""
    timeout_s: float = 3600.0
    """processes >= 1: end every worker after this many seconds."""


def check(config: GenerateConfig) -> list[str]:
    """Every check of the flags that needs no weights, before any work or launch: the flags
    alone, then the plan against the model's config.json (`checks.check_plan_on_model`). All
    the problems found are raised together (`checks.Problems`, a ValueError: one line each,
    naming the value and what fits); returns the options given that have no effect here."""
    from patchpar.lab.checks import Problems, check_plan_on_model
    from patchpar.lab.defaults import default_guidance, default_true_cfg
    from patchpar.pipelines.checks import check_guidance, check_seed
    from patchpar.quant import check_mode

    problems = Problems.collect()
    with problems.check():
        if config.dtype not in DTYPES:
            raise ValueError(f"dtype={config.dtype!r}; known: {list(DTYPES)}")
    with problems.check():
        check_mode(config.quant)
        check_scan(config.scan_blocks, config.quant, config.strategy)
    for name in ("height", "width"):
        v = getattr(config, name)
        if v is not None and v <= 0:
            problems.lines.append(
                f"{name}={v}: must be a positive number of pixels (or left unset)"
            )
    if config.steps < 1:
        problems.lines.append(f"steps={config.steps}: must be >= 1")
    with problems.check():
        check_seed(config.seed)
    if config.processes not in (0, config.devices):
        problems.lines.append(
            f"processes={config.processes}: must be 0 or devices={config.devices} (devices "
            f"must equal processes x local devices, and a launched process has one CPU device)"
        )
    if not config.timeout_s > 0:
        problems.lines.append(
            f"timeout_s={config.timeout_s}: must be a positive number of seconds (how long "
            f"launched workers may run)"
        )
    guidance = (
        default_guidance(config.model) if config.guidance_scale is None else config.guidance_scale
    )
    t = default_true_cfg(config.model) if config.true_cfg_scale is None else config.true_cfg_scale
    true_cfg_ok = isinstance(t, int | float) and math.isfinite(t) and t >= 0
    if not true_cfg_ok:
        problems.lines.append(f"true_cfg_scale={t!r}: must be a finite number >= 0 (<= 1: off)")
    with problems.check():
        check_guidance(guidance, None if true_cfg_ok and t > 1 else [config.negative_prompt])
    plan = None
    with problems.check():
        plan = config.plan()  # unknown strategy or option: error before loading anything
    with problems.check():
        config.vae_plan()
    sizes_ok = config.steps >= 1 and all(v is None or v > 0 for v in (config.height, config.width))
    if plan is not None and sizes_ok:  # the plan against the model (no weights read)
        with problems.check():
            check_plan_on_model(
                config.model, plan, config.height, config.width, config.steps, guidance,
                t, build_mesh=not config.processes, scan_blocks=config.scan_blocks,
            )  # fmt: skip
    problems.raise_any()
    unused = [fsdp_unused(config.devices)] if config.fsdp and plan.fsdp_degree == 1 else []
    if plan.cache is not None:
        unused += plan.cache.idle_options(config.steps)
    if config.timeout_s != GenerateConfig.timeout_s and not config.processes:
        unused.append(
            f"timeout_s={config.timeout_s} has no effect without processes (it ends launched "
            f"workers that hang)"
        )
    return unused


def generate(config: GenerateConfig, log=lambda msg: None) -> dict:
    """Run the pipeline; write image_<i>.png, latent.npy and generate.json into config.out.
    `log` hears the progress (loading, encoding, compiling, each phase, decoding)."""
    import jax.numpy as jnp
    from PIL import Image

    from patchpar import compile_cache
    from patchpar.lab.defaults import default_guidance, default_sampler, default_true_cfg
    from patchpar.lab.results import check_writable
    from patchpar.models.attention import AttentionSpec, resolve
    from patchpar.models.presets import resolve_dtype
    from patchpar.pipelines import load_pipeline

    check(config)
    guidance = (
        default_guidance(config.model) if config.guidance_scale is None else config.guidance_scale
    )
    sampler = default_sampler(config.model) if config.sampler is None else config.sampler
    true_cfg = (
        default_true_cfg(config.model) if config.true_cfg_scale is None else config.true_cfg_scale
    )
    check_writable(config.out, "out")  # before any work, not after generating
    cache_folder = compile_cache.enable(warn=lambda msg: log(f"patchpar: warning: {msg}"))
    hits, compiled = compile_cache.hits(), compile_cache.compiled()
    plan = config.plan()
    vae_plan = config.vae_plan()
    t0 = time.perf_counter()
    log(f"loading {config.model}")
    pipe = (
        load_pipeline(
            config.model,
            getattr(jnp, resolve_dtype(config.dtype, config.model)),
            resolve(AttentionSpec(config.attention)),
            config.quant,
        )
        .with_true_cfg(true_cfg)
        .with_scan(config.scan_blocks)
    )
    t_load = time.perf_counter() - t0
    checkpoint = getattr(pipe, "quant_checkpoint", None)  # the quantized weights, not the floats
    if checkpoint is not None:
        log(f"read quantized checkpoint {checkpoint}")
    t0 = time.perf_counter()
    negative = [config.negative_prompt] * len(config.prompt) if config.negative_prompt else None
    out = pipe(
        list(config.prompt),
        height=config.height,
        width=config.width,
        steps=config.steps,
        guidance_scale=guidance,
        seed=config.seed,
        sampler=sampler,
        negative_prompts=negative,
        plan=plan,
        check_memory=True,  # compiled first: a program that cannot fit is refused up front
        vae_plan=vae_plan,
        log=log,
    )
    t_gen = time.perf_counter() - t0
    hits, compiled = compile_cache.hits() - hits, compile_cache.compiled() - compiled
    if cache_folder is not None:
        log(f"{hits} program(s) read from the compile cache ({cache_folder}), {compiled} compiled")
    record = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "images": [],
        "latent_shape": list(out.latents.shape),
        "guidance_scale": guidance,
        "sampler": sampler,
        "compute_dtype": jnp.dtype(pipe.unet.module.dtype).name,
        "attention": pipe.unet.module.attn.impl,
        "quant": pipe.quant,
        "scan_blocks": config.scan_blocks,
        "quant_checkpoint": None if checkpoint is None else str(checkpoint),
        "strategy": plan.strategy.describe(),
        "devices": plan.devices,
        "vae_parallel": vae_plan.mode,
        "processes": config.processes,
        "stale_bytes_per_device": out.stale_bytes_per_device,
        **(out.cache or {}),
        "compile_cache_hits": hits,
        "load_s": round(t_load, 3),
        "generate_s_including_compile": round(t_gen, 3),
    }
    if not is_writer():  # with several processes, process 0 alone writes
        return record
    folder = Path(config.out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, img in enumerate(out.images):
        path = folder / f"image_{i}.png"
        Image.fromarray(img).save(path)
        paths.append(str(path))
    np.save(folder / "latent.npy", out.latents)
    record["images"] = paths
    tmp = folder / "generate.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(folder / "generate.json")
    return record


def launched_generate(config: GenerateConfig, args: list[str]) -> dict:
    """`patchpar generate` (the command line `args`) in `config.processes` launched processes;
    returns the generate.json that process 0 wrote."""
    import sys

    check(config)
    from patchpar.lab.results import check_writable

    done = check_writable(config.out, "out") / "generate.json"
    done.unlink(missing_ok=True)
    launch(args, config.processes, config.timeout_s, lambda m: print(m, file=sys.stderr))
    return json.loads(done.read_text())
