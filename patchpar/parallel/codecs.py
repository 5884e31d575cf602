"""Codecs for compressed exchange (docs/design.md §2b): what a compressed site puts on the wire.

A codec turns an activation into one flat `uint8` payload (packed codes plus the bytes of its
scales) and back. Payloads travel as `uint8`, so the compiled program's collectives count
exactly the bytes the codec sends, and `payload_bytes` counts them analytically.

An activation is seen as G matrices of N tokens x C channels: `lead` leading axes are the
batch of matrices (K/V's (2, B): keys and values of each image apart; a halo's (B,)), the last
axis the channels, the rest tokens. Scales are float16 (clipped to its range), but the
per-token codecs' of `to_rows` (bfloat16: no activation is too large for them).

| name | codes | scales | bytes per matrix |
|---|---|---|---|
| `none` | the activation itself | - | N C x itemsize |
| `int8` | round(x / s) in [-127, 127] | per token: max abs / 127 | N C + 2 N |
| `fp8` | x / s in float8 e4m3 | per token: max abs / 448 | N C + 2 N |
| `fp8-e5m2` | x / s in float8 e5m2 | per token: max abs / 57344 | N C + 2 N |
| `int4` | round((x - min) / s) in [0, 15] | per channel: min and (max - min) / 15 | N C / 2 + 4 C |
| `int2` | 4 levels {-2, -1/2, 1/2, 2} x S | rank-1 S = u v^T of abs(x) | N C / 4 + 2 (N + C) |
| `sign1` | sign(x) x S | rank-1 S = u v^T of abs(x) | N C / 8 + 2 (N + C) |
| `lowrank-r` | x ~ P Q^T, P (N, r), Q (C, r) | - | 2 r (N + C) |

The fp8 codecs scale each token into the format's finite range (its largest value, 448 for
e4m3, 57344 for e5m2, is the token's largest magnitude), so no value overflows however large the
activations are; e4m3 keeps 3 mantissa bits over a 2^17 range below the largest value, e5m2 2
bits over 2^31 (for tokens whose channels span more). `int8`, `fp8` and `fp8-e5m2` are also
the codecs of an exact strategy's `wire` (`to_rows`: stateless, each row's codes and its
scale's two bytes side by side, so the payload keeps every axis but the last and goes through
all-to-alls, ring hops and gathers as the activation would).

`int2` and `sign1` follow CompactFusion (arXiv 2507.17511): signs or 2-bit levels times a rank-1
approximation of |x|, found by two power iterations from the channel means (the Perron vectors
of a non-negative matrix). The 2-bit levels are near the Lloyd-Max quantiser of a Laplacian in
units of its mean absolute value (±0.59, ±2.59, thresholds ±1.59). `lowrank-r` is one
PowerSGD step (Vogels et al., NeurIPS 2019): P = orth(X Q), Q = X^T P, with Q warm-started from
the previous step's (the sender's state `q`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

NAMES = ("none", "int8", "fp8", "fp8-e5m2", "int4", "int2", "sign1", "lowrank-r")
FP8 = {"fp8": jnp.float8_e4m3fn, "fp8-e5m2": jnp.float8_e5m2}
ROWS = ("int8", "fp8", "fp8-e5m2")  # per-token codecs: an exact strategy's `wire` (`to_rows`)
WIRE = ("none", *ROWS)  # what an exact strategy's `wire` takes
SCALE = jnp.float16  # the dtype of the scales on the wire (but `to_rows`')
ROW_SCALE = jnp.bfloat16  # `to_rows`' per-row scales: float32's range
_F16_MAX = float(np.finfo(np.float16).max)
_INT2_LEVELS = (-2.0, -0.5, 0.5, 2.0)  # x S, codes 0..3
_INT2_CUT = 1.25  # |x| / S above which a value takes the outer level


@dataclass(frozen=True)
class Codec:
    """One codec by name (`parse`): `bits` per code (0: `none`, raw), `rank` for `lowrank`."""

    name: str = "none"
    rank: int = 0

    @property
    def exact(self) -> bool:
        return self.name == "none"

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "int2": 2, "sign1": 1}.get(self.name, 8 * (self.name in FP8))

    def __str__(self) -> str:
        return f"lowrank-{self.rank}" if self.name == "lowrank" else self.name

    # ------------------------------------------------------------------ sizes

    def payload_bytes(self, shape: tuple[int, ...], itemsize: int, lead: int) -> int:
        """Bytes on the wire for one activation of `shape` (`itemsize` bytes per element)."""
        g, n, c = matrices(shape, lead)
        if self.exact:
            return g * n * c * itemsize
        if self.name == "lowrank":
            return g * 2 * self.rank * (n + c)
        codes = math.ceil(g * n * c * self.bits / 8)
        return codes + 2 * g * self._scales(n, c)

    def _scales(self, n: int, c: int) -> int:
        """float16 scales per matrix."""
        return {"int8": n, "fp8": n, "fp8-e5m2": n, "int4": 2 * c}.get(self.name, n + c)

    def check(self, shape: tuple[int, ...], lead: int, where: str) -> None:
        """A low rank must fit the matrices it compresses; ValueError naming them."""
        if self.name != "lowrank":
            return
        _, n, c = matrices(shape, lead)
        if self.rank > min(n, c):
            raise ValueError(
                f"codec lowrank-{self.rank}: {where} compresses {n} x {c} matrices (tokens x "
                f"channels), whose rank is at most {min(n, c)}; use lowrank-r with r <= "
                f"{min(n, c)}"
            )

    # ------------------------------------------------------------------ encode / decode

    def init_state(self, shape: tuple[int, ...], lead: int) -> jax.Array | None:
        """The sender's codec state before its first encode: lowrank's Q (G, C, r), orthonormal
        columns from a fixed key (the same on every device); None for the others."""
        if self.name != "lowrank":
            return None
        g, _, c = matrices(shape, lead)
        q = jax.random.normal(jax.random.key(0), (c, self.rank), jnp.float32)
        q, _ = jnp.linalg.qr(q)
        return jnp.broadcast_to(q, (g, c, self.rank))

    def encode(self, x: jax.Array, lead: int, state=None) -> tuple[jax.Array, jax.Array | None]:
        """x -> (flat uint8 payload, the sender's new codec state)."""
        g, n, c = matrices(x.shape, lead)
        m = x.reshape(g, n, c).astype(jnp.float32)
        if self.name == "lowrank":
            p, q = jax.vmap(_power_step)(m, state)
            return jnp.concatenate([_f16_bytes(p), _f16_bytes(q)]), q
        if self.name in FP8:
            return to_rows(m, self).reshape(-1), None
        if self.name == "int8":
            s = jnp.max(jnp.abs(m), axis=2, keepdims=True) / 127  # (G, N, 1)
            s = _f16(s)
            q = jnp.round(m / _safe(s)).clip(-127, 127).astype(jnp.int8)
            return jnp.concatenate(
                [lax.bitcast_convert_type(q, jnp.uint8).reshape(-1), _f16_bytes(s)]
            ), None
        if self.name == "int4":
            lo = _f16(jnp.min(m, axis=1, keepdims=True))  # (G, 1, C)
            s = _f16((jnp.max(m, axis=1, keepdims=True) - lo) / 15)
            q = jnp.round((m - lo) / _safe(s)).clip(0, 15).astype(jnp.uint8)
            return jnp.concatenate([pack(q, 4), _f16_bytes(lo), _f16_bytes(s)]), None
        u, v = jax.vmap(_rank1)(jnp.abs(m))  # (G, N), (G, C)
        u, v = _f16(u), _f16(v)
        scale = u[:, :, None] * v[:, None, :]
        if self.name == "sign1":
            q = (m >= 0).astype(jnp.uint8)
        else:  # int2
            r = m / _safe(scale)
            q = (
                jnp.where(r >= 0, 2, 1)
                + jnp.where(r >= _INT2_CUT, 1, 0)
                - jnp.where(r < -_INT2_CUT, 1, 0)
            )
            q = q.astype(jnp.uint8)
        return jnp.concatenate([pack(q, self.bits), _f16_bytes(u), _f16_bytes(v)]), None

    def decode(self, payload: jax.Array, shape: tuple[int, ...], dtype, lead: int) -> jax.Array:
        """A flat uint8 payload -> the activation of `shape` and `dtype` it stands for."""
        g, n, c = matrices(shape, lead)
        if self.name == "lowrank":
            p, q = _split(payload, [(g, n, self.rank), (g, c, self.rank)])
            m = jnp.einsum("gnr,gcr->gnc", p, q)
        elif self.name in FP8:
            m = from_rows(payload.reshape(g, n, c + 2), self, jnp.float32)
        elif self.name == "int8":
            codes, (s,) = _cut(payload, g * n * c, [(g, n, 1)])
            q = lax.bitcast_convert_type(codes, jnp.int8).reshape(g, n, c)
            m = q.astype(jnp.float32) * s
        elif self.name == "int4":
            codes, (lo, s) = _cut(payload, math.ceil(g * n * c / 2), [(g, 1, c), (g, 1, c)])
            m = unpack(codes, 4, g * n * c).reshape(g, n, c).astype(jnp.float32) * s + lo
        else:
            codes, (u, v) = _cut(payload, math.ceil(g * n * c * self.bits / 8), [(g, n), (g, c)])
            q = unpack(codes, self.bits, g * n * c).reshape(g, n, c)
            scale = u[:, :, None] * v[:, None, :]
            if self.name == "sign1":
                m = jnp.where(q == 1, scale, -scale)
            else:
                m = jnp.asarray(_INT2_LEVELS, jnp.float32)[q] * scale
        return m.reshape(shape).astype(dtype)


def parse(name: str) -> Codec:
    """A codec from its name (`int2`, `lowrank-4`, ...); ValueError listing the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"codec {name!r} is not a name; known: {list(NAMES)}")
    if m := re.fullmatch(r"lowrank-(-?\d+)", name):
        rank = int(m.group(1))
        if rank <= 0:
            raise ValueError(f"codec {name!r}: the rank r of lowrank-r must be >= 1, got {rank}")
        return Codec("lowrank", rank)
    if name not in NAMES or name == "lowrank-r":
        raise ValueError(f"unknown codec {name!r}; known: {list(NAMES)} (r a rank >= 1)")
    return Codec(name)


def wire_codec(name: str, where: str) -> Codec | None:
    """A codec for an exact strategy's wire (`ROWS`; `none`: None), or a ValueError naming
    `where` and the codecs that fit (`WIRE`: only those, whatever was given)."""
    if name in WIRE:
        return None if name == "none" else Codec(name)
    try:
        parse(name)
    except ValueError:
        raise ValueError(f"{where}: unknown codec {name!r}; the wire takes {list(WIRE)}") from None
    raise ValueError(
        f"{where}: codec {name!r} keeps state between steps or scales over many tokens; an "
        f"exact strategy's wire takes a per-token codec: {list(WIRE)}"
    )


def wire_codecs(spec: str, kinds: tuple[str, ...], who: str) -> dict[str, Codec]:
    """An exact strategy's `wire` option -> {tensor or site kind: codec} of those coded: one
    codec for all of `kinds` (`fp8`), or kind=codec pairs (`q=fp8,v=fp8,o=fp8`; the kinds
    not named go as they are); ValueError naming what is wrong and what fits."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{who}: wire={spec!r}: give a codec name or kind=codec pairs")
    where = f"{who}: wire={spec!r}"
    if "=" not in spec:
        codec = wire_codec(spec.strip(), where)
        return {} if codec is None else dict.fromkeys(kinds, codec)
    out: dict[str, Codec] = {}
    for part in spec.split(","):
        kind, _, name = (p.strip() for p in part.partition("="))
        if kind not in kinds or kind in out:
            why = "named twice" if kind in out else f"unknown {kind!r}"
            raise ValueError(f"{where}: {why}; {who} sends {list(kinds)} (e.g. {kinds[0]}=fp8)")
        codec = wire_codec(name, where)
        if codec is not None:
            out[kind] = codec
    return out


def to_rows(x: jax.Array, codec: Codec) -> jax.Array:
    """(..., C) -> (..., C + 2) uint8: each row's codes, then the two bytes of its bfloat16
    scale (the row's largest magnitude at the format's largest value, rounded up: nothing
    overflows, and a bfloat16 scale has float32's range, so no activation is too large)."""
    m = x.astype(jnp.float32)
    top = 127.0 if codec.name == "int8" else float(jnp.finfo(FP8[codec.name]).max)
    s = jnp.max(jnp.abs(m), axis=-1, keepdims=True) / top
    s = (s * (1 + 2**-7)).astype(ROW_SCALE).astype(jnp.float32)  # >= s: rounded to nearest
    r = jnp.clip(m / _safe(s), -top, top)
    q = jnp.round(r).astype(jnp.int8) if codec.name == "int8" else r.astype(FP8[codec.name])
    codes = lax.bitcast_convert_type(q, jnp.uint8)
    scale = lax.bitcast_convert_type(s.astype(ROW_SCALE), jnp.uint8)  # (..., 1, 2)
    return jnp.concatenate([codes, scale.reshape(s.shape[:-1] + (2,))], axis=-1)


def from_rows(w: jax.Array, codec: Codec, dtype) -> jax.Array:
    """`to_rows`'s payload (..., C + 2) -> the (..., C) activation in `dtype`."""
    kind = jnp.int8 if codec.name == "int8" else FP8[codec.name]
    q = lax.bitcast_convert_type(w[..., :-2], kind).astype(jnp.float32)
    pairs = w[..., -2:].reshape(w.shape[:-1] + (1, 2))
    s = lax.bitcast_convert_type(pairs, ROW_SCALE).astype(jnp.float32)  # (..., 1)
    return (q * s).astype(dtype)


def rows_bytes(shape: tuple[int, ...], itemsize: int, codec: Codec | None) -> int:
    """Bytes of an activation of `shape` on an exact strategy's wire (None: as it is)."""
    if codec is None:
        return math.prod(shape) * itemsize
    return math.prod(shape[:-1]) * (shape[-1] * codec.bits // 8 + 2)


def matrices(shape: tuple[int, ...], lead: int) -> tuple[int, int, int]:
    """(G, N, C): `lead` leading axes form G matrices of N tokens x C channels."""
    return math.prod(shape[:lead]), math.prod(shape[lead:-1]), shape[-1]


# ---------------------------------------------------------------------- bits and bytes


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Codes < 2**bits -> a flat uint8 array, 8 / bits codes per byte, low bits first (the last
    byte padded with zeros)."""
    per = 8 // bits
    flat = codes.reshape(-1).astype(jnp.uint8)
    flat = jnp.pad(flat, (0, -flat.size % per)).reshape(-1, per)
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    return jnp.sum(flat << shifts, axis=1, dtype=jnp.uint8)  # the bit fields do not overlap


def unpack(packed: jax.Array, bits: int, count: int) -> jax.Array:
    """The first `count` codes of a `pack`ed array, flat."""
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * bits
    codes = (packed[:, None] >> shifts) & jnp.uint8((1 << bits) - 1)
    return codes.reshape(-1)[:count]


def _f16(x: jax.Array) -> jax.Array:
    """Rounded to float16 (clipped to its range), kept float32 for the arithmetic: sender and
    receiver then scale by the very values on the wire."""
    return jnp.clip(x, -_F16_MAX, _F16_MAX).astype(SCALE).astype(jnp.float32)


def _f16_bytes(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x.astype(SCALE), jnp.uint8).reshape(-1)


def _safe(s: jax.Array) -> jax.Array:
    """A divisor: 1 where the scale is 0 (every code is then 0, and so is its value)."""
    return jnp.where(s == 0, 1.0, s)


def _split(payload: jax.Array, shapes: list[tuple[int, ...]]) -> list[jax.Array]:
    """float16 arrays of `shapes`, laid one after another in `payload`, as float32."""
    out, at = [], 0
    for shape in shapes:
        size = 2 * math.prod(shape)
        pairs = payload[at : at + size].reshape(-1, 2)
        out.append(lax.bitcast_convert_type(pairs, SCALE).reshape(shape).astype(jnp.float32))
        at += size
    return out


def _cut(payload, code_bytes: int, scale_shapes):
    """(codes, [scales]) of a payload laid out as codes, then float16 scales."""
    return payload[:code_bytes], _split(payload[code_bytes:], scale_shapes)


def _rank1(a: jax.Array, iters: int = 2) -> tuple[jax.Array, jax.Array]:
    """A rank-1 approximation u v^T of a non-negative (N, C) matrix: power iterations from the
    channel means (u: (N,), v: (C,), both non-negative)."""
    v = jnp.mean(a, axis=0)
    u = jnp.ones(a.shape[0], a.dtype)
    for _ in range(iters):
        u = a @ v / jnp.maximum(v @ v, 1e-30)
        v = u @ a / jnp.maximum(u @ u, 1e-30)
    return u, v


def _power_step(m: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One PowerSGD step on (N, C) from (C, r): P orthonormal (N, r), Q = M^T P (C, r)."""
    p, _ = jnp.linalg.qr(m @ q)
    return p, m.T @ p
