"""Softmax attention kernels, chosen by a small static spec (`model.attention` in a run config).

Every kernel takes the same arguments: q (B, Tq, H*D), k/v (B, Tk, H*D), an optional bool mask
of the keys that exist, (Tk,) for every image (PCPP's band on an edge device, padding) or
(B, Tk) per image (a text encoder's padding tokens), and returns (B, Tq, H*D).
Scores, softmax statistics and accumulators are float32 whatever the compute dtype.

- `xla`: the whole (B, H, Tq, Tk) logits at once (`einsum` + `softmax`): the reference. Memory
  grows with Tq x Tk: SDXL at 3840x3840 needs 265 GB of logits in one call.
- `chunked`: blockwise attention with an online softmax (flash attention's recurrence written
  in JAX): a `lax.scan` over each key source's key/value blocks, read where they lie, around a
  `lax.map` over query blocks, carrying per query block the row maximum and a float32
  accumulator whose last column is the row sum. Memory O(block_q x block_kv) per (batch,
  head); pure JAX, every backend. Queries that are not a multiple of the block are padded (and
  dropped); keys that are not start their last block early, the keys read twice masked.
- `cudnn`: `jax.nn.dot_product_attention(..., implementation="cudnn")`, NVIDIA GPUs, bf16/fp16.
- `splash`: the Pallas TPU splash-attention kernel (block sizes as MaxDiffusion's
  `flash_block_sizes`), TPUs; masked and padded keys through segment ids.
- `auto`: cudnn on a GPU for bf16/fp16 (chunked for float32), chunked on a TPU and on CPU.
  `resolve` says which, and run records carry it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn", "splash")
_NEEDS = {"cudnn": ("gpu",), "splash": ("tpu",)}


@dataclass(frozen=True)
class AttentionSpec:
    """Which kernel and its block sizes. Static and hashable: it is part of the compiled program."""

    impl: str = "auto"
    """auto, xla, chunked, cudnn or splash."""
    block_q: int = 256
    """Queries per block (chunked, splash)."""
    block_kv: int = 512
    """Keys/values per block (chunked, splash)."""
    interpret: bool = False
    """splash only: run the Pallas kernel in interpret mode (any backend; for tests)."""

    def __post_init__(self):
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(
                f"model.attention={self.impl!r} is not an attention implementation; "
                f"known: {list(IMPLEMENTATIONS)}"
            )
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"attention {name}={value!r}: must be a positive int (e.g. 512)")
        if self.impl == "splash" and (self.block_q % 128 or self.block_kv % 128):
            raise ValueError(
                f"splash attention: block_q={self.block_q}, block_kv={self.block_kv} must be "
                f"multiples of 128 (the TPU lane width); nearest: "
                f"{_round128(self.block_q)}, {_round128(self.block_kv)}"
            )


def _round128(n: int) -> int:
    return max(128, round(n / 128) * 128)


XLA = AttentionSpec("xla")
AUTO = AttentionSpec()


def available(backend: str | None = None) -> list[str]:
    """Implementations this backend can run (`auto` always)."""
    backend = backend or jax.default_backend()
    return [i for i in IMPLEMENTATIONS if backend in _NEEDS.get(i, (backend,))]


def resolve(spec: AttentionSpec, dtype=jnp.float32, backend: str | None = None) -> AttentionSpec:
    """`auto` made concrete for this backend and compute dtype; an implementation the backend
    lacks is a ValueError naming the backend and what it has."""
    backend = backend or jax.default_backend()
    impl = spec.impl
    if impl == "auto":
        low = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        # on a TPU v5e at 1024² `chunked` 256x512 was measured faster than splash's best
        # blocks on SDXL, PixArt-α and SD3.5, within 2% of them on FLUX.1 (results/tpu_v5e);
        # other TPU generations and sizes are not measured yet
        impl = {"gpu": "cudnn" if low else "chunked"}.get(backend, "chunked")
    elif backend not in _NEEDS.get(impl, (backend,)) and not (impl == "splash" and spec.interpret):
        raise ValueError(
            f"model.attention={impl!r} needs a {' or '.join(_NEEDS[impl]).upper()} backend; this "
            f"one is {backend!r}, which has {available(backend)}"
        )
    if impl == "cudnn" and jnp.dtype(dtype) not in (
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        raise ValueError(
            f"model.attention='cudnn' needs bfloat16 or float16 compute; the dtype is "
            f"{jnp.dtype(dtype).name} (use chunked or xla, or sampler.dtype=bfloat16)"
        )
    return AttentionSpec(impl, spec.block_q, spec.block_kv, spec.interpret)


@dataclass(frozen=True)
class Keys:
    """Keys and values in the layout every kernel reads them, heads-major: `kv` (S, 2, B, H, T, D)
    holds S slots of T tokens (a gathered buffer's patches in order, or one slot), keys at
    [:, 0] and values at [:, 1], so that one array travels for both. `keep`: (S, B|1, T) bool,
    the keys that exist (None: all). `skip`: a slot not read (a traced index: the own patch's
    slot of a stale buffer, whose fresh keys come as a source of their own; None: read all).

    The layout is what the `chunked` kernel reads block by block, so keys formatted once (by
    whoever computed them, before they travel) are read where they arrive: no copy into heads,
    no whole buffer rebuilt with one slot replaced (docs/design.md §5c)."""

    kv: jax.Array
    keep: jax.Array | None = None
    skip: jax.Array | None = None

    @classmethod
    def of(cls, k: jax.Array, v: jax.Array, heads: int, mask: jax.Array | None = None) -> Keys:
        """One slot from keys/values (B, T, H*D) and a (T,) or (B, T) mask."""
        keep = None if mask is None else _keys_mask(mask)[None]
        return cls(heads_kv(k, v, heads)[None], keep)


jax.tree_util.register_dataclass(Keys, data_fields=["kv", "keep", "skip"], meta_fields=[])


def heads_kv(k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Keys and values (B, T, H*D) -> one (2, B, H, T, D) array: the kernels' layout."""
    return jnp.stack([_split(k, heads), _split(v, heads)])


def attend(
    spec: AttentionSpec,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    heads: int,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention with `spec`'s kernel. q: (B, Tq, H*D), k/v: (B, Tk, H*D), mask: (Tk,)
    or (B, Tk) bool keys that exist -> (B, Tq, H*D) in v's dtype."""
    return attend_keys(spec, q, heads, [Keys.of(k, v, heads, mask)])


def attend_joint(spec, q, text_k, text_v, k, v, heads: int, mask=None) -> jax.Array:
    """`attend` over the text keys/values (all exist) followed by the image's (`mask`: (Tk,)
    of the image keys that exist, None: all): an MMDiT's joint attention."""
    sources = [Keys.of(text_k, text_v, heads), Keys.of(k, v, heads, mask)]
    return attend_keys(spec, q, heads, sources)


def attend_keys(spec: AttentionSpec, q: jax.Array, heads: int, sources) -> jax.Array:
    """Softmax attention of q (B, Tq, H*D) over the keys of every source (`Keys`), as one
    softmax -> (B, Tq, H*D) in the values' dtype. `chunked` reads each source where it lies
    (their blocks folded into one online softmax); the other kernels read one sequence, the
    sources joined into it (a copy)."""
    dtype = sources[0].kv.dtype
    impl = spec.impl if spec.impl != "auto" else resolve(spec, q.dtype).impl
    if impl == "chunked":
        state = OnlineSoftmax.start(q, heads, spec.block_q)
        return state.update_keys(sources, spec.block_kv).finish(dtype)
    kh, vh, keep = joined(sources)
    if impl == "xla":
        return _xla(q, kh, vh, heads, keep)
    if impl == "cudnn":
        return _cudnn_attention(q, kh, vh, heads, keep)
    return _splash_attention(q, kh, vh, heads, keep, spec)


def joined(sources) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The keys of every source as one sequence: keys and values (B, H, T, D) and the (B|1, T)
    keys that exist (None: all); a skipped slot is left out (the others rotated to start after
    it, as `chunked` reads them)."""
    ks, vs, keeps = [], [], []
    for src in sources:
        kv, keep = src.kv, src.keep
        if src.skip is not None:
            kv = jnp.roll(kv, -(src.skip + 1), axis=0)[:-1]
            keep = None if keep is None else jnp.roll(keep, -(src.skip + 1), axis=0)[:-1]
        s, _, b, h, t, d = kv.shape
        kv = kv.transpose(1, 2, 3, 0, 4, 5).reshape(2, b, h, s * t, d)  # slots in order
        ks.append(kv[0])
        vs.append(kv[1])
        if keep is None:
            keep = jnp.ones((1, s * t), bool)
        else:
            keep = keep.transpose(1, 0, 2).reshape(keep.shape[1], s * t)
        keeps.append(keep)
    if all(src.keep is None for src in sources):
        keep = None
    else:
        width = max(k.shape[0] for k in keeps)
        keep = jnp.concatenate([jnp.broadcast_to(k, (width, k.shape[1])) for k in keeps], 1)
    if len(ks) == 1:
        return ks[0], vs[0], keep
    return jnp.concatenate(ks, 2), jnp.concatenate(vs, 2), keep


def _keys_mask(mask: jax.Array) -> jax.Array:
    """A (Tk,) or (B, Tk) key mask as (B or 1, Tk)."""
    return mask[None] if mask.ndim == 1 else mask


def _split(t: jax.Array, heads: int) -> jax.Array:  # (B, T, H*D) -> (B, H, T, D)
    b, n, inner = t.shape
    return t.reshape(b, n, heads, inner // heads).transpose(0, 2, 1, 3)


def _merge(t: jax.Array) -> jax.Array:  # (B, H, T, D) -> (B, T, H*D)
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def xla_attention(q, k, v, heads: int, mask=None) -> jax.Array:
    """The whole logits at once; softmax in float32."""
    keep = None if mask is None else _keys_mask(mask)
    return _xla(q, _split(k, heads), _split(v, heads), heads, keep)


def _xla(q, kh, vh, heads: int, keep=None) -> jax.Array:
    """q (B, Tq, H*D), kh/vh (B, H, Tk, D), keep (B|1, Tk) -> (B, Tq, H*D)."""
    b, tq, inner = q.shape
    d = inner // heads
    qh = q.reshape(b, tq, heads, d)
    logits = jnp.einsum("bqhd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32)
    if keep is not None:
        logits = jnp.where(keep[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits / math.sqrt(d), axis=-1).astype(vh.dtype)
    out = jnp.einsum("bhqk,bhkd->bqhd", probs, vh)
    return out.reshape(b, tq, inner)


def _blocks(n: int, block: int) -> tuple[int, int]:
    """(blocks, block size) covering n tokens with the least padding for at most `block`."""
    count = -(-n // block)
    return count, -(-n // count)


def chunked_attention(q, k, v, heads: int, mask=None, block_q: int = 512, block_kv: int = 1024):
    """Blockwise attention with an online softmax; memory O(block_q x block_kv) per head."""
    blocks = OnlineSoftmax.start(q, heads, block_q)
    return blocks.update(k, v, mask, block_kv).finish(v.dtype)


@dataclass(frozen=True)
class OnlineSoftmax:
    """Flash attention's recurrence over any sequence of key/value sources (the chunked kernel
    feeds it a layer's sources; ring attention one per hop): float32 running row maxima and
    accumulators per query block, so keys seen in any order give the same softmax."""

    qb: jax.Array  # (nq, B, H, bq, D) query blocks (padded queries at the end)
    m: jax.Array  # (nq, B, H, bq, 1) running max of the unscaled scores, float32
    acc: jax.Array  # (nq, B, H, bq, D + 1) sum of p v, and of p in the last column, float32
    tq: int  # queries before padding

    @classmethod
    def start(cls, q: jax.Array, heads: int, block_q: int) -> OnlineSoftmax:
        """q: (B, Tq, H*D); no key seen yet."""
        b, tq, inner = q.shape
        d = inner // heads
        nq, bq = _blocks(tq, block_q)
        qh = _split(q, heads)  # (B, H, Tq, D)
        if nq * bq != tq:
            qh = jnp.pad(qh, ((0, 0), (0, 0), (0, nq * bq - tq), (0, 0)))
        qb = qh.reshape(b, heads, nq, bq, d).transpose(2, 0, 1, 3, 4)  # blocks first
        m = jnp.full(qb.shape[:4] + (1,), -jnp.inf, jnp.float32)
        return cls(qb, m, jnp.zeros(qb.shape[:4] + (d + 1,), jnp.float32), tq)

    def update(self, k: jax.Array, v: jax.Array, mask=None, block_kv: int = 1024):
        """The state after also attending to keys/values k, v (B, Tk, H*D), mask (Tk,) or
        (B, Tk) bool."""
        return self.update_keys([Keys.of(k, v, self.qb.shape[2], mask)], block_kv)

    def update_keys(self, sources, block_kv: int = 1024) -> OnlineSoftmax:
        """The state after also attending to the keys of every source (`Keys`), read where
        they lie in blocks of at most `block_kv` keys (`_fold_source`)."""
        scale = self.qb.shape[-1] ** -0.5
        m, acc = self.m, self.acc
        for src in sources:
            m, acc = _fold_source(src, block_kv, self.qb, m, acc, scale)
        return OnlineSoftmax(self.qb, m, acc, self.tq)

    def finish(self, dtype) -> jax.Array:
        """The attention output (B, Tq, H*D) in `dtype`."""
        nq, b, heads, bq, d = self.qb.shape
        out = self.acc[..., :d] / self.acc[..., d:]  # (nq, B, H, bq, D)
        out = out.transpose(1, 2, 0, 3, 4).reshape(b, heads, nq * bq, d)[:, :, : self.tq]
        return _merge(out).astype(dtype)


_KQ = (((3,), (3,)), ((0, 1), (0, 1)))  # k (B, H, bk, D) . q (B, H, bq, D) -> (B, H, bk, bq)
_PTV = (((2,), (2,)), ((0, 1), (0, 1)))  # p (B, H, bk, bq) . v (B, H, bk, D+1) -> (B, H, bq, D+1)


def _with_ones(v: jax.Array) -> jax.Array:
    """v (..., D) -> (..., D + 1) with a column of ones: the product p v then also gives the
    row sums of p (no reduction pass: on a TPU v5e that pass cost 18% of a PixArt-α call's
    attention, where the extra column rides in the MXU's spare lanes)."""
    return jnp.concatenate([v, jnp.ones(v.shape[:-1] + (1,), v.dtype)], -1)


def _fold_source(src: Keys, block_kv: int, qb, m, acc, scale: float):
    """Every query block's (m, acc) after the keys of one source, read where they lie: each
    block of every slot but a skipped one is a dynamic slice (no copy of the source, whether it
    was formatted in this program or arrived so), its values given their column of ones once,
    then folded into every query block. Key blocks outside, query blocks inside: joining the
    column per (query, key) pair cost a PixArt-α attention call 40% more on a TPU v5e, and
    laying fresh keys out blocks-first with the column in one copy 9% more. A slot's T keys come
    in blocks of at most `block_kv`; where they do not divide evenly the last block starts early
    (clamped to T - size) and its keys already read are masked, so no key is padded."""
    slots_all, _, b, heads, t, d = src.kv.shape
    nk, bk = _blocks(t, block_kv)
    overlap = nk * bk - t  # keys of a slot's last block that the block before also read
    slots = slots_all - (src.skip is not None)
    rows = None if src.keep is None else src.keep.shape[1]

    def body(carry, j):
        i, blk = (j // nk, j % nk) if nk > 1 else (j, 0)
        slot = i if src.skip is None else (src.skip + 1 + i) % slots_all
        start = jnp.minimum(blk * bk, t - bk) if overlap else blk * bk
        at = (slot, 0, 0, 0, start, 0)
        kk = lax.dynamic_slice(src.kv, at, (1, 1, b, heads, bk, d)).reshape(b, heads, bk, d)
        vv = lax.dynamic_slice(src.kv, (slot, 1) + at[2:], (1, 1, b, heads, bk, d))
        vv = _with_ones(vv.reshape(b, heads, bk, d))
        keep = None  # (B|1, bk)
        if src.keep is not None:
            keep = lax.dynamic_slice(src.keep, (slot, 0, start), (1, rows, bk))[0]
        if overlap:  # the last block's keys the one before read
            new = (start + jnp.arange(bk) >= blk * bk)[None]
            keep = new if keep is None else keep & new

        def one(qblk):  # one query block against this key block
            qi, mi, ai = qblk
            return _fold((mi, ai), qi, kk, vv, keep, scale)

        return lax.map(one, (qb,) + carry), None

    (m, acc), _ = lax.scan(body, (m, acc), jnp.arange(slots * nk))
    return m, acc


def _fold(carry, qi, kk, vv, keep, scale: float):
    """Flash attention's recurrence: the running (max, accumulator) of a query block (B, H, bq,
    D) after one key block kk (B, H, bk, D), vv (B, H, bk, D + 1), keep (B|1, bk) or None. The
    scores are laid out keys x queries, so the row maxima reduce over the second-minor axis,
    element-wise across the queries: on XLA:CPU that reduction and the exponential after it
    run several times faster than over the minor axis (a block of 512 x 256: 1.0 against
    6.8 ms for the max, one core)."""
    m, acc = carry  # m (B, H, bq, 1)
    # unscaled scores: the scale (> 0) commutes with the max and folds into the exp, which
    # saves a pass over the (bk, bq) block
    sc = lax.dot_general(kk, qi, _KQ, preferred_element_type=jnp.float32)  # (B, H, bk, bq)
    if keep is not None:  # (B|1, bk) -> (B|1, 1, bk, 1)
        sc = jnp.where(keep[:, None, :, None], sc, -jnp.inf)
    m_new = jnp.maximum(m, jnp.swapaxes(sc.max(-2, keepdims=True), -1, -2))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # no key at all so far
    p = jnp.exp((sc - jnp.swapaxes(m_safe, -1, -2)) * scale)
    alpha = jnp.exp((m - m_safe) * scale)
    pv = lax.dot_general(p.astype(vv.dtype), vv, _PTV, preferred_element_type=jnp.float32)
    return m_new, alpha * acc + pv


def _cudnn_attention(q, kh, vh, heads: int, keep=None):
    """q (B, Tq, H*D), kh/vh (B, H, Tk, D), keep (B|1, Tk) -> (B, Tq, H*D)."""
    b, tq, inner = q.shape
    tk = kh.shape[2]
    tokens = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731  (B, H, T, D) -> (B, T, H, D)
    full = None if keep is None else jnp.broadcast_to(keep[:, None, None, :], (b, 1, tq, tk))
    out = jax.nn.dot_product_attention(
        q.reshape(b, tq, heads, inner // heads), tokens(kh), tokens(vh), mask=full,
        implementation="cudnn",
    )  # fmt: skip
    return out.reshape(b, tq, inner)


def _splash_attention(q, kh, vh, heads: int, keep, spec: AttentionSpec):
    """q (B, Tq, H*D), kh/vh (B, H, Tk, D), keep (B|1, Tk) -> (B, Tq, H*D)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    b, tq, inner = q.shape
    tk = kh.shape[2]
    d = inner // heads
    # pad both sequences to whole blocks; padded or masked keys get another segment id
    bq, bk = min(spec.block_q, _ceil(tq, 128)), min(spec.block_kv, _ceil(tk, 128))
    pq, pk = _ceil(tq, bq), _ceil(tk, bk)
    qh = jnp.pad(_split(q, heads) * jnp.asarray(d**-0.5, q.dtype), _pad_t(pq - tq))
    kh, vh = jnp.pad(kh, _pad_t(pk - tk)), jnp.pad(vh, _pad_t(pk - tk))
    masked = keep is not None
    keep = jnp.ones((1, tk), bool) if keep is None else keep
    keep = jnp.broadcast_to(jnp.pad(keep, ((0, 0), (0, pk - tk))), (b, pk))  # per image
    kv_ids = jnp.where(keep, 0, 1).astype(jnp.int32)
    kernel = splash.make_splash_mha_single_device(
        masks.MultiHeadMask([masks.FullMask((pq, pk))] * heads),
        block_sizes=splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk),
        interpret=spec.interpret,
    )

    if not masked and pk == tk:  # every key exists: no segment ids (the kernel's fast path)
        out = jax.vmap(kernel)(qh, kh, vh)
    else:

        def one(qq, kk, vv, kv):
            ids = splash.SegmentIds(q=jnp.zeros((pq,), jnp.int32), kv=kv)
            return kernel(qq, kk, vv, segment_ids=ids)

        out = jax.vmap(one)(qh, kh, vh, kv_ids)
    return _merge(out[:, :, :tq]).astype(vh.dtype)


def _ceil(n: int, block: int) -> int:
    return -(-n // block) * block


def _pad_t(extra: int):
    return ((0, 0), (0, 0), (0, extra), (0, 0))
