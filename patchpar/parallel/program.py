"""How a plan's denoising phases are built and run (docs/design.md §3b).

The engine's own program (`engine.STEP`) runs each step as one call of the denoiser under
`shard_map`, with the strategy's site ops doing the exchanges. A strategy that needs another
shape of program (PipeFusion: the layers split into stages, patches streamed through them)
returns its own `Program` from `Strategy.program()`, and the engine, the cost model and the
projection ask the plan's program (`Plan.program`) instead of branching on the strategy."""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from patchpar.parallel.split import describe, is_even


class Program:
    """What the engine asks of a program. Subclasses implement the methods."""

    name: ClassVar[str]
    per_call: ClassVar[bool] = True
    """A step is one model call with the strategy's site ops: the cost of one call (lowered
    alone, `measure.cost`) is a step's. False: the phase loops are lowered instead."""
    splits_rows: ClassVar[bool] = True
    """Each device guides its own row slab of a step's output (False: every row of it)."""
    gathers_output: ClassVar[bool] = True
    """The released code of its strategies all-gathers the model output every step
    (DistriFusion's, PCPP's; `measure.cost.released_count`)."""
    sync_offset: ClassVar[int] = 1
    """Synchronous steps = warmup_steps + this (DistriFusion's step counter starts at 1)."""
    no_cache: ClassVar[str] = ""
    """Why a step cache is not defined on its steps (empty: it is)."""
    rules_name: ClassVar[str | None] = None
    """How it places the parameters, when not the plan's rules (`Plan.rules_name`)."""

    def validate(self, plan, unet, latent_hw: tuple[int, int], build_mesh: bool = True) -> None:
        """Checks of the plan against the denoiser and latent size that belong to this
        program (ValueError naming the numbers and what would fit); `build_mesh=False`: the
        devices are elsewhere (launched processes)."""
        raise NotImplementedError

    def split_note(self, plan, unet, rows: int) -> str | None:
        """One line saying how an uneven split of a latent of `rows` rows falls (None: even,
        or no rows split): the plan's row patches by default."""
        got = plan.patch_rows(rows, unet)
        return None if is_even(got) else describe(rows, got, unet, plan.patch_weights is not None)

    def place(self, plan, unet, params):
        """The parameters as the phase programs take them best, placed once outside them."""
        raise NotImplementedError

    def weight_bytes(self, plan, unet, params) -> int:
        """Parameter bytes one device holds."""
        raise NotImplementedError

    def run_phase(self, unet, plan, sampler, phase, span, params, cond, schedule, x, loop,
                  guidance_scale, watch=False):  # fmt: skip
        """Steps span = [start, stop) of one phase: (x, loop) -> (x, loop), loop None before
        the first phase; with `watch`, also the first step that left a NaN or Inf in x (-1:
        none; -2: not known)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<program {self.name}>"


class LoopProgram(Program):
    """A program whose phase is one function of its module, `phase(unet, plan, sampler, phase,
    span, params, cond, schedule, x, loop, guidance_scale)` -> (x, loop), which does not
    watch for a NaN (with `watch`, the step of one is not known: -2)."""

    phase: ClassVar  # a staticmethod

    def run_phase(self, unet, plan, sampler, phase, span, params, cond, schedule, x, loop,
                  guidance_scale, watch=False):  # fmt: skip
        out = self.phase(
            unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale
        )
        return (*out, jnp.int32(-2)) if watch else out


def strip_device_axes(tree):
    """One device's part of what a phase carries (leading (data, cfg, patch, model) axes of
    size 1 inside `shard_map`) without those axes."""
    return jax.tree.map(lambda a: a[0, 0, 0, 0], tree)


def with_device_axes(tree):
    """The inverse of `strip_device_axes`: what a phase carries out of `shard_map`."""
    return jax.tree.map(lambda a: a[None, None, None, None], tree)


def check_layer_split(plan) -> None:
    """A strategy that splits the blocks over the patch axis places its own weights: no FSDP
    or tensor parallelism beside it (ValueError)."""
    if plan.fsdp or plan.model > 1:
        raise ValueError(
            f"strategy {plan.strategy.name!r} splits the blocks over the patch axis itself; it "
            f"does not combine with fsdp or tensor parallelism (use fsdp=False and a strategy "
            f"without a model degree)"
        )
