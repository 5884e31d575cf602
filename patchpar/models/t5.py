"""Flax T5 encoder (transformers' `T5EncoderModel` layout): the text encoder of PixArt-α/Σ,
FLUX.1 and SD3; with a relative position bias in every block, umT5's (`UMT5EncoderModel`, Wan's).

transformers 5 has no Flax T5, so it is written here from the architecture: token embedding
(`shared`), blocks of RMS-normed self-attention and feed-forward with residuals, a final RMS
norm. T5's attention does not scale q·k by 1/sqrt(d) and adds a learned *relative position
bias* instead of position embeddings: one (buckets, heads) table owned by the first block's
attention, computed once per call and added in every block (umT5: each block its own table,
`bias_per_layer`). Relative distances go to buckets
exactly up to half the bucket range and logarithmically beyond, up to `max_distance`, where
they saturate; the encoder's buckets are bidirectional (the sign takes half of them).
Feed-forward: `relu` (wi, wo) or gated (`gated-gelu`: gelu_new(wi_0 x) * wi_1 x, then wo).
Padding tokens are masked out as keys; their own outputs are computed but meaningless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

_ACTS = {
    "relu": jax.nn.relu,
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
}
ARCHITECTURES = ("T5EncoderModel", "T5ForConditionalGeneration", "T5Model")
UMT5_ARCHITECTURES = ("UMT5EncoderModel", "UMT5ForConditionalGeneration", "UMT5Model")


@dataclass(frozen=True)
class T5Config:
    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "gelu_new"
    is_gated_act: bool = True
    pad_token_id: int = 0
    eos_token_id: int = 1
    bias_per_layer: bool = False  # umT5: every block its own relative position bias table

    @classmethod
    def from_transformers(cls, cfg: dict, where: str = "text_encoder/config.json") -> T5Config:
        """A transformers T5 config.json (the encoder's part); unsupported values raise."""
        umt5 = cfg.get("model_type") == "umt5"
        known = UMT5_ARCHITECTURES if umt5 else ARCHITECTURES
        arch = (cfg.get("architectures") or [known[0]])[0]
        if arch not in known or cfg.get("model_type", "t5") not in ("t5", "umt5"):
            raise ValueError(
                f"{where}: architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not "
                f"a T5 encoder (nor a umT5 one; supported: {list(ARCHITECTURES + UMT5_ARCHITECTURES)})"
            )
        proj = cfg.get("feed_forward_proj", "relu")
        parts = proj.split("-")
        gated = parts[0] == "gated"
        if len(parts) > 2 or (len(parts) == 2 and not gated):
            raise ValueError(
                f"{where}: feed_forward_proj={proj!r}: expected 'ACT' or 'gated-ACT' "
                f"(e.g. 'relu', 'gated-gelu')"
            )
        act = "gelu_new" if proj == "gated-gelu" else parts[-1]  # as transformers maps it
        if act not in _ACTS:
            raise ValueError(
                f"{where}: feed_forward_proj={proj!r}: activation {act!r} not supported "
                f"(supported: {sorted(_ACTS)})"
            )
        return cls(
            vocab_size=cfg.get("vocab_size", 32128),
            d_model=cfg.get("d_model", 512),
            d_kv=cfg.get("d_kv", 64),
            d_ff=cfg.get("d_ff", 2048),
            num_layers=cfg.get("num_layers", 6),
            num_heads=cfg.get("num_heads", 8),
            relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
            layer_norm_epsilon=cfg.get("layer_norm_epsilon", 1e-6),
            dense_act_fn=act,
            is_gated_act=gated,
            pad_token_id=cfg.get("pad_token_id", 0),
            eos_token_id=cfg.get("eos_token_id", 1),
            bias_per_layer=umt5,
        )


def relative_position_buckets(
    queries: int, keys: int, num_buckets: int, max_distance: int
) -> jax.Array:
    """(queries, keys) int32 bucket of each key position relative to each query position,
    bidirectional (the encoder's): distances below a quarter of `num_buckets` get a bucket
    each, larger ones share log-spaced buckets up to `max_distance`, beyond which they
    saturate; positive and negative distances use separate halves."""
    rel = jnp.arange(keys)[None, :] - jnp.arange(queries)[:, None]  # key - query
    half = num_buckets // 2
    bucket = jnp.where(rel > 0, half, 0)
    dist = jnp.abs(rel)
    exact = half // 2
    # log-spaced beyond `exact` (the float log of 0 on the exact side is discarded by where)
    far = exact + (
        jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / exact)
        / math.log(max_distance / exact)
        * (half - exact)
    ).astype(jnp.int32)
    far = jnp.minimum(far, half - 1)
    return (bucket + jnp.where(dist < exact, dist, far)).astype(jnp.int32)


class RMSNorm(nn.Module):
    """T5LayerNorm: x / sqrt(mean(x^2) + eps) * scale, no mean, no bias; float32 statistics."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        return (x32 * jax.lax.rsqrt(var + self.epsilon)).astype(self.dtype) * scale


def _linear(features: int, name: str, dtype) -> nn.Dense:
    return nn.Dense(features, use_bias=False, dtype=dtype, param_dtype=dtype, name=name)


class T5SelfAttention(nn.Module):
    """q, k, v, o without biases; logits = q·k (unscaled) + position bias, padded keys masked."""

    config: T5Config
    has_relative_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, keep, bias):  # x (B, S, D), keep (B, S) bool, bias (1, H, S, S) | None
        cfg = self.config
        b, s, _ = x.shape
        inner = cfg.num_heads * cfg.d_kv

        def heads(t):  # (B, S, H*d) -> (B, S, H, d)
            return t.reshape(b, s, cfg.num_heads, cfg.d_kv)

        q = heads(_linear(inner, "q", self.dtype)(x))
        k = heads(_linear(inner, "k", self.dtype)(x))
        v = heads(_linear(inner, "v", self.dtype)(x))
        if self.has_relative_bias:
            table = nn.Embed(
                cfg.relative_attention_num_buckets,
                cfg.num_heads,
                dtype=self.dtype,
                param_dtype=self.dtype,
                name="relative_attention_bias",
            )
            buckets = relative_position_buckets(
                s, s, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
            )
            bias = table(buckets).transpose(2, 0, 1)[None]  # (1, H, S, S)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        logits = logits + bias.astype(jnp.float32)
        logits = jnp.where(keep[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, inner)
        return _linear(cfg.d_model, "o", self.dtype)(out), bias


class T5FeedForward(nn.Module):
    config: T5Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        cfg, act = self.config, _ACTS[self.config.dense_act_fn]
        if cfg.is_gated_act:
            h = act(_linear(cfg.d_ff, "wi_0", self.dtype)(x)) * _linear(
                cfg.d_ff, "wi_1", self.dtype
            )(x)
        else:
            h = act(_linear(cfg.d_ff, "wi", self.dtype)(x))
        return _linear(cfg.d_model, "wo", self.dtype)(h)


class _AttentionLayer(nn.Module):  # transformers' T5LayerSelfAttention: norm, attention, residual
    config: T5Config
    has_relative_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, keep, bias):
        cfg = self.config
        h = RMSNorm(cfg.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        out, bias = T5SelfAttention(cfg, self.has_relative_bias, self.dtype, name="SelfAttention")(
            h, keep, bias
        )
        return x + out, bias


class _FeedForwardLayer(nn.Module):  # T5LayerFF: norm, feed-forward, residual
    config: T5Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        h = RMSNorm(cfg.layer_norm_epsilon, self.dtype, name="layer_norm")(x)
        return x + T5FeedForward(cfg, self.dtype, name="DenseReluDense")(h)


class _Block(nn.Module):
    config: T5Config
    has_relative_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, keep, bias):
        x, bias = _AttentionLayer(self.config, self.has_relative_bias, self.dtype, name="layer_0")(
            x, keep, bias
        )
        return _FeedForwardLayer(self.config, self.dtype, name="layer_1")(x), bias


class _Encoder(nn.Module):
    config: T5Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, keep):
        bias = None  # the first block computes it; every block adds the same (umT5: its own)
        for i in range(self.config.num_layers):
            own = i == 0 or self.config.bias_per_layer
            x, bias = _Block(self.config, own, self.dtype, name=f"block_{i}")(x, keep, bias)
        return RMSNorm(self.config.layer_norm_epsilon, self.dtype, name="final_layer_norm")(x)


class T5EncoderModel(nn.Module):
    """`(input_ids (B, S), attention_mask (B, S) | None)` -> {"last_hidden_state": (B, S, D)}."""

    config: T5Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> dict:
        cfg = self.config
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, dtype=self.dtype, param_dtype=self.dtype, name="shared"
        )
        keep = (
            jnp.ones(input_ids.shape, bool)
            if attention_mask is None
            else attention_mask.astype(bool)
        )
        hidden = _Encoder(cfg, self.dtype, name="encoder")(embed(input_ids), keep)
        return {"last_hidden_state": hidden}
