"""PipeFusion (xDiT, arXiv 2405.14430) as its own `shard_map` program per phase (docs/design.md
§3b): a DiT's blocks split into S stages over the patch axis, the latent into M >= S row
patches streamed through them.

Each device is one stage: it holds 1/S of the blocks (stacked, sharded over `patch`; layer
counts that do not divide are spread as evenly as they go, the first stages one block more,
the others padded with a skipped block) and for each of its layers a full-image K/V buffer
(`parallel.sites.pipe.PipeKV`). A step is M slots; in slot k of step period p, stage s works on
item j = p*M + k - s (step j // M, patch j % M) if there is one (the pipeline fills and drains
once per phase, not per step). Stage 0 embeds the patch (its rows of the position table); every
stage runs its blocks, the patch's K/V written into its slot of the buffers, and passes its
tokens to stage s+1 (one collective-permute of every (s, s+1) pair per slot); the last stage
applies the output layers, guidance (with cfg=2 the halves meet by an all-gather over `cfg`)
and the sampler step of the patch, and sends the new latent patch to stage 0, which needs it
M - S + 1 slots later (so M >= S). The sampler's history is kept per patch.

The warm-up phase is `warmup_steps` full-image passes, each S slots with one stage active: the
exact model (buffers written whole), so warm-up covering every step equals `single`, and so does
M = S = 1. Every device carries the latent as M patches and the sampler's per-patch history
(meaningful on stages 0 and S-1), with the K/V buffers, from phase to phase: nothing is
exchanged between phases. The latent a phase returns is stage 0's.

The loop body is one step (M slots: M hops of one patch's tokens and M of its latent), so the
collectives and FLOPs of the compiled loop are one step's, as for the other strategies; the
steady loop runs one period more than its steps when S > 1 (the drain: its slots compute only
where a stage still has an item, its hops run; `Strategy.phase_iterations`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from patchpar.parallel.mesh import AXES, CFG, DATA, PATCH
from patchpar.parallel.program import Program
from patchpar.parallel.sites import STALE
from patchpar.parallel.sites.pipe import SLOT, Hop, PipeKV
from patchpar.sampling.loop import guided

STATE_SPEC = P(*AXES)  # what each device carries from phase to phase: leading device axes


def layer_counts(layers: int, stages: int) -> list[int]:
    """Blocks per stage: as even as they go, the first stages one more."""
    q, r = divmod(layers, stages)
    return [q + (s < r) for s in range(stages)]


def stacked(stack, params, stages: int):
    """(outer parameters, the blocks' stacked in stage order (S x per, ...) with zero blocks
    padding short stages, (S x per,) bool: a real block), per = the most blocks of a stage."""
    blocks = stack.blocks(params)
    counts = layer_counts(len(blocks), stages)
    per, order, real, start = max(counts), [], [], 0
    xp = np if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(blocks)) else jnp
    pad = jax.tree.map(xp.zeros_like, blocks[0]) if min(counts) < per else None
    for c in counts:
        order += [blocks[start + j] if j < c else pad for j in range(per)]
        real += [j < c for j in range(per)]
        start += c
    return stack.outer(params), jax.tree.map(lambda *ls: xp.stack(ls), *order), xp.asarray(real)


class Staged(NamedTuple):
    """A DiT's parameters laid out for the pipeline (`stacked`), placed once: the blocks
    sharded over `patch` (each device holds its stage's), the rest on every device. Passed
    in place of the parameters, the phase programs take each device's blocks as they are;
    plain parameters are stacked inside the program instead (every device then holds them
    all, and the stacked copy too)."""

    outer: dict
    blocks: dict
    real: jax.Array


def staged(stack, params, plan) -> Staged:
    """`params` stacked and placed on `plan`'s mesh (abstract parameters give abstract,
    sharded shapes: for lowering without weights)."""
    mesh = plan.mesh()
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)):
        parts = jax.eval_shape(lambda p: stacked(stack, p, plan.patch), params)

        def put(spec):
            sharding = NamedSharding(mesh, spec)
            return lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    else:
        parts = stacked(stack, jax.tree.map(np.asarray, params), plan.patch)

        def put(spec):
            sharding = NamedSharding(mesh, spec)

            def place(a):  # every process places its own devices' parts
                host = np.asarray(a)
                return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

            return place

    outer, blocks, real = parts
    return Staged(
        jax.tree.map(put(P()), outer), jax.tree.map(put(P(PATCH)), blocks), put(P(PATCH))(real)
    )


def block_bytes_per_device(stack, params, stages: int) -> int:
    """Parameter bytes one stage holds: the outer parameters whole, its (padded) share of the
    blocks."""
    outer, blocks = stack.outer(params), stack.blocks(params)
    size = lambda tree: sum(  # noqa: E731
        math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)
    )
    return size(outer) + max(layer_counts(len(blocks), stages)) * size(blocks[0])


def _strip(tree):
    return jax.tree.map(lambda a: a[0, 0, 0, 0], tree)


def _with_axes(tree):
    return jax.tree.map(lambda a: a[None, None, None, None], tree)


def run_phase(unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale):
    """Steps span = [start, stop) of one phase of PipeFusion, as `engine.denoise_phase`:
    (x, loop) -> (x, loop), where loop = ((latent patches, sampler history), K/V buffers),
    every leaf with leading device axes, and None before the first phase (then `x`, the whole
    latent, starts it)."""
    start, stop = span
    stages = plan.patch
    if isinstance(params, Staged):
        outer, blocks, real = params
    else:
        outer, blocks, real = stacked(unet.stack, params, stages)
    body = partial(
        _local, unet, plan, sampler, phase, start, stop, float(guidance_scale), loop is None
    )
    g = CFG if plan.cfg == 2 else None
    first = loop is None
    fn = jax.shard_map(
        body,
        mesh=plan.mesh(),
        in_specs=(
            jax.tree.map(lambda _: P(), outer),
            jax.tree.map(lambda _: P(PATCH), blocks),
            P(PATCH),
            jax.tree.map(lambda _: P(g, DATA), cond),
            jax.tree.map(lambda _: P(), schedule),
            P(DATA) if first else STATE_SPEC,
        ),
        out_specs=(STATE_SPEC, STATE_SPEC),
        check_vma=False,
    )
    carried, state = fn(outer, blocks, real, cond, schedule, x if first else loop)
    patches = carried[0][:, 0, 0, 0]  # stage 0's latent: (data, M, b, h, W, C)
    d, m, b, h, w, c = patches.shape
    x = jnp.moveaxis(patches, 1, 2).reshape(d * b, m * h, w, c)
    return x, (carried, state)


def _local(
    unet, plan, sampler, phase, start, stop, gs, first, outer, blocks, real, cond, schedule, x
):
    """Inside shard_map: one device (stage) of one phase."""
    stack = unet.stack
    stages, s = plan.patch, lax.axis_index(PATCH)
    patches = plan.strategy.patches(stages)
    hop = Hop(local=not plan.comm)
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    extras = {k: flat(v) for k, v in cond.added().items()}
    ctx = stack.context(outer, flat(cond.context), extras)  # step-invariant
    if first:  # the whole latent (b, H, W, C) -> M patches, a history per patch, no buffers yet
        bb, hh, ww, cc = x.shape
        lat = jnp.moveaxis(x.reshape(bb, patches, hh // patches, ww, cc), 1, 0)
        hist = jax.vmap(sampler.init_carry)(lat)
        kv = None
    else:
        (lat, hist), kv = _strip(x)
    rows, width = lat.shape[2], lat.shape[3]  # one patch's latent rows, the latent's columns
    p = stack.patch_size
    row = width // p  # tokens per image row

    dt, d = jnp.dtype(stack.dtype), stack.width
    tokens = (rows * patches // p) * row  # the whole image's
    if kv is None:  # the first full pass writes the buffers whole
        zeros = [jnp.zeros((g * b, tokens, d), dt) for _ in range(real.shape[0])]
        kv = {"k": zeros, "v": list(zeros)}  # per block: updated in place in the loop

    def stage(active, h_in, kv, x_in, i, m, n_patch):
        """This stage's blocks on one item: step i, patch m of n_patch (1: the whole image);
        -> (tokens out, the prediction (g, b, h, W, C) of the output layers, buffers). Every
        stage computes every slot (the slot takes as long as the busiest stage); where it has
        no item (`active` false: the pipeline filling or draining) or the block is padding,
        nothing it computes is kept: its K/V writes are masked (`live`), its tokens are
        never read."""
        ops = PipeKV(patches=n_patch)
        at = jnp.asarray(m, jnp.int32)
        ts = jnp.broadcast_to(schedule.timesteps[i], (g * b,))
        temb = stack.time(outer, ts, extras)
        xs = sampler.scale_input(schedule, i, x_in)
        xs = jnp.broadcast_to(xs[None], (g,) + xs.shape).reshape((g * b,) + xs.shape[1:])
        first_stage = stack.embed(outer, ops, xs, {SLOT: {"at": at}})
        h = jnp.where(s == 0, first_stage, h_in)
        ks, vs = [], []
        for l in range(real.shape[0]):  # this stage's blocks, in order
            live = jnp.logical_and(active, real[l])
            variables = {
                SLOT: {"attn1": {"at": at, "live": live}},
                STALE: {"attn1": {"k": kv["k"][l], "v": kv["v"][l]}},
            }
            params_l = jax.tree.map(lambda a: a[l], blocks)  # noqa: B023
            out, mut = stack.block(outer, ops, params_l, h, ctx, temb, row, variables, [STALE])
            h = jnp.where(real[l], out, h)  # a padding block passes its input on
            ks.append(mut[STALE]["attn1"]["k"])
            vs.append(mut[STALE]["attn1"]["v"])
        pred = unet.prediction(stack.head(outer, h, temb, x_in.shape[1], width))
        return h, pred.reshape((g, b) + pred.shape[1:]), {"k": ks, "v": vs}

    def guide(pred):  # outside any cond: the cfg gather is a collective
        if plan.cfg == 2:
            if plan.comm:
                with jax.named_scope("pp_cfg"):
                    pred = lax.all_gather(pred, CFG, axis=0, tiled=True)
            else:
                pred = jnp.concatenate([pred, pred], axis=0)
        return guided(pred, gs)

    last = stages - 1
    if phase == "warmup":

        def step(i, loop):
            lat, hist, kv = loop
            whole = _whole(lat)
            h = jnp.zeros((g * b, tokens, d), dt)
            for k in range(stages):  # slot k: stage k runs its blocks on the whole latent
                h, pred, kv = stage(s == k, h, kv, whole, i, 0, 1)
                if k < last:
                    h = hop.send(h, ((k, k + 1),))
            eps = guide(pred)  # the last stage's
            eps = jnp.moveaxis(eps.reshape(b, patches, rows, width, -1), 1, 0)
            new, hist = jax.vmap(partial(sampler.step, schedule, i))(lat, eps, hist)
            lat = jnp.where(s == last, new, lat)  # the middle stages keep none
            if stages > 1:  # the new latent back to the first stage
                lat = jnp.where(s == 0, hop.send(new, ((last, 0),)), lat)
            return lat, hist, kv

        lat, hist, kv = lax.fori_loop(start, stop, step, (lat, hist, kv))
    else:
        items = (stop - start) * patches
        periods = (stop - start) + (stages > 1)
        tok = (rows // p) * row  # one patch's tokens

        def period(n, loop):
            lat, hist, kv, inbox = loop
            for k in range(patches):  # slot k of the period
                j = n * patches + k - s  # this stage's item
                active = jnp.logical_and(j >= 0, j < items)
                jj = jnp.clip(j, 0, items - 1)
                i, m = start + jj // patches, jj % patches
                x_in = lat[m]
                h, pred, kv = stage(active, inbox, kv, x_in, i, m, patches)
                eps = guide(pred)
                hm = jax.tree.map(lambda a: a[m], hist)  # noqa: B023
                new, hm_new = sampler.step(schedule, i, x_in, eps, hm)
                mine = jnp.logical_and(active, s == last)
                new = jnp.where(mine, new, x_in)
                hm_new = jax.tree.map(partial(jnp.where, mine), hm_new, hm)
                lat = lax.dynamic_update_index_in_dim(lat, new, m, 0)
                hist = jax.tree.map(
                    lambda a, v: lax.dynamic_update_index_in_dim(a, v, m, 0),  # noqa: B023
                    hist,
                    hm_new,
                )
                if stages > 1:
                    inbox = hop.send(h, tuple((t, t + 1) for t in range(last)))
                    back = hop.send(new, ((last, 0),))
                    jl = n * patches + k - last  # the last stage's item: its patch comes back
                    got = jnp.logical_and(s == 0, jnp.logical_and(jl >= 0, jl < items))
                    ml = jnp.clip(jl, 0, items - 1) % patches
                    old = lat[ml]
                    lat = lax.dynamic_update_index_in_dim(lat, jnp.where(got, back, old), ml, 0)
            return lat, hist, kv, inbox

        inbox = jnp.zeros((g * b, tok, d), dt)
        lat, hist, kv, _ = lax.fori_loop(0, periods, period, (lat, hist, kv, inbox))
    return _with_axes((lat, hist)), _with_axes(kv)


def _whole(lat: jax.Array) -> jax.Array:
    """(M, b, h, W, C) patches -> (b, M*h, W, C)."""
    m, b, h, w, c = lat.shape
    return jnp.moveaxis(lat, 0, 1).reshape(b, m * h, w, c)


class PipelineProgram(Program):
    """PipeFusion's program: the layers of the denoiser's `stack` split into stages over the
    patch axis, patches streamed through them (`run_phase`)."""

    name = "pipeline"
    per_call = False  # its phases are lowered whole (a step is M slots of every stage)
    splits_rows = False  # the last stage guides every row of the image each step
    gathers_output = False  # xDiT returns each latent patch to the first stage, as here
    sync_offset = 0  # warmup_steps full-image passes, no step counter offset
    rules_name = "stages"  # each device its stage's blocks (`Staged`)

    def validate(self, plan, unet, latent_hw, build_mesh=True) -> None:
        s = plan.strategy
        if plan.fsdp or plan.model > 1:
            raise ValueError(
                f"strategy {s.name!r} splits the blocks over the patch axis itself; it does "
                f"not combine with fsdp or tensor parallelism (use fsdp=False)"
            )
        stack = unet.stack
        if stack is None:
            raise ValueError(
                f"{s.name} splits a stack of identical transformer blocks into stages; a "
                f"{unet.family} has none ({unet.no_stack}): use "
                f"sync_patch, distrifusion or pcpp on it, or a DiT (PixArt)"
            )
        s.validate_layers(stack.num_layers, latent_hw[0], unet.row_multiple,
                          unet.row_multiple_reason, plan.patch)  # fmt: skip

    def place(self, plan, unet, params):
        return staged(unet.stack, params, plan)

    def weight_bytes(self, plan, unet, params) -> int:
        return block_bytes_per_device(unet.stack, params, plan.patch)

    def run_phase(self, unet, plan, sampler, phase, span, params, cond, schedule, x, loop,
                  guidance_scale, watch=False):  # fmt: skip
        out = run_phase(
            unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale
        )
        return (*out, jnp.int32(-2)) if watch else out  # the step of a NaN is not known


PIPELINE = PipelineProgram()

__all__ = [
    "PIPELINE",
    "Staged",
    "block_bytes_per_device",
    "layer_counts",
    "run_phase",
    "stacked",
    "staged",
]
