"""Text conditioning stacked over the guidance axis, and the model call on that stack."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Conditioning:
    """Text conditioning stacked over a leading guidance axis G: [unconditional, conditional]
    with CFG (G = 2), [conditional] without (G = 1). `extras` are the model family's other
    keyword inputs, each (G, B, ...): SDXL's `text_embeds` (pooled text) and `time_ids` (size
    and crop); PixArt's `encoder_attention_mask` (the text's real tokens), `resolution` and
    `aspect_ratio` (micro-conditions)."""

    context: jax.Array  # (G, B, S, D)
    extras: dict = struct.field(default_factory=dict)

    @property
    def text_embeds(self) -> jax.Array | None:  # (G, B, P) SDXL
        return self.extras.get("text_embeds")

    @property
    def time_ids(self) -> jax.Array | None:  # (G, B, 6) SDXL
        return self.extras.get("time_ids")

    def added(self) -> dict:
        """The extras as the model call's keyword arguments."""
        return dict(self.extras)


def call_on_stack(apply: Callable, x: jax.Array, t: jax.Array, cond: Conditioning):
    """apply(xs (G*B, ...), ts (G*B,), context (G*B, S, D), **added) on every guidance half of
    `cond` at once. x: (B, h, W, C) -> (G, B, h, W, C), plus whatever else `apply` returns."""
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    xs = jnp.broadcast_to(x[None], (g,) + x.shape).reshape((g * b,) + x.shape[1:])
    added = {k: flat(v) for k, v in cond.added().items()}
    res = apply(xs, jnp.broadcast_to(t, (g * b,)), flat(cond.context), **added)
    out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
    out = out.reshape((g, b) + out.shape[1:])
    return (out, *rest) if rest else out
