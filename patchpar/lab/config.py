"""Typed, frozen configs. Every knob an ablation varies is a field (with its paper reference).

`RunConfig` is what `patchpar run` takes: read from YAML (`load_config`), changed by dotted
overrides (`with_overrides(cfg, {"strategy.portion": 0.5})`, or `--strategy.portion 0.5` on the
command line), checked by `validate()`. A sweep point is a new RunConfig, never a mutated one.
Its sections (`ModelConfig`, `MeshConfig`, `StrategyConfig`, `CacheConfig`, and the narrower
`AbstractModel`, `PlanMesh`, `DecodeMesh`) are what `generate`, `comm` and `project` take too;
the strategies' options and the short flags are `patchpar.lab.options`'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated

import tyro

from patchpar.lab.checks import Problems, check_scan, clip_ok, fsdp_unused
from patchpar.lab.measure_config import QUALITY_METRICS, MeasureConfig
from patchpar.lab.options import HELP, StrategyOptions, build_plan, build_vae_plan
from patchpar.lab.paths import RUNS

DTYPES = ("auto", "float32", "bfloat16")  # a run's compute dtype (auto: per model size)
LOWERED_DTYPES = DTYPES[1:]  # what `comm` and `project` lower abstract weights in


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

    def check(self, strategy: str) -> None:
        """The quant mode, and scanned blocks against it and the strategy: a ValueError naming
        the field (`model.quant=...`)."""
        from patchpar.quant import check_mode

        try:
            check_mode(self.quant)
            check_scan(self.scan_blocks, self.quant, strategy)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None


@dataclass(frozen=True)
class AbstractModel(ModelConfig):
    """The denoiser lowered with abstract weights (`comm`, `project`): only its config.json is
    read, so every preset and folder can be named."""

    name: Annotated[str, tyro.conf.arg(help=HELP["any_model"])] = "sdxl"
    quant: str = "none"
    """Quantized denoiser (patchpar/quant.py: none, w8, w4, int8, fp8), abstract weights:
    `comm` counts its quantized weights per device and in FSDP's gathers (on a CPU, int8/fp8
    products are emulated: memory then includes dequantized copies no GPU program holds);
    `project` prices its int8/fp8 products at the profile's int8/fp8 peak (its bf16 peak where
    it has none), the speedup against the unquantized one-device run."""


@dataclass(frozen=True)
class PlanMesh:
    """How the devices are split (`comm`: one denoiser call, no decode, nothing launched)."""

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
    patch_weights: str = ""
    """Each patch device's share of the latent rows, comma-separated, in order (`3,2,2,1`: a
    faster device takes more rows; parallel/split.py); measured: each device's speed timed
    when the run starts (`patchpar calibrate`); "": equal shares, an even split where the
    rows divide, else the most even one (said when it runs)."""
    uneven_compute: str = "auto"
    """Uneven patches: own (a stale DiT's steady phase computes each device's own rows alone),
    padded (the largest patch's), auto (own where patch_weights are given, else padded)."""
    layout: str = "frames"
    """A video model's patches: frames (runs of consecutive frames), rows (the same rows of
    every frame) or FxR (F frame blocks x R row blocks, F x R = the patch devices); images:
    frames."""


@dataclass(frozen=True)
class DecodeMesh(PlanMesh):
    """How the devices are split and where the VAE decodes (`project`: nothing launched)."""

    vae_parallel: str = "off"
    """The VAE decode (patchpar/parallel/vae.py): off (one device, the whole image; the
    papers' runs), rows (the decoder on row patches over the same devices, images over data:
    exact halos after every upsampling, exact GroupNorm, Ring attention in the mid block;
    equals off) or tiles (diffusers' enable_tiling rule, tiles spread over the devices and
    blended: not exact)."""
    vae_tile: int = 0
    """vae_parallel=tiles: a tile's side in pixels (0: the VAE's sample_size, as diffusers)."""

    def vae_plan(self):
        """How the VAE decodes on these devices (patchpar.parallel.vae.VAEPlan)."""
        return build_vae_plan(self.vae_parallel, self.devices, self.data, self.vae_tile)


@dataclass(frozen=True)
class MeshConfig(DecodeMesh):
    """How the devices are split, where the VAE decodes, and whether processes are launched."""

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


def sections_plan(strategy: StrategyConfig, mesh: MeshConfig, cache: CacheConfig, comm=True):
    """The plan the sections give: the strategy with its options on the mesh, with the step
    cache (`comm=False`: stand-in collectives)."""
    return build_plan(
        strategy.name, strategy.options(), mesh.devices, mesh.cfg, comm=comm, data=mesh.data,
        fsdp=mesh.fsdp, cache=cache.name, cache_options=cache.options(),
        patch_weights=mesh.patch_weights, uneven_compute=mesh.uneven_compute,
    )  # fmt: skip


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
    frames: int | None = None
    """A video model's frames (default: the model's own); images: unset."""
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
        return sections_plan(self.strategy, self.mesh, self.cache, not self.measure.compute_only)

    def vae_plan(self):
        """How the VAE decodes, on the run's devices (patchpar.parallel.vae.VAEPlan)."""
        return self.mesh.vae_plan()

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
            (s.frames is None or s.frames > 0, "sampler.frames", s.frames,
             "a positive integer (unset: the video model's own)"),
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
        from patchpar.sampling.cache import make_cache

        cache_ok = False  # the plan below builds the cache again
        with problems.check():
            try:
                make_cache(self.cache.name, **self.cache.options())
            except ValueError as e:
                raise ValueError(f"cache: {e}") from None
            cache_ok = True
        with problems.check():
            self.model.check(self.strategy.name)
        if self.strategy.name in STRATEGIES and mesh_ok and cache_ok and s.steps >= 1:
            with problems.check():
                try:
                    plan = self.plan()  # strategy options: unknown names and bad values
                    plan.strategy.validate(s.steps, plan.patch, plan.cfg)
                except ValueError as e:  # the mesh's patch weights, or the strategy's options
                    mesh = str(e).startswith(("patch_weights=", "uneven_compute="))
                    where = "mesh." if mesh else "strategy: "
                    raise ValueError(f"{where}{e}") from None
        if mesh_ok:
            with problems.check():
                try:
                    self.vae_plan()
                except ValueError as e:
                    raise ValueError(f"mesh.{e}") from None
        problems.raise_any()
        return self


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
