"""One step of the engine's program (`make_step`): the denoiser called once under `shard_map`
over the (data, cfg, patch, model) mesh, the strategy's site ops doing the exchanges, its stale
buffers (and a step cache's state) in and out with leading device axes, the guidance halves
met and guided."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from functools import cache

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from patchpar.models.family import Denoiser
from patchpar.parallel.cached import DecisionSum, cached_call
from patchpar.parallel.exchange import exchange_packed, merged, pending_sends
from patchpar.parallel.mesh import AXES, CFG, DATA, PATCH, STATE_SPEC
from patchpar.parallel.rules import placed, unplaced
from patchpar.parallel.sites import SEND, STALE, FSDPGather, PatchOps, TensorSum, shapes_only
from patchpar.parallel.sites.common import CollectiveInBranch, no_collectives, note
from patchpar.parallel.split import Rows, is_even, pad_rows, unpad_rows
from patchpar.sampling.cache import CACHE, STEADY_COMPUTED
from patchpar.sampling.guidance import call_on_stack
from patchpar.sampling.loop import guided


def _x_spec(axis: str) -> P:  # (B, H, W, C): images over data, rows (or columns) over patch
    return P(DATA, PATCH, None, None) if axis == "row" else P(DATA, None, PATCH, None)


def _cond_spec(cond, cfg: int):  # (G, B, ...): guidance halves over cfg, images over data
    return jax.tree.map(lambda _: P(CFG if cfg == 2 else None, DATA), cond)


def make_step(
    unet: Denoiser, plan, phase: str, axis: str, guidance_scale: float, mesh: Mesh, padded=None
):
    """step(params, x (B,H,W,C), t, cond, state) -> (guided model output (B,H,W,C), state).
    `padded`: uneven patches of these latent rows, x given padded (`split.pad_rows`) and the
    output returned so, its padding rows zero (None: x as it is, padded and joined here).

    `state` is None in the `warmup` phase (buffers are written, not read), unless the plan has
    a step cache (a skipped step returns the buffers it read, so every phase reads them and
    the cache's state: `state_template`). In the steady phase
    of a strategy with packed exchange, the sites' pending sends are exchanged after the model
    call, in the strategy's `comm_groups` groups (`patchpar.parallel.exchange`)."""
    if plan.strategy.program() is not None:  # not the engine's step program
        raise ValueError(
            f"strategy {plan.strategy.name!r} runs its own program per phase "
            f"({plan.program.name}), not one model call with site ops; time or count "
            f"its phases with `denoise_phase`"
        )
    ops = plan.strategy.ops(phase, plan.patch)
    if plan.model > 1:
        ops = replace(ops, tp_op=TensorSum(degree=plan.model))
    # the modules' own (local) parameter shapes: split over `model`, whole otherwise (traced
    # outside any mesh: one patch, stand-in collectives)
    split = PatchOps(tp_op=TensorSum(degree=plan.model, local=True))
    local_shapes = _local_param_shapes(unet.with_ops(split)) if plan.model > 1 else None
    if plan.fsdp_degree > 1:
        ops = replace(ops, fsdp_op=FSDPGather(degree=plan.fsdp_degree))
    if not plan.comm:
        ops = ops.with_stand_ins()
    rules = plan.rules()
    cfg = plan.cfg
    cache = plan.cache
    # a cache carries its state through every phase; a skipped step keeps the stale buffers
    # it read, so with a cache the warm-up reads them too (its sites only write them)
    reads_state = phase == "steady" or cache is not None
    groups = plan.strategy.packed_groups() if plan.strategy.packs(phase) else None
    # the stale exchanges left out (`Plan.stale_exchange`): every stale send collected, none sent
    left_out = not plan.stale_exchange and phase == "steady" and bool(ops.stale_buffers())
    if left_out:
        ops, groups = ops.with_packed(), 1

    def reduce_sum(v):  # over every device that holds other rows, halves or images
        if not plan.comm:  # stand-ins: this one's
            return v
        note(DecisionSum(plan.data * cfg * plan.patch), bytes=v.size * v.dtype.itemsize)
        with jax.named_scope("pp_cache"):
            return lax.psum(v, (DATA, CFG, PATCH))

    def program(ops, rows=None, fn=unet):  # one device's program of `fn` with these site ops
        module = fn.module.clone(ops=ops)
        # uneven patches in a steady phase whose exchanges all follow the call: each device
        # computes its own rows alone (a branch per patch size); padded slabs otherwise
        whole = not hasattr(ops, "with_rows")  # identity sites: each slab a whole image
        by_rows = (
            not is_even(rows) and (groups or whole) and cache is None and plan.comm
            and (plan.own_rows or whole)
            and plan.model == 1 and plan.fsdp_degree == 1
        )  # fmt: skip

        def own_rows_call(variables, mutable, x, t, cond):
            """call_on_stack on this device's own rows of its padded slab x, the output padded
            back; None where a site exchanges inside the call (every device must take part)."""
            sizes = sorted(set(rows))

            def branch(i, r):
                def call(x):
                    module_r = fn.module.clone(ops=ops if whole else ops.with_rows(rows, slab=r))

                    def apply(*a, **k):
                        return module_r.apply(variables, *a, **k, mutable=mutable)

                    # the sites' calls are recorded once (for the byte models), the first size's
                    with contextlib.nullcontext() if i == 0 else shapes_only():
                        out, mutated = call_on_stack(apply, x[:, :r], t, cond)
                    widths = [(0, 0)] * out.ndim
                    widths[2] = (0, max(rows) - r)  # (G, B, h, W, C)
                    return jnp.pad(out, widths), mutated

                return call

            which = jnp.asarray([sizes.index(r) for r in rows], jnp.int32)[lax.axis_index(PATCH)]
            try:
                with no_collectives():
                    return lax.switch(which, [branch(i, r) for i, r in enumerate(sizes)], x)
            except CollectiveInBranch:
                return None

        def local(params, x, t, cond, state):
            # cond: this device's guidance half with cfg=2 (G = 1), the whole stack with cfg=1;
            # params: this device's share of each weight
            variables = {"params": unplaced(params, unet.logical, rules)}
            state = jax.tree.map(lambda a: a[0, 0, 0, 0], state or {})  # drop device axes
            cache_state = state.pop(CACHE, None)
            state.pop(SEND, None)  # the sends of a step whose exchanges were left out
            if reads_state and state:
                variables[STALE] = state
            mutable = [STALE, SEND] if groups else [STALE]

            def exchanged(mutated, n_groups=groups):  # the stale buffers after the call's sends
                stale = mutated.get(STALE, {})
                if not n_groups:
                    return stale
                sends = mutated.get(SEND, {})
                if left_out:  # the buffers as given, the sends out as they would leave
                    return {**stale, SEND: sends}
                n_groups = min(n_groups, max(1, sum(1 for _ in pending_sends(sends))))
                return merged(stale, exchange_packed(sends, ops, n_groups, stale))

            if cache is None:

                def apply(*a, **k):
                    return module.apply(variables, *a, **k, mutable=mutable)

                mine = own_rows_call(variables, mutable, x, t, cond) if by_rows else None
                if mine is None:
                    mine = call_on_stack(apply, x, t, cond)  # (G, B, h, W, C)
                out, mutated = mine
                stale = exchanged(mutated)
            else:
                before = cache_state
                inner = None if before is None else {
                    k: v for k, v in before.items() if k != STEADY_COMPUTED
                }  # fmt: skip
                out, stale, cache_state = cached_call(
                    cache, module, variables, mutable, exchanged, x, t, cond, inner, reduce_sum
                )
            out = unet.prediction(out)  # the sampler's model output (a learned-sigma DiT: half)
            if cache is not None:  # and the steady phase's computed steps apart (bytes per phase)
                ran = cache_state["computed"] - (0 if before is None else before["computed"])
                steady = 0 if before is None else before[STEADY_COMPUTED]
                cache_state = {**cache_state, STEADY_COMPUTED: steady + ran * (phase == "steady")}
                stale = {**stale, CACHE: cache_state}
            if cfg == 2 and not plan.comm:
                out = jnp.concatenate([out, out], axis=0)  # the stand-in for the gather below
            elif cfg == 2:
                with jax.named_scope("pp_cfg"):
                    out = lax.all_gather(out, CFG, axis=0, tiled=True)  # (2, B, h, W, C)
            new_state = jax.tree.map(lambda a: a[None, None, None, None], stale)
            out = guided(out, guidance_scale)
            if padded is not None:  # the padding rows stay zero in the loop's latent
                keep = Rows(padded, not plan.comm).own_mask(out.shape[1])
                out = jnp.where(keep[None, :, None, None], out, jnp.zeros_like(out))
            return out, new_state

        return local

    xs = _x_spec(axis)

    def step(params, x, t, cond, state):
        state_in = state if reads_state else {}
        rows = padded
        if padded is None:
            rows = plan.patch_rows(x.shape[1], unet) if axis == "row" else None
        uneven = not is_even(rows)  # every slab padded to the largest patch's rows
        sited = uneven and hasattr(ops, "with_rows")  # (identity sites: slabs whole images)
        alone = rows is not None and len(rows) > 1 and not hasattr(ops, "with_rows")
        slab_fn = unet.as_patch(tuple(rows)) if alone else unet  # a slab a whole input (video)
        local = program(ops.with_rows(rows) if sited else ops, rows if uneven else None, slab_fn)
        if uneven and padded is None:
            x = pad_rows(x, rows)
        params = unet.prepare(params)  # as placed (`placed_params`), or stacked in the program
        # split by the logical-axis rules
        params, param_specs = placed(params, rules, unet.logical, local_shapes, plan.degrees())
        fn = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(
                param_specs,
                xs,
                P(),
                _cond_spec(cond, cfg),
                jax.tree.map(lambda _: STATE_SPEC, state_in),
            ),
            out_specs=(xs, STATE_SPEC),
            # The guided output is replicated over cfg by the all-gather; the static check
            # cannot see through Flax's apply, so it is off.
            check_vma=False,
        )
        out, new_state = fn(params, x, t, cond, state_in)
        return (unpad_rows(out, rows) if uneven and padded is None else out), new_state

    return step


@cache
def _local_param_shapes(unet: Denoiser):
    """The modules' own parameter shapes on one device (split widths, heads padded), traced
    once per module: make_step is built per phase and patch axis, and a full-size UNet's
    abstract init takes seconds."""
    with shapes_only():
        return jax.eval_shape(unet.prepare, unet.abstract_params())  # stacked where scanned


def stale_bytes_per_device(state) -> int:
    """Stale-buffer memory one device holds (the global arrays carry the mesh's device grid);
    a step cache's state is not counted."""
    total = 0
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k != CACHE}
    for leaf in jax.tree.leaves(state):
        per = leaf.size // math.prod(leaf.shape[: len(AXES)])
        total += per * leaf.dtype.itemsize
    return total
