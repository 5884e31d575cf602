"""AsyncDiff (arXiv 2406.06911) as its own `shard_map` program per phase (docs/design.md §3b').

The denoiser's forward is prologue (embeddings), blocks [0, N) and epilogue (output layers),
as its module gives them: a DiT's transformer blocks (FLUX.1: double-, then single-stream), a
UNet's down blocks, mid block and up blocks, whose skip connections not yet consumed travel
with the activation. The blocks are split into S contiguous components, one per device of the
patch axis, balanced by FLOPs (`component_bounds`: XLA's count of each block at the run's
latent and text size). Every device holds the whole model and the whole image.

Warm-up (`warmup_steps` steps): every device runs the whole model, exactly, and keeps the
output of the component before its own (what its first asynchronous step reads); nothing is
exchanged (but the guidance halves' gather with cfg=2), so warm-up over every step equals
`single`. Steady phase, step t on device k: its component runs on component k-1's output of
step t-1 (device 0: on the embedded latent of step t), one `lax.switch` over the devices; the
outputs then hop to the next device (collective-permutes k -> k+1) for step t+1, and the last
device's model output, guided, hops to device 0, which takes the sampler step. Only device 0's
latent is kept current; the latent a phase returns is device 0's. Every component runs on this
step's timestep (the released code's `time_shift=False`, its default).

Stride 2 (S components on S + 1 devices), as the released code schedules it: the model runs on
the odd steps after warm-up (rounds); an even step takes the prediction the round before gave
it. In the round of step t, devices 0..S-1 run the components on the timestep of step t+1,
device 0's on latent t, device k's on component k-1's output of the round before, and device S
runs the last component on step t's timestep, on the same input as device S-1. Device S's
prediction is step t's, device S-1's step t+1's: both go to device 0 (two permutes), which
takes both sampler steps. After a warm-up of an even number of steps the first steady step is
even: it reuses the last warm-up step's prediction, as the released code does. The phase loop's body is
one step (a `lax.cond` between a round and a step without the model); a record's steady bytes
and FLOPs are a round's, which runs on `Strategy.phase_iterations` of the steps.

What a component passes on is packed into one flat array (`Packing`), padded to the largest
boundary's size so that every branch returns one shape; each boundary's own size goes on the
wire (boundaries of one size in one permute). The released code broadcasts each component's
output and the prediction from its device to every device (`Relay.released_bytes`), each
device taking the sampler step; here each goes to the one device that reads it.

Two differences from the released code. It caches and broadcasts every module of its split
on its own (a UNet's each down, mid and up block, SD3's each transformer block), not only the
components' outputs: `released_bytes` counts the boundaries and so undercounts its traffic.
And on a UNet its up blocks read the skips of the round before, whichever component made them;
here the skips travel with the activation, so with 3 or more components a skip is as many
rounds old as the boundaries it crossed (2 components: the same).
"""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from patchpar.models.sites import IDENTITY
from patchpar.parallel.mesh import CFG, DATA, PATCH, STATE_SPEC
from patchpar.parallel.program import (
    LoopProgram,
    check_layer_split,
    strip_device_axes,
    with_device_axes,
)
from patchpar.parallel.sites import param_shapes, shapes_only
from patchpar.parallel.sites.pipe import Relay
from patchpar.sampling.loop import guided, run_steps


def balanced_split(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) ranges of `costs` in `parts` non-empty parts whose largest sum is
    the least possible; among such splits the earlier parts take as many as they can."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} blocks into {parts} non-empty components")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # suffix[k][i]: the least largest sum splitting blocks i.. into k parts
    suffix = [[inf] * (n + 1) for _ in range(parts + 1)]
    suffix[0][n] = 0.0
    for k in range(1, parts + 1):
        for i in range(n - k, -1, -1):
            suffix[k][i] = min(
                max(prefix[j] - prefix[i], suffix[k - 1][j]) for j in range(i + 1, n - k + 2)
            )
    best, bounds, lo = suffix[parts][0], [], 0
    tol = 1e-9 * max(1.0, best)
    for k in range(parts, 0, -1):
        hi = max(
            j
            for j in range(lo + 1, n - k + 2)
            if prefix[j] - prefix[lo] <= best + tol and suffix[k - 1][j] <= best + tol
        )
        bounds.append((lo, hi))
        lo = hi
    return bounds


def _blocks(module, variables, lo: int, hi: int, hs, aux):
    """Blocks [lo, hi) of `module` on `hs`; after the last block a stream no later block reads
    may come out None (SD3's text): the input's passes on, so that every component's output
    has one structure per boundary."""
    out = module.apply(variables, lo, hi, hs, aux, method="blocks")
    return tuple(h if o is None else o for o, h in zip(out, hs, strict=True))


def _abstract(latent: tuple, text: tuple, batch: int = 1):
    """Abstract (x, t, context, added) for `batch` rows of latent (H, W, C, dtype) and text
    ((name, shape without the batch axis, dtype) per conditioning input)."""
    h, w, c, dt = latent
    x = jax.ShapeDtypeStruct((batch, h, w, c), dt)
    t = jax.ShapeDtypeStruct((batch,), jnp.float32)
    cond = {name: jax.ShapeDtypeStruct((batch, *shape), dtype) for name, shape, dtype in text}
    return x, t, cond.pop("context"), cond


@cache
def block_flops(unet, latent: tuple, text: tuple) -> tuple[float, ...]:
    """XLA's FLOPs of each block of `unet`'s forward for one image of latent (H, W, C, dtype)
    and text ((name, shape, dtype) of each conditioning input without guidance and batch axes),
    lowered on abstract shapes: the forward up to block j + 1 less the forward up to block j;
    of a stack of identical blocks (a DiT's segments), one block per segment."""

    module = unet.module.clone(ops=IDENTITY)
    params = param_shapes(unet)

    def upto(j):
        def fn(p, x, t, ctx, added):
            hs, aux = module.apply({"params": p}, x, t, ctx, **added, method="prologue")
            return _blocks(module, {"params": p}, 0, j, hs, aux)

        with shapes_only():
            low = jax.jit(fn).lower(params, *_abstract(latent, text))
        return float((low.cost_analysis() or {}).get("flops", 0.0))

    n = unet.module.num_blocks
    stack = unet.stack
    segments = stack.segment_layers if stack is not None else (1,) * n
    out, start = [], 0
    for count in segments:
        out += [max(upto(start + 1) - upto(start), 1.0)] * count
        start += count
    return tuple(out)


@cache
def boundaries(unet, bounds: tuple, latent: tuple, text: tuple, batch: int):
    """What each component but the last passes on (abstract, for `batch` rows), and the
    model output's shape and dtype."""

    module = unet.module.clone(ops=IDENTITY)

    def fn(p, x, t, ctx, added):
        v = {"params": p}
        hs, aux = module.apply(v, x, t, ctx, **added, method="prologue")
        outs = []
        for lo, hi in bounds:
            hs = _blocks(module, v, lo, hi, hs, aux)
            outs.append(hs)
        return outs[:-1], module.apply(v, hs, aux, method="epilogue")

    with shapes_only():
        return jax.eval_shape(fn, param_shapes(unet), *_abstract(latent, text, batch))


class Packing:
    """The tokens (or a UNet's activation with its skip connections) at each boundary as one
    flat array: each component's output packed, padded to the largest boundary's size, so that
    every device's branch returns the same shape; a boundary's own size goes on the wire."""

    def __init__(self, shapes):
        self.trees = [jax.tree.structure(t) for t in shapes]
        self.leaves = [jax.tree.leaves(t) for t in shapes]
        dts = {jnp.dtype(a.dtype) for ls in self.leaves for a in ls}
        if len(dts) > 1:
            raise ValueError(f"asyncdiff packs a boundary's arrays of one dtype, not {dts}")
        self.dtype = dts.pop() if dts else jnp.float32
        self.sizes = [sum(a.size for a in ls) for ls in self.leaves]
        self.size = max(self.sizes, default=1)

    def pack(self, k: int, tree) -> jax.Array:
        flat = jnp.concatenate([a.reshape(-1) for a in jax.tree.leaves(tree)])
        return jnp.pad(flat, (0, self.size - flat.shape[0]))

    def unpack(self, k: int, flat: jax.Array):
        out, at = [], 0
        for a in self.leaves[k]:
            out.append(flat[at : at + a.size].reshape(a.shape))
            at += a.size
        return jax.tree.unflatten(self.trees[k], out)


def component_bounds(unet, components: int, x, cond) -> list[tuple[int, int]]:
    """The [lo, hi) blocks of each component for latent `x` (B, H, W, C) and conditioning
    `cond` (G, B, ...), balanced by FLOPs."""
    costs = block_flops(unet, _latent(x), _text(cond))
    return balanced_split(list(costs), components)


def _latent(x) -> tuple:
    return (*x.shape[1:], jnp.dtype(x.dtype))


def _text(cond) -> tuple:
    """(name, shape without guidance and batch axes, dtype) of each conditioning input."""
    return (("context", tuple(cond.context.shape[2:]), jnp.dtype(cond.context.dtype)),) + tuple(
        (k, tuple(v.shape[2:]), jnp.dtype(v.dtype)) for k, v in sorted(cond.added().items())
    )


def run_phase(unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale):
    """Steps span = [start, stop) of one phase of AsyncDiff, as `engine.denoise_phase`:
    (x, loop) -> (x, loop), where loop = ((latent, sampler history), the output of the
    component before each device's: its stale buffer), every leaf with leading device axes,
    None before the first phase (then `x`, the whole latent, starts it)."""
    first = loop is None
    lead = x if first else loop[0][0][:, 0, 0, 0]
    parts = plan.strategy.components(plan.patch)
    bounds = component_bounds(unet, parts, lead.reshape((-1,) + lead.shape[-3:]), cond)
    body = partial(_local, unet, plan, sampler, phase, span, float(guidance_scale), first, bounds)
    g = CFG if plan.cfg == 2 else None
    fn = jax.shard_map(
        body,
        mesh=plan.mesh(),
        in_specs=(
            jax.tree.map(lambda _: P(), params),
            jax.tree.map(lambda _: P(g, DATA), cond),
            jax.tree.map(lambda _: P(), schedule),
            P(DATA) if first else STATE_SPEC,
        ),
        out_specs=(STATE_SPEC, STATE_SPEC),
        check_vma=False,
    )
    carried, inbox = fn(params, cond, schedule, x if first else loop)
    lat = carried[0][:, 0, 0, 0]  # device 0's latent: (data, b, H, W, C)
    return lat.reshape((-1,) + lat.shape[2:]), (carried, inbox)


def _local(unet, plan, sampler, phase, span, gs, first, bounds, params, cond, schedule, x):
    """Inside shard_map: one device (component) of one phase."""
    start, stop = span
    d, s, stride = plan.patch, lax.axis_index(PATCH), plan.strategy.stride
    n = len(bounds)  # components: d, or d - 1 with stride 2 (device d - 1 runs the last again)
    module = unet.module.clone(ops=IDENTITY)  # the whole image on every device
    variables = {"params": params}
    hop = Relay(local=not plan.comm)
    again = Relay(local=not plan.comm, released=False)  # a second copy of one broadcast
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    added = {k: flat(v) for k, v in cond.added().items()}
    context = flat(cond.context)
    if first:
        lat, hist, state = x, sampler.init_carry(x), None
    else:
        (lat, hist), state = strip_device_axes(x)
    passed, out_shape = boundaries(unet, tuple(bounds), _latent(lat), _text(cond), g * b)
    packing = Packing(passed)
    if state is None:  # stride 2 also carries the prediction a round gave the next step
        state = jnp.zeros((packing.size,), packing.dtype)
        state = state if stride == 1 else (state, jnp.zeros_like(lat))

    def prologue(x_in, t):
        xs = jnp.broadcast_to(x_in[None], (g,) + x_in.shape).reshape((g * b,) + x_in.shape[1:])
        ts = jnp.broadcast_to(t, (g * b,))
        return module.apply(variables, xs, ts, context, **added, method="prologue")

    def guide(out):  # the model output of both guidance halves -> the guided prediction
        out = unet.prediction(out)
        out = out.reshape((g, b) + out.shape[1:])
        if plan.cfg == 2:  # the other guidance half's, from the devices of the other cfg index
            if plan.comm:
                with jax.named_scope("pp_cfg"):
                    out = lax.all_gather(out, CFG, axis=0, tiled=True)
            else:
                out = jnp.concatenate([out, out], axis=0)
        return guided(out, gs)

    def warm(x_in, t, i, state):
        del i
        hs, aux = prologue(x_in, t)
        mine = jnp.zeros((packing.size,), packing.dtype)  # device 0 reads no component's output
        for k, (lo, hi) in enumerate(bounds):
            hs = _blocks(module, variables, lo, hi, hs, aux)
            if k < n - 1:  # the input of component k + 1 (stride 2: also of device d - 1)
                reads = (s == k + 1) | ((s == d - 1) & (k == n - 2))
                mine = jnp.where(reads, packing.pack(k, hs), mine)
        eps = guide(module.apply(variables, hs, aux, method="epilogue"))
        return eps, (mine if stride == 1 else (mine, eps.astype(lat.dtype)))

    def components(x_in, t, inbox):
        """Each device's component at timestep `t` (per device); the guided prediction (the
        last component's devices') and what each device receives for the next round."""
        hs0, aux = prologue(x_in, t)

        def component(k):
            def run(inbox):
                h = hs0 if k == 0 else packing.unpack(k - 1, inbox)
                h = _blocks(module, variables, *bounds[k], h, aux)
                if k < n - 1:  # its output packed for the next; no prediction
                    return packing.pack(k, h), jnp.zeros(out_shape.shape, out_shape.dtype)
                out = module.apply(variables, h, aux, method="epilogue")
                return jnp.zeros((packing.size,), packing.dtype), out

            return run

        if n == 1:
            _, out = component(0)(inbox)
        else:
            runs = [component(min(k, n - 1)) for k in range(d)]
            sent, out = lax.switch(s, runs, inbox)
        eps = guide(out)
        nxt = jnp.zeros_like(inbox)
        by_size: dict[int, list[int]] = {}  # boundaries of one size go in one permute
        for k, size in enumerate(packing.sizes):
            by_size.setdefault(size, []).append(k)
        sends = [(hop, size, tuple((k, k + 1) for k in ks)) for size, ks in by_size.items()]
        if n < d and n > 1:  # stride 2: the last component's input to device d - 1 as well
            sends.append((again, packing.sizes[n - 2], ((n - 2, d - 1),)))
        for site, size, pairs in sends:
            got = jnp.pad(site.send(sent[:size], pairs), (0, packing.size - size))
            nxt = jnp.where(jnp.isin(s, jnp.asarray([dst for _, dst in pairs])), got, nxt)
        return eps, nxt

    def steady(x_in, t, i, inbox):
        del i
        eps, nxt = components(x_in, t, inbox)
        return (hop.send(eps, ((n - 1, 0),)) if n > 1 else eps), nxt

    def stride2(x_in, t, i, state):
        inbox, pending = state

        def round_(_):  # devices 0..n-1 on the next step's timestep, device n on this one's
            t_next = schedule.timesteps[jnp.minimum(i + 1, schedule.timesteps.shape[0] - 1)]
            eps, nxt = components(x_in, jnp.where(s == n, t, t_next), inbox)
            now, later = hop.send(eps, ((n, 0),)), hop.send(eps, ((n - 1, 0),))
            return now.astype(pending.dtype), (nxt, later.astype(pending.dtype))

        def reuse(_):  # an even step: the prediction the round before gave it
            return pending, (inbox, pending)

        return lax.cond(i % 2 == 1, round_, reuse, None)

    fn = warm if phase == "warmup" else steady if stride == 1 else stride2
    lat, hist, state = run_steps(fn, sampler, schedule, lat, hist, state, start, stop)
    return with_device_axes((lat, hist)), with_device_axes(state)


class AsyncProgram(LoopProgram):
    """AsyncDiff's program: the blocks split into components over the patch axis, each run on
    the previous step's output of the one before (`run_phase`)."""

    name = "async"
    per_call = False  # its phases are lowered whole (a step is every component at once)
    splits_rows = False  # every device holds the whole image
    gathers_output = False  # the prediction goes to the first device, the released code's too
    sync_offset = 0  # warmup_steps exact steps, no step counter offset
    phase = staticmethod(run_phase)
    no_cache = (
        "its components run at once on different steps' activations, so no step has the "
        "whole image's first-block output and the last block's together"
    )

    def validate(self, plan, unet, latent_hw, build_mesh=True) -> None:
        check_layer_split(plan)
        if not hasattr(unet.module, "blocks"):
            raise ValueError(
                f"asyncdiff splits the denoiser's blocks into components; a {unet.family}'s "
                f"forward is not built as prologue, blocks and epilogue: use sync_patch, "
                f"distrifusion or pcpp on it"
            )
        for what, size in zip(("rows", "columns"), latent_hw, strict=True):
            if size % unet.row_multiple:
                raise ValueError(
                    f"asyncdiff: latent {what}={size} not divisible by "
                    f"{unet.row_multiple_reason} = {unet.row_multiple}; use a latent size that "
                    f"is a multiple of {unet.row_multiple}"
                )
        blocks, parts = unet.module.num_blocks, plan.strategy.components(plan.patch)
        if parts > blocks:
            extra = plan.patch - parts
            raise ValueError(
                f"asyncdiff: {parts} components ({plan.patch} devices on the patch axis, "
                f"stride {plan.strategy.stride}) on a stack of {blocks} blocks: every component "
                f"needs at least one block; use at most {blocks + extra} devices on the patch axis"
            )

    def place(self, plan, unet, params):
        return params  # every device holds the whole model (the released code's)

    def weight_bytes(self, plan, unet, params) -> int:
        from patchpar.parallel.rules import weight_bytes_per_device

        return weight_bytes_per_device(params, plan.rules(), plan.degrees(), unet.logical)


ASYNC = AsyncProgram()

__all__ = ["ASYNC", "balanced_split", "block_flops", "component_bounds", "run_phase"]
