"""Typed, frozen configs. Every knob an ablation varies is a field (with its paper reference).

`RunConfig` is what `patchpar run` takes: read from YAML (`load_config`), changed by dotted
overrides (`with_overrides(cfg, {"strategy.portion": 0.5})`, or `--strategy.portion 0.5` on the
command line), checked by `validate()`. A sweep point is a new RunConfig, never a mutated one.
`PlanFlags` is the flat form `patchpar generate` and `patchpar comm` take.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

from patchpar.lab.paths import RUNS

DTYPES = ("auto", "float32", "bfloat16")  # a run's compute dtype (auto: per model size)
LOWERED_DTYPES = DTYPES[1:]  # what `comm` and `project` lower abstract weights in


def build_plan(
    name: str,
    options: dict,
    devices: int,
    cfg: int,
    comm: bool = True,
    data: int = 1,
    fsdp: bool = False,
    cache: str = "none",
    cache_options: dict | None = None,
):
    """The strategy `name` with the options given (None = the strategy's default), on devices
    split as data x cfg x patch x model, weights sharded per layer with `fsdp`, with the step
    cache `cache` (`patchpar.sampling.cache`; options None = the cache's default)."""
    from patchpar.parallel.engine import Plan
    from patchpar.parallel.strategies import make_strategy
    from patchpar.sampling.cache import make_cache

    options = {k: v for k, v in options.items() if v is not None}
    step_cache = make_cache(
        cache, **{k: v for k, v in (cache_options or {}).items() if v is not None}
    )
    return Plan(make_strategy(name, **options), devices, cfg, comm, data, fsdp, step_cache)


def build_vae_plan(mode: str, devices: int, data: int, tile: int):
    """The VAE's placement: `mode` (off, rows, tiles) on the run's devices, images over
    `data` (patchpar.parallel.vae.VAEPlan)."""
    from patchpar.parallel.vae import MODES, VAEPlan

    if mode not in MODES:
        raise ValueError(f"vae_parallel={mode!r}; known: {list(MODES)}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 0:
        raise ValueError(f"vae_tile={tile!r}: must be 0 (the VAE's sample size) or pixels > 0")
    if tile and mode != "tiles":
        raise ValueError(
            f"vae_tile={tile}: a tile size is for vae_parallel=tiles, and vae_parallel={mode!r} "
            f"decodes without tiles; set vae_parallel=tiles, or leave vae_tile at 0"
        )
    return VAEPlan(mode, devices, data, tile)


def _strategy_options() -> dict[str, tuple[Any, str]]:
    """Every strategy option, from the strategy dataclasses themselves (`patchpar/parallel/
    strategies/`, each option declared with its help by `base.option`): name -> (type, help
    prefixed by the strategies that have it), in registry order. A new strategy brings its options with
    it; nothing here lists them."""
    from patchpar.parallel.strategies import STRATEGIES

    found: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for name, cls in STRATEGIES.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            entry = found.setdefault(f.name, (hints[f.name], {}))
            entry[1].setdefault(f.metadata.get("help", ""), []).append(name)
    # an option that means one thing to some strategies and another to others (warmup_steps:
    # DistriFusion's and PipeFusion's conventions) gets each meaning prefixed by its users
    return {
        k: (t, " ".join(f"{'/'.join(users)}: {text}" for text, users in helps.items()))
        for k, (t, helps) in found.items()
    }


def _registry_help() -> dict[str, str]:
    """Help of the options that name a registry's entry, made from the registries (a new
    strategy, sampler, step cache, preset or model family shows up in --help unedited):
    `model` (the presets that run: trained, or random weights written on first use; or a
    folder), `any_model` (every preset, lowered without weights; or a folder)."""
    from patchpar.models.family import families
    from patchpar.models.presets import PRESETS, SHIPPED, WEIGHTED
    from patchpar.parallel.strategies import STRATEGIES
    from patchpar.sampling.cache import CACHES
    from patchpar.sampling.schedulers import DDPM_SAMPLERS, SAMPLERS

    fams = families().values()
    pipelines = ", ".join(c.removesuffix("Pipeline") for f in fams for c in f.pipeline_classes)
    folder = f"a local diffusers-format folder (pipelines: {pipelines})"
    ddpm = "/".join(f.name for f in fams if f.default_sampler in DDPM_SAMPLERS)
    flow = "/".join(f.name for f in fams if f.default_sampler not in DDPM_SAMPLERS)
    caches = "; ".join(f"{k}: {c.summary.removeprefix('it ')}" for k, c in CACHES.items())
    return {
        "strategy": f"{', '.join(STRATEGIES)} (patchpar/parallel/strategies/).",
        "sampler": f"{', '.join(DDPM_SAMPLERS)} (noise or v prediction: {ddpm} models) or "
        f"{', '.join(s for s in SAMPLERS if s not in DDPM_SAMPLERS)} (flow matching: {flow}).",
        "cache": f"A step cache (reuse across steps, with any one-call strategy): none; {caches}.",
        "model": f"A preset, trained ({', '.join(SHIPPED)}) or with random weights "
        f"({', '.join(WEIGHTED)}), or {folder}.",
        "any_model": f"A preset ({', '.join(sorted([*PRESETS, *SHIPPED]))}) or {folder}.",
    }


HELP = _registry_help()


def _optional(t):
    return t if type(None) in typing.get_args(t) else t | None


_OPTIONS = _strategy_options()
STRATEGY_OPTIONS = tuple(_OPTIONS)


def _options(self) -> dict:
    return {k: getattr(self, k) for k in STRATEGY_OPTIONS if getattr(self, k) is not None}


def _bare_flag(name: str):
    """A boolean strategy option on the command line: `--no-sync` alone is True, `--no-sync
    False` also reads; unset stays None (the strategy's default)."""
    from tyro.constructors import PrimitiveConstructorSpec

    flag = "--" + name.replace("_", "-")

    def parse(args: list[str]) -> bool:
        if not args:
            return True
        if len(args) == 1 and args[0].lower() in ("true", "false"):
            return args[0].lower() == "true"
        raise ValueError(f"{flag} {' '.join(args)!r}: a bare flag ({flag}), or {flag} True/False")

    return PrimitiveConstructorSpec(
        nargs="*",
        metavar="[True|False]",
        instance_from_str=parse,
        is_instance=lambda v: v is None or isinstance(v, bool),
        str_from_instance=lambda v: [str(v)],
    )


def _option_type(name: str, t):
    if t is bool or t == bool | None:
        return Annotated[bool | None, _bare_flag(name)]
    return _optional(t)


StrategyOptions = make_dataclass(
    "StrategyOptions",
    [
        (
            name,
            Annotated[_option_type(name, t), tyro.conf.arg(help=text)],
            field(default=None),
        )
        for name, (t, text) in _OPTIONS.items()
    ],
    frozen=True,
    namespace={"options": _options, "__module__": __name__},
)
StrategyOptions.__doc__ = """The strategies' options (declared in each strategy's own file); one left
    unset (None) keeps the strategy's default, and one the chosen strategy does not have is an
    error."""


@dataclass(frozen=True)
class PlanFlags(StrategyOptions):
    """Which strategy, on how many devices, with which options (flat flags for `generate`,
    `comm` and `project`)."""

    strategy: Annotated[str, tyro.conf.arg(help=HELP["strategy"])] = "single"
    devices: int = 1
    """Devices in all (= data x cfg x patch x model; model = tensor's tp_degree, else 1)."""
    cfg: int = 1
    """1: both guidance halves on every device; 2: split across two device halves."""
    data: int = 1
    """Devices that split the images of a batch (data parallel; the Flax SD pipeline's pmap)."""
    fsdp: bool = False
    """Shard the weights over the devices that share them, gathered per layer (ZeRO-3)."""

    def plan(self):
        """The strategy with the options given, placed on the devices."""
        return build_plan(
            self.strategy, self.options(), self.devices, self.cfg, data=self.data, fsdp=self.fsdp
        )


@dataclass(frozen=True)
class DecodeFlags(PlanFlags):
    """PlanFlags and where the VAE decodes (`generate`, `project`; `comm` counts one denoiser
    call and has no decode)."""

    vae_parallel: str = "off"
    """The VAE decode: off (one device, the whole image), rows (row patches over the devices,
    exact halos, GroupNorm and Ring attention: equals off) or tiles (diffusers' enable_tiling
    tiles spread over the devices and blended: not exact)."""
    vae_tile: int = 0
    """vae_parallel=tiles: a tile's side in pixels (0: the VAE's sample_size, diffusers')."""

    def vae_plan(self):
        """How the VAE decodes (patchpar.parallel.vae), on the same devices."""
        return build_vae_plan(self.vae_parallel, self.devices, self.data, self.vae_tile)


CACHE_FLAGS = tuple(
    f"cache_{k}" for k in ("threshold", "interval", "warmup", "order", "stop", "branch")
)


@dataclass(frozen=True)
class CachedDecodeFlags(DecodeFlags):
    """DecodeFlags and a step cache as flat flags (`generate`, `project`)."""

    cache: Annotated[str, tyro.conf.arg(help=HELP["cache"])] = "none"
    cache_threshold: float | None = None
    """fbcache: skip the blocks after the first while its residual changed by at most this
    (relative mean absolute change since the last computed step); unset: 0.05 (diffusers').
    teacache: its rel_l1_thresh; unset: 0.25."""
    cache_interval: int | None = None
    """taylorseer: one step in this many runs the denoiser after the warm-up (unset: 5).
    deepcache: one step in this many runs the whole UNet (unset: 3)."""
    cache_warmup: int | None = None
    """taylorseer: the first steps that all run the denoiser (unset: 3)."""
    cache_order: int | None = None
    """taylorseer: the Taylor expansion's highest order (unset: 1)."""
    cache_stop: int | None = None
    """taylorseer: from this step on every step runs again (unset: never)."""
    cache_branch: int | None = None
    """deepcache: the shallow branch's levels - 1, run every step (unset: 0, the shallowest)."""

    def plan(self):
        """The strategy with the options given, placed on the devices, with the cache."""
        options = {k.removeprefix("cache_"): getattr(self, k) for k in CACHE_FLAGS}
        return build_plan(
            self.strategy, self.options(), self.devices, self.cfg, data=self.data,
            fsdp=self.fsdp, cache=self.cache, cache_options=options,
        )  # fmt: skip


# ---------------------------------------------------------------------------- RunConfig parts


@dataclass(frozen=True)
class ModelConfig:
    name: Annotated[str, tyro.conf.arg(help=HELP["model"])] = "tiny"
    attention: str = "auto"
    """Attention kernel: auto (chunked on CPU and TPU, cudnn on GPU for bf16), xla
    (whole logits: the reference), chunked (blockwise, online softmax), cudnn or splash."""
    block_q: int = 256
    """Chunked/splash attention: queries per block (MaxDiffusion's flash block_q)."""
    block_kv: int = 512
    """Chunked/splash attention: keys/values per block (MaxDiffusion's flash block_kv)."""
    quant: str = "none"
    """Quantized denoiser (Qwix, patchpar/quant.py): none; w8 or w4 (int8 / int4 weights,
    activations in the compute dtype); int8 or fp8 (int8 / fp8 e4m3 weights x activations)."""
    scan_blocks: bool = False
    """Run each stack of identical blocks (a DiT's transformer blocks, a UNet transformer's) as
    one scanned loop: a much shorter compile, outputs equal within float rounding
    (patchpar/models/scan.py); not with quant, PipeFusion, AsyncDiff, or fbcache and teacache
    on a DiT."""

    def attention_spec(self):
        from patchpar.models.attention import AttentionSpec

        return AttentionSpec(self.attention, self.block_q, self.block_kv)


@dataclass(frozen=True)
class MeshConfig:
    devices: int = 1
    """Devices in all (= data x cfg x patch x model; model = tensor's tp_degree, else 1)."""
    cfg: int = 1
    """1: both guidance halves on every device; 2: split across two device halves (DistriFusion §4.3)."""
    data: int = 1
    """Devices that split the images of each call (data parallel, as the Flax SD pipeline's
    pmap); the images per call must be a multiple of it. Image (prompt, seed) is the same
    whatever the split."""
    fsdp: bool = False
    """Shard every weight's embed dimension over the devices that run the same weights (data x
    cfg x patch; MaxDiffusion's fsdp rule, ZeRO-3) and all-gather each layer's just before it
    runs: weight memory per device / that degree, for one all-gather of the weights per UNet
    call (site fsdp). Exact: the images are those without it."""
    vae_parallel: str = "off"
    """The VAE decode (patchpar/parallel/vae.py): off (one device, the whole image; the
    papers' runs), rows (the decoder on row patches over the same devices, images over data:
    exact halos after every upsampling, exact GroupNorm, Ring attention in the mid block;
    equals off) or tiles (diffusers' enable_tiling rule, tiles spread over the devices and
    blended: not exact)."""
    vae_tile: int = 0
    """vae_parallel=tiles: a tile's side in pixels (0: the VAE's sample_size, as diffusers)."""
    processes: int = 0
    """0: run in this process on the devices it sees (on CPU, fake devices sharing the cores:
    no speedup). N >= 1: launch N processes here (`--processes N`), one CPU device, one core
    and one thread each, joined by jax.distributed (gloo): a real speedup; devices must be N."""


@dataclass(frozen=True)
class StrategyConfig(StrategyOptions):
    """A strategy and its options."""

    name: Annotated[str, tyro.conf.arg(help=HELP["strategy"])] = "single"

    def label(self) -> str:
        """Name and the options set, e.g. `pcpp portion=0.5 send=band`."""
        return " ".join([self.name] + [f"{k}={v}" for k, v in self.options().items()])


@dataclass(frozen=True)
class CacheConfig:
    """A step cache: reuse across denoising steps, orthogonal to the strategy
    (`patchpar.sampling.cache`, docs/design.md §3c)."""

    name: Annotated[str, tyro.conf.arg(help=HELP["cache"])] = "none"
    threshold: float | None = None
    """fbcache: skip while the first block's residual changed by at most this (relative mean
    absolute change since the last computed step); unset: 0.05 (diffusers'). teacache: skip
    while the accumulated rescaled change of the first block's modulated input stays under
    this; unset: 0.25."""
    interval: int | None = None
    """taylorseer: one step in this many runs the denoiser after the warm-up (unset: 5).
    deepcache: one step in this many runs the whole UNet (unset: 3)."""
    warmup: int | None = None
    """taylorseer: the first steps that all run the denoiser (unset: 3)."""
    order: int | None = None
    """taylorseer: the Taylor expansion's highest order (unset: 1)."""
    stop: int | None = None
    """taylorseer: from this step on every step runs again (unset: never)."""
    branch: int | None = None
    """deepcache: the shallow branch's levels - 1, run every step (unset: 0, the shallowest)."""

    def options(self) -> dict:
        """The options set (None: the cache's default)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "name" and getattr(self, f.name) is not None}  # fmt: skip

    def label(self) -> str:
        """Name and the options set, e.g. `fbcache threshold=0.1`."""
        return " ".join([self.name] + [f"{k}={v}" for k, v in self.options().items()])


@dataclass(frozen=True)
class SamplerConfig:
    name: Annotated[str, tyro.conf.arg(help=HELP["sampler"])] = "ddim"
    steps: int = 20
    """Denoising steps (DistriFusion and PCPP evaluate 50-step DDIM / Euler)."""
    guidance_scale: float = 7.5
    """Classifier-free guidance scale; <= 1 disables CFG (FLUX.1-dev: the guidance input)."""
    true_cfg_scale: float = 1.0
    """True classifier-free guidance over a guidance-distilled model (FLUX.1; diffusers'
    true_cfg_scale): > 1 adds the negative prompt as a second guidance half; <= 1: off."""
    height: int | None = None
    """Image height in pixels (default: the denoiser's sample size x the VAE factor)."""
    width: int | None = None
    """Image width in pixels (default: as height)."""
    dtype: str = "auto"
    """auto, float32 or bfloat16. auto: bfloat16 for the full-size models (sd15, sd21, sdxl,
    pixart-alpha, pixart-sigma and folders of such sizes), float32 for the small ones."""


@dataclass(frozen=True)
class PromptsConfig:
    prompts: tuple[str, ...] = ("a photo of a red bag",)
    """The prompt set; one image per prompt and seed."""
    seeds: tuple[int, ...] = (0,)
    """Seeds of the initial latents; image (prompt p, seed s) starts from normal(key(s))."""
    negative_prompt: str = ""
    """Negative prompt for classifier-free guidance ("" = unconditional)."""
    batch_size: int = 0
    """Images per pipeline call (0 = all in one call); the first call's batch is the timed one."""


QUALITY_METRICS = ("psnr", "ssim", "lpips", "fid", "fid_gt", "clip_score", "prompt_accuracy")


@dataclass(frozen=True)
class MeasureConfig:
    warmup_runs: int = 1
    """Untimed runs after compilation, before the timed repeats."""
    repeats: int = 3
    """Timed runs (block_until_ready); the record keeps the median, min, max and all."""
    comm: bool = True
    """Count bytes per device and FLOPs from the lowered step programs (patchpar comm)."""
    quality: tuple[str, ...] = ("psnr", "ssim")
    """psnr, ssim, lpips (vs the single-device image of the same prompt and seed; DistriFusion
    Table 1), fid (vs the single-device set), fid_gt (vs ground_truth), clip_score (vs prompts),
    prompt_accuracy (the model folder's classifier/ agrees with the class the prompt names)."""
    ground_truth: str = "fashion-mnist"
    """fid_gt's reference: fashion-mnist[:train|:test] (padded 28 -> 32 as the fmnist model's
    frame) or a folder of images."""
    ground_truth_samples: int = 1000
    """How many ground-truth images fid_gt uses (their features are cached)."""
    clip_model: str | None = None
    """clip_score: a shipped CLIP (fmnist-clip), a folder in open_clip's local-dir format
    (open_clip_config.json + open_clip_model.safetensors), or an open_clip model name with
    clip_checkpoint; unset: the model's default (fmnist, fmnist-random: fmnist-clip)."""
    clip_checkpoint: str | None = None
    """clip_score: a local checkpoint file of a named open_clip model (nothing is downloaded)."""
    clip_config: str | None = None
    """clip_score: a model config JSON named <clip_model>.json, for models open_clip lacks."""
    lpips_net: str = "alex"
    """LPIPS backbone: alex, vgg or squeeze (its torchvision weights must be on disk)."""
    save_images: bool = True
    """Write the images next to the record (git-ignored)."""
    compute_only: bool = False
    """Replace every collective by a local stand-in of the same shape: the images are wrong
    (quality and bytes are not measured), the time is each device's compute alone
    (DistriFusion Table 2's "no communication (ideal)" row; experiments/speedup_breakdown.py)."""


@dataclass(frozen=True)
class RunConfig:
    """One experiment run: a model, a strategy on a mesh, a sampler, prompts and what to measure.
    Records go to `<results>/<experiment>/runs.jsonl`."""

    experiment: str = "default"
    """Name of the results folder."""
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    results: Path = RUNS
    """Root folder of the records; also holds the single-device baselines (.baselines/).
    Default `runs/` (git-ignored, a user's own runs); the published records are under
    `results/` (patchpar.lab.paths)."""
    timeout_s: float = 7200.0
    """mesh.processes >= 1: every worker is ended, and the run recorded as an error, after this
    many seconds (a hung collective cannot block a sweep)."""

    def label(self) -> str:
        """The strategy's label, the cache's and the quant mode's, e.g. `pcpp send=band +
        fbcache threshold=0.1`, `distrifusion + fp8`."""
        cache = "" if self.cache.name == "none" else f" + {self.cache.label()}"
        quant = "" if self.model.quant == "none" else f" + {self.model.quant}"
        return self.strategy.label() + cache + quant

    def plan(self):
        return build_plan(
            self.strategy.name,
            self.strategy.options(),
            self.mesh.devices,
            self.mesh.cfg,
            comm=not self.measure.compute_only,
            data=self.mesh.data,
            fsdp=self.mesh.fsdp,
            cache=self.cache.name,
            cache_options=self.cache.options(),
        )

    def vae_plan(self):
        """How the VAE decodes, on the run's devices (patchpar.parallel.vae.VAEPlan)."""
        m = self.mesh
        return build_vae_plan(m.vae_parallel, m.devices, m.data, m.vae_tile)

    def validate(self) -> RunConfig:
        """Everything checkable without a model; every problem found raised together
        (`checks.Problems`, a ValueError: one line each, naming the field and what fits)."""
        from patchpar.lab.defaults import DEFAULT_CLIP
        from patchpar.measure.quality import FID_MIN_SAMPLES, FID_RELIABLE_SAMPLES
        from patchpar.models.attention import IMPLEMENTATIONS
        from patchpar.models.presets import CLIP_MODELS
        from patchpar.parallel.strategies import STRATEGIES
        from patchpar.pipelines.checks import SEED_RANGE
        from patchpar.sampling.schedulers import SAMPLERS

        s, m = self.sampler, self.measure
        n_images = len(self.prompts.prompts) * len(self.prompts.seeds)
        seeds_ok = all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < SEED_RANGE
            for x in self.prompts.seeds
        )
        gs = s.guidance_scale
        checks = [
            (isinstance(self.mesh.devices, int) and self.mesh.devices >= 1, "mesh.devices",
             self.mesh.devices, "an integer >= 1"),
            (isinstance(self.mesh.processes, int) and self.mesh.processes >= 0, "mesh.processes",
             self.mesh.processes, "0 (this process) or the number of processes to launch"),
            (self.mesh.processes in (0, self.mesh.devices), "mesh.processes",
             self.mesh.processes, f"0 or mesh.devices={self.mesh.devices}: devices must equal "
             "processes x local devices, and a launched process has one CPU device"),
            (self.timeout_s > 0, "timeout_s", self.timeout_s, "a positive number of seconds"),
            (self.mesh.cfg in (1, 2), "mesh.cfg", self.mesh.cfg,
             "1 (both guidance halves on every device) or 2 (split across two device halves)"),
            (isinstance(self.mesh.data, int) and self.mesh.data >= 1, "mesh.data",
             self.mesh.data, "an integer >= 1 (1: no data parallelism)"),
            (self.mesh.data == 1 or self.strategy.name != "single", "mesh.data",
             self.mesh.data, "1 with strategy single (one device); data parallelism composes "
             "with the parallel strategies (sync_patch with mesh.devices = mesh.data is pure "
             "data parallel)"),
            (self.experiment and "/" not in self.experiment, "experiment", self.experiment,
             "a non-empty name without '/'"),
            (self.strategy.name in STRATEGIES, "strategy.name", self.strategy.name,
             f"one of {list(STRATEGIES)}"),
            (s.name in SAMPLERS, "sampler.name", s.name, f"one of {list(SAMPLERS)}"),
            (s.steps >= 1, "sampler.steps", s.steps, "an integer >= 1"),
            (s.dtype in DTYPES, "sampler.dtype", s.dtype, f"one of {list(DTYPES)}"),
            (self.model.attention in IMPLEMENTATIONS, "model.attention", self.model.attention,
             f"one of {list(IMPLEMENTATIONS)}"),
            (isinstance(self.model.block_q, int) and self.model.block_q >= 1, "model.block_q",
             self.model.block_q, "a positive integer (e.g. 256)"),
            (isinstance(self.model.block_kv, int) and self.model.block_kv >= 1, "model.block_kv",
             self.model.block_kv, "a positive integer (e.g. 512)"),
            (s.height is None or s.height > 0, "sampler.height", s.height, "a positive integer"),
            (s.width is None or s.width > 0, "sampler.width", s.width, "a positive integer"),
            (len(self.prompts.prompts) > 0, "prompts.prompts", self.prompts.prompts,
             "at least one prompt"),
            (len(self.prompts.seeds) > 0, "prompts.seeds", self.prompts.seeds, "at least one seed"),
            (seeds_ok, "prompts.seeds", self.prompts.seeds,
             "integers in [0, 2^32) (larger seeds wrap around: 2^32 would repeat seed 0)"),
            (isinstance(gs, int | float) and math.isfinite(gs) and gs >= 0,
             "sampler.guidance_scale", gs, "a finite number >= 0 (<= 1 turns guidance off)"),
            (isinstance(s.true_cfg_scale, int | float) and math.isfinite(s.true_cfg_scale)
             and s.true_cfg_scale >= 0, "sampler.true_cfg_scale", s.true_cfg_scale,
             "a finite number >= 0 (<= 1: off)"),
            (not self.prompts.negative_prompt or gs > 1 or s.true_cfg_scale > 1,
             "prompts.negative_prompt",
             self.prompts.negative_prompt, f"empty with sampler.guidance_scale={gs}: guidance "
             "<= 1 is off, so the negative prompt would be dropped; set guidance_scale > 1"),
            (self.prompts.batch_size >= 0, "prompts.batch_size", self.prompts.batch_size,
             "0 (all at once) or a positive integer"),
            (m.warmup_runs >= 0, "measure.warmup_runs", m.warmup_runs, "an integer >= 0"),
            (m.repeats >= 1, "measure.repeats", m.repeats, "an integer >= 1"),
            (set(m.quality) <= set(QUALITY_METRICS), "measure.quality", m.quality,
             f"a subset of {list(QUALITY_METRICS)}"),
            ("clip_score" not in m.quality or clip_ok(self.model.name, m),
             "measure.clip_model", m.clip_model,
             f"one of {sorted(CLIP_MODELS)}, a CLIP folder (open_clip_config.json), or a name "
             f"with measure.clip_checkpoint, when measure.quality has clip_score (model "
             f"{self.model.name!r} has no default CLIP; models with one: {sorted(DEFAULT_CLIP)})"),
            (not {"fid", "fid_gt"} & set(m.quality) or n_images >= FID_MIN_SAMPLES,
             "prompts", f"{len(self.prompts.prompts)} prompts x {len(self.prompts.seeds)} seeds",
             f"at least {FID_MIN_SAMPLES} images in all for fid/fid_gt (a covariance of "
             f"2048-d features from fewer is meaningless; below {FID_RELIABLE_SAMPLES} the "
             f"record flags FID as biased)"),
            (m.ground_truth_samples >= 2, "measure.ground_truth_samples",
             m.ground_truth_samples, "an integer >= 2"),
            (m.lpips_net in ("alex", "vgg", "squeeze"), "measure.lpips_net", m.lpips_net,
             "alex, vgg or squeeze"),
        ]  # fmt: skip
        from patchpar.lab.checks import Problems

        problems = Problems.collect()  # every problem, one line each, raised together
        problems.lines += [f"{key}={value!r}: must be {fits}" for ok, key, value, fits in checks
                           if not ok]  # fmt: skip
        if "fid_gt" in m.quality:  # the reference must be there before anything is generated
            from patchpar.lab.datasets import check_ground_truth

            with problems.check():
                check_ground_truth(m.ground_truth)
        from patchpar.parallel.mesh import mesh_shape

        mesh_ok = False  # the plans below need a mesh that splits
        fields_ok = not any(key.startswith("mesh.") and key != "mesh.processes"
                            for ok, key, *_ in checks if not ok)  # fmt: skip
        if fields_ok:  # else said above, field by field
            with problems.check():
                try:
                    mesh_shape(self.mesh.devices, self.mesh.cfg, self.mesh.data)
                except ValueError as e:
                    raise ValueError(f"mesh: {e}") from None
                mesh_ok = True
        per_call = min(self.prompts.batch_size or n_images, n_images)
        calls = {per_call} | ({n_images % per_call} if per_call and n_images % per_call else set())
        data = self.mesh.data
        if isinstance(data, int) and data >= 1 and any(c % data for c in calls):
            problems.lines.append(
                f"mesh.data={data}: the calls take {sorted(calls)} image(s) "
                f"({len(self.prompts.prompts)} prompts x {len(self.prompts.seeds)} seeds, "
                f"prompts.batch_size={self.prompts.batch_size}), and every call's images must "
                f"split evenly over the data axis; use a batch size and an image count that are "
                f"multiples of {data}"
            )
        from patchpar.quant import check_mode
        from patchpar.sampling.cache import make_cache

        with problems.check():
            try:
                make_cache(self.cache.name, **self.cache.options())
            except ValueError as e:
                raise ValueError(f"cache: {e}") from None
        with problems.check():
            try:
                check_mode(self.model.quant)
                check_scan(self.model.scan_blocks, self.model.quant, self.strategy.name)
            except ValueError as e:
                raise ValueError(f"model.{e}") from None
        if self.strategy.name in STRATEGIES and mesh_ok and s.steps >= 1:
            with problems.check():
                try:
                    plan = self.plan()  # strategy options: unknown names and bad values
                    plan.strategy.validate(s.steps, plan.patch, plan.cfg)
                except ValueError as e:
                    raise ValueError(f"strategy: {e}") from None
        if mesh_ok:
            with problems.check():
                try:
                    self.vae_plan()
                except ValueError as e:
                    raise ValueError(f"mesh.{e}") from None
        problems.raise_any()
        return self


def check_scan(scan_blocks: bool, quant: str, strategy: str) -> None:
    """Scanned blocks run whole, on float weights: ValueError for a quantized model or a
    strategy that runs the blocks apart (each its own stage or device)."""
    if not scan_blocks:
        return
    if quant != "none":
        raise ValueError(
            f"scan_blocks with quant={quant!r}: a quantized model runs its blocks unrolled; "
            f"turn one of them off"
        )
    if strategy in ("pipefusion", "asyncdiff"):
        raise ValueError(
            f"scan_blocks with strategy {strategy!r}: it runs the blocks apart (stages of "
            f"layers); turn scan_blocks off"
        )


def unused_options(config: RunConfig) -> list[str]:
    """Options a run is given that have no effect in its context, one line each (printed as
    warnings, kept in the record): the run goes on, but the user meant something else. Only
    values away from their defaults are named (a default has no effect to miss)."""
    m, model, dm = config.measure, config.model, MeasureConfig()
    out = []
    if model.attention in ("xla", "cudnn"):
        for key in ("block_q", "block_kv"):
            if getattr(model, key) != getattr(ModelConfig(), key):
                out.append(
                    f"model.{key}={getattr(model, key)} has no effect with model.attention="
                    f"{model.attention!r} (block sizes are the chunked and splash kernels')"
                )
    needs = {  # measure fields -> the metric that reads them
        "ground_truth": "fid_gt", "ground_truth_samples": "fid_gt", "clip_model": "clip_score",
        "clip_checkpoint": "clip_score", "clip_config": "clip_score", "lpips_net": "lpips",
    }  # fmt: skip
    same = {"fashion-mnist": "fashion-mnist:test"}  # one reference, two spellings
    for key, metric in needs.items():
        given, default = getattr(m, key), getattr(dm, key)
        if same.get(given, given) != same.get(default, default) and metric not in m.quality:
            out.append(
                f"measure.{key}={getattr(m, key)!r} has no effect: measure.quality "
                f"{list(m.quality)} does not include {metric}"
            )
    if m.compute_only and m.quality:
        out.append(
            f"measure.quality {list(m.quality)} is not measured with measure.compute_only (the "
            f"collectives are stand-ins, so the images are wrong); set measure.quality []"
        )
    if config.timeout_s != RunConfig.timeout_s and not config.mesh.processes:
        out.append(
            f"timeout_s={config.timeout_s} has no effect without mesh.processes (it ends "
            f"launched workers that hang)"
        )
    if config.mesh.fsdp and config.plan().fsdp_degree == 1:
        out.append(fsdp_unused(config.mesh.devices))
    if (cache := config.plan().cache) is not None:
        out += cache.idle_options(config.sampler.steps)
    n_images = len(config.prompts.prompts) * len(config.prompts.seeds)
    if config.prompts.batch_size > n_images:
        out.append(
            f"prompts.batch_size={config.prompts.batch_size} is more than the {n_images} "
            f"image(s) of the prompt set: one call takes them all"
        )
    return out


def fsdp_unused(devices: int) -> str:
    return (
        f"fsdp has no effect on {devices} device(s) here: no two devices run the same weights "
        f"(one device, or tensor parallelism over all of them), so there is nothing to shard"
    )


def clip_ok(model: str, m: MeasureConfig) -> bool:
    """clip_score has a CLIP to use: the model's default, a shipped name, a local-dir folder,
    or a named open_clip model with its checkpoint (whether the files load is checked before
    generating: patchpar.lab.evaluate.check_quality_inputs)."""
    from patchpar.lab.defaults import DEFAULT_CLIP
    from patchpar.models.presets import CLIP_MODELS

    if m.clip_model is None:
        return model in DEFAULT_CLIP
    return (
        m.clip_model in CLIP_MODELS
        or m.clip_model.startswith("local-dir:")
        or Path(m.clip_model).is_dir()
        or bool(m.clip_checkpoint)
    )


# ---------------------------------------------------------------------------- dict <-> config


def with_defaults(section: type, given: dict) -> dict:
    """A config section as a record holds it, with the defaults of the fields the record
    predates (`with_defaults(MeshConfig, record["config"]["mesh"])`)."""
    return {**to_dict(section()), **given}


def point_config(config: RunConfig | dict) -> dict:
    """A run's config as a point (plain data): without where records go (`results`) or how
    long a worker may take (`timeout_s`), and with the fields older records lack filled in as
    those runs ran (the mesh, strategy, cache, measure and prompts defaults of today; attention `xla`,
    float32 from before kernels and dtypes existed)."""
    d = to_dict(config) if isinstance(config, RunConfig) else dict(config)
    d.pop("results", None)
    d.pop("timeout_s", None)
    d["mesh"] = with_defaults(MeshConfig, d.get("mesh", {}))
    d["strategy"] = with_defaults(StrategyConfig, d.get("strategy", {}))
    d["cache"] = with_defaults(CacheConfig, d.get("cache", {}))
    d["measure"] = with_defaults(MeasureConfig, d.get("measure", {}))
    d["prompts"] = with_defaults(PromptsConfig, d.get("prompts", {}))
    d["model"] = {
        "attention": "xla",
        "block_q": 256,
        "block_kv": 512,
        "quant": "none",
        "scan_blocks": False,
        **d.get("model", {}),
    }
    d["sampler"] = {**d.get("sampler", {})}
    d["sampler"].setdefault("dtype", "float32")
    return d


def to_dict(cfg) -> dict:
    """Plain JSON/YAML types: nested dicts, lists for tuples, str for paths."""

    def plain(v):
        if is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    return plain(cfg)


def from_dict(cls, data: dict, where: str = ""):
    """Build a (nested) config dataclass from plain data; unknown keys and wrong types are
    errors naming the dotted key and what would fit. Missing keys keep their defaults."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ValueError(f"unknown key {key!r}; known keys here: {sorted(known)}")
    kwargs = {k: _coerce(hints[k], v, f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _coerce(tp, v, key: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(inner[0], v, key)
        for a in inner:  # e.g. int | str: the first type the value is
            if isinstance(v, a) and not (a is not bool and isinstance(v, bool)):
                return v
        names = " or ".join(a.__name__ for a in inner)
        raise ValueError(f"{key}={v!r}: expected {names}")
    if is_dataclass(tp):
        return from_dict(tp, v, key)
    if origin is tuple:
        if isinstance(v, str | int | float):  # a single value stands for a one-element tuple
            v = [v]
        if not isinstance(v, list | tuple):
            raise ValueError(f"{key}={v!r}: expected a list")
        return tuple(_coerce(args[0], x, key) for x in v)
    if tp is Path:
        if not isinstance(v, str | Path):
            raise ValueError(f"{key}={v!r}: expected a path")
        return Path(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (int, float, str, bool) and (
        not isinstance(v, tp) or (tp is not bool and isinstance(v, bool))
    ):
        hint = ""
        if tp is str and isinstance(v, bool):  # YAML 1.1 reads a bare off/on/yes/no as a bool
            hint = " (in YAML a bare off, on, yes or no is a boolean: quote it, e.g. 'off')"
        raise ValueError(f"{key}={v!r}: expected {tp.__name__}{hint}")
    return v


def with_overrides(cfg, overrides: dict[str, Any]):
    """A new config with dotted keys set: {"strategy.portion": 0.5}. A value for a key naming a
    sub-config (e.g. "strategy") is a mapping that replaces the whole sub-config."""
    data = to_dict(cfg)
    for dotted, value in overrides.items():
        node, parts = data, dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                raise ValueError(
                    f"unknown key {'.'.join(parts[: i + 1])!r} in override {dotted!r}; known: "
                    f"{sorted(k for k, v in node.items() if isinstance(v, dict))}"
                )
            node = node[part]
        if parts[-1] not in node:
            raise ValueError(f"unknown key {dotted!r}; known keys here: {sorted(node)}")
        node[parts[-1]] = value
    return from_dict(type(cfg), data)


def read_yaml(path: str | Path, what: str = "config file"):
    """The data in a YAML file ({} for an empty one); ValueError if it is absent or not YAML."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None


def load_config(path: str | Path, cls=RunConfig):
    """A config from a YAML file (keys not given keep their defaults)."""
    data = read_yaml(path)
    try:
        return from_dict(cls, data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def dump_config(cfg, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
