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
    phase_steps,
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
from patchpar.pipelines.single import denoise_single, single_phase
from patchpar.sampling.cache import CACHE, CLOSEST, cache_report
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler


@dataclass
class Output:
    images: np.ndarray  # (B, H, W, 3) uint8
    latents: np.ndarray  # (B, h, w, C) final latent, before VAE scaling, float32
    stale_bytes_per_device: int = 0  # the strategy's stale buffers per device (0: none)
    cache: dict | None = None  # a step cache's report (`sampling.cache.cache_report`): None: none


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
        return self if unet is self.unet else replace(self, unet=unet, unet_params=params)

    def save_quantized(self) -> Path:
        """Write this quantized denoiser's parameters beside its float checkpoint (a local
        model folder), so that `load_pipeline(folder, quant=mode)` reads them instead of the
        floats; the path written."""
        from patchpar.quant import checkpoint_paths, save_quantized

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
        whether it holds NaN or Inf; the callers that make images check it once, outside any
        timed call)."""
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

    def _denoise_call(self, cond, latents, sampler, steps, guidance_scale, plan):
        """(jitted function, all its arguments) for denoising on one device or under `plan`;
        arguments 3, 4, 5 and 6 (params, cond, schedule, x) are the dynamic ones."""
        smp = get_sampler(sampler)
        schedule = smp.schedule(self.scheduler_at(*latents.shape[1:3]), steps)
        x = (latents * schedule.init_noise_sigma).astype(self.unet.module.dtype)
        gs = float(self.text.loop_scale(guidance_scale))  # the loop's CFG scale
        if plan is not None:
            plan.validate(self.unet, x.shape[1:3], steps, gs, x.shape[0])
            if plan.cache is not None:  # a cache that needs the run's length keeps it
                plan = replace(plan, cache=plan.cache.bind(steps))
        if plan is None or not plan.strategy.parallel:
            fn, static = denoise_single, (self.unet, smp, None if plan is None else plan.cache)
            params = self.unet_params
        else:
            fn, static = denoise_parallel, (self.unet, plan, smp)
            params = self._placed(plan)
        return fn, (*static, params, cond, schedule, x, gs)

    def scheduler_at(self, h: int, w: int) -> SchedulerConfig:
        """The scheduler for a latent of h x w (a flow-matching model's shift may depend on its
        tokens: `SchedulerConfig.at_tokens`)."""
        tokens = getattr(self.unet, "image_tokens", None)
        return self.scheduler if tokens is None else self.scheduler.at_tokens(tokens(h, w))

    def _placed(self, plan: Plan):
        """The denoiser's parameters placed for `plan` (`engine.placed_params`), once per plan."""
        cache = self.__dict__.setdefault("_placed_cache", {})
        if plan not in cache:
            cache.clear()  # one plan's placement at a time: it may hold a copy of the weights
            cache[plan] = placed_params(plan, self.unet, self.unet_params)
        return cache[plan]

    def denoise_phases(
        self, cond, latents, sampler, steps, guidance_scale, plan=None, watch: bool = False
    ):
        """The denoising split into its phases, each its own jitted program, for timing the
        phases apart: ([(phase, steps in it, fn)], args). Starting from `loop = None`,
        `x, loop = fn(*args, loop)` with `args = (params, cond, schedule, x)` for each phase in
        order, x carried from one to the next, gives `denoise`'s latent. One device: a single
        phase `warmup` with every step. `watch`: each fn also returns the first step that left
        a NaN or Inf in x (-1: none; -2: not known)."""
        fn, args = self._denoise_call(cond, latents, sampler, steps, guidance_scale, plan)
        static, dynamic, gs = args[:3], args[3:7], args[7]
        if fn is denoise_single:
            spans, phase_fn = {"warmup": (0, steps)}, single_phase
        else:
            spans, phase_fn = phase_steps(plan, steps), denoise_phase
        extra = {"watch": True} if watch else {}
        programs = [
            (phase, stop - start, partial(phase_fn, *static, phase, guidance_scale=gs, **extra))
            for phase, (start, stop) in spans.items()
        ]
        return programs, dynamic

    def check_finite_latent(self, final, cond, latents, sampler, steps, guidance_scale, plan=None):
        """NonFiniteError when the final latent `final` holds NaN or Inf, naming the step and
        phase where it first did: the run is replayed phase by phase with the loop watched (a
        diagnostic program, run only then). Every process of a launched run calls it (the
        replay has collectives); they all see the same gathered latent. A plan with stand-in
        collectives (`comm=False`: timing alone, the images wrong by design) is not checked."""
        if plan is not None and not plan.comm:
            return
        if np.isfinite(np.asarray(to_local(final), np.float32)).all():
            return
        programs, args = self.denoise_phases(
            cond, latents, sampler, steps, guidance_scale, plan, watch=True
        )
        where, x, loop, done = "only in the timed run", args[3], None, 0
        for phase, n, fn in programs:
            x, loop, first = fn(*args[:3], x, loop)
            first = int(first)
            in_phase = f"{phase.replace('warmup', 'warm-up')} phase; " if len(programs) > 1 else ""
            if first >= 0:
                where = f"first after step {first + 1} of {steps} ({in_phase}"
                break
            if not np.isfinite(np.asarray(to_local(x), np.float32)).all():
                where = f"first in steps {done + 1}-{done + n} of {steps} ({in_phase}"
                break
            done += n
        else:
            where += " ("
        label = "single" if plan is None else plan.strategy.name
        devices = 1 if plan is None else plan.devices
        raise NonFiniteError(
            f"NaN or Inf in the latent, {where}{label} on {devices} device(s), {sampler}, "
            f"guidance {guidance_scale}, {jnp.dtype(self.unet.module.dtype).name}): no image of "
            f"it is a result; an overflow in bfloat16 may fit in float32, else the weights, "
            f"inputs or guidance are at fault"
        )

    def denoise(
        self,
        cond: Conditioning,
        latents: jax.Array,
        sampler: str,
        steps: int,
        guidance_scale: float,
        plan: Plan | None = None,
    ) -> jax.Array:
        """Denoise an initial unit-Gaussian latent, on one device or under `plan`; returns the
        final latent."""
        return self.denoise_with_state(cond, latents, sampler, steps, guidance_scale, plan)[0]

    def denoise_with_state(
        self,
        cond: Conditioning,
        latents: jax.Array,
        sampler: str,
        steps: int,
        guidance_scale: float,
        plan: Plan | None = None,
        check_memory: bool = False,
    ) -> tuple[jax.Array, dict]:
        """`denoise`, also returning the final stale state (the strategy's buffers). With
        `check_memory`, the program is compiled first and refused (ValueError naming both
        figures) when it needs more memory per device than a device here has."""
        fn, args = self._denoise_call(cond, latents, sampler, steps, guidance_scale, plan)
        if check_memory:
            from patchpar.measure.cost import check_fits, memory_per_device

            compiled = fn.lower(*args).compile()
            check_fits(memory_per_device(compiled), "the denoising program")
            out, state = compiled(*args[3:7])
        else:
            out, state = fn(*args)
        out = to_local(out)  # every process gets the whole latent across processes
        self.check_finite_latent(out, cond, latents, sampler, steps, guidance_scale, plan)
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
    ) -> Output:
        """Images for the prompts, on one device or under `plan`. `log` (optional) hears one
        line per stage as it starts: encoding, compiling and running each phase, decoding (the
        phases then run as their own programs, which chain to the same latent)."""
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
        get_sampler(sampler).schedule(self.scheduler_at(*hw), steps)  # name, steps, model kind
        if plan is not None:  # every check before any work
            n = len(prompts) if latents is None else latents.shape[0]
            plan.validate(self.unet, hw, steps, self.text.loop_scale(guidance_scale), n)
        if vae_plan is not None:
            vae_plan.validate(self.vae, hw, len(prompts) if latents is None else latents.shape[0])
        say = log or (lambda msg: None)
        if plan is not None and (note := plan.split_note(hw[0], self.unet)):
            say(note)
        say(f"encoding {len(prompts)} prompt(s)")
        cond = self.encode_prompt(prompts, negative_prompts, guidance_scale, height, width)
        check_finite_conditioning(cond, self.unet.module.dtype)
        if latents is None:
            latents = self.initial_latents(len(prompts), height, width, seed)
        args = (cond, latents, sampler, steps, guidance_scale, plan, check_memory)
        if log is None:
            final, state = self.denoise_with_state(*args)
        else:
            final, state = self._denoise_logged(*args, log)
        say("decoding" + (f" ({vae_plan.mode})" if vae_plan is not None and self.vae else ""))
        # float32 on the host whatever the compute dtype: .npy files stay readable by plain NumPy
        return Output(
            self.decode(final, vae_plan),
            np.asarray(final.astype(jnp.float32)),
            stale_bytes_per_device(state),
            self.cache_report(plan, state, steps),
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

    def _denoise_logged(self, cond, latents, sampler, steps, guidance_scale, plan, check_memory,
                        log):  # fmt: skip
        """`denoise_with_state` phase by phase, announced: every phase compiled (and, with
        `check_memory`, checked to fit) before any runs, then each run in turn."""
        programs, args = self.denoise_phases(cond, latents, sampler, steps, guidance_scale, plan)
        compiled, x, loop, done = [], args[3], None, 0
        for phase, n, fn in programs:
            name = (
                "denoising" if len(programs) == 1 else f"{phase.replace('warmup', 'warm-up')} phase"
            )
            span = f"steps {done + 1}-{done + n} of {steps}"
            log(f"{name}: compiling ({span})")
            t0 = time.perf_counter()
            c = jax.jit(fn).lower(*args[:3], x, loop).compile()
            if check_memory:
                from patchpar.measure.cost import check_fits, memory_per_device

                what = "the denoising program" if len(programs) == 1 else f"the {name}'s program"
                check_fits(memory_per_device(c), what)
            compiled.append((name, span, c, time.perf_counter() - t0))
            x, loop = outputs_abstract(c)  # the next phase is lowered on what this returns
            done += n
        x, loop = args[3], None
        for name, span, c, compile_s in compiled:
            log(f"{name}: running {span} (compiled in {compile_s:.1f} s)")
            x, loop = c(*args[:3], x, loop)
        final = to_local(x)
        self.check_finite_latent(final, cond, latents, sampler, steps, guidance_scale, plan)
        return final, loop[1]


def outputs_abstract(compiled):
    """A compiled program's outputs as shapes, dtypes and shardings (the next phase's inputs,
    to lower it before the first has run)."""
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        compiled.out_info,
        compiled.output_shardings,
    )
