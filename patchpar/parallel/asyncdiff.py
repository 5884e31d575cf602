"""AsyncDiff (arXiv 2406.06911) as its own `shard_map` program per phase (docs/design.md §3b).

The denoiser's forward is prologue (embeddings), blocks [0, N) and epilogue (output layers),
as its module gives them. The blocks are split into S contiguous components, one per device of
the patch axis, balanced by FLOPs (`component_bounds`: XLA's count of one block of each kind
at the run's latent and text size). Every device holds the whole model and the whole image.

Warm-up (`warmup_steps` steps): every device runs the whole model, exactly, and keeps the
output of the component before its own (what its first asynchronous step reads); nothing is
exchanged (but the guidance halves' gather with cfg=2), so warm-up over every step equals
`single`. Steady phase, step t on device k: its component runs on component k-1's output of
step t-1 (device 0: on the embedded latent of step t); the outputs then hop to the next device
(one collective-permute, k -> k+1) for step t+1, and the last device's prediction (after
guidance) hops to device 0, which takes the sampler step. Only device 0's latent is kept
current; the latent a phase returns is device 0's. Every component runs on this step's
timestep (the released code's `time_shift=False`, its default).

What differs from the released code: it broadcasts each component's output and the
prediction to every device (`Relay.released_bytes`), each device taking the sampler step;
here each goes to the one device that reads it. Every device computes the output layers on
its component's output (a linear layer per token; only the last device's is used), so that
the components' branches stay one `lax.switch` of equal outputs.
"""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from patchpar.models.sites import IDENTITY
from patchpar.parallel.mesh import AXES, CFG, DATA, PATCH
from patchpar.parallel.program import Program
from patchpar.parallel.sites import shapes_only
from patchpar.parallel.sites.pipe import Relay
from patchpar.sampling.loop import guided, run_steps

STATE_SPEC = P(*AXES)  # what each device carries from phase to phase: leading device axes


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


def _one(shape_dtype, lead: int):
    """An abstract array with its `lead` leading (guidance, batch) axes cut to one element."""
    return jax.ShapeDtypeStruct((1,) + tuple(shape_dtype.shape[lead:]), shape_dtype.dtype)


@cache
def block_flops(unet, latent: tuple, text: tuple) -> tuple[float, ...]:
    """XLA's FLOPs of each block of `unet`'s forward for one image of latent (H, W, C, dtype)
    and text ((name, shape, dtype) of each conditioning input, guidance and batch axes cut):
    one block of each segment of identical blocks, lowered on abstract shapes."""
    from patchpar.parallel.engine import _param_shapes

    module = unet.module.clone(ops=IDENTITY)
    params = _param_shapes(unet)
    h, w, c, dt = latent
    x = jax.ShapeDtypeStruct((1, h, w, c), dt)
    t = jax.ShapeDtypeStruct((1,), jnp.float32)
    cond = {name: jax.ShapeDtypeStruct(shape, dtype) for name, shape, dtype in text}
    ctx = cond.pop("context")

    def upto(j):
        def fn(p, x, t, ctx, added):
            hs, aux = module.apply({"params": p}, x, t, ctx, **added, method="prologue")
            return hs if j is None else module.apply({"params": p}, j, j + 1, hs, aux,
                                                     method="blocks")  # fmt: skip

        with shapes_only():
            low = jax.jit(fn).lower(params, x, t, ctx, cond)
        return float((low.cost_analysis() or {}).get("flops", 0.0))

    base, out, start = upto(None), [], 0
    for count in unet.stack.segment_layers:
        out += [max(upto(start) - base, 1.0)] * count
        start += count
    return tuple(out)


def component_bounds(unet, components: int, x, cond) -> list[tuple[int, int]]:
    """The [lo, hi) blocks of each component for latent `x` (B, H, W, C) and conditioning
    `cond` (G, B, ...), balanced by FLOPs."""
    text = (("context", _one(cond.context, 2).shape, cond.context.dtype),) + tuple(
        (k, _one(v, 2).shape, v.dtype) for k, v in sorted(cond.added().items())
    )
    costs = block_flops(unet, (*x.shape[1:], jnp.dtype(x.dtype)), text)
    return balanced_split(list(costs), components)


def _strip(tree):
    return jax.tree.map(lambda a: a[0, 0, 0, 0], tree)


def _with_axes(tree):
    return jax.tree.map(lambda a: a[None, None, None, None], tree)


def run_phase(unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale):
    """Steps span = [start, stop) of one phase of AsyncDiff, as `engine.denoise_phase`:
    (x, loop) -> (x, loop), where loop = ((latent, sampler history), the output of the
    component before each device's: its stale buffer), every leaf with leading device axes,
    None before the first phase (then `x`, the whole latent, starts it)."""
    first = loop is None
    lead = x if first else loop[0][0][:, 0, 0, 0]
    bounds = component_bounds(unet, plan.patch, lead.reshape((-1,) + lead.shape[-3:]), cond)
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


def _where(pred, a, b):
    return jax.tree.map(partial(jnp.where, pred), a, b)


def _local(unet, plan, sampler, phase, span, gs, first, bounds, params, cond, schedule, x):
    """Inside shard_map: one device (component) of one phase."""
    start, stop = span
    n, s = plan.patch, lax.axis_index(PATCH)
    module = unet.module.clone(ops=IDENTITY)  # the whole image on every device
    variables = {"params": params}
    hop = Relay(local=not plan.comm)
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    added = {k: flat(v) for k, v in cond.added().items()}
    context = flat(cond.context)

    def prologue(x_in, t):
        xs = jnp.broadcast_to(x_in[None], (g,) + x_in.shape).reshape((g * b,) + x_in.shape[1:])
        ts = jnp.broadcast_to(t, (g * b,))
        return module.apply(variables, xs, ts, context, **added, method="prologue")

    def blocks(k, hs, aux):
        out = module.apply(variables, *bounds[k], hs, aux, method="blocks")
        # after the last block a stream no later block reads may be None (SD3's text): the
        # input's passes on, so that every component returns the same structure
        return tuple(h if o is None else o for o, h in zip(out, hs, strict=True))

    def predict(hs, aux, x_in):  # the output layers, guidance: (b, H, W, C)
        out = unet.prediction(module.apply(variables, hs, aux, method="epilogue"))
        out = out.reshape((g, b) + out.shape[1:])
        if plan.cfg == 2:  # the other guidance half's, from the devices of the other cfg index
            if plan.comm:
                with jax.named_scope("pp_cfg"):
                    out = lax.all_gather(out, CFG, axis=0, tiled=True)
            else:
                out = jnp.concatenate([out, out], axis=0)
        return guided(out, gs)

    if first:
        lat, hist, inbox = x, sampler.init_carry(x), None
    else:
        (lat, hist), inbox = _strip(x)
    if inbox is None:  # zeros shaped as the tokens between blocks (traced for their shape)
        hs0, _ = prologue(sampler.scale_input(schedule, start, lat), schedule.timesteps[start])
        inbox = jax.tree.map(jnp.zeros_like, hs0)

    def warm(x_in, t, i, inbox):
        del i
        hs, aux = prologue(x_in, t)
        mine = jax.tree.map(jnp.zeros_like, inbox)  # device 0 reads no component's output
        for k in range(n):
            hs = blocks(k, hs, aux)
            if k < n - 1:  # the input of component k + 1
                mine = _where(s == k + 1, hs, mine)
        return predict(hs, aux, x_in), mine

    def steady(x_in, t, i, inbox):
        del i
        hs0, aux = prologue(x_in, t)
        h_in = _where(s == 0, hs0, inbox)
        if n == 1:
            out = blocks(0, h_in, aux)
        else:
            out = lax.switch(s, [partial(blocks, k, aux=aux) for k in range(n)], h_in)
        eps = predict(out, aux, x_in)  # the last device's is the step's prediction
        nxt = hop.send(out, tuple((k, k + 1) for k in range(n - 1)))
        eps = hop.send(eps, ((n - 1, 0),)) if n > 1 else eps
        return eps, nxt

    fn = warm if phase == "warmup" else steady
    lat, hist, inbox = run_steps(fn, sampler, schedule, lat, hist, inbox, start, stop)
    return _with_axes((lat, hist)), _with_axes(inbox)


class AsyncProgram(Program):
    """AsyncDiff's program: the blocks split into components over the patch axis, each run on
    the previous step's output of the one before (`run_phase`)."""

    name = "async"
    per_call = False  # its phases are lowered whole (a step is every component at once)
    splits_rows = False  # every device holds the whole image
    gathers_output = False  # the prediction goes to the first device, the released code's too
    sync_offset = 0  # warmup_steps exact steps, no step counter offset
    no_cache = (
        "its components run at once on different steps' activations, so no step has the "
        "whole image's first-block output and the last block's together"
    )

    def validate(self, plan, unet, latent_hw, build_mesh=True) -> None:
        s = plan.strategy
        if plan.fsdp or plan.model > 1:
            raise ValueError(
                f"strategy {s.name!r} splits the blocks over the patch axis itself; it does "
                f"not combine with fsdp or tensor parallelism (use fsdp=False)"
            )
        if unet.stack is None or not hasattr(unet.module, "blocks"):
            raise ValueError(
                f"asyncdiff splits the denoiser's blocks into components; a {unet.family}'s "
                f"forward is not built as a stack of blocks here (a UNet's skip connections "
                f"would travel with the activation: not built): use a transformer (PixArt, "
                f"SD3, FLUX.1), or sync_patch, distrifusion or pcpp"
            )
        blocks = sum(unet.stack.segment_layers)
        if plan.patch > blocks:
            raise ValueError(
                f"asyncdiff: {plan.patch} components (devices on the patch axis) on a stack "
                f"of {blocks} blocks: every component needs at least one block; use at most "
                f"{blocks} devices on the patch axis"
            )

    def place(self, plan, unet, params):
        return params  # every device holds the whole model (the released code's)

    def weight_bytes(self, plan, unet, params) -> int:
        from patchpar.parallel.rules import weight_bytes_per_device

        return weight_bytes_per_device(params, plan.rules(), plan.degrees(), unet.logical)

    def run_phase(self, unet, plan, sampler, phase, span, params, cond, schedule, x, loop,
                  guidance_scale, watch=False):  # fmt: skip
        out = run_phase(
            unet, plan, sampler, phase, span, params, cond, schedule, x, loop, guidance_scale
        )
        return (*out, jnp.int32(-2)) if watch else out  # the step of a NaN is not known


ASYNC = AsyncProgram()

__all__ = ["ASYNC", "balanced_split", "block_flops", "component_bounds", "run_phase"]
