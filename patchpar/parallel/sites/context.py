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

Uneven patches (`rows`, `parallel.split`): every device's tokens are padded to the largest
patch's; after Ulysses' all-to-all a device holds its group's padded slabs in order, and a ring
block is a group's, so each block of keys carries the mask of its patches' own tokens (a
constant where one group holds every patch, else looked up by the group the block came from).

fp8 (or int8) on the wire (`codecs`, one per tensor of Q, K, V and the output O; cache-dit's
FP8 all-to-all sends Q, V and O in fp8 and K as it is): each coded tensor goes as
`codecs.to_rows` payloads, a scale per token and head (the last axis is a head's D channels),
so an all-to-all moves whole heads of codes and their scales together. The tensors of one
all-to-all that share a codec go in one collective; the ring passes the coded K/V blocks as
they were coded (each device codes its own once; the hops do not code again), and each device
attends its own block exactly. In the Ring x Ulysses hybrid the K/V decoded after the
all-to-all are coded again for the ring (two roundings), and a device's "own" ring block holds
its group's decoded tokens. The text heads an MMDiT gathers stay exact (S tokens, small).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.models.attention import AttentionSpec, OnlineSoftmax, attend, attend_joint
from patchpar.parallel.codecs import Codec, from_rows, rows_bytes, to_rows
from patchpar.parallel.mesh import PATCH, divisors
from patchpar.parallel.sites.common import PatchSite, note, stand_in

QKVO = ("q", "k", "v", "o")  # the tensors of a context-parallel attention on the wire
Codecs = tuple  # (Codec | None,) x 4, for Q, K, V, O (None: as it is)
EXACT: Codecs = (None,) * 4


@dataclass(frozen=True)
class ContextAttention(PatchSite):
    """Exact context-parallel self-attention: `ulysses` = the Ulysses degree (a divisor of n),
    ring degree = n / ulysses. No stale state: every phase is exact."""

    kind = "kv"
    ulysses: int = 1
    codecs: Codecs = EXACT  # Q, K, V, O on the wire (module docstring)

    def __post_init__(self):
        super().__post_init__()
        if self.ulysses < 1 or self.n % self.ulysses:
            raise ValueError(f"ulysses={self.ulysses} must divide the patch axis n={self.n}")

    def __call__(self, mod, q, k, v, heads: int, spec: AttentionSpec, row=None) -> jax.Array:
        note(self, shape=q.shape, itemsize=q.dtype.itemsize, heads=heads)
        if self.n == 1:
            return attend(spec, q, k, v, heads)
        return context_attention(
            q, k, v, heads, spec, self.n, self.ulysses, self.local, self.codecs,
            self._masks(q.shape[1]),
        )  # fmt: skip

    def _masks(self, length: int) -> jax.Array | None:
        """Uneven patches: (r, u * L) bool, the own tokens of each ring block (one group's slabs
        in order); None where the split is even."""
        split = self.split
        if split is None:
            return None
        own = split.gathered_mask(length).reshape(self.n // self.ulysses, -1)
        return jnp.asarray(own)

    def joint(self, mod, q, text_k, text_v, k, v, heads: int, spec: AttentionSpec, row=None):
        """An MMDiT's joint attention (`SiteOps.joint_attention`): the image tokens' Q/K/V go
        through Ulysses' all-to-alls and the ring as in `__call__`; the text tokens' (held
        whole by every device) take this device's heads locally, their K/V fold into every
        query's softmax once, and their output heads are all-gathered over the Ulysses group."""
        s = text_k.shape[1]
        note(self, shape=k.shape, itemsize=q.dtype.itemsize, heads=heads, text=s)
        if self.n == 1:
            return attend_joint(spec, q, text_k, text_v, k, v, heads)
        return joint_context_attention(
            q[:, :s], text_k, text_v, q[:, s:], k, v, heads, spec, self.n, self.ulysses,
            self.local, self.codecs, self._masks(k.shape[1]),
        )  # fmt: skip

    def received_bytes(self, info, p):
        if self.n == 1:
            return 0
        total = context_bytes(
            info["shape"], info["itemsize"], info["heads"], self.n, self.ulysses, self.codecs
        )
        if info.get("text") and self.ulysses > 1:  # the text output's heads, all-gathered
            b, _, inner = info["shape"]
            hp = padded_heads(info["heads"], self.ulysses)
            one = b * info["text"] * hp * (inner // info["heads"]) * info["itemsize"]
            total += (self.ulysses - 1) * one // self.ulysses
        return total

    def padding_bytes(self, info, p):
        """Uneven patches: of each received piece, the share that is its patches' padding (a
        ring block: its group's; an all-to-all's piece from member m: m's; the output's pieces
        are this device's own tokens)."""
        split = self.split
        if split is None or self.n == 1:  # (an MMDiT's text heads, gathered, are no padding)
            return 0
        b, length, inner = info["shape"]
        heads, u, n = info["heads"], self.ulysses, self.n
        r, d, hp = n // u, inner // heads, padded_heads(heads, u)
        pad = [length - c for c in split.counts(length)]

        def part(codec, tokens_padding, tokens):  # of one tensor's `one`, the padding's share
            return rows_bytes((b, length, hp, d), info["itemsize"], codec) * tokens_padding // (
                tokens)  # fmt: skip

        g, total = p // u, 0
        if u > 1:
            for m in range(g * u, g * u + u):
                if m == p:
                    continue
                # from member m: its tokens x my heads of Q, K, V (1/u each), then the output
                # of my own tokens x its heads
                total += sum(part(c, pad[m], u * length) for c in self.codecs[:3])
                total += part(self.codecs[3], pad[p], u * length)
        for hop in range(1, r):  # the block of group (g - hop) mod r: its u slabs' tokens
            src = (g - hop) % r
            share = sum(pad[src * u + j] for j in range(u))
            total += sum(part(c, share, u * length) for c in self.codecs[1:3])
        return total


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
    codecs: Codecs = EXACT,
    masks: jax.Array | None = None,
) -> jax.Array:
    """Self-attention of the local queries over the keys/values of all n patches.
    q, k, v: (B, L, H*D) of this device's patch -> (B, L, H*D). `local`: stand-ins of the same
    shapes instead of collectives (compute-only timing); `codecs`: Q, K, V, O on the wire;
    `masks`: (r, u * L) own tokens of each ring block (uneven patches; None: all)."""
    b, length, inner = q.shape
    d = inner // heads
    hp = padded_heads(heads, ulysses)
    r = n // ulysses
    qkv = jnp.stack([q, k, v]).reshape(3, b, length, heads, d)  # (3, B, L, H, D)
    if hp != heads:
        qkv = jnp.pad(qkv, ((0, 0),) * 3 + ((0, hp - heads), (0, 0)))
    if ulysses > 1:  # sequence-sharded -> head-sharded: (3, B, u*L, Hp/u, D)
        qkv = _all_to_all(qkv, 3, 2, n, ulysses, local, codecs[:3])
    lh = hp // ulysses  # local heads
    q, kv = qkv[0].reshape(qkv.shape[1:3] + (lh * d,)), qkv[1:]  # (B, T, Hp/u * D), T = u*L
    if r == 1:
        mask = None if masks is None else masks[0]
        out = attend(spec, q, *(a.reshape(q.shape) for a in kv), lh, mask)
    else:
        out = _ring(q, kv, lh, spec, n, ulysses, r, local, codecs=codecs[1:3], masks=masks)
    out = out.reshape(b, -1, lh, d)
    if ulysses > 1:  # head-sharded -> sequence-sharded: (B, L, Hp, D)
        out = _all_to_all(out[None], 2, 3, n, ulysses, local, codecs[3:])[0]
    return out[:, :, :heads].reshape(b, length, inner)


def joint_context_attention(tq, tk, tv, q, k, v, heads, spec, n, ulysses, local=False,
                            codecs: Codecs = EXACT, masks=None):  # fmt: skip
    """Joint attention of text queries tq and image queries q (this device's patch) over the
    text keys/values tk, tv (B, S, H*D, whole on every device) and the image's of all n
    patches: -> (B, S + L, H*D), text first. The image part is `context_attention`'s; each
    device computes its Ulysses heads of the text queries too, whose outputs are gathered."""
    b, length, inner = q.shape
    s, d = tq.shape[1], inner // heads
    hp = padded_heads(heads, ulysses)
    r = n // ulysses
    lh = hp // ulysses  # local heads
    qkv = jnp.stack([q, k, v]).reshape(3, b, length, heads, d)
    text = jnp.stack([tq, tk, tv]).reshape(3, b, s, heads, d)
    if hp != heads:
        pad = ((0, 0),) * 3 + ((0, hp - heads), (0, 0))
        qkv, text = jnp.pad(qkv, pad), jnp.pad(text, pad)
    if ulysses > 1:
        qkv = _all_to_all(qkv, 3, 2, n, ulysses, local, codecs[:3])
        j = 0 if local else lax.axis_index(PATCH) % ulysses  # this device's heads in its group
        text = lax.dynamic_slice_in_dim(text, j * lh, lh, axis=3)
    flat = qkv.reshape(qkv.shape[:3] + (lh * d,))  # (3, B, T, lh * D)
    text = text.reshape(3, b, s, lh * d)
    queries = jnp.concatenate([text[0], flat[0]], axis=1)  # (B, S + T, lh * D)
    if r == 1:
        keys = jnp.concatenate([text[1], flat[1]], axis=1)
        mask = None if masks is None else jnp.concatenate([jnp.ones((s,), bool), masks[0]])
        out = attend(spec, queries, keys, jnp.concatenate([text[2], flat[2]], axis=1), lh, mask)
    else:
        out = _ring(queries, qkv[1:], lh, spec, n, ulysses, r, local, first=text[1:],
                    codecs=codecs[1:3], masks=masks)  # fmt: skip
    out = out.reshape(b, -1, lh, d)
    t_out, i_out = out[:, :s], out[:, s:]
    if ulysses > 1:
        i_out = _all_to_all(i_out[None], 2, 3, n, ulysses, local, codecs[3:])[0]
        t_out = _gather_heads(t_out, n, ulysses, local)
    t_out = t_out[:, :, :heads].reshape(b, s, inner)
    return jnp.concatenate([t_out, i_out[:, :, :heads].reshape(b, length, inner)], axis=1)


def _gather_heads(x, n: int, ulysses: int, local: bool):
    """(B, S, lh, D) of this device's heads -> (B, S, u * lh, D) of its Ulysses group."""
    if local:
        return stand_in(jnp.concatenate([x] * ulysses, axis=2))
    with jax.named_scope("pp_kv"):
        return lax.all_gather(x, PATCH, axis=2, axis_index_groups=_groups(n, ulysses), tiled=True)


def _all_to_all(x, split: int, concat: int, n: int, ulysses: int, local: bool,
                codecs: Codecs = EXACT):  # fmt: skip
    """x: (k, B, tokens, heads, D), k stacked tensors (Q, K, V or the output) -> heads split
    over the Ulysses group, tokens concatenated. The tensors that share a codec (`codecs[i]`
    for x[i]) go in one all-to-all, coded (`to_rows`: codes and a scale per token and head)."""
    groups: dict[Codec | None, list[int]] = {}
    for i in range(x.shape[0]):
        groups.setdefault(codecs[i] if i < len(codecs) else None, []).append(i)
    out = [None] * x.shape[0]
    for codec, members in groups.items():
        part = x[jnp.asarray(members)] if len(members) < x.shape[0] else x
        wire = part if codec is None else to_rows(part, codec)
        if local:  # same shapes, no exchange
            got = stand_in(jnp.concatenate(jnp.split(wire, ulysses, axis=split), axis=concat))
        else:
            with jax.named_scope("pp_kv"):
                got = lax.all_to_all(
                    wire, PATCH, split, concat, axis_index_groups=_groups(n, ulysses), tiled=True
                )
        got = got if codec is None else from_rows(got, codec, x.dtype)
        for j, i in enumerate(members):
            out[i] = got[j]
    return jnp.stack(out)


def _ring(q, kv, heads: int, spec: AttentionSpec, n: int, ulysses: int, r: int, local: bool,
          first=None, codecs: Codecs = (None, None), masks=None):  # fmt: skip
    """Online softmax over the r K/V blocks of the ring (Python-unrolled: r <= devices, and
    each hop is its own collective in the program, so its bytes are counted). With the `xla`
    kernel each hop's block is one whole-logits block (no inner loop: XLA's cost analysis
    counts a loop body once, so FLOP counts need it); otherwise the spec's block sizes.
    kv: (2, B, T, heads, D); `codecs`: K's and V's on the wire (the blocks travel coded, as
    their owner coded them; the own block is attended exactly); `masks`: (r, T) the own tokens
    of each group's block (uneven patches), the block at hop h being group (g - h) mod r's."""
    b, t = kv.shape[1:3]
    own = kv.reshape(2, b, t, -1)
    k_codec, v_codec = codecs
    if k_codec == v_codec:  # one payload
        parts, kinds = [kv if k_codec is None else to_rows(kv, k_codec)], [(k_codec, (0, 1))]
    else:
        parts = [a if c is None else to_rows(a, c) for a, c in ((kv[0], k_codec), (kv[1], v_codec))]
        kinds = [(k_codec, (0,)), (v_codec, (1,))]

    def block(payloads):  # what was received -> (2, B, T, heads * D)
        out = []
        for w, (c, _) in zip(payloads, kinds, strict=True):
            x = w if c is None else from_rows(w, c, kv.dtype)
            out.append(x if x.ndim == 5 else x[None])
        return jnp.concatenate(out).reshape(2, b, t, -1)

    whole = spec.impl == "xla"
    block_q = q.shape[1] if whole else spec.block_q
    block_kv = t if whole else spec.block_kv
    state = OnlineSoftmax.start(q, heads, block_q)
    if first is not None:  # keys/values every device holds (an MMDiT's text): folded once
        state = state.update(first[0], first[1], None, first.shape[2] if whole else block_kv)
    pairs = ring_pairs(n, ulysses)
    for hop in range(r):
        nxt = None
        if hop < r - 1:  # issued before this block's compute: free to overlap with it
            if local:
                nxt = [stand_in(w) for w in parts]
            else:
                with jax.named_scope("pp_kv"):
                    nxt = [lax.ppermute(w, PATCH, pairs) for w in parts]
        cur = own if hop == 0 else block(parts)
        mask = None
        if masks is not None:  # the group this block came from
            g = 0 if local else lax.axis_index(PATCH) // ulysses
            mask = masks[(g - hop) % r]
        state = state.update(cur[0], cur[1], mask, block_kv)
        parts = nxt
    return state.finish(q.dtype)


def context_bytes(q_shape: tuple[int, ...], itemsize: int, heads: int, n: int, ulysses: int,
                  codecs: Codecs = EXACT) -> int:  # fmt: skip
    """Bytes one device receives for one context-parallel self-attention (every device the
    same): Ulysses' two all-to-alls ((u-1)/u of the stacked Q, K, V, then of the output, with
    padded heads; one all-to-all per codec among them), and r-1 ring hops of the
    (head-sharded) K/V; a coded tensor is `rows_bytes` of its (tokens, heads, D)."""
    b, length, inner = q_shape
    d = inner // heads
    hp = padded_heads(heads, ulysses)
    r = n // ulysses

    def one(codec):  # one of Q, K, V or the output, padded, per device, on the wire
        return rows_bytes((b, length, hp, d), itemsize, codec)

    total = 0
    if ulysses > 1:
        for tensors in (codecs[:3], codecs[3:]):
            for codec in set(tensors):
                size = one(codec) * tensors.count(codec)
                total += (ulysses - 1) * size // ulysses
    # after the all-to-all: u*L tokens of Hp/u heads = `one`
    total += (r - 1) * (one(codecs[1]) + one(codecs[2]))
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
