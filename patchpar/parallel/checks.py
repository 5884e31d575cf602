"""What a plan cannot run, said before it runs (`Plan.validate`, `StepProgram.validate`):
scanned blocks where a program runs them apart, uneven patches where a site does not handle
them yet. `plan`: an `engine.Plan`."""

from __future__ import annotations

from patchpar.parallel.sites import PHASES, ContextAttention

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


def uneven_supported(plan, rows: tuple[int, ...]) -> None:
    """Uneven patches (`rows` latent rows each) run with halos, GroupNorm and K/V that are
    gathered, kept stale or local; a ValueError names what does not run on them yet. `plan`: an `engine.Plan`."""
    said = f"uneven patches ({', '.join(map(str, rows))} latent rows)"
    if plan.cache is not None:
        raise ValueError(
            f"{said} with cache {plan.cache.name!r}: a cache's decision over padded patches is "
            f"not implemented; use a latent size that the patch devices divide, or no cache"
        )
    for phase in PHASES:
        ops = plan.strategy.ops(phase, plan.patch)
        attn = ops.attn_op
        what = None
        if isinstance(attn, ContextAttention):
            pass  # its blocks carry their patches' masks
        elif attn.mode == "band":
            what = "PCPP's neighbour bands"
        elif any(getattr(op, "link", None) is not None for op in ops.sites()):
            what = "a compressed exchange"
        if what is not None:
            raise ValueError(
                f"{said} with strategy {plan.strategy.name!r}: {what} on uneven patches is not "
                f"implemented; use a latent size that the patch devices divide (even patches), "
                f"or sync_patch, distrifusion, ring, ulysses"
            )
