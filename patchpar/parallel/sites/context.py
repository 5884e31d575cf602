"""Context-parallel self-attention over the patch axis (inside `shard_map`): Ring, Ulysses and
their hybrid. Each device holds the queries, keys and values of its own row patch; the output
equals attention over the whole image's tokens.

- Ring (Liu et al. 2023; xDiT's `ring_degree`): the K/V blocks travel around the ring with
  `ppermute`; each device folds every block into a float32 online softmax
  (`attention.OnlineSoftmax`), so block order does not matter. The next hop is issued before
  the current block's compute, so XLA may overlap the transfer with it.
- Ulysses (DeepSpeed-Ulysses; xDiT's `ulysses_degree`): one all-to-all turns the
  sequence-sharded Q, K, V into head-sharded ones over the whole sequence, any attention kernel
  runs on its share of the heads, and a second all-to-all turns the output back. Heads that do
  not divide the degree are padded with zero heads (their outputs are dropped).
- Hybrid `ring_degree x ulysses_degree` = patch: Ulysses inside groups of `ulysses` consecutive
  devices, then a ring across the groups (device g * ulysses + j passes to the same j of the
  next group).

Every collective sits in `pp_kv` (the self-attention site), and `context_bytes` is its analytic
byte model (the convention of `patchpar.measure.comm`). `ContextAttention` is the site op.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.models.attention import AttentionSpec, OnlineSoftmax, attend, attend_joint
from patchpar.parallel.mesh import PATCH, divisors
from patchpar.parallel.sites.common import PatchSite, note


@dataclass(frozen=True)
class ContextAttention(PatchSite):
    """Exact context-parallel self-attention: `ulysses` = the Ulysses degree (a divisor of n),
    ring degree = n / ulysses. No stale state: every phase is exact."""

    kind = "kv"
    ulysses: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.ulysses < 1 or self.n % self.ulysses:
            raise ValueError(f"ulysses={self.ulysses} must divide the patch axis n={self.n}")

    def __call__(self, mod, q, k, v, heads: int, spec: AttentionSpec, row=None) -> jax.Array:
        note(self, shape=q.shape, itemsize=q.dtype.itemsize, heads=heads)
        if self.n == 1:
            return attend(spec, q, k, v, heads)
        return context_attention(q, k, v, heads, spec, self.n, self.ulysses, self.local)

    def joint(self, mod, q, text_k, text_v, k, v, heads: int, spec: AttentionSpec, row=None):
        """An MMDiT's joint attention under Ring / Ulysses: not built yet."""
        if self.n == 1:
            return attend_joint(spec, q, text_k, text_v, k, v, heads)
        raise NotImplementedError(
            "ring and ulysses do not run an MMDiT's joint attention yet (the text tokens' "
            "keys and values beside the image's); use sync_patch, distrifusion or pcpp"
        )

    def received_bytes(self, info, p):
        if self.n == 1:
            return 0
        return context_bytes(info["shape"], info["itemsize"], info["heads"], self.n, self.ulysses)


def padded_heads(heads: int, ulysses: int) -> int:
    """Heads after padding to a multiple of the Ulysses degree."""
    return -(-heads // ulysses) * ulysses


def ring_pairs(n: int, ulysses: int) -> list[tuple[int, int]]:
    """Source -> target of one ring hop: device g*u + j sends to ((g+1) mod r)*u + j."""
    r = n // ulysses
    return [(g * ulysses + j, (g + 1) % r * ulysses + j) for g in range(r) for j in range(ulysses)]


def _groups(n: int, ulysses: int) -> list[list[int]] | None:
    """Ulysses groups of consecutive patch indices (None: the whole axis, one group)."""
    if ulysses == n:
        return None
    return [list(range(g, g + ulysses)) for g in range(0, n, ulysses)]


def context_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    heads: int,
    spec: AttentionSpec,
    n: int,
    ulysses: int,
    local: bool = False,
) -> jax.Array:
    """Self-attention of the local queries over the keys/values of all n patches.
    q, k, v: (B, L, H*D) of this device's patch -> (B, L, H*D). `local`: stand-ins of the same
    shapes instead of collectives (compute-only timing)."""
    b, length, inner = q.shape
    d = inner // heads
    hp = padded_heads(heads, ulysses)
    r = n // ulysses
    qkv = jnp.stack([q, k, v]).reshape(3, b, length, heads, d)  # (3, B, L, H, D)
    if hp != heads:
        qkv = jnp.pad(qkv, ((0, 0),) * 3 + ((0, hp - heads), (0, 0)))
    if ulysses > 1:  # sequence-sharded -> head-sharded: (3, B, u*L, Hp/u, D)
        qkv = _all_to_all(qkv, split=3, concat=2, n=n, ulysses=ulysses, local=local)
    lh = hp // ulysses  # local heads
    qkv = qkv.reshape(qkv.shape[:3] + (lh * d,))  # (3, B, T, Hp/u * D), T = u*L
    q, kv = qkv[0], qkv[1:]
    if r == 1:
        out = attend(spec, q, kv[0], kv[1], lh)
    else:
        out = _ring(q, kv, lh, spec, n, ulysses, r, local)
    out = out.reshape(b, -1, lh, d)
    if ulysses > 1:  # head-sharded -> sequence-sharded: (B, L, Hp, D)
        out = _all_to_all(out, split=1, concat=2, n=n, ulysses=ulysses, local=local)
    return out[:, :, :heads].reshape(b, length, inner)


def _all_to_all(x, split: int, concat: int, n: int, ulysses: int, local: bool):
    if local:  # same shapes, no exchange
        parts = jnp.split(x, ulysses, axis=split)
        return jnp.concatenate(parts, axis=concat)
    with jax.named_scope("pp_kv"):
        return lax.all_to_all(
            x, PATCH, split, concat, axis_index_groups=_groups(n, ulysses), tiled=True
        )


def _ring(q, kv, heads: int, spec: AttentionSpec, n: int, ulysses: int, r: int, local: bool):
    """Online softmax over the r K/V blocks of the ring (Python-unrolled: r <= devices, and
    each hop is its own collective in the program, so its bytes are counted). With the `xla`
    kernel each hop's block is one whole-logits block (no inner loop: XLA's cost analysis
    counts a loop body once, so FLOP counts need it); otherwise the spec's block sizes."""
    whole = spec.impl == "xla"
    block_q = q.shape[1] if whole else spec.block_q
    block_kv = kv.shape[2] if whole else spec.block_kv
    state = OnlineSoftmax.start(q, heads, block_q)
    pairs = ring_pairs(n, ulysses)
    for hop in range(r):
        nxt = None
        if hop < r - 1:  # issued before this block's compute: free to overlap with it
            if local:
                nxt = kv
            else:
                with jax.named_scope("pp_kv"):
                    nxt = lax.ppermute(kv, PATCH, pairs)
        state = state.update(kv[0], kv[1], None, block_kv)
        kv = nxt
    return state.finish(q.dtype)


def context_bytes(q_shape: tuple[int, ...], itemsize: int, heads: int, n: int, ulysses: int) -> int:
    """Bytes one device receives for one context-parallel self-attention (every device the
    same): Ulysses' two all-to-alls ((u-1)/u of the stacked Q, K, V, then of the output, with
    padded heads), and r-1 ring hops of the (head-sharded) K/V."""
    b, length, inner = q_shape
    d = inner // heads
    hp = padded_heads(heads, ulysses)
    one = b * length * hp * d * itemsize  # one of Q, K, V or the output, padded, per device
    r = n // ulysses
    total = 0
    if ulysses > 1:
        total += (ulysses - 1) * (3 * one) // ulysses + (ulysses - 1) * one // ulysses
    total += (r - 1) * 2 * one  # after the all-to-all: u*L tokens of Hp/u heads = `one`
    return total


def check_degrees(patch: int, ring: int | None, ulysses: int | None, who: str) -> tuple[int, int]:
    """(ring, ulysses) degrees with ring x ulysses = patch; ValueError naming both and what fits."""
    for name, value in (("ring_degree", ring), ("ulysses_degree", ulysses)):
        if value is not None and (not isinstance(value, int) or value < 1 or patch % value):
            raise ValueError(
                f"{who}: {name}={value!r} must divide the patch axis ({patch} devices); "
                f"divisors: {divisors(patch)}"
            )
    if ring is not None and ulysses is not None and ring * ulysses != patch:
        raise ValueError(
            f"{who}: ring_degree={ring} x ulysses_degree={ulysses} = {ring * ulysses}, but the "
            f"patch axis has {patch} devices; give one of them (the other follows) or a pair "
            f"whose product is {patch}"
        )
    if ring is None:
        ring = patch // (ulysses or 1)
    return ring, patch // ring
