"""Softmax attention kernels, chosen by a small static spec (`model.attention` in a run config).

Every kernel takes the same arguments: q (B, Tq, H*D), k/v (B, Tk, H*D), an optional bool mask
of the keys that exist, (Tk,) for every image (PCPP's band on an edge device, padding) or
(B, Tk) per image (a text encoder's padding tokens), and returns (B, Tq, H*D).
Scores, softmax statistics and accumulators are float32 whatever the compute dtype.

- `xla`: the whole (B, H, Tq, Tk) logits at once (`einsum` + `softmax`): the reference. Memory
  grows with Tq x Tk: SDXL at 3840x3840 needs 265 GB of logits in one call.
- `chunked`: blockwise attention with an online softmax (flash attention's recurrence written
  in JAX): a `lax.map` over query blocks, a `lax.scan` over key/value blocks carrying the row
  maximum, the row sum and a float32 accumulator. Memory O(block_q x block_kv) per (batch, head);
  pure JAX, every backend. Token counts that are not multiples of the blocks are padded (padded
  keys masked, padded queries dropped).
- `cudnn`: `jax.nn.dot_product_attention(..., implementation="cudnn")`, NVIDIA GPUs, bf16/fp16.
- `splash`: the Pallas TPU splash-attention kernel (block sizes as MaxDiffusion's
  `flash_block_sizes`), TPUs; masked and padded keys through segment ids.
- `auto`: cudnn on a GPU for bf16/fp16 (chunked for float32), chunked on a TPU and on CPU.
  `resolve` says which, and run records carry it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

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
    impl = spec.impl if spec.impl != "auto" else resolve(spec, q.dtype).impl
    if impl == "xla":
        return xla_attention(q, k, v, heads, mask)
    if impl == "chunked":
        return chunked_attention(q, k, v, heads, mask, spec.block_q, spec.block_kv)
    if impl == "cudnn":
        return _cudnn_attention(q, k, v, heads, mask)
    return _splash_attention(q, k, v, heads, mask, spec)


def attend_joint(spec, q, text_k, text_v, k, v, heads: int, mask=None) -> jax.Array:
    """`attend` over the text keys/values (all exist) followed by the image's (`mask`: (Tk,)
    of the image keys that exist, None: all): an MMDiT's joint attention."""
    keys = jnp.concatenate([text_k, k], axis=1)
    values = jnp.concatenate([text_v, v], axis=1)
    if mask is not None:
        mask = jnp.concatenate([jnp.ones(mask.shape[:-1] + (text_k.shape[1],), bool), mask], -1)
    return attend(spec, q, keys, values, heads, mask)


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
    b, tq, inner = q.shape
    d = inner // heads
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, d)  # noqa: E731
    logits = jnp.einsum("bqhd,bkhd->bhqk", split(q), split(k), preferred_element_type=jnp.float32)
    if mask is not None:
        keep = _keys_mask(mask)[:, None, None, :]
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits / math.sqrt(d), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, split(v))
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
    """Flash attention's recurrence over any sequence of key/value chunks (the chunked kernel
    feeds it one chunk; ring attention one chunk per hop): float32 running row maxima and
    accumulators per query block, so chunks seen in any order give the same softmax."""

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
        nq, b, heads, bq, d = self.qb.shape
        tk = k.shape[1]
        nk, bk = _blocks(tk, block_kv)
        kh, vh = _split(k, heads), _split(v, heads)  # (B, H, T, D)
        keep = jnp.ones((1, tk), bool) if mask is None else _keys_mask(mask)  # (B or 1, Tk)
        if nk * bk != tk:
            pad = ((0, 0), (0, 0), (0, nk * bk - tk), (0, 0))
            kh, vh = jnp.pad(kh, pad), jnp.pad(vh, pad)
            keep = jnp.pad(keep, ((0, 0), (0, nk * bk - tk)))
        # blocks first: (n, B, H, block, D)
        kb = kh.reshape(b, heads, nk, bk, d).transpose(2, 0, 1, 3, 4)
        vb = vh.reshape(b, heads, nk, bk, d).transpose(2, 0, 1, 3, 4)
        keepb = keep.reshape(-1, nk, bk).transpose(1, 0, 2)[
            :, :, None, None, :
        ]  # (nk, B|1, 1, 1, bk)
        masked = mask is not None or nk * bk != tk
        # v carries a column of ones: the matmul also gives the row sums of p (no reduce pass)
        vb = jnp.concatenate([vb, jnp.ones(vb.shape[:-1] + (1,), vb.dtype)], -1)
        m, acc = lax.map(
            partial(_query_block, kb=kb, vb=vb, keepb=keepb if masked else None, scale=d**-0.5),
            (self.qb, self.m, self.acc),
        )
        return OnlineSoftmax(self.qb, m, acc, self.tq)

    def finish(self, dtype) -> jax.Array:
        """The attention output (B, Tq, H*D) in `dtype`."""
        nq, b, heads, bq, d = self.qb.shape
        out = self.acc[..., :d] / self.acc[..., d:]  # (nq, B, H, bq, D)
        out = out.transpose(1, 2, 0, 3, 4).reshape(b, heads, nq * bq, d)[:, :, : self.tq]
        return _merge(out).astype(dtype)


_KQ = (((3,), (3,)), ((0, 1), (0, 1)))  # k (B, H, bk, D) . q (B, H, bq, D) -> (B, H, bk, bq)
_PTV = (((2,), (2,)), ((0, 1), (0, 1)))  # p (B, H, bk, bq) . v (B, H, bk, D+1) -> (B, H, bq, D+1)


def _query_block(blk, kb, vb, keepb, scale):
    """One query block (B, H, bq, D) and its running (max, accumulator) against every key
    block: flash attention's recurrence. The scores are laid out keys x queries, so the row
    maxima reduce over the second-minor axis, element-wise across the queries: on XLA:CPU
    that reduction and the exponential after it run several times faster than over the
    minor axis (a block of 512 x 256: 1.0 against 6.8 ms for the max, one core)."""
    qi, m0, acc0 = blk

    def step(carry, blk):
        m, acc = carry  # m (B, H, bq, 1)
        kk, vv, keep = blk
        # unscaled scores: the scale (> 0) commutes with the max and folds into the exp, which
        # saves a pass over the (bk, bq) block
        s = lax.dot_general(kk, qi, _KQ, preferred_element_type=jnp.float32)  # (B, H, bk, bq)
        if keep is not None:  # keep (B|1, 1, 1, bk) -> (B|1, 1, bk, 1)
            s = jnp.where(jnp.swapaxes(keep, -1, -2), s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.swapaxes(s.max(-2, keepdims=True), -1, -2))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # a block with no key at all
        p = jnp.exp((s - jnp.swapaxes(m_safe, -1, -2)) * scale)
        alpha = jnp.exp((m - m_safe) * scale)
        pv = lax.dot_general(p.astype(vv.dtype), vv, _PTV, preferred_element_type=jnp.float32)
        return (m_new, alpha * acc + pv), None

    (m, acc), _ = lax.scan(step, (m0, acc0), (kb, vb, keepb))
    return m, acc


def _cudnn_attention(q, k, v, heads: int, mask=None):
    b, tq, inner = q.shape
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, inner // heads)  # noqa: E731
    full = (
        None
        if mask is None
        else jnp.broadcast_to(_keys_mask(mask)[:, None, None, :], (b, 1, tq, k.shape[1]))
    )
    out = jax.nn.dot_product_attention(
        split(q), split(k), split(v), mask=full, implementation="cudnn"
    )
    return out.reshape(b, tq, inner)


def _splash_attention(q, k, v, heads: int, mask, spec: AttentionSpec):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    b, tq, inner = q.shape
    tk = k.shape[1]
    d = inner // heads
    # pad both sequences to whole blocks; padded or masked keys get another segment id
    bq, bk = min(spec.block_q, _ceil(tq, 128)), min(spec.block_kv, _ceil(tk, 128))
    pq, pk = _ceil(tq, bq), _ceil(tk, bk)
    qh = jnp.pad(_split(q, heads) * jnp.asarray(d**-0.5, q.dtype), _pad_t(pq - tq))
    kh, vh = jnp.pad(_split(k, heads), _pad_t(pk - tk)), jnp.pad(_split(v, heads), _pad_t(pk - tk))
    keep = jnp.ones((1, tk), bool) if mask is None else _keys_mask(mask)
    keep = jnp.broadcast_to(jnp.pad(keep, ((0, 0), (0, pk - tk))), (b, pk))  # per image
    kv_ids = jnp.where(keep, 0, 1).astype(jnp.int32)
    kernel = splash.make_splash_mha_single_device(
        masks.MultiHeadMask([masks.FullMask((pq, pk))] * heads),
        block_sizes=splash.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk),
        interpret=spec.interpret,
    )

    if mask is None and pk == tk:  # every key exists: no segment ids (the kernel's fast path)
        out = jax.vmap(kernel)(qh, kh, vh)
    else:

        def one(qq, kk, vv, kv):
            ids = splash.SegmentIds(q=jnp.zeros((pq,), jnp.int32), kv=kv)
            return kernel(qq, kk, vv, segment_ids=ids)

        out = jax.vmap(one)(qh, kh, vh, kv_ids)
    return _merge(out[:, :, :tq]).astype(v.dtype)


def _ceil(n: int, block: int) -> int:
    return -(-n // block) * block


def _pad_t(extra: int):
    return ((0, 0), (0, 0), (0, extra), (0, 0))
