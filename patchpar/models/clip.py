"""Flax CLIP text encoders (transformers' CLIPTextModel / CLIPTextModelWithProjection layout)."""

from __future__ import annotations

from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp

from patchpar.models.layers import dense

_ACTS = {
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}
ARCHITECTURES = ("CLIPTextModel", "CLIPTextModelWithProjection")


@dataclass(frozen=True)
class CLIPTextConfig:
    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407
    projection_dim: int | None = None  # set for CLIPTextModelWithProjection

    @classmethod
    def from_transformers(
        cls, cfg: dict, where: str = "text_encoder/config.json"
    ) -> CLIPTextConfig:
        arch = (cfg.get("architectures") or ["CLIPTextModel"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{where}: architecture {arch!r} not supported (supported: {list(ARCHITECTURES)})"
            )
        act = cfg.get("hidden_act", "quick_gelu")
        if act not in _ACTS:
            raise ValueError(
                f"{where}: hidden_act={act!r} not supported (supported: {sorted(_ACTS)})"
            )
        return cls(
            vocab_size=cfg.get("vocab_size", 49408),
            hidden_size=cfg.get("hidden_size", 512),
            intermediate_size=cfg.get("intermediate_size", 2048),
            num_hidden_layers=cfg.get("num_hidden_layers", 12),
            num_attention_heads=cfg.get("num_attention_heads", 8),
            max_position_embeddings=cfg.get("max_position_embeddings", 77),
            hidden_act=act,
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-5),
            eos_token_id=cfg.get("eos_token_id", 2),
            projection_dim=cfg.get("projection_dim")
            if arch == "CLIPTextModelWithProjection"
            else None,
        )


class EncoderLayer(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:  # (B, S, D)
        cfg, dt = self.config, self.dtype

        def ln(name: str) -> nn.LayerNorm:
            return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=dt, param_dtype=dt, name=name)

        h = ln("layer_norm1")(x)
        h = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, dt, name="self_attn")(h, mask)
        x = x + h
        h = ln("layer_norm2")(x)
        h = MLP(cfg.intermediate_size, cfg.hidden_size, cfg.hidden_act, dt, name="mlp")(h)
        return x + h


class SelfAttention(nn.Module):
    dim: int
    heads: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        q = dense(self.dim, "q_proj", self.dtype)(x)
        k = dense(self.dim, "k_proj", self.dtype)(x)
        v = dense(self.dim, "v_proj", self.dtype)(x)
        b, s, _ = x.shape
        d = self.dim // self.heads
        split = lambda t: t.reshape(b, s, self.heads, d)  # noqa: E731
        logits = jnp.einsum(
            "bqhd,bkhd->bhqk", split(q), split(k), preferred_element_type=jnp.float32
        )
        logits = jnp.where(mask, logits * d**-0.5, jnp.finfo(jnp.float32).min)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1).astype(v.dtype), split(v))
        return dense(self.dim, "out_proj", self.dtype)(out.reshape(b, s, self.dim))


class MLP(nn.Module):
    inner: int
    dim: int
    act: str
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return dense(self.dim, "fc2", self.dtype)(
            _ACTS[self.act](dense(self.inner, "fc1", self.dtype)(x))
        )


class TextTransformer(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> dict[str, jax.Array]:
        cfg, dt = self.config, self.dtype
        b, s = input_ids.shape
        x = _Embeddings(cfg, dt, name="embeddings")(input_ids)  # (B, S, D)
        hidden = _Encoder(cfg, dt, name="encoder")(x)  # L + 1 x (B, S, D)
        x = hidden[-1]
        last = nn.LayerNorm(
            epsilon=cfg.layer_norm_eps, dtype=dt, param_dtype=dt, name="final_layer_norm"
        )(x)
        if cfg.eos_token_id == 2:  # legacy configs: the EOS token has the largest id
            eos = jnp.argmax(input_ids, axis=-1)
        else:
            eos = jnp.argmax(input_ids == cfg.eos_token_id, axis=-1)
        pooled = last[jnp.arange(b), eos]  # (B, D)
        return {"last_hidden_state": last, "pooler_output": pooled, "hidden_states": tuple(hidden)}


class _Encoder(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, ...]:
        s = x.shape[1]
        mask = jnp.tril(jnp.ones((s, s), bool))[None, None]  # causal, (1, 1, S, S)
        hidden = [x]
        for i in range(self.config.num_hidden_layers):
            hidden.append(
                EncoderLayer(self.config, self.dtype, name=f"layers_{i}")(hidden[-1], mask)
            )
        return tuple(hidden)


class _Embeddings(nn.Module):
    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> jax.Array:  # (B, S) -> (B, S, D)
        cfg, dt = self.config, self.dtype
        if input_ids.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"{input_ids.shape[1]} tokens, but the text encoder takes at most {cfg.max_position_embeddings}"
            )
        tok = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt, name="token_embedding"
        )
        pos = nn.Embed(
            cfg.max_position_embeddings,
            cfg.hidden_size,
            dtype=dt,
            param_dtype=dt,
            name="position_embedding",
        )
        return tok(input_ids) + pos(jnp.arange(input_ids.shape[1]))[None]


class CLIPTextModel(nn.Module):
    """Returns last_hidden_state (B,S,D), pooler_output (B,D), hidden_states (tuple of L+1 x (B,S,D),
    hidden_states[-2] is SDXL's penultimate layer) and, with a projection, text_embeds (B,P)."""

    config: CLIPTextConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: jax.Array) -> dict[str, jax.Array]:
        out = TextTransformer(self.config, self.dtype, name="text_model")(input_ids)
        if self.config.projection_dim is not None:
            proj = dense(self.config.projection_dim, "text_projection", self.dtype, use_bias=False)
            out["text_embeds"] = proj(out["pooler_output"])
        return out
