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
all-gather over `cfg`) and the sampler step of the patch (uneven patches, where M does not
divide the rows: each padded to the largest, `PipeKV` writing its own rows); the new latent patch goes back to
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

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from patchpar.parallel.mesh import CFG, DATA, PATCH, STATE_SPEC
from patchpar.parallel.program import (
    LoopProgram,
    check_layer_split,
    strip_device_axes,
    with_device_axes,
)
from patchpar.parallel.sites import STALE
from patchpar.parallel.sites.pipe import SLOT, Hop, PipeKV
from patchpar.parallel.split import pad_rows, split_rows, unpad_rows
from patchpar.parallel.stages import Staged, block_bytes_per_device, stacked, staged
from patchpar.sampling.loop import guided


def device_stage(segment: int, device: int, stages: int) -> int:
    """The stage of `segment` that `device` runs: segments alternate direction (0 -> S-1,
    then S-1 -> 0, ...), so each segment starts on the device where the one before ended."""
    return device if segment % 2 == 0 else stages - 1 - device


def slot_offset(segment: int, stage, stages: int):
    """Slots between an item's start (its embedding on device 0) and `stage` of `segment`:
    one per stage, none at a segment's turn (the same device runs both in one slot)."""
    return segment * (stages - 1) + stage


def run_phase(unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale):
    """Steps span = [start, stop) of one phase of PipeFusion, as `engine.denoise_phase`:
    (x, loop) -> (x, loop), where loop = ((latent patches, sampler history), K/V buffers),
    every leaf with leading device axes, and None before the first phase (then `x`, the whole
    latent, starts it)."""
    start, stop = span
    stages = plan.patch
    rows = patch_rows(plan, unet, x.shape[1])  # uneven patches' latent rows (None: even)
    if isinstance(params, Staged):
        outer, blocks, real = params
    else:
        outer, blocks, real = stacked(unet.stack, params, stages)
    body = partial(
        _local, unet, plan, sampler, phase, start, stop, float(guidance_scale), loop is None, rows
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
    return (x if rows is None else unpad_rows(x, rows)), (carried, state)


def patch_rows(plan, unet, rows: int) -> tuple[int, ...] | None:
    """The latent rows of each of the M patches of a latent of `rows` rows, where M does not
    divide them (the most even split of whole token rows); None where it does."""
    p, segments = unet.row_multiple, len(unet.stack.segment_layers)
    m = plan.strategy.patches(plan.patch, segments, rows // p)
    return None if rows % (m * p) == 0 else split_rows(rows, m, p)


def _where(pred, a, b):
    return jax.tree.map(partial(jnp.where, pred), a, b)


def _local(
    unet, plan, sampler, phase, start, stop, gs, first, rows, outer, blocks, real, cond, schedule,
    x,
):  # fmt: skip
    """Inside shard_map: one device (a stage of every segment) of one phase."""
    dev = _Device(unet, plan, sampler, schedule, gs, outer, blocks, real, cond, rows)
    lat, hist, kv = dev.carried(x, first)
    if phase == "warmup":
        lat, hist, kv = lax.fori_loop(start, stop, dev.full_pass, (lat, hist, kv))
    else:
        lat, hist, kv = dev.stream(start, stop, lat, hist, kv)
    return with_device_axes((lat, hist)), with_device_axes(kv)


class _Device:
    """One device of the pipeline inside shard_map: a stage of every segment. What every part
    of a phase shares (the plan, the sampler, the weights, the step-invariant text context,
    the shapes) is set once here; the parts are its methods: `carried` (what a phase starts
    from), `full_pass` (a warm-up step), `stream` (the steady steps, slot by slot), and
    `run_segment`, `predict` and `guide` that they call."""

    def __init__(self, unet, plan, sampler, schedule, gs, outer, blocks, real, cond, split=None):
        self.split = split  # uneven patches' latent rows (None: even)
        self.unet, self.plan, self.sampler, self.schedule, self.gs = (
            unet,
            plan,
            sampler,
            schedule,
            gs,
        )
        self.outer, self.blocks, self.real = outer, blocks, real
        self.stack = stack = unet.stack
        self.stages, self.s = plan.patch, lax.axis_index(PATCH)
        self.segments = len(blocks)
        self.last = self.stages - 1
        self.final = self.last if self.segments % 2 else 0  # the last segment's last stage
        self.hop = Hop(local=not plan.comm)
        self.g, self.b = g, b = cond.context.shape[:2]
        flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
        self.extras = {k: flat(v) for k, v in cond.added().items()}
        self.ctx = stack.context(outer, flat(cond.context), self.extras)  # step-invariant
        # the attentions of a segment's blocks whose image K/V a stage keeps (SD3.5's dual
        # blocks: two), each a whole-image buffer per block
        self.names = stack.segment_kv_names

    def carried(self, x, first: bool):
        """(latent patches (M, b, h, W, C), the sampler's history per patch, K/V buffers per
        segment) a phase starts from: the first phase cuts the whole latent into M patches and
        writes the buffers whole; a later one takes the last phase's."""
        stack, g, b = self.stack, self.g, self.b
        if first:
            bb, hh, ww, cc = x.shape
            patches = self.plan.strategy.patches(
                self.stages, self.segments, hh // self.unet.row_multiple
            )
            if self.split is not None:  # each patch padded to the largest's rows
                x, hh = pad_rows(x, self.split), patches * max(self.split)
            lat = jnp.moveaxis(x.reshape(bb, patches, hh // patches, ww, cc), 1, 0)
            hist = jax.vmap(self.sampler.init_carry)(lat)
            kv = None
        else:
            (lat, hist), kv = strip_device_axes(x)
        self.patches = patches = lat.shape[0]
        self.rows, self.width = lat.shape[2], lat.shape[3]  # a patch's rows, the columns
        p = stack.patch_size
        self.row = self.width // p  # tokens per image row
        self.tokens = (self.rows * patches // p) * self.row  # the whole image's
        tail, self.pad = 0, None  # uneven: the buffer's rows after the image's (the last
        if self.split is not None:  # patch's padding), and the padding's share of a hop
            self.tokens = sum(self.split) // p * self.row
            tail = (self.rows - min(self.split)) // p * self.row
            self.pad = (patches * self.rows - sum(self.split), patches * self.rows)
        if kv is None:  # per attention, per block: updated in place in the loop
            dt, d = jnp.dtype(stack.dtype), stack.width
            kv = []
            for k, r in enumerate(self.real):
                zeros = [jnp.zeros((g * b, self.tokens + tail, d), dt) for _ in range(r.shape[0])]
                kv.append({n: {"k": list(zeros), "v": list(zeros)} for n in self.names[k]})
        return lat, hist, list(kv)

    def kv_ops(self, n_patch: int) -> PipeKV:
        """The site ops of a pass over one of `n_patch` patches (1: the whole image)."""
        if self.split is None:
            return PipeKV(patches=n_patch)
        p = self.stack.patch_size  # token rows: of each patch, or of the whole image
        return PipeKV(n_patch, tuple(r // p for r in self.split) if n_patch > 1 else (
            sum(self.split) // p,))  # fmt: skip

    def own(self, m, x):
        """Uneven patches: patch m's (b, h, W, C) x with its padding rows zero."""
        if self.split is None:
            return x
        keep = jnp.arange(x.shape[1]) < jnp.asarray(self.split, jnp.int32)[m]
        return jnp.where(keep[None, :, None, None], x, jnp.zeros_like(x))

    def temb_at(self, i):
        ts = jnp.broadcast_to(self.schedule.timesteps[i], (self.g * self.b,))
        return self.stack.time(self.outer, ts, self.extras)

    def run_segment(self, k, active, h, kv_k, temb, m, n_patch):
        """This device's blocks of segment k on one item (patch m of n_patch, 1: the whole
        image). Every device computes every slot (the slot takes as long as the busiest);
        where it has no item (`active` false: filling or draining) or the block is padding,
        nothing it computes is kept: its K/V writes are masked (`live`), its tokens are
        never read."""
        names, real = self.names[k], self.real[k]
        ops = self.kv_ops(n_patch)
        at = jnp.asarray(m, jnp.int32)
        new = {n: {"k": [], "v": []} for n in names}
        for l in range(real.shape[0]):
            live = jnp.logical_and(active, real[l])
            variables = {
                SLOT: {n: {"at": at, "live": live} for n in names},
                STALE: {n: {"k": kv_k[n]["k"][l], "v": kv_k[n]["v"][l]} for n in names},
            }
            params_l = jax.tree.map(lambda a, l=l: a[l], self.blocks[k])
            out, mut = self.stack.block(self.outer, ops, params_l, h, self.ctx, temb, self.row,
                                        variables, [STALE], segment=k)  # fmt: skip
            h = _where(real[l], out, h)  # a padding block passes its input on
            for n in names:
                new[n]["k"].append(mut[STALE][n]["k"])
                new[n]["v"].append(mut[STALE][n]["v"])
        return h, new

    def guide(self, pred):
        """Guidance of the final stage's prediction (outside any cond: the cfg gather is a
        collective)."""
        if self.plan.cfg == 2:
            if self.plan.comm:
                with jax.named_scope("pp_cfg"):
                    pred = lax.all_gather(pred, CFG, axis=0, tiled=True)
            else:
                pred = jnp.concatenate([pred, pred], axis=0)
        return guided(pred, self.gs)

    def predict(self, h, temb, x_in):
        """The output layers on the last block's tokens, guided: the sampler's model output."""
        pred = self.unet.prediction(self.stack.head(self.outer, h, temb, x_in.shape[1],
                                                    self.width))  # fmt: skip
        return self.guide(pred.reshape((self.g, self.b) + pred.shape[1:]))

    def scaled(self, i, x_in):
        """The sampler's scaled input of step i over the guidance halves, (g*b, ...)."""
        xs = self.sampler.scale_input(self.schedule, i, x_in)
        xs = jnp.broadcast_to(xs[None], (self.g,) + xs.shape)
        return xs.reshape((self.g * self.b,) + xs.shape[2:])

    def full_pass(self, i, loop):
        """A warm-up step: the whole image through every stage of every segment in turn, one
        device active; the final device's sampler step, its new latent back to device 0."""
        lat, hist, kv = loop
        s, stages, last, stack = self.s, self.stages, self.last, self.stack
        whole = _whole(lat, self.split)
        temb = self.temb_at(i)
        at = {SLOT: {"at": jnp.int32(0)}}
        h = stack.embed(self.outer, self.kv_ops(1), self.scaled(i, whole), at, ctx=self.ctx)
        h = _where(s == 0, h, stack.zeros(self.g * self.b, self.tokens, self.ctx))
        for k in range(self.segments):  # every stage of every segment in turn
            for t in range(stages):
                dev = device_stage(k, t, stages)
                h, kv[k] = self.run_segment(k, s == dev, h, kv[k], temb, 0, 1)
                if t < last:  # to the next stage's device (a segment's turn stays put)
                    h = self.hop.send(h, ((dev, device_stage(k, t + 1, stages)),))
        eps = self.predict(h, temb, whole)  # the final device's
        if self.split is not None:
            eps = pad_rows(eps, self.split)
        eps = jnp.moveaxis(eps.reshape(self.b, self.patches, self.rows, self.width, -1), 1, 0)
        new, hist = jax.vmap(partial(self.sampler.step, self.schedule, i))(lat, eps, hist)
        if self.split is not None:  # the padding rows stay zero
            new = jax.vmap(self.own)(jnp.arange(self.patches), new)
        lat = jnp.where(s == self.final, new, lat)  # the middle stages keep none
        if self.final != 0:  # the new latent back to the first stage
            lat = jnp.where(s == 0, self.hop.send(new, ((self.final, 0),), self.pad), lat)
        return lat, hist, kv

    def stream(self, start, stop, lat, hist, kv):
        """The steady steps [start, stop): the patches streamed through the stages, M slots
        a period, one period more than the steps when S > 1 (the drain)."""
        self.items = (stop - start) * self.patches
        self.start = start
        periods = (stop - start) + (self.stages > 1)
        tok = (self.rows // self.stack.patch_size) * self.row  # one patch's tokens
        inbox = tuple(self.stack.zeros(self.g * self.b, tok, self.ctx)
                      for _ in range(self.segments))  # fmt: skip
        lat, hist, kv, _ = lax.fori_loop(0, periods, self.period, (lat, hist, kv, inbox))
        return lat, hist, kv

    def item(self, n, k_slot, k):
        """This device's item at its stage of segment k in slot k_slot of period n: (active,
        step, patch)."""
        j = n * self.patches + k_slot - slot_offset(k, device_stage(k, self.s, self.stages),
                                                    self.stages)  # fmt: skip
        active = jnp.logical_and(j >= 0, j < self.items)
        jj = jnp.clip(j, 0, self.items - 1)
        return active, self.start + jj // self.patches, jj % self.patches

    def period(self, n, loop):
        """One period: M slots; in each, this device runs its item of every segment, the final
        stage steps its item's latent, and the tokens and the new latent hop on."""
        lat, hist, kv, inbox = loop
        inbox = list(inbox)
        for k_slot in range(self.patches):
            lat, hist, kv, inbox = self.slot(n, k_slot, lat, hist, kv, inbox)
        return lat, hist, kv, tuple(inbox)

    def slot(self, n, k_slot, lat, hist, kv, inbox):
        s, stages, segments = self.s, self.stages, self.segments
        outs, h = [], None
        for k in range(segments):
            active, i, m = self.item(n, k_slot, k)
            temb = self.temb_at(i)
            if k == 0:
                first_stage = self.stack.embed(
                    self.outer, self.kv_ops(self.patches), self.scaled(i, lat[m]),
                    {SLOT: {"at": jnp.asarray(m, jnp.int32)}}, ctx=self.ctx,
                )  # fmt: skip
                h_in = _where(s == 0, first_stage, inbox[0])
            else:  # where segment k starts, segment k-1's output of this slot
                h_in = _where(s == device_stage(k, 0, stages), h, inbox[k])
            h, kv[k] = self.run_segment(k, active, h_in, kv[k], temb, m, self.patches)
            outs.append(h)
        # the final stage: the output layers, guidance and the sampler step of its item
        x_in = lat[m]
        eps = self.predict(h, temb, x_in)
        hm = jax.tree.map(lambda a: a[m], hist)
        new, hm_new = self.sampler.step(self.schedule, i, x_in, eps, hm)
        mine = jnp.logical_and(active, s == self.final)
        new = jnp.where(mine, self.own(m, new), x_in)
        hm_new = jax.tree.map(partial(jnp.where, mine), hm_new, hm)
        lat = lax.dynamic_update_index_in_dim(lat, new, m, 0)
        hist = jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, m, 0), hist, hm_new)
        if stages > 1:
            for k in range(segments):  # each segment's tokens to its next stage
                pairs = tuple(
                    (device_stage(k, t, stages), device_stage(k, t + 1, stages))
                    for t in range(self.last)
                )
                inbox[k] = self.hop.send(outs[k], pairs, self.pad)
            if self.final != 0:  # the new latent back to the first stage
                lat = self.latent_back(n, k_slot, lat, new)
        return lat, hist, kv, inbox

    def latent_back(self, n, k_slot, lat, new):
        """The final stage's new latent of this slot sent to device 0, which stores it where
        its item's patch is (M slots after it left)."""
        back = self.hop.send(new, ((self.final, 0),), self.pad)
        jl = n * self.patches + k_slot - slot_offset(self.segments - 1, self.last, self.stages)
        got = jnp.logical_and(self.s == 0, jnp.logical_and(jl >= 0, jl < self.items))
        ml = jnp.clip(jl, 0, self.items - 1) % self.patches
        return lax.dynamic_update_index_in_dim(lat, jnp.where(got, back, lat[ml]), ml, 0)


def _whole(lat: jax.Array, rows=None) -> jax.Array:
    """(M, b, h, W, C) patches -> (b, M*h, W, C) (uneven patches of `rows`: their own rows)."""
    m, b, h, w, c = lat.shape
    x = jnp.moveaxis(lat, 0, 1).reshape(b, m * h, w, c)
    return x if rows is None else unpad_rows(x, rows)


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

    def split_note(self, plan, unet, rows: int) -> str | None:
        got = patch_rows(plan, unet, rows)
        if got is None:
            return None
        return (
            f"pipefusion: latent rows={rows} into {len(got)} patches of {', '.join(map(str, got))}"
            f" rows (the most even split in units of {unet.row_multiple} rows, "
            f"{unet.row_multiple_reason}); each is computed padded to {max(got)} rows"
        )

    def place(self, plan, unet, params):
        return staged(unet.stack, params, plan)

    def weight_bytes(self, plan, unet, params) -> int:
        return block_bytes_per_device(unet.stack, params, plan.patch)


PIPELINE = PipelineProgram()

__all__ = ["PIPELINE", "patch_rows", "run_phase"]
