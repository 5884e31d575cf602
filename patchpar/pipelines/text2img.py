"""Text-to-image: prompts -> tokens -> text embeddings (with the negative prompt for CFG) ->
denoising loop -> VAE decode -> uint8 images, for a folder of any model family
(`patchpar.models.family`): the family loads its denoiser and turns prompts into its
conditioning (SD: CLIP; SDXL: two CLIPs, pooled embedding and size conditioning; PixArt-α/Σ:
T5 tokens and their mask, micro-conditions)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from patchpar.models.components import VAEFn
from patchpar.models.family import Denoiser, TextConditioner
from patchpar.models.loading import read_config
from patchpar.models.presets import PRESETS, SHIPPED, model_family
from patchpar.parallel.engine import (
    Plan,
    denoise_phase,
    expert_phases,
    placed_params,
)
from patchpar.parallel.engine import denoise as denoise_parallel
from patchpar.parallel.mesh import to_local
from patchpar.parallel.step import stale_bytes_per_device
from patchpar.parallel.vae import VAEPlan
from patchpar.parallel.vae import decode as vae_decode
from patchpar.pipelines.checks import (
    NonFiniteError,
    check_finite_conditioning,
    check_guidance,
    check_image_size,
    check_seed,
)
from patchpar.pipelines.phased import check_finite_latent, denoise_logged
from patchpar.pipelines.single import denoise_single, single_phase
from patchpar.sampling.cache import CACHE, CLOSEST, cache_report
from patchpar.sampling.experts import two_experts
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler


@dataclass
class Output:
    images: np.ndarray  # (B, H, W, 3) uint8
    latents: np.ndarray  # (B, h, w, C) final latent, before VAE scaling, float32
    stale_bytes_per_device: int = 0  # the strategy's stale buffers per device (0: none)
    cache: dict | None = None  # a step cache's report (`sampling.cache.cache_report`): None: none
    stages: dict | None = None  # seconds per stage (`Pipeline.__call__`)


@dataclass
class Pipeline:
    unet: Denoiser  # the denoiser, of any family (field named as before DiTs)
    unet_params: dict
    vae: VAEFn | None  # None: a pixel-space model (the "latent" is the image in [-1, 1])
    vae_params: dict | None
    text: TextConditioner  # the family's prompts -> Conditioning (its encoders, tokenizers)
    scheduler: SchedulerConfig
    name: str = ""
    default_sampler: str = "ddim"  # the family's (`Family.default_sampler`)
    quant_checkpoint: Path | None = None  # the quantized checkpoint read (None: none was)
    float_stamp: tuple | None = None  # the denoiser's float files when read (`quant.float_stamp`)
    unet_params_2: dict | None = None
    """A second expert's parameters (Wan 2.2's low-noise transformer, `transformer_2`): the
    same denoiser with them runs the steps whose timestep is below `boundary_ratio` x the
    scheduler's training timesteps (`sampling.experts`); None: one denoiser for every step."""
    boundary_ratio: float | None = None
    makes_video = False  # a text-to-video pipeline (`text2video.VideoPipeline`)

    def with_true_cfg(self, scale: float) -> Pipeline:
        """This pipeline with true classifier-free guidance at `scale` over a guidance-distilled
        model (diffusers' `true_cfg_scale`: FLUX.1; <= 1 is off): the negative prompt becomes a
        second guidance half. A conditioning that guides with `guidance_scale` itself (UNets,
        PixArt) has no such option: ValueError."""
        if not isinstance(scale, int | float) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"true_cfg_scale={scale!r}: must be a finite number >= 0 (<= 1: off)")
        if not hasattr(self.text, "true_cfg_scale"):
            if scale <= 1:
                return self
            raise ValueError(
                f"true_cfg_scale={scale}: a {self.family} model guides with guidance_scale "
                f"(classifier-free guidance) already; true CFG is for a guidance-distilled "
                f"model (FLUX.1), whose guidance_scale is a model input"
            )
        if float(scale) == self.text.true_cfg_scale:
            return self
        return replace(self, text=replace(self.text, true_cfg_scale=float(scale)))

    def with_scan(self, on: bool) -> Pipeline:
        """This pipeline with its denoiser's stacks of identical blocks scanned (`on`) or
        unrolled (`patchpar.models.scan`); its parameters stay as loaded (stacked once per
        plan, when placed)."""
        if self.unet.scanned == on:
            return self
        if self.quant != "none":
            raise ValueError(
                f"scan_blocks with a {self.quant}-quantized denoiser: a quantized model runs its "
                f"blocks unrolled; turn one of them off"
            )
        return replace(self, unet=self.unet.with_scan(on))

    def quantized(self, mode: str) -> Pipeline:
        """This pipeline with its denoiser quantized (`patchpar.quant`: w8, w4, int8, fp8;
        `none`: itself), its weights stored quantized; the text encoders and the VAE stay in
        the compute dtype. Quantizing a quantized denoiser again: ValueError."""
        from patchpar.quant import quantize

        unet, params = quantize(self.unet, self.unet_params, mode)
        if unet is self.unet:
            return self
        second = (
            None if self.unet_params_2 is None else quantize(self.unet, self.unet_params_2, mode)[1]
        )
        return replace(self, unet=unet, unet_params=params, unet_params_2=second)

    def save_quantized(self) -> Path:
        """Write this quantized denoiser's parameters beside its float checkpoint (a local
        model folder), so that `load_pipeline(folder, quant=mode)` reads them instead of the
        floats; the path written."""
        from patchpar.quant import checkpoint_paths, save_quantized

        if self.unet_params_2 is not None:
            raise ValueError(
                "save_quantized: a model of two experts is quantized as it loads (quant=...); "
                "a saved checkpoint holds one denoiser"
            )
        folder = self._denoiser_folder()
        save_quantized(self.unet, self.unet_params, folder, read_config(folder), self.float_stamp)
        return checkpoint_paths(folder, self.quant)[0]

    def _denoiser_folder(self) -> Path:
        if self.name in PRESETS or self.name in SHIPPED or not Path(self.name).is_dir():
            raise ValueError(
                f"save_quantized: {self.name!r} is not a local model folder (a preset's folder "
                f"is the package's); copy it to a folder of your own first"
            )
        return Path(self.name) / model_family(Path(self.name)).denoiser_folder

    @property
    def quant(self) -> str:
        """The denoiser's quant mode (`none`: not quantized)."""
        return self.unet.quant_mode or "none"

    @property
    def text_encoders(self) -> list:
        return self.text.encoders

    @property
    def tokenizers(self) -> list:
        return self.text.tokenizers

    @property
    def text_tokens(self) -> int | None:
        """T5 pipelines: tokens the encoder reads (PixArt-α 120, Σ 300); None for CLIP."""
        return getattr(self.text, "tokens", None)

    @property
    def is_xl(self) -> bool:
        return len(self.text_encoders) == 2

    @property
    def family(self) -> str:
        return self.unet.family

    @property
    def latent_channels(self) -> int:
        """Channels of the latent the denoiser takes (FLUX: the unpacked latent's 16)."""
        (sample, *_), _ = self.unet.example_inputs(
            1, self.unet.row_multiple, self.unet.row_multiple
        )
        return sample.shape[-1]

    @property
    def latent_factor(self) -> int:
        return 1 if self.vae is None else self.vae.config.downsample_factor

    def check_size(self, height: int, width: int, rows_multiple: int = 1) -> tuple[int, int]:
        """Latent (h, w) for an image size; ValueError when it does not fit the networks."""
        return check_image_size(self.unet, self.latent_factor, height, width, rows_multiple)

    # ------------------------------------------------------------------ text

    def encode_prompt(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None,
        guidance_scale: float,
        height: int,
        width: int,
    ) -> Conditioning:
        """The prompts' conditioning stacked over guidance (`check_finite_conditioning` says
        whether it holds NaN or Inf; the callers that make images check it once: `__call__`
        inside its encoding stage, where reading it back is also what waits for it; the lab's
        timed encodes outside their timed calls)."""
        self._check_guidance(guidance_scale, negative_prompts)
        negative = negative_prompts or [""] * len(prompts)
        if len(negative) != len(prompts):
            raise ValueError(
                f"{len(negative)} negative prompts for {len(prompts)} prompts; give one per prompt or none"
            )
        return self.text(
            self.unet, prompts, negative, guidance_scale, height, width,
            not any(negative_prompts or []),
        )  # fmt: skip

    def _check_guidance(self, guidance_scale, negative_prompts) -> None:
        """A valid scale; a negative prompt only where the loop guides (a family whose scale
        is a model input, FLUX, says itself why it takes none)."""
        check_guidance(guidance_scale)
        if self.text.loop_scale(guidance_scale) == guidance_scale:
            check_guidance(guidance_scale, negative_prompts)

    # ------------------------------------------------------------------ sampling

    def initial_latents(self, batch: int, height: int, width: int, seed: int) -> jax.Array:
        """Unit Gaussian latent (B, h, w, C) fixed by the seed; the sampler scales it."""
        check_seed(seed)
        h, w = self.check_size(height, width)
        return jax.random.normal(
            jax.random.key(seed), (batch, h, w, self.latent_channels), jnp.float32
        )

    def _denoise_call(self, cond, latents, sampler, steps, guidance_scale, plan,
                      guidance_scale_2=None):  # fmt: skip
        """(jitted function, all its arguments) for denoising on one device or under `plan`;
        arguments 3, 4, 5 and 6 (params, cond, schedule, x) are the dynamic ones, 7 the
        guidance scale and 8 the experts (`sampling.experts`; None: one denoiser)."""
        smp = get_sampler(sampler)
        schedule = smp.schedule(self.scheduler_at(*latents.shape[1:3]), steps)
        x = (latents * schedule.init_noise_sigma).astype(self.unet.module.dtype)
        gs = float(self.text.loop_scale(guidance_scale))  # the loop's CFG scale
        which, experts = self.experts_at(schedule.timesteps, guidance_scale, guidance_scale_2, plan)
        if plan is not None:  # with the first scale: it decides the conditioning's halves
            plan.validate(self.unet, x.shape[1:3], steps, gs, x.shape[0])
            if plan.cache is not None:  # a cache that needs the run's length keeps it
                plan = replace(plan, cache=plan.cache.bind(steps))
        if plan is None or not plan.strategy.parallel:
            fn, static = denoise_single, (self.unet, smp, None if plan is None else plan.cache)
            placed = self.expert_params
        else:
            fn, static = denoise_parallel, (self.unet, plan, smp)
            placed = lambda k: self._placed(plan, k)  # noqa: E731
        if experts is not None and len(which) == 1:  # one expert has every step: a run of it
            gs, experts = experts.scales[0], None
        params = placed(which[0]) if experts is None else tuple(map(placed, which))
        return fn, (*static, params, cond, schedule, x, gs, experts)

    def expert_params(self, k: int) -> dict:
        """Expert k's parameters (0: the denoiser's own; 1: `unet_params_2`)."""
        return self.unet_params if k == 0 else self.unet_params_2

    def experts_at(self, timesteps, guidance_scale: float, guidance_scale_2: float | None = None,
                   plan: Plan | None = None):  # fmt: skip
        """(the experts that run, by index, `Experts` over them or None: one denoiser) for a
        run of these timesteps: with a second expert, the high-noise one (0) while the timestep
        is >= boundary_ratio x the training timesteps, then the low-noise one (1) with
        `guidance_scale_2` (default `guidance_scale`), as WanPipeline; an expert with no step
        does not run. A step cache across two experts is refused (`plan`)."""
        if self.unet_params_2 is None:
            if guidance_scale_2 is not None:
                raise ValueError(
                    f"guidance_scale_2={guidance_scale_2}: {self.name or 'this model'} has one "
                    f"denoiser; the second guidance scale is for a model of two experts (Wan 2.2 "
                    f"A14B, with boundary_ratio and transformer_2)"
                )
            return (0,), None
        scale2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        check_guidance(scale2)
        scales = [self.text.loop_scale(g) for g in (guidance_scale, scale2)]
        train = self.scheduler.num_train_timesteps
        cache = None if plan is None else plan.cache
        return two_experts(timesteps, self.boundary_ratio, train, scales, cache)

    def scheduler_at(self, h: int, w: int) -> SchedulerConfig:
        """The scheduler for a latent of h x w (a flow-matching model's shift may depend on its
        tokens: `SchedulerConfig.at_tokens`)."""
        tokens = getattr(self.unet, "image_tokens", None)
        return self.scheduler if tokens is None else self.scheduler.at_tokens(tokens(h, w))

    def _placed(self, plan: Plan, expert: int = 0):
        """Expert `expert`'s parameters placed for `plan` (`engine.placed_params`), once per
        plan."""
        cache = self.__dict__.setdefault("_placed_cache", {})
        if plan not in {key[0] for key in cache}:
            cache.clear()  # one plan's placement at a time: it may hold a copy of the weights
        if (plan, expert) not in cache:
            cache[plan, expert] = placed_params(plan, self.unet, self.expert_params(expert))
        return cache[plan, expert]

    def denoise_phases(
        self, cond, latents, sampler, steps, guidance_scale, plan=None, watch: bool = False,
        guidance_scale_2: float | None = None,
    ):  # fmt: skip
        """The denoising split into its phases, each its own jitted program, for timing the
        phases apart: ([(phase, steps in it, fn)], args). Starting from `loop = None`,
        `x, loop = fn(*args, loop)` with `args = (params, cond, schedule, x)` for each phase in
        order, x carried from one to the next, gives `denoise`'s latent. One device: a single
        phase `warmup` with every step. Two experts: each expert's phases in turn, named
        `expert 1 warmup`, `expert 1 steady`, `expert 2 warmup`, ... (one device: `expert 1`,
        `expert 2`). `watch`: each fn also returns the
        first step that left a NaN or Inf in x (-1: none; -2: not known)."""
        fn, args = self._denoise_call(
            cond, latents, sampler, steps, guidance_scale, plan, guidance_scale_2
        )
        static, dynamic, gs, experts = args[:3], args[3:7], args[7], args[8]
        one = fn is denoise_single
        if one:  # one program per expert
            spans = [(0, steps)] if experts is None else experts.spans(steps)
            ks = [None] if experts is None else range(len(spans))
            phases = [(k, "warmup", span, False) for k, span in zip(ks, spans, strict=True)]
            phase_fn = single_phase
        else:
            phases, phase_fn = expert_phases(plan, steps, experts), denoise_phase
        extra = {"watch": True} if watch else {}
        programs = []
        for k, phase, (start, stop), restart in phases:
            if k is None:
                name, scale, where = phase, gs, {}
            else:
                name = f"expert {k + 1}" + ("" if one else f" {phase}")
                scale = experts.scales[k]
                where = {"span": (start, stop), "expert": k, "restart": restart}
            fn_k = partial(phase_fn, *static, phase, guidance_scale=scale, **where, **extra)
            programs.append((name, stop - start, fn_k))
        return programs, dynamic

    def check_finite_latent(self, final, cond, latents, sampler, steps, guidance_scale, plan=None,
                            guidance_scale_2=None):  # fmt: skip
        """NonFiniteError when the final latent `final` holds NaN or Inf, naming the step and
        phase where it first did (`phased.check_finite_latent`: a watched replay)."""
        check_finite_latent(self, final, cond, latents, sampler, steps, guidance_scale, plan,
                            guidance_scale_2)  # fmt: skip

    def denoise(
        self,
        cond: Conditioning,
        latents: jax.Array,
        sampler: str,
        steps: int,
        guidance_scale: float,
        plan: Plan | None = None,
        guidance_scale_2: float | None = None,
    ) -> jax.Array:
        """Denoise an initial unit-Gaussian latent, on one device or under `plan`; returns the
        final latent. `guidance_scale_2`: the second expert's (`experts_at`)."""
        return self.denoise_with_state(cond, latents, sampler, steps, guidance_scale, plan,
                                       guidance_scale_2=guidance_scale_2)[0]  # fmt: skip

    def denoise_with_state(
        self,
        cond: Conditioning,
        latents: jax.Array,
        sampler: str,
        steps: int,
        guidance_scale: float,
        plan: Plan | None = None,
        check_memory: bool = False,
        guidance_scale_2: float | None = None,
    ) -> tuple[jax.Array, dict]:
        """`denoise`, also returning the final stale state (the strategy's buffers). With
        `check_memory`, the program is compiled first and refused (ValueError naming both
        figures) when it needs more memory per device than a device here has."""
        fn, args = self._denoise_call(
            cond, latents, sampler, steps, guidance_scale, plan, guidance_scale_2
        )
        if check_memory:
            from patchpar.measure.cost import check_fits, memory_per_device

            compiled = fn.lower(*args).compile()
            check_fits(memory_per_device(compiled), "the denoising program")
            out, state = compiled(*args[3:7])
        else:
            out, state = fn(*args)
        out = to_local(out)  # every process gets the whole latent across processes
        self.check_finite_latent(out, cond, latents, sampler, steps, guidance_scale, plan,
                                 guidance_scale_2)  # fmt: skip
        return out, state

    def decode(self, latents: jax.Array, vae_plan: VAEPlan | None = None) -> np.ndarray:
        """Final latent -> (B, H, W, 3) uint8, as diffusers' pipelines post-process. `vae_plan`:
        the decoder on one device (None, `off`), on row patches (`rows`, exact) or as
        distributed tiles (`tiles`); with a parallel plan every process must call this."""
        if self.vae is None:  # pixel space
            img = latents.astype(jnp.float32)
        else:
            z = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
            img = to_local(vae_decode(self.vae, self.vae_params, z, vae_plan or VAEPlan()))
        img = np.asarray(img, np.float32)
        img = np.repeat(img, 3, axis=-1) if img.shape[-1] == 1 else img  # grey becomes RGB
        if not np.isfinite(img).all():
            where = "the latent" if self.vae is None else "the VAE decode"
            raise NonFiniteError(
                f"{where} gave NaN or Inf in {int((~np.isfinite(img)).sum())} of {img.size} "
                f"pixel values ({jnp.dtype(self.unet.module.dtype).name}): no image of it is a "
                f"result (uint8 would turn them black)"
            )
        return np.round(np.clip(img / 2 + 0.5, 0, 1) * 255).astype(np.uint8)

    def __call__(
        self,
        prompts: str | list[str],
        height: int | None = None,
        width: int | None = None,
        steps: int = 20,
        guidance_scale: float = 7.5,
        seed: int = 0,
        sampler: str | None = None,
        negative_prompts: list[str] | None = None,
        latents: jax.Array | None = None,
        plan: Plan | None = None,
        check_memory: bool = False,
        vae_plan: VAEPlan | None = None,
        log: Callable[[str], None] | None = None,
        guidance_scale_2: float | None = None,
    ) -> Output:
        """Images for the prompts, on one device or under `plan`. `log` (optional) hears one
        line per stage as it starts: encoding, compiling and running each phase, decoding (the
        phases then run as their own programs, which chain to the same latent).
        `guidance_scale_2`: a model of two experts' low-noise scale (default `guidance_scale`;
        `experts_at`). The output's `stages`: seconds of the text encoding, compiling the
        denoising phases (None without `log`: then in the denoising's figure), the denoising
        and the decode, each waited for; a stage's first call in a process includes its
        compile (the encoders', the VAE's)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        sampler = self.default_sampler if sampler is None else sampler
        if height is None:  # 0 is an error (check_size), not "default"
            height = self.unet.config.sample_size * self.latent_factor
        width = height if width is None else width
        hw = self.check_size(height, width)
        check_seed(seed)
        self._check_guidance(guidance_scale, negative_prompts)
        schedule = get_sampler(sampler).schedule(self.scheduler_at(*hw), steps)  # name, steps,
        self.experts_at(schedule.timesteps, guidance_scale, guidance_scale_2, plan)  # model kind
        if plan is not None:  # every check before any work
            n = len(prompts) if latents is None else latents.shape[0]
            plan.validate(self.unet, hw, steps, self.text.loop_scale(guidance_scale), n)
        if vae_plan is not None:
            vae_plan.validate(self.vae, hw, len(prompts) if latents is None else latents.shape[0])
        say = log or (lambda msg: None)
        if plan is not None and (note := plan.split_note(hw[0], self.unet)):
            say(note)
        say(f"encoding {len(prompts)} prompt(s)")
        t0 = time.perf_counter()
        cond = self.encode_prompt(prompts, negative_prompts, guidance_scale, height, width)
        check_finite_conditioning(cond, self.unet.module.dtype)  # reads them back: done
        stages = {"encode_s": time.perf_counter() - t0}
        if latents is None:
            latents = self.initial_latents(len(prompts), height, width, seed)
        args = (cond, latents, sampler, steps, guidance_scale, plan, check_memory)
        t0 = time.perf_counter()
        if log is None:  # compiled as it runs: one figure
            final, state = self.denoise_with_state(*args, guidance_scale_2)
            stages["compile_s"] = None
        else:
            final, state, stages["compile_s"] = denoise_logged(self, *args, log, guidance_scale_2)
        jax.block_until_ready(final)
        stages["denoise_s"] = time.perf_counter() - t0 - (stages["compile_s"] or 0.0)
        say("decoding" + (f" ({vae_plan.mode})" if vae_plan is not None and self.vae else ""))
        t0 = time.perf_counter()
        images = self.decode(final, vae_plan)  # uint8 on the host: done
        stages["decode_s"] = time.perf_counter() - t0
        # float32 on the host whatever the compute dtype: .npy files stay readable by plain NumPy
        return Output(
            images,
            np.asarray(final.astype(jnp.float32)),
            stale_bytes_per_device(state),
            self.cache_report(plan, state, steps),
            stages,
        )

    def cache_report(self, plan: Plan | None, state: dict, steps: int) -> dict | None:
        """What a step cache did in a denoising run whose final state is `state`: its
        description, the steps that ran every block and the fraction of block calls that ran
        (`sampling.cache.cache_report`); None without a cache."""
        if plan is None or plan.cache is None:
            return None
        first = lambda a: np.asarray(to_local(a)).reshape(-1)[0]  # noqa: E731 (all the same)
        n = int(first(state[CACHE]["computed"]))
        closest = float(first(state[CACHE][CLOSEST])) if CLOSEST in state[CACHE] else None
        blocks = getattr(self.unet.module, "num_blocks", 1)  # 1: a forward not in blocks
        return cache_report(plan.cache, blocks, steps, n, closest)
