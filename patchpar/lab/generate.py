"""`patchpar generate`: one pipeline run from the command line, images and latent on disk."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import numpy as np
import tyro

from patchpar.lab.calibrate import MEASURED
from patchpar.lab.config import (
    DTYPES,
    CacheConfig,
    MeshConfig,
    ModelConfig,
    StrategyConfig,
    sections_plan,
)
from patchpar.lab.configio import FromFlags
from patchpar.lab.launch import is_writer, launch
from patchpar.lab.options import HELP


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
class GenerateSampler:
    """The sampler of `generate`: what is left unset takes the preset's tuned value."""

    name: Annotated[str | None, tyro.conf.arg(help=SAMPLER_HELP)] = None
    steps: int = 20
    """Denoising steps."""
    guidance_scale: float | None = None
    """Classifier-free guidance scale; <= 1 disables CFG (default: the preset's tuned value, 2
    for fmnist; its family's pipelines' else: 4.5 for PixArt, 5 for Wan, 7.5 for SD)."""
    guidance_scale_2: float | None = None
    """Wan 2.2 A14B's low-noise expert's guidance scale (a folder with `boundary_ratio` and
    `transformer_2`; default: guidance_scale, as WanPipeline)."""
    true_cfg_scale: float | None = None
    """True classifier-free guidance over a FLUX.1 model (diffusers' true_cfg_scale): > 1 adds
    the negative prompt as a second guidance half; <= 1: off (default: the preset's tuned value,
    fmnist-flux's; else off)."""
    height: int | None = None
    """Image height in pixels (default: the denoiser's sample size x the VAE factor; a video
    model's own, 480 for Wan)."""
    width: int | None = None
    """Image width in pixels (default: as height; a video model's own)."""
    frames: int | None = None
    """A video model's frames, 4k + 1 for Wan's VAE (default: the model's, 81 for Wan)."""
    dtype: str = "auto"
    """auto, float32 or bfloat16 (auto: bfloat16 for SD, SDXL and PixArt-size models, else
    float32)."""

    def tuned(self, model: str) -> tuple[str, float, float]:
        """(sampler, guidance scale, true CFG scale): each as given, else the preset's tuned
        value (`lab.defaults`)."""
        from patchpar.lab.defaults import default_guidance, default_sampler, default_true_cfg

        pick = lambda v, default: default(model) if v is None else v  # noqa: E731
        return (pick(self.name, default_sampler), pick(self.guidance_scale, default_guidance),
                pick(self.true_cfg_scale, default_true_cfg))  # fmt: skip


@dataclass(frozen=True)
class GenerateConfig(FromFlags):
    """Generate images from prompts and save them as PNG, with the final latent as latent.npy
    (a video model: each video as an animated GIF and a PNG grid of its frames).
    The model, mesh, strategy and cache sections are `patchpar run`'s (`--strategy.warmup-steps`
    means one thing in both); every section's fields also take their short flags
    (`--strategy distrifusion --devices 2 --warmup-steps 1`, `options.flat_aliases`)."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="fmnist"))
    mesh: MeshConfig = field(default_factory=MeshConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampler: GenerateSampler = field(default_factory=GenerateSampler)
    prompt: tuple[str, ...] = ("a photo of a red bag",)
    """One or more prompts; one image each."""
    negative_prompt: str = ""
    """Negative prompt for classifier-free guidance ("" = unconditional)."""
    seed: int = 0
    """Seed of the initial latent, in [0, 2^32)."""
    out: Path = Path("runs/generate")
    """Output folder."""
    timeout_s: float = 3600.0
    """mesh.processes >= 1: end every worker after this many seconds."""

    def plan(self):
        """The strategy with its options, placed on the mesh, with the step cache."""
        return sections_plan(self.strategy, self.mesh, self.cache)

    def vae_plan(self):
        """How the VAE decodes (patchpar.parallel.vae), on the same devices."""
        return self.mesh.vae_plan()


def check(config: GenerateConfig) -> list[str]:
    """Every check of the flags that needs no weights, before any work or launch: the flags
    alone, then the plan against the model's config.json (`checks.check_plan_on_model`). All
    the problems found are raised together (`checks.Problems`, a ValueError: one line each,
    naming the value and what fits); returns the options given that have no effect here."""
    from patchpar.lab.checks import Problems, check_plan_on_model, fsdp_unused
    from patchpar.models.presets import model_family
    from patchpar.pipelines.checks import check_guidance, check_seed

    problems = Problems.collect()
    with problems.check():
        if config.sampler.dtype not in DTYPES:
            raise ValueError(f"sampler.dtype={config.sampler.dtype!r}; known: {list(DTYPES)}")
    model_ok = False  # the checks against the model say scan_blocks' refusals again
    with problems.check():
        config.model.check(config.strategy.name)
        model_ok = True
    for name in ("height", "width"):
        v = getattr(config.sampler, name)
        if v is not None and v <= 0:
            problems.lines.append(
                f"sampler.{name}={v}: must be a positive number of pixels (or left unset)"
            )
    if config.sampler.steps < 1:
        problems.lines.append(f"sampler.steps={config.sampler.steps}: must be >= 1")
    with problems.check():
        check_seed(config.seed)
    if config.mesh.processes not in (0, config.mesh.devices):
        problems.lines.append(
            f"mesh.processes={config.mesh.processes}: must be 0 or mesh.devices="
            f"{config.mesh.devices} (devices must equal processes x local devices, and a "
            f"launched process has one CPU device)"
        )
    if not config.timeout_s > 0:
        problems.lines.append(
            f"timeout_s={config.timeout_s}: must be a positive number of seconds (how long "
            f"launched workers may run)"
        )
    _, guidance, t = config.sampler.tuned(config.model.name)
    true_cfg_ok = isinstance(t, int | float) and math.isfinite(t) and t >= 0
    if not true_cfg_ok:
        problems.lines.append(
            f"sampler.true_cfg_scale={t!r}: must be a finite number >= 0 (<= 1: off)"
        )
    with problems.check():
        check_guidance(guidance, None if true_cfg_ok and t > 1 else [config.negative_prompt])
    if config.sampler.guidance_scale_2 is not None and model_ok:
        with problems.check():
            check_second_expert(config.model.name, config.sampler.guidance_scale_2)
    plan = None
    with problems.check():
        plan = config.plan()  # unknown strategy or option: error before loading anything
    if plan is not None and plan.cache is not None and model_ok and config.sampler.steps >= 1:
        with problems.check():  # a cache across two experts' switch: before both are read
            cache_across_experts(config.model.name, config.sampler.tuned(config.model.name)[0],
                                 config.sampler.steps, plan.cache)  # fmt: skip
    with problems.check():
        vae_plan = config.vae_plan()
        if model_ok and model_family(config.model.name).video:
            from patchpar.parallel.vae import check_video_plan

            try:
                check_video_plan(vae_plan)
            except ValueError as e:
                raise ValueError(f"mesh.{e}") from None
    sizes_ok = config.sampler.steps >= 1 and all(
        v is None or v > 0 for v in (config.sampler.height, config.sampler.width)
    )
    if plan is not None and sizes_ok and model_ok:  # the plan against the model (no weight)
        with problems.check():
            s = config.sampler
            check_plan_on_model(
                config.model.name, plan, s.height, s.width, s.steps, guidance, t,
                build_mesh=not config.mesh.processes, scan_blocks=config.model.scan_blocks,
                frames=s.frames, layout=config.mesh.layout,
            )  # fmt: skip
    problems.raise_any()
    unused = (
        [fsdp_unused(config.mesh.devices)] if config.mesh.fsdp and plan.fsdp_degree == 1 else []
    )
    if plan.cache is not None:
        unused += plan.cache.idle_options(config.sampler.steps)
    if config.timeout_s != GenerateConfig.timeout_s and not config.mesh.processes:
        unused.append(
            f"timeout_s={config.timeout_s} has no effect without processes (it ends launched "
            f"workers that hang)"
        )
    return unused


def cache_across_experts(model: str, sampler: str, steps: int, cache) -> None:
    """ValueError where a step cache would run across a two-expert model's switch (the
    pipeline refuses it too, once both experts are read: `sampling.experts.two_experts`)."""
    from dataclasses import replace

    from patchpar.models.loading import read_config
    from patchpar.models.presets import PRESETS, SHIPPED, component_config, model_family
    from patchpar.sampling.experts import two_experts
    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    fam = model_family(model)
    second = fam.second_expert(component_config(model, "pipeline") or {})
    if second is None or model in PRESETS or model in SHIPPED:
        return
    cfg = read_config(Path(model) / "scheduler", "scheduler_config.json")
    sched = replace(SchedulerConfig.from_diffusers(cfg), flow_sigmas=fam.flow_sigmas)
    timesteps = get_sampler(sampler).schedule(sched, steps).timesteps
    two_experts(timesteps, second[1], sched.num_train_timesteps, (1.0, 1.0), cache)


def check_second_expert(model: str, scale: float) -> None:
    """A second guidance scale: a valid one, for a model of two experts (ValueError)."""
    from patchpar.models.presets import component_config, model_family

    if (
        isinstance(scale, bool)
        or not isinstance(scale, int | float)
        or not (math.isfinite(scale) and scale >= 0)
    ):
        raise ValueError(
            f"sampler.guidance_scale_2={scale!r}: must be a finite number >= 0 (<= 1 turns the "
            f"low-noise expert's guidance off)"
        )
    index = component_config(model, "pipeline") or {}
    if model_family(model).second_expert(index) is None:
        raise ValueError(
            f"sampler.guidance_scale_2={scale}: {model} has one denoiser; the second scale is "
            f"a model of two experts' (Wan 2.2 A14B: boundary_ratio and transformer_2 in its "
            f"model_index.json)"
        )


def generate(config: GenerateConfig, log=lambda msg: None, checked: bool = False) -> dict:
    """Run the pipeline; write image_<i>.png, latent.npy and generate.json into config.out.
    `log` hears the progress (loading, encoding, compiling, each phase, decoding)."""
    import jax.numpy as jnp
    from PIL import Image

    from patchpar import compile_cache
    from patchpar.lab.results import check_writable
    from patchpar.models.attention import resolve
    from patchpar.models.presets import resolve_dtype
    from patchpar.pipelines import load_pipeline

    if not checked:  # `checked`: the caller ran `check` (the CLI, to say its warnings)
        check(config)
    sampler, guidance, true_cfg = config.sampler.tuned(config.model.name)
    check_writable(config.out, "out")  # before any work, not after generating
    cache_folder = compile_cache.enable(warn=lambda msg: log(f"patchpar: warning: {msg}"))
    hits, compiled = compile_cache.hits(), compile_cache.compiled()
    plan = config.plan()
    vae_plan = config.vae_plan()
    t0 = time.perf_counter()
    log(f"loading {config.model.name}")
    pipe = (
        load_pipeline(
            config.model.name,
            getattr(jnp, resolve_dtype(config.sampler.dtype, config.model.name)),
            resolve(config.model.attention_spec()),
            config.model.quant,
        )
        .with_true_cfg(true_cfg)
        .with_scan(config.model.scan_blocks)
    )
    t_load = time.perf_counter() - t0
    measured = {}
    video = (
        {"frames": config.sampler.frames, "layout": config.mesh.layout} if pipe.makes_video else {}
    )
    if config.mesh.patch_weights == MEASURED:  # timed on these devices now
        from patchpar.lab.calibrate import measured_plan
        from patchpar.lab.checks import default_size

        size = default_size(pipe.unet, pipe.latent_factor, config.sampler.height,
                            config.sampler.width)  # fmt: skip
        sized = pipe.at(config.sampler.frames or pipe.unet.default_frames, config.mesh.layout,
                        *size) if pipe.makes_video else pipe  # fmt: skip
        hw = sized.check_size(*size)
        # timed on the loaded denoiser (a video model's: one frame, so that a slab's positions
        # need no frame count; the compute is the same)
        plan, seconds = measured_plan(plan, pipe.unet, pipe.unet_params, hw, log)
        measured = {"measured_seconds_per_step": seconds, "patch_weights": list(plan.patch_weights)}
    checkpoint = getattr(pipe, "quant_checkpoint", None)  # the quantized weights, not the floats
    if checkpoint is not None:
        log(f"read quantized checkpoint {checkpoint}")
    t0 = time.perf_counter()
    negative = [config.negative_prompt] * len(config.prompt) if config.negative_prompt else None
    out = pipe(
        list(config.prompt),
        height=config.sampler.height,
        width=config.sampler.width,
        steps=config.sampler.steps,
        guidance_scale=guidance,
        seed=config.seed,
        sampler=sampler,
        negative_prompts=negative,
        plan=plan,
        check_memory=True,  # compiled first: a program that cannot fit is refused up front
        vae_plan=vae_plan,
        log=log,
        guidance_scale_2=config.sampler.guidance_scale_2,
        **video,
    )
    t_gen = time.perf_counter() - t0
    experts = {}  # a model of two experts: the low-noise one's scale, where it takes over
    if pipe.unet_params_2 is not None:
        g2 = config.sampler.guidance_scale_2
        experts = {"guidance_scale_2": guidance if g2 is None else g2,
                   "boundary_ratio": pipe.boundary_ratio}  # fmt: skip
    hits, compiled = compile_cache.hits() - hits, compile_cache.compiled() - compiled
    if cache_folder is not None:
        log(f"{hits} program(s) read from the compile cache ({cache_folder}), {compiled} compiled")
    log("stages: " + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s"
                               for k, v in (out.stages or {}).items() if v is not None))  # fmt: skip
    record = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "images": [],
        "latent_shape": list(out.latents.shape),
        "guidance_scale": guidance,
        **experts,
        "sampler": sampler,
        "compute_dtype": jnp.dtype(pipe.unet.module.dtype).name,
        "attention": pipe.unet.module.attn.impl,
        "quant": pipe.quant,
        "scan_blocks": config.model.scan_blocks,
        "quant_checkpoint": None if checkpoint is None else str(checkpoint),
        "strategy": plan.strategy.describe(),
        "devices": plan.devices,
        "vae_parallel": vae_plan.mode,
        "processes": config.mesh.processes,
        "stale_bytes_per_device": out.stale_bytes_per_device,
        **(out.cache or {}),
        **measured,
        "compile_cache_hits": hits,
        "load_s": round(t_load, 3),
        "generate_s_including_compile": round(t_gen, 3),
        # each stage waited for: the text encoding (its first call's compile in it), the
        # denoising phases' compile, the denoising, the decode (its compile in it)
        "stages_s": {k: None if v is None else round(v, 3) for k, v in (out.stages or {}).items()},
    }
    if not is_writer():  # with several processes, process 0 alone writes
        return record
    folder = Path(config.out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    if pipe.makes_video:
        from patchpar.lab.video import write_video

        for i, clip in enumerate(out.frames):
            paths += [str(p) for p in write_video(clip, folder, f"video_{i}")]
        record.update(frames=int(out.frames.shape[1]), layout=config.mesh.layout)
    else:
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


def launched_generate(config: GenerateConfig, args: list[str], checked: bool = False) -> dict:
    """`patchpar generate` (the command line `args`) in `config.mesh.processes` launched
    processes; returns the generate.json that process 0 wrote. `checked`: the caller ran
    `check`."""
    import sys

    from patchpar.lab.results import check_writable

    if not checked:
        check(config)

    done = check_writable(config.out, "out") / "generate.json"
    done.unlink(missing_ok=True)
    launch(args, config.mesh.processes, config.timeout_s, lambda m: print(m, file=sys.stderr))
    return json.loads(done.read_text())
