"""PipeFusion (xDiT, arXiv 2405.14430) as its own `shard_map` program per phase (docs/design.md
§3b): a DiT's blocks split into S stages over the patch axis, the latent into M row patches
streamed through them.

The denoiser's `stack` gives its blocks as segments of identical blocks: one for PixArt, two
for FLUX.1 (double-stream, then single-stream). Each segment is split into S stages (layer
counts that do not divide are spread as evenly as they go, the first stages one block more,
the others padded with a skipped block); device d runs stage d of segment 0, stage S-1-d of
segment 1, and so on: the segments alternate direction, so a segment starts on the device
where the one before ended, in the same slot. Each device holds its stages' blocks (stacked,
sharded over `patch`) and for each of its layers a full-image K/V buffer
(`parallel.sites.pipe.PipeKV`). A step is M slots; in slot k of step period n, device d works
in segment g on item j = n*M + k - o(g, d) (step j // M, patch j % M) if there is one, with
o the slots from the item's start to that stage (`slot_offset`: one per stage, none at a
turn); the pipeline fills and drains once per phase, not per step. Device 0 embeds the patch
(its rows of the position table); every device runs its blocks of each segment in turn, the
patch's K/V written into its slot of the buffers, and passes each segment's tokens to the
segment's next stage (one collective-permute per segment and slot; FLUX's tokens are the
pair (image, text): each patch carries its own text stream). The device of the last
segment's last stage applies the output layers, guidance (with cfg=2 the halves meet by an
all-gather over `cfg`) and the sampler step of the patch; the new latent patch goes back to
device 0 (unless it is that device: an even number of segments), which needs it M slots
after it left, so M >= segments x (S - 1) + 1 (M >= S for one segment; `PipeFusion.patches`
picks the default). The sampler's history is kept per patch.

The warm-up phase is `warmup_steps` full-image passes, each every stage of every segment in
turn, one device active: the exact model (buffers written whole), so warm-up covering every
step equals `single`, and so does one stage with one patch. Every device carries the latent
as M patches and the sampler's per-patch history (meaningful on device 0 and the last
segment's last device), with the K/V buffers, from phase to phase: nothing is exchanged
between phases. The latent a phase returns is device 0's.

The loop body is one step (M slots), so the collectives and FLOPs of the compiled loop are one
step's, as for the other strategies; the steady loop runs one period more than its steps when
S > 1 (the drain: its slots compute only where a stage still has an item, its hops run;
`Strategy.phase_iterations`).
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

from patchpar.parallel.mesh import CFG, DATA, PATCH, STATE_SPEC
from patchpar.parallel.program import (
    LoopProgram,
    check_layer_split,
    strip_device_axes,
    with_device_axes,
)
from patchpar.parallel.sites import STALE
from patchpar.parallel.sites.common import bits
from patchpar.parallel.sites.pipe import SLOT, Hop, PipeKV
from patchpar.sampling.loop import guided


def layer_counts(layers: int, stages: int) -> list[int]:
    """Blocks per stage: as even as they go, the first stages one more."""
    q, r = divmod(layers, stages)
    return [q + (s < r) for s in range(stages)]


def device_stage(segment: int, device: int, stages: int) -> int:
    """The stage of `segment` that `device` runs: segments alternate direction (0 -> S-1,
    then S-1 -> 0, ...), so each segment starts on the device where the one before ended."""
    return device if segment % 2 == 0 else stages - 1 - device


def slot_offset(segment: int, stage, stages: int):
    """Slots between an item's start (its embedding on device 0) and `stage` of `segment`:
    one per stage, none at a segment's turn (the same device runs both in one slot)."""
    return segment * (stages - 1) + stage


def _stack_segment(blocks: list, stages: int, reverse: bool):
    """One segment's blocks stacked in device order (S x per, ...), zero blocks padding short
    stages, and (S x per,) bool: a real block."""
    counts = layer_counts(len(blocks), stages)
    per, starts = max(counts), np.cumsum([0] + counts[:-1])
    xp = np if all(isinstance(a, np.ndarray) for a in jax.tree.leaves(blocks)) else jnp
    pad = jax.tree.map(xp.zeros_like, blocks[0]) if min(counts) < per else None
    order, real = [], []
    for d in range(stages):
        t = stages - 1 - d if reverse else d  # the stage device d runs
        order += [blocks[starts[t] + j] if j < counts[t] else pad for j in range(per)]
        real += [j < counts[t] for j in range(per)]
    return jax.tree.map(lambda *ls: xp.stack(ls), *order), xp.asarray(real)


def stacked(stack, params, stages: int):
    """(outer parameters, per segment its blocks stacked in device order (S x per, ...),
    per segment (S x per,) bool: a real block); per = the most blocks of a stage."""
    segs = [
        _stack_segment(b, stages, k % 2 == 1) for k, b in enumerate(stack.segment_blocks(params))
    ]
    return stack.outer(params), tuple(b for b, _ in segs), tuple(r for _, r in segs)


class Staged(NamedTuple):
    """A DiT's parameters laid out for the pipeline (`stacked`), placed once: the blocks
    sharded over `patch` (each device holds its stages'), the rest on every device. Passed
    in place of the parameters, the phase programs take each device's blocks as they are;
    plain parameters are stacked inside the program instead (every device then holds them
    all, and the stacked copy too)."""

    outer: dict
    blocks: tuple
    real: tuple


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
        jax.tree.map(put(P()), outer),
        jax.tree.map(put(P(PATCH)), blocks),
        jax.tree.map(put(P(PATCH)), real),
    )


def block_bytes_per_device(stack, params, stages: int) -> int:
    """Parameter bytes one device holds: the outer parameters whole, its (padded) share of
    each segment's blocks."""
    size = lambda tree: sum(  # noqa: E731 (int4: half a byte)
        math.ceil(math.prod(a.shape) * bits(a.dtype) / 8) for a in jax.tree.leaves(tree)
    )
    share = sum(
        max(layer_counts(len(b), stages)) * size(b[0]) for b in stack.segment_blocks(params)
    )
    return size(stack.outer(params)) + share


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
            jax.tree.map(lambda _: P(PATCH), real),
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


def _where(pred, a, b):
    return jax.tree.map(partial(jnp.where, pred), a, b)


def _local(
    unet, plan, sampler, phase, start, stop, gs, first, outer, blocks, real, cond, schedule, x
):
    """Inside shard_map: one device (a stage of every segment) of one phase."""
    stack = unet.stack
    stages, s = plan.patch, lax.axis_index(PATCH)
    segments = len(blocks)
    hop = Hop(local=not plan.comm)
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    extras = {k: flat(v) for k, v in cond.added().items()}
    ctx = stack.context(outer, flat(cond.context), extras)  # step-invariant
    if first:  # the whole latent (b, H, W, C) -> M patches, a history per patch, no buffers yet
        bb, hh, ww, cc = x.shape
        patches = plan.strategy.patches(stages, segments, hh // unet.row_multiple)
        lat = jnp.moveaxis(x.reshape(bb, patches, hh // patches, ww, cc), 1, 0)
        hist = jax.vmap(sampler.init_carry)(lat)
        kv = None
    else:
        (lat, hist), kv = strip_device_axes(x)
        patches = lat.shape[0]
    rows, width = lat.shape[2], lat.shape[3]  # one patch's latent rows, the latent's columns
    p = stack.patch_size
    row = width // p  # tokens per image row

    dt, d = jnp.dtype(stack.dtype), stack.width
    tokens = (rows * patches // p) * row  # the whole image's
    # the attentions of a segment's blocks whose image K/V a stage keeps (SD3.5's dual
    # blocks: two), each a whole-image buffer per block
    names = stack.segment_kv_names
    if kv is None:  # the first full pass writes the buffers whole
        kv = []
        for k, r in enumerate(real):
            zeros = [jnp.zeros((g * b, tokens, d), dt) for _ in range(r.shape[0])]
            # per attention, per block: updated in place in the loop
            kv.append({n: {"k": list(zeros), "v": list(zeros)} for n in names[k]})
    kv = list(kv)
    last = stages - 1
    final = last if segments % 2 else 0  # the device of the last segment's last stage

    def temb_at(i):
        ts = jnp.broadcast_to(schedule.timesteps[i], (g * b,))
        return stack.time(outer, ts, extras)

    def run_segment(k, active, h, kv_k, temb, m, n_patch):
        """This device's blocks of segment k on one item (patch m of n_patch, 1: the whole
        image). Every device computes every slot (the slot takes as long as the busiest);
        where it has no item (`active` false: filling or draining) or the block is padding,
        nothing it computes is kept: its K/V writes are masked (`live`), its tokens are
        never read."""
        ops = PipeKV(patches=n_patch)
        at = jnp.asarray(m, jnp.int32)
        new = {n: {"k": [], "v": []} for n in names[k]}
        for l in range(real[k].shape[0]):
            live = jnp.logical_and(active, real[k][l])
            variables = {
                SLOT: {n: {"at": at, "live": live} for n in names[k]},
                STALE: {n: {"k": kv_k[n]["k"][l], "v": kv_k[n]["v"][l]} for n in names[k]},
            }
            params_l = jax.tree.map(lambda a: a[l], blocks[k])  # noqa: B023
            out, mut = stack.block(outer, ops, params_l, h, ctx, temb, row, variables, [STALE],
                                   segment=k)  # fmt: skip
            h = _where(real[k][l], out, h)  # a padding block passes its input on
            for n in names[k]:
                new[n]["k"].append(mut[STALE][n]["k"])
                new[n]["v"].append(mut[STALE][n]["v"])
        return h, new

    def guide(pred):  # outside any cond: the cfg gather is a collective
        if plan.cfg == 2:
            if plan.comm:
                with jax.named_scope("pp_cfg"):
                    pred = lax.all_gather(pred, CFG, axis=0, tiled=True)
            else:
                pred = jnp.concatenate([pred, pred], axis=0)
        return guided(pred, gs)

    def predict(h, temb, x_in):
        pred = unet.prediction(stack.head(outer, h, temb, x_in.shape[1], width))
        return guide(pred.reshape((g, b) + pred.shape[1:]))

    if phase == "warmup":

        def step(i, loop):
            lat, hist, kv = loop
            whole = _whole(lat)
            temb = temb_at(i)
            at = {SLOT: {"at": jnp.int32(0)}}
            h = stack.embed(outer, PipeKV(patches=1), _scaled(whole, i), at, ctx=ctx)
            h = _where(s == 0, h, stack.zeros(g * b, tokens, ctx))
            for k in range(segments):  # every stage of every segment in turn, one device each
                for t in range(stages):
                    dev = device_stage(k, t, stages)
                    h, kv[k] = run_segment(k, s == dev, h, kv[k], temb, 0, 1)
                    if t < last:  # to the next stage's device (a segment's turn stays put)
                        h = hop.send(h, ((dev, device_stage(k, t + 1, stages)),))
            eps = predict(h, temb, whole)  # the final device's
            eps = jnp.moveaxis(eps.reshape(b, patches, rows, width, -1), 1, 0)
            new, hist = jax.vmap(partial(sampler.step, schedule, i))(lat, eps, hist)
            lat = jnp.where(s == final, new, lat)  # the middle stages keep none
            if final != 0:  # the new latent back to the first stage
                lat = jnp.where(s == 0, hop.send(new, ((final, 0),)), lat)
            return lat, hist, kv

        def _scaled(whole, i):
            xs = sampler.scale_input(schedule, i, whole)
            return jnp.broadcast_to(xs[None], (g,) + xs.shape).reshape((g * b,) + xs.shape[1:])

        lat, hist, kv = lax.fori_loop(start, stop, step, (lat, hist, kv))
    else:
        items = (stop - start) * patches
        periods = (stop - start) + (stages > 1)
        tok = (rows // p) * row  # one patch's tokens

        def item(n, k_slot, k):
            """This device's item at stage of segment k in slot k_slot of period n: (active,
            step, patch)."""
            j = n * patches + k_slot - slot_offset(k, device_stage(k, s, stages), stages)
            active = jnp.logical_and(j >= 0, j < items)
            jj = jnp.clip(j, 0, items - 1)
            return active, start + jj // patches, jj % patches

        def period(n, loop):
            lat, hist, kv, inbox = loop
            inbox = list(inbox)
            for k_slot in range(patches):  # slot k_slot of the period
                outs, h = [], None
                for k in range(segments):
                    active, i, m = item(n, k_slot, k)
                    temb = temb_at(i)
                    if k == 0:
                        x_in = lat[m]
                        xs = sampler.scale_input(schedule, i, x_in)
                        xs = jnp.broadcast_to(xs[None], (g,) + xs.shape)
                        at = jnp.asarray(m, jnp.int32)
                        first_stage = stack.embed(
                            outer, PipeKV(patches=patches), xs.reshape((g * b,) + xs.shape[2:]),
                            {SLOT: {"at": at}}, ctx=ctx,
                        )  # fmt: skip
                        h_in = _where(s == 0, first_stage, inbox[0])
                    else:  # where segment k starts, segment k-1's output of this slot
                        turn = device_stage(k, 0, stages)
                        h_in = _where(s == turn, h, inbox[k])
                    h, kv[k] = run_segment(k, active, h_in, kv[k], temb, m, patches)
                    outs.append(h)
                # the final stage: the output layers, guidance and the sampler step of its item
                x_in = lat[m]
                eps = predict(h, temb, x_in)
                hm = jax.tree.map(lambda a: a[m], hist)  # noqa: B023
                new, hm_new = sampler.step(schedule, i, x_in, eps, hm)
                mine = jnp.logical_and(active, s == final)
                new = jnp.where(mine, new, x_in)
                hm_new = jax.tree.map(partial(jnp.where, mine), hm_new, hm)
                lat = lax.dynamic_update_index_in_dim(lat, new, m, 0)
                hist = jax.tree.map(
                    lambda a, v: lax.dynamic_update_index_in_dim(a, v, m, 0),  # noqa: B023
                    hist,
                    hm_new,
                )
                if stages > 1:
                    for k in range(segments):  # each segment's tokens to its next stage
                        pairs = tuple(
                            (device_stage(k, t, stages), device_stage(k, t + 1, stages))
                            for t in range(last)
                        )
                        inbox[k] = hop.send(outs[k], pairs)
                    if final != 0:  # the new latent back to the first stage
                        back = hop.send(new, ((final, 0),))
                        jl = n * patches + k_slot - slot_offset(segments - 1, last, stages)
                        got = jnp.logical_and(s == 0, jnp.logical_and(jl >= 0, jl < items))
                        ml = jnp.clip(jl, 0, items - 1) % patches
                        old = lat[ml]
                        lat = lax.dynamic_update_index_in_dim(lat, jnp.where(got, back, old), ml, 0)
            return lat, hist, kv, tuple(inbox)

        inbox = tuple(stack.zeros(g * b, tok, ctx) for _ in range(segments))
        lat, hist, kv, _ = lax.fori_loop(0, periods, period, (lat, hist, kv, inbox))
    return with_device_axes((lat, hist)), with_device_axes(kv)


def _whole(lat: jax.Array) -> jax.Array:
    """(M, b, h, W, C) patches -> (b, M*h, W, C)."""
    m, b, h, w, c = lat.shape
    return jnp.moveaxis(lat, 0, 1).reshape(b, m * h, w, c)


class PipelineProgram(LoopProgram):
    """PipeFusion's program: the layers of the denoiser's `stack` split into stages over the
    patch axis, patches streamed through them (`run_phase`)."""

    name = "pipeline"
    per_call = False  # its phases are lowered whole (a step is M slots of every stage)
    splits_rows = False  # the last stage guides every row of the image each step
    gathers_output = False  # xDiT returns each latent patch to the first stage, as here
    sync_offset = 0  # warmup_steps full-image passes, no step counter offset
    rules_name = "stages"  # each device its stage's blocks (`Staged`)
    phase = staticmethod(run_phase)
    no_cache = (
        "it streams patches through stages, so no step has the whole image's first-block "
        "residual at one point"
    )

    def validate(self, plan, unet, latent_hw, build_mesh=True) -> None:
        s = plan.strategy
        check_layer_split(plan)
        stack = unet.stack
        if stack is None:
            raise ValueError(
                f"{s.name} splits a stack of identical transformer blocks into stages; a "
                f"{unet.family} has none ({unet.no_stack}): use "
                f"sync_patch, distrifusion or pcpp on it, or a DiT (PixArt)"
            )
        s.validate_layers(stack.segment_layers, latent_hw[0], unet.row_multiple,
                          unet.row_multiple_reason, plan.patch)  # fmt: skip

    def place(self, plan, unet, params):
        return staged(unet.stack, params, plan)

    def weight_bytes(self, plan, unet, params) -> int:
        return block_bytes_per_device(unet.stack, params, plan.patch)


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
