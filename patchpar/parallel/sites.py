"""Site ops for row patches inside `shard_map` (docs/design.md §2): exact, stale and banded versions
of the three spatial sites. One frozen `PatchOps` per strategy and phase.

Stale state is explicit: each site keeps its buffer in the Flax collection "stale" of the
module that calls it. In the `sync` phase (warm-up) a site exchanges fresh activations exactly
and, if its steady mode is stale, writes the buffer the steady phase will read. In the `steady`
phase a site reads the buffer written at step t-1 and launches the collective on its fresh
activation; the result is only the buffer for step t+1, so the compiler may overlap it with the
rest of step t.

Modes per site:
- halo: `fresh` (exact, every step), `stale` (previous step's rows), `zero` (no exchange)
- gn:   `sync` (exact all-reduce), `separate` (local), `stale` (own fresh, others' stale),
        `corrected` (DistriFusion Eq. 2: stale global + fresh local - stale local)
- kv:   `all` (exact all-gather), `local`, `stale` (own fresh + all others stale),
        `band` (own fresh + stale bands of the two neighbours, `portion` of their tokens),
        `context` (exact context-parallel attention: Ring, Ulysses or their hybrid,
        `patchpar.parallel.context`; `ulysses` = the Ulysses degree, ring = n / ulysses)

Weights: `tp` splits layers over the `model` axis for good (an all-reduce after each row-split
layer, site `tp`); `fsdp` > 1 means the parameters arrive sharded at rest (boxed by
`parallel.rules.unplaced`) and every layer gathers its own just before it runs (site `fsdp`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass, replace

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from patchpar.models.attention import AttentionSpec
from patchpar.models.sites import SiteOps
from patchpar.parallel.context import context_attention, context_bytes
from patchpar.parallel.mesh import MODEL, PATCH

HALO_MODES = ("fresh", "stale", "zero")
GN_MODES = ("sync", "separate", "stale", "corrected")
KV_MODES = ("all", "local", "stale", "band", "context")
PHASES = ("sync", "steady")
STALE = "stale"  # the Flax collection holding stale buffers


_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "patchpar_site_log", default=None
)


@contextlib.contextmanager
def record_sites():
    """Collect (ops, kind, info) for every site call traced inside the block (for the analytic
    communication model; tracing only, nothing is computed)."""
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


_LOCAL: contextvars.ContextVar[bool] = contextvars.ContextVar("patchpar_local", default=False)


@contextlib.contextmanager
def local_stand_ins(active: bool = True):
    """Inside the block (at trace time) every collective of the sites is replaced by a local
    stand-in of the same shape: no communication, wrong values, each device's own compute
    only. For timing DistriFusion Table 2's "no communication (ideal)" row (`Plan.comm`)."""
    token = _LOCAL.set(active)
    try:
        yield
    finally:
        _LOCAL.reset(token)


@contextlib.contextmanager
def shapes_only():
    """Inside the block site calls are neither recorded nor exchanged (for tracing a module's
    parameter shapes: `jax.eval_shape` of its init outside any mesh)."""
    token, local = _LOG.set(None), _LOCAL.set(True)
    try:
        yield
    finally:
        _LOG.reset(token)
        _LOCAL.reset(local)


def stand_ins_active() -> bool:
    return _LOCAL.get()


def _note(ops, kind: str, **info) -> None:
    log = _LOG.get()
    if log is not None:
        log.append((ops, kind, info))


_AFTER: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "patchpar_fsdp_after", default=None
)


@functools.cache
def _gathering(cls: type, ops: PatchOps) -> type:
    """`cls` whose parameters pass through `ops.gather_weights` on their way in (Flax
    `map_variables`), after its input exists: one class per layer type and ops."""
    mapped = nn.map_variables(cls, "params", trans_in_fn=ops.gather_weights, mutable=False)

    class Gathering(mapped):
        def __call__(self, *args, **kwargs):
            arrays = [a for a in jax.tree.leaves((args, kwargs)) if isinstance(a, jax.Array)]
            token = _AFTER.set(arrays[0] if arrays else None)
            try:
                return super().__call__(*args, **kwargs)
            finally:
                _AFTER.reset(token)

    Gathering.__name__ = Gathering.__qualname__ = cls.__name__
    return Gathering


def _after_input(flat: jax.Array) -> jax.Array:
    """`flat` (1-D) unchanged, but computed after the running layer's input: + (-0.0) made from
    one element of the input (finite or not, -|0 x where(finite(t), t, 0)| is -0.0, and v + -0.0
    is v for every v). Without it XLA's CPU scheduler (which drops optimization barriers) issues
    every layer's all-gather at the start of the program, so all weights are whole at once."""
    t = _AFTER.get()
    if t is None:
        return flat
    t = t[(0,) * t.ndim].astype(jnp.float32)  # one element, by index (no reshape of t)
    zero = -jnp.abs(0.0 * jnp.where(jnp.isfinite(t), t, 0.0))
    return flat + zero.astype(flat.dtype)


def band_tokens(tokens: int, portion: float) -> int:
    """Tokens of a neighbour's patch kept on each side: ceil(portion x tokens), at least one.
    (PCPP's code rounds the band above up and the band below down; they differ by <= 1 token.)"""
    return max(1, min(tokens, math.ceil(portion * tokens - 1e-9)))


def _pmean(x: jax.Array) -> jax.Array:
    if _LOCAL.get():
        return x
    with jax.named_scope("pp_gn"):
        return lax.pmean(x, PATCH)


def _gather(kv: jax.Array, n: int) -> jax.Array:
    """(2, B, L, D) on each device -> (2, B, n*L, D), patches in order. The stand-in repeats
    the local part n times (n, not the mesh's axis size: experiments/device/shard_timing.py
    runs one device's program of an n-way plan on a one-device mesh)."""
    if _LOCAL.get():
        return jnp.concatenate([kv] * n, axis=2)
    with jax.named_scope("pp_kv"):
        return lax.all_gather(kv, PATCH, axis=2, tiled=True)


def _down(x: jax.Array, n: int) -> jax.Array:
    """Device i receives device i-1's x; device 0 receives zeros."""
    if _LOCAL.get():
        return x
    return lax.ppermute(x, PATCH, [(i, i + 1) for i in range(n - 1)])


def _up(x: jax.Array, n: int) -> jax.Array:
    """Device i receives device i+1's x; the last device receives zeros."""
    if _LOCAL.get():
        return x
    return lax.ppermute(x, PATCH, [(i + 1, i) for i in range(n - 1)])


@dataclass(frozen=True)
class PatchOps(SiteOps):
    n: int  # devices on the patch axis
    phase: str = "sync"
    halo_mode: str = "fresh"
    gn: str = "sync"
    kv: str = "all"
    portion: float = 1.0  # kv="band"
    send: str = "full"  # kv="band": send whole K/V and crop at the receiver, or only the band
    exchange: bool = True  # steady phase: refresh buffers (False: DistriFusion's no_sync)
    input: bool = False  # the model's first conv (`input_layer()`): halo always fresh
    ulysses: int = 1  # kv="context": the Ulysses degree (a divisor of n); ring degree = n / ulysses
    tp: int = 1  # devices on the model axis: tensor-parallel layers split their weights tp ways
    fsdp: int = 1  # devices each weight is sharded over at rest, gathered per layer (FSDP)

    def __post_init__(self):
        for name, value, known in (
            ("phase", self.phase, PHASES),
            ("halo_mode", self.halo_mode, HALO_MODES),
            ("gn", self.gn, GN_MODES),
            ("kv", self.kv, KV_MODES),
            ("send", self.send, ("full", "band")),
        ):
            if value not in known:
                raise ValueError(f"{name}={value!r}; known: {list(known)}")
        if self.kv == "context" and (self.ulysses < 1 or self.n % self.ulysses):
            raise ValueError(
                f"kv='context': ulysses={self.ulysses} must divide the patch axis n={self.n}"
            )
        if not self.exchange and self.gn != "separate":
            raise ValueError(
                f"exchange=False (no_sync) keeps no GroupNorm statistics fresh: gn must be "
                f"'separate' (local after warm-up), got gn={self.gn!r}"
            )

    @property
    def sync(self) -> bool:
        return self.phase == "sync"

    def input_layer(self) -> PatchOps:
        """`conv_in` reads the latent itself, which the sampler updates every step: a stale halo
        would be last step's input (with Euler, under last step's input scaling), so it is
        exchanged fresh (2 rows x W x C_in per neighbour). `zero` (naive patch) stays zero."""
        mode = "fresh" if self.halo_mode == "stale" else self.halo_mode
        return replace(self, halo_mode=mode, input=True)

    # ------------------------------------------------------------------ tensor parallel

    def model_degree(self) -> int:
        return self.tp

    def model_sum(self, mod, y: jax.Array) -> jax.Array:
        """All-reduce of a row-split layer's partial output over the model axis."""
        _note(self, "tp", shape=y.shape, itemsize=y.dtype.itemsize)
        if self.tp == 1 or _LOCAL.get():
            return y
        with jax.named_scope("pp_tp"):
            return lax.psum(y, MODEL)

    # ------------------------------------------------------------------ FSDP

    def layer(self, cls: type) -> type:
        """With `fsdp` > 1: `cls` wrapped so that its parameters sharded at rest are all-gathered
        when it runs (Flax `map_variables`), once its input exists; the gathered weights live
        only while it runs."""
        return cls if self.fsdp == 1 else _gathering(cls, self)

    def gather_weights(self, variables):
        """One layer's parameters, whole: its boxed shares (`nn.Partitioned`, names = the mesh
        axes of the one sharded dimension) go out flattened into one buffer and come back by
        one all-gather (PyTorch FSDP's flat parameter: one collective per layer, not one per
        tensor), then are cut and laid back; anything not boxed stays as it is."""
        is_box = lambda v: isinstance(v, nn.Partitioned)  # noqa: E731
        leaves, treedef = jax.tree.flatten(variables, is_leaf=is_box)
        groups: dict[tuple, list[tuple[int, int]]] = {}  # (dtype, axes) -> [(leaf, dim)]
        for i, leaf in enumerate(leaves):
            if is_box(leaf):
                (dim,) = [d for d, a in enumerate(leaf.names) if a is not None]
                groups.setdefault((leaf.value.dtype, leaf.names[dim]), []).append((i, dim))
        k = self.fsdp
        for (_, axes), members in groups.items():
            shares = [leaves[i].value for i, _ in members]
            # each share flattened after the input exists, so that no copy is made earlier
            flat = jnp.concatenate([_after_input(x.reshape(-1)) for x in shares])  # (L,)
            _note(self, "fsdp", shape=flat.shape, itemsize=flat.dtype.itemsize)
            if _LOCAL.get():  # stand-in: this device's buffer k times
                full = jnp.broadcast_to(flat, (k,) + flat.shape)
            else:
                with jax.named_scope("pp_fsdp"):
                    full = lax.all_gather(flat, axes, axis=0)  # (k, L), devices in mesh order
            at = 0
            for (i, dim), x in zip(members, shares, strict=True):
                part = full[:, at : at + x.size].reshape((k,) + x.shape)  # (k, ..., s_dim, ...)
                at += x.size
                whole = x.shape[:dim] + (k * x.shape[dim],) + x.shape[dim + 1 :]
                leaves[i] = jnp.moveaxis(part, 0, dim).reshape(whole)
        return jax.tree.unflatten(treedef, leaves)

    # ------------------------------------------------------------------ conv halo

    def halo(self, mod, x: jax.Array, top: int, bottom: int) -> jax.Array:
        """(B, h, W, C) -> (B, top + h + bottom, W, C)."""
        _note(self, "halo", shape=x.shape, itemsize=x.dtype.itemsize, top=top, bottom=bottom)
        if self.halo_mode == "zero" or self.n == 1:
            return jnp.pad(x, ((0, 0), (top, bottom), (0, 0), (0, 0)))
        if self.sync or self.halo_mode == "fresh":
            above, below = self._exchange_halo(x, top, bottom)
            if self.halo_mode == "stale":  # warm-up: the buffer the steady phase reads first
                mod.variable(STALE, "halo", lambda: jnp.concatenate([above, below], axis=1))
        else:
            buf = mod.variable(
                STALE, "halo", jnp.zeros, (x.shape[0], top + bottom) + x.shape[2:], x.dtype
            )
            above, below = buf.value[:, :top], buf.value[:, top:]
            if self.exchange:
                buf.value = jnp.concatenate(self._exchange_halo(x, top, bottom), axis=1)
        return jnp.concatenate([above, x, below], axis=1)

    def _exchange_halo(self, x, top, bottom):
        b, _, w, c = x.shape
        with jax.named_scope("pp_halo"):
            above = (
                _down(x[:, x.shape[1] - top :], self.n) if top else jnp.zeros((b, 0, w, c), x.dtype)
            )
            below = _up(x[:, :bottom], self.n) if bottom else jnp.zeros((b, 0, w, c), x.dtype)
        return above, below

    # ------------------------------------------------------------------ GroupNorm

    def group_stats(self, mod, mean: jax.Array, mean_sq: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Local (B, G) E[x], E[x^2] -> the global estimate the mode gives."""
        act = jnp.dtype(getattr(mod, "dtype", jnp.float32)).itemsize  # the activation's dtype
        _note(self, "gn", shape=(2,) + mean.shape, itemsize=4, act_itemsize=act)
        # Every mode is exact during warm-up (the released code all-reduces while
        # counter <= warmup_steps); `separate` is local only in the steady phase.
        if self.n == 1 or (self.gn == "separate" and not self.sync):
            return mean, mean_sq
        fresh = jnp.stack([mean, mean_sq])  # (2, B, G): one collective for both moments
        stale_mode = self.gn in ("stale", "corrected")
        if self.sync or self.gn == "sync":
            glob = _pmean(fresh)
            if stale_mode:
                mod.variable(STALE, "gn_global", lambda: glob)
                mod.variable(STALE, "gn_local", lambda: fresh)
            return glob[0], glob[1]
        g = mod.variable(STALE, "gn_global", jnp.zeros, fresh.shape, fresh.dtype)
        loc = mod.variable(STALE, "gn_local", jnp.zeros, fresh.shape, fresh.dtype)
        if self.gn == "stale":  # own slot fresh, the others as at step t-1
            est = g.value + (fresh - loc.value) / self.n
        else:  # corrected: DistriFusion Eq. 2
            est = g.value + (fresh - loc.value)
        g.value = _pmean(fresh)
        loc.value = fresh
        e_mean, e_sq = est[0], est[1]
        if self.gn == "corrected":  # where the estimated variance is negative, use the local one
            local_var = mean_sq - jnp.square(mean)
            e_sq = jnp.where(e_sq - jnp.square(e_mean) < 0, jnp.square(e_mean) + local_var, e_sq)
        return e_mean, e_sq

    # ------------------------------------------------------------------ self-attention K/V

    def self_attention(self, mod, q, k, v, heads: int, spec: AttentionSpec) -> jax.Array:
        if self.kv != "context" or self.n == 1:
            return super().self_attention(mod, q, k, v, heads, spec)
        _note(self, "kv", shape=q.shape, itemsize=q.dtype.itemsize, heads=heads)
        return context_attention(q, k, v, heads, spec, self.n, self.ulysses, _LOCAL.get())

    def self_attn_kv(self, mod, k: jax.Array, v: jax.Array):
        """Local (B, L, D) keys/values -> (B, T, D) keys/values to attend to, and a key mask."""
        _note(self, "kv", shape=(2,) + k.shape, itemsize=k.dtype.itemsize)
        if self.kv == "local" or self.n == 1:
            return k, v, None
        kv = jnp.stack([k, v])  # (2, B, L, D): one collective for both
        if self.sync or self.kv == "all":
            full = _gather(kv, self.n)  # (2, B, n*L, D)
            if self.kv == "stale":
                mod.variable(STALE, "kv", lambda: full)
            elif self.kv == "band":
                above, below = self._bands_from_full(full, kv.shape[2])
                mod.variable(STALE, "kv_above", lambda: above)
                mod.variable(STALE, "kv_below", lambda: below)
            return full[0], full[1], None
        if self.kv == "stale":
            return self._stale_all(mod, kv)
        return self._stale_band(mod, kv)

    def _stale_all(self, mod, kv):
        n, length = self.n, kv.shape[2]
        shape = kv.shape[:2] + (n * length,) + kv.shape[3:]
        buf = mod.variable(STALE, "kv", jnp.zeros, shape, kv.dtype)
        idx = lax.axis_index(PATCH)
        full = lax.dynamic_update_slice_in_dim(
            buf.value, kv, idx * length, axis=2
        )  # own slot fresh
        if self.exchange:
            buf.value = _gather(kv, self.n)
        return full[0], full[1], None

    def _stale_band(self, mod, kv):
        length = kv.shape[2]
        band = band_tokens(length, self.portion)
        shape = kv.shape[:2] + (band,) + kv.shape[3:]
        above = mod.variable(STALE, "kv_above", jnp.zeros, shape, kv.dtype)
        below = mod.variable(STALE, "kv_below", jnp.zeros, shape, kv.dtype)
        keys = jnp.concatenate([above.value, kv, below.value], axis=2)  # (2, B, band+L+band, D)
        if self.exchange:
            with jax.named_scope("pp_kv"):
                if self.send == "full":  # PCPP's code: whole neighbour K/V, cropped at the receiver
                    above.value = _down(kv, self.n)[:, :, length - band :]
                    below.value = _up(kv, self.n)[:, :, :band]
                else:  # only the rows used
                    above.value = _down(kv[:, :, length - band :], self.n)
                    below.value = _up(kv[:, :, :band], self.n)
        return keys[0], keys[1], self._band_mask(band, length)

    def _bands_from_full(self, full, length):
        """The neighbours' bands out of an exact all-gather (zeros where there is no neighbour)."""
        band = band_tokens(length, self.portion)
        idx = lax.axis_index(PATCH)
        start_above = jnp.maximum(idx * length - band, 0)
        above = lax.dynamic_slice_in_dim(full, start_above, band, axis=2)
        below = lax.dynamic_slice_in_dim(
            full, jnp.minimum((idx + 1) * length, full.shape[2] - band), band, axis=2
        )
        above = jnp.where(idx > 0, above, jnp.zeros_like(above))
        below = jnp.where(idx < self.n - 1, below, jnp.zeros_like(below))
        return above, below

    def _band_mask(self, band: int, length: int) -> jax.Array:
        """(band + L + band,) keys that exist: no band above device 0 or below the last device."""
        idx = lax.axis_index(PATCH)
        has_above = jnp.broadcast_to(idx > 0, (band,))
        has_below = jnp.broadcast_to(idx < self.n - 1, (band,))
        return jnp.concatenate([has_above, jnp.ones((length,), bool), has_below])

    # ------------------------------------------------------------------ analytic model

    def received_bytes(self, kind: str, info: dict, p: int) -> int:
        """Bytes device p of the patch axis receives for one site call (the conventions of
        `patchpar.measure.comm`), from the strategy's rules and the site's local shapes alone."""
        n = self.n
        size = math.prod(info["shape"]) * info["itemsize"]  # one device's operand
        if kind == "tp":  # ring all-reduce over the model axis
            return 2 * (self.tp - 1) * size // self.tp
        if kind == "fsdp":  # all-gather of a layer's weight over the devices sharing it
            return (self.fsdp - 1) * size
        if n == 1:
            return 0
        if kind == "halo":
            if self.halo_mode == "zero" or (
                not self.sync and self.halo_mode == "stale" and not self.exchange
            ):
                return 0
            rows = info["shape"][1]
            per_row = size // rows
            return per_row * ((info["top"] if p > 0 else 0) + (info["bottom"] if p < n - 1 else 0))
        if kind == "gn":
            if not self.sync and self.gn == "separate":
                return 0
            return 2 * (n - 1) * size // n  # ring all-reduce
        if kind == "kv":
            if self.kv == "context":
                return context_bytes(
                    info["shape"], info["itemsize"], info["heads"], n, self.ulysses
                )
            if self.kv == "local" or (not self.sync and self.kv != "all" and not self.exchange):
                return 0
            if self.sync or self.kv in ("all", "stale"):
                return (n - 1) * size  # all-gather
            length = info["shape"][2]
            sent = (
                size if self.send == "full" else size // length * band_tokens(length, self.portion)
            )
            return sent * ((p > 0) + (p < n - 1))
        raise ValueError(f"unknown site kind {kind!r}")

    def released_bytes(self, kind: str, info: dict, p: int) -> int:
        """Bytes device p would receive for the same site call with the released code's traffic
        pattern (mit-han-lab/distrifuser, and xiuyuz/pcpp for K/V bands), analytic only:
        - halo: every 3x3 conv but the first all-gathers its top and bottom `padding` rows
          (`conv_in` slices the full latent, nothing is sent); no_sync sends nothing after warm-up;
        - gn: statistics in the activation dtype; stale/corrected modes all-gather them, the
          others all-reduce them during warm-up (and `sync` every step); separate is local after;
        - kv: all-gather (warm-up, distrifusion); PCPP's steady phase sends the whole K/V to
          each neighbour (its code has no band-only send); context parallelism as patchpar's
          own (xDiT moves the same all-to-alls and ring hops).
        The UNet output's all-gather is not a site: `patchpar.measure.cost.released_count`."""
        n = self.n
        if kind in ("tp", "fsdp"):
            return self.received_bytes(kind, info, p)
        if n == 1 or self.halo_mode == "zero":
            return 0
        steady = not self.sync
        size = math.prod(info["shape"]) * info["itemsize"]
        if kind == "halo":
            if self.input or (steady and not self.exchange):
                return 0
            rows = info["shape"][1]
            pad = max(info["top"], info["bottom"])
            return (n - 1) * 2 * pad * (size // rows)
        if kind == "gn":
            size = size // info["itemsize"] * info["act_itemsize"]
            if steady and self.gn == "separate":
                return 0
            if self.gn in ("stale", "corrected"):
                return (n - 1) * size  # all-gather
            return 2 * (n - 1) * size // n  # all-reduce: sync, or separate during warm-up
        if kind == "kv":
            if self.kv == "context":
                return self.received_bytes(kind, info, p)
            if steady and not self.exchange:
                return 0
            if steady and self.kv == "band":
                return size * ((p > 0) + (p < n - 1))
            return (n - 1) * size
        raise ValueError(f"unknown site kind {kind!r}")
