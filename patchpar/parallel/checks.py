"""What a plan cannot run, said before it runs (`Plan.validate`, `StepProgram.validate`):
scanned blocks where a program runs them apart, uneven patches where a site does not handle
them yet. `plan`: an `engine.Plan`."""

from __future__ import annotations

from functools import cache

from patchpar.parallel.sites import PHASES, patch_ops, record_sites
from patchpar.parallel.sites.halo import Halo
from patchpar.parallel.sites.kv import KV

# the step caches that run part of a DiT's stack of blocks apart (its first block)
PARTIAL_CACHES = ("fbcache", "teacache")


def check_scan_plan(plan, unet) -> None:
    """A denoiser with scanned blocks (`model.scan_blocks`) runs each scanned run whole, on
    the engine's program: ValueError for a program that runs the blocks apart (PipeFusion's
    stages, AsyncDiff's components) or a step cache that runs a DiT's first block apart."""
    if not unet.scanned:
        return
    if plan.program.name != "step":
        raise ValueError(
            f"scan_blocks with strategy {plan.strategy.name!r}: its program runs the blocks "
            f"apart (stages of layers); turn scan_blocks off"
        )
    if plan.cache is not None and plan.cache.name in PARTIAL_CACHES and unet.stack is not None:
        raise ValueError(
            f"scan_blocks with cache {plan.cache.name!r}: it runs the first block apart from the "
            f"others; turn scan_blocks off, or use taylorseer"
        )


def uneven_supported(plan, rows: tuple[int, ...] | str) -> None:
    """Uneven patches (`rows` latent rows each, or how they will be split; `plan`: an
    `engine.Plan`) run with halos, GroupNorm statistics and K/V gathered, stale, banded,
    compressed or context-parallel; a ValueError names what does not run on them: naive
    patches (each slab a whole image) with a step cache, FSDP or tensor parallelism."""
    said = "uneven patches (" + (rows if isinstance(rows, str) else (
        f"{', '.join(map(str, rows))} latent rows")) + ")"  # fmt: skip
    for phase in PHASES:
        ops = plan.strategy.ops(phase, plan.patch)
        whole = not hasattr(ops, "with_rows")  # the identity's sites: a slab a whole image
        if whole and (plan.fsdp_degree > 1 or plan.model > 1 or plan.cache is not None):
            raise ValueError(  # own rows alone, in a branch of their own: `step.py`
                f"{said} with strategy {plan.strategy.name!r}: each device denoises its own "
                f"rows alone as a whole image, which a step cache, FSDP or tensor parallelism "
                f"inside the model call does not allow; use even patches, or none of those"
            )


@cache
def site_kinds(unet) -> frozenset[str]:
    """The site kinds at which `unet` exchanges activations that a codec can code (a `wire`
    or `codec` option): `halo` (the rows of a convolution but the first, which stays exact)
    and `kv` (attention's keys and values; a DiT's and an MMDiT's only exchange). Traced once
    per module: its abstract init, every site a stand-in, the site calls recorded."""
    with record_sites() as calls:
        unet.with_ops(patch_ops(1).with_stand_ins()).abstract_params()
    halo = any(
        isinstance(op, Halo) and not op.input and info["top"] + info["bottom"] > 0
        for op, info in calls
    )
    kv = any(isinstance(op, KV) for op, _ in calls)
    return frozenset(k for k, has in (("halo", halo), ("kv", kv)) if has)
