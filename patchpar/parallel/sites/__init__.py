"""Site ops for row patches inside `shard_map` (docs/design.md §2): one small frozen op per site
kind, each in its own module with its exchange, its stale buffers and its two byte models
(patchpar's and the released code's):

| module | op | site | collectives |
|---|---|---|---|
| `halo.py` | `Halo` | conv halo | neighbour permutes |
| `groupnorm.py` | `GroupStats` | GroupNorm statistics | mean over the patch axis |
| `kv.py` | `KV` | self-attention K/V (all, local, stale, band) | all-gather or permutes |
| `context.py` | `ContextAttention` | self-attention, Ring / Ulysses | ring hops, all-to-alls |
| `tensor.py` | `TensorSum` | a row-split layer's output (tensor parallel) | all-reduce over `model` |
| `fsdp.py` | `FSDPGather` | a layer's weights (FSDP) | all-gather of its shares |
| `text.py` | `TextStream` | an MMDiT's text stream after each block | all-reduce or all-gather |

`PatchOps` bundles one op per site for one strategy and phase: it is the `SiteOps` the model
calls. Stale state is explicit: each site keeps its buffer in the Flax collection `stale` of
the module that calls it; in the warm-up phase a site exchanges exactly and writes the buffer
the steady phase reads first; in the steady phase it reads the buffer written at step t-1 and
sends its fresh activation for step t+1, exchanged at the site (`per_site`) or left in the
collection `send` for the engine's packed exchange (`patchpar.parallel.exchange`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cache

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.models.attention import AttentionSpec
from patchpar.models.sites import IDENTITY, SiteOps
from patchpar.parallel.mesh import PATCH
from patchpar.parallel.sites.common import (
    PHASES,
    SEND,
    STALE,
    PatchSite,
    Site,
    exchange,
    one_trace,
    record_sites,
    repeated,
    shapes_only,
)
from patchpar.parallel.sites.context import QKVO, ContextAttention
from patchpar.parallel.sites.fsdp import FSDPGather
from patchpar.parallel.sites.groupnorm import GroupStats
from patchpar.parallel.sites.halo import Halo
from patchpar.parallel.sites.kv import KV, band_tokens
from patchpar.parallel.sites.tensor import TensorSum
from patchpar.parallel.sites.text import TextStream


@dataclass(frozen=True)
class PatchOps(SiteOps):
    """One op per site kind, for one strategy and phase."""

    halo_op: Halo = field(default_factory=Halo)
    gn_op: GroupStats = field(default_factory=GroupStats)
    attn_op: KV | ContextAttention = field(default_factory=KV)
    tp_op: TensorSum = field(default_factory=TensorSum)
    fsdp_op: FSDPGather = field(default_factory=FSDPGather)
    text_op: TextStream = field(default_factory=TextStream)

    def sites(self) -> tuple[Site, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def site(self, kind: str) -> Site:
        """The op of a site kind (`halo`, `gn`, `kv`, `tp`, `fsdp`)."""
        for op in self.sites():
            if op.kind == kind:
                return op
        raise ValueError(f"unknown site kind {kind!r}; known: {[s.kind for s in self.sites()]}")

    @property
    def n(self) -> int:
        return self.halo_op.n

    @property
    def packed(self) -> bool:
        return any(isinstance(op, PatchSite) and op.packed for op in self.sites())

    def stale_buffers(self) -> set[str]:
        """The stale buffers that this (steady-phase) ops' sends refresh."""
        return {b for op in self.sites() if op.sends_stale() for b in op.buffers}

    def with_rows(self, rows: tuple[int, ...] | None, slab: int | None = None) -> PatchOps:
        """The same ops on patches of `rows` latent rows each (`parallel.split`; None: even);
        `slab`: the rows of a slab that holds its patch's alone (None: padded slabs)."""
        return self._with_patch_sites(rows=rows, slab=slab)

    def with_packed(self) -> PatchOps:
        """The same ops with every stale send left for the engine (`packed`), not exchanged at
        the site."""
        return self._with_patch_sites(packed=True)

    def _with_patch_sites(self, **changes) -> PatchOps:
        return replace(self, **{
            f.name: replace(op, **changes) for f in fields(self)
            if isinstance(op := getattr(self, f.name), PatchSite)
        })  # fmt: skip

    def with_stand_ins(self) -> PatchOps:
        """Every collective replaced by a local stand-in of the same shape (`Plan(comm=False)`,
        and tracing outside a mesh)."""
        return replace(
            self, **{f.name: replace(getattr(self, f.name), local=True) for f in fields(self)}
        )

    # the SiteOps interface, each call answered by its site's op

    def halo(self, mod, x: jax.Array, top: int, bottom: int) -> jax.Array:
        return self.halo_op(mod, x, top, bottom)

    def group_stats(self, mod, mean, mean_sq):
        return self.gn_op(mod, mean, mean_sq)

    def own_rows(self, h: int):
        split = self.gn_op.split
        return None if split is None else split.mine(h)

    def self_attn_kv(self, mod, k, v, row: int | None = None):
        return self.attn_op.keys(mod, k, v, row)

    def self_attention(
        self, mod, q, k, v, heads: int, spec: AttentionSpec, row: int | None = None
    ) -> jax.Array:
        return self.attn_op(mod, q, k, v, heads, spec, row)

    def joint_attention(self, mod, q, text_k, text_v, k, v, heads, spec, row=None):
        return self.attn_op.joint(mod, q, text_k, text_v, k, v, heads, spec, row)

    def text_stream(self, mod, txt: jax.Array) -> jax.Array:
        return self.text_op(mod, txt)

    def positions(self, mod, table, rows: int, cols: int) -> jax.Array:
        """This device's rows of the whole image's position table: the image has n x rows
        token rows and this slab is the patch index's (a constant sliced, no exchange; row
        patches only). Stand-ins (tracing outside a mesh) take the first slab."""
        del mod
        n, split = self.n, self.halo_op.split
        if split is not None:  # uneven: the patches' own rows, then padding's (zeros)
            total = sum(split.counts(rows))
            whole = jnp.pad(jnp.asarray(table(total, cols)), ((0, rows * cols), (0, 0)))
            return lax.dynamic_slice_in_dim(whole, split.start(rows) * cols, rows * cols, axis=0)
        whole = jnp.asarray(table(rows * n, cols))  # (n * rows * cols, D)
        if n == 1:
            return whole
        start = 0 if self.halo_op.local else lax.axis_index(PATCH) * rows * cols
        return lax.dynamic_slice_in_dim(whole, start, rows * cols, axis=0)

    def model_degree(self) -> int:
        return self.tp_op.degree

    def model_sum(self, mod, y: jax.Array) -> jax.Array:
        return self.tp_op(mod, y)

    def repeated(self, n: int):
        return repeated(n)

    def one_trace(self):
        return one_trace()

    def layer(self, cls: type) -> type:
        return self.fsdp_op.layer(cls)

    def input_layer(self) -> PatchOps:
        return replace(self, halo_op=self.halo_op.input_layer())


def patch_ops(
    n: int,
    phase: str = "warmup",
    *,
    halo: str = "fresh",
    gn: str = "sync",
    kv: str = "all",
    portion: float = 1.0,
    send: str = "full",
    align: str = "tokens",
    exchange: bool = True,
    ulysses: int | None = None,
    packed: bool = False,
    links: dict | None = None,
    text: str = "own",
    wire: dict | None = None,
) -> PatchOps:
    """The ops of the row-patch sites on `n` patch devices in `phase`, by mode words (see each
    site's module): halo fresh | stale | zero, gn sync | separate | stale | corrected, kv all |
    local | stale | band (with `portion`, `send` and `align`), or `ulysses` = d for context-parallel
    attention (Ring x Ulysses, ring degree n / d). `exchange=False` is DistriFusion's no_sync;
    `packed`: steady sends go to the engine's packed exchange; `links`: {site kind: Link}, how the
    steady phase's halos and K/V are compressed and extrapolated (`sites.compress`); `text`: how
    an MMDiT's text stream is kept (`sites.text`: own | mean | first); `wire`: an exact
    strategy's per-token codecs ({halo, kv: Codec}, or with `ulysses` {q, k, v, o: Codec}:
    `codecs.to_rows`)."""
    if not exchange and gn != "separate":
        raise ValueError(
            f"exchange=False (no_sync) keeps no GroupNorm statistics fresh: gn must be "
            f"'separate' (local after warm-up), got gn={gn!r}"
        )
    common = dict(n=n, phase=phase, packed=packed)
    links, wire = links or {}, wire or {}
    if ulysses is None:
        attn = KV(
            **common,
            mode=kv,
            portion=portion,
            sends=send,
            align=align,
            exchange=exchange,
            link=links.get("kv"),
            wire=wire.get("kv"),
        )
    else:
        codecs = tuple(wire.get(t) for t in QKVO)
        attn = ContextAttention(n=n, phase=phase, ulysses=ulysses, codecs=codecs)
    return PatchOps(
        Halo(**common, mode=halo, exchange=exchange, link=links.get("halo"), wire=wire.get("halo")),
        GroupStats(**common, mode=gn),
        attn,
        text_op=TextStream(n=n, phase=phase, mode=text),
    )


@cache
def param_shapes(unet):
    """A denoiser's whole parameters' shapes (for checks up front), its sites the identity
    (no site call recorded); traced once per module."""
    with shapes_only():
        return unet.with_ops(IDENTITY).abstract_params()


__all__ = [
    "KV",
    "PHASES",
    "SEND",
    "STALE",
    "ContextAttention",
    "FSDPGather",
    "GroupStats",
    "Halo",
    "PatchOps",
    "PatchSite",
    "Site",
    "TensorSum",
    "TextStream",
    "band_tokens",
    "exchange",
    "param_shapes",
    "patch_ops",
    "record_sites",
    "shapes_only",
]
