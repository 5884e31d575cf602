"""What every family's denoiser (`family.Denoiser`) shares: a frozen dataclass over its Flax
module (`module`), whose config, quant mode, site ops, attention kernel and scanned blocks it
hands on; a family adds its inputs, its row multiple, its stack and its parallel checks. And
what the token (DiT, MMDiT) families' layer stacks share (`TokenStack`, `JointStack`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from patchpar.models.components import random_params
from patchpar.models.scan import Scannable


class ModuleDenoiser(Scannable):
    """The shared glue of the four families' denoisers (each a frozen dataclass with a
    `module` field)."""

    module: Any

    @property
    def config(self) -> Any:
        return self.module.config

    @property
    def quant_mode(self) -> str | None:
        """The mode its module was quantized with (`patchpar.quant`); None: not quantized."""
        return getattr(self.module, "quant_mode", None)

    def with_ops(self, ops):
        """The same denoiser with other site ops (`models.sites.SiteOps`)."""
        return dataclasses.replace(self, module=self.module.clone(ops=ops))

    def as_patch(self, rows: tuple[int, ...]):
        """The denoiser each row patch (of `rows` latent rows each) runs as a whole input of
        its own (naive patch): itself, a slab of an image being an image."""
        del rows
        return self

    def with_attention(self, spec):
        """The same denoiser with another attention kernel (`models.attention.AttentionSpec`)."""
        return dataclasses.replace(self, module=self.module.clone(attn=spec))

    def init(self, seed: int = 0):
        """Random parameters of `abstract_params`' shapes (`components.random_params`)."""
        return random_params(self.abstract_params(), seed)


class TokenDenoiser(ModuleDenoiser):
    """A transformer over p x p latent patches (PixArt, SD3): a row slab is a run of whole
    token rows, so its latent rows are a multiple of p; tensor parallelism splits the
    feed-forward's inner width (heads are padded with zero heads)."""

    @property
    def row_multiple(self) -> int:
        """Latent rows of one patch must be a multiple of the patch size p: a row slab is then
        a contiguous run of whole tokens."""
        return self.config.patch_size

    @property
    def row_multiple_reason(self) -> str:
        return f"patch size {self.config.patch_size}"

    def image_tokens(self, h: int, w: int) -> int:
        """Tokens of an h x w latent (what a resolution-dependent shift reads)."""
        p = self.config.patch_size
        return (h // p) * (w // p)

    def check_split(self, model: int) -> None:
        """Tensor parallel over `model` devices: the feed-forward's inner width divides."""
        inner = 4 * self.config.inner_dim
        if model > 1 and inner % model:
            fits = [d for d in range(2, 9) if inner % d == 0]
            raise ValueError(
                f"tensor parallel over model={model}: the feed-forward width {inner} is not "
                f"divisible by {model}; degrees that divide it: {fits}"
            )


@dataclasses.dataclass(frozen=True)
class TokenStack:
    """A transformer's forward as a layer-splitting strategy (PipeFusion, AsyncDiff:
    `patchpar.parallel.pipeline`) consumes it: the model's own parts (`context`, `time`,
    `embed`, one `block`, `head`), each applied on explicit parameters. `extras` are the
    conditioning's keyword inputs; `variables` are extra Flax collections of a part (the site
    ops' state), `mutable` those a block returns. The tokens between blocks are one (B, T, D)
    array. A family gives its segments of identical blocks (`segment_layers`,
    `segment_blocks`, `segment_kv_names`), its block names and its parts."""

    module: Any

    @property
    def num_layers(self) -> int:
        return self.module.config.num_layers

    @property
    def patch_size(self) -> int:
        """Latent rows (and columns) per token."""
        return self.module.config.patch_size

    @property
    def width(self) -> int:
        """The tokens' width (what a block passes on)."""
        return self.module.config.inner_dim

    @property
    def dtype(self):
        return self.module.dtype

    def block_names(self) -> set[str]:
        """The names of the blocks' parameters."""
        raise NotImplementedError

    def outer(self, params) -> dict:
        """Every parameter that is not a block's (input and output parts)."""
        names = self.block_names()
        return {k: v for k, v in params.items() if k not in names}

    def zeros(self, batch: int, tokens: int, ctx):
        """Zeros shaped as the tokens between blocks, for `tokens` image tokens."""
        del ctx
        return jnp.zeros((batch, tokens, self.width), self.dtype)

    def _apply(self, ops, outer, method, *args, variables=None, mutable=()):
        module = self.module.clone(ops=ops)
        return module.apply({"params": outer, **(variables or {})}, *args, method=method,
                            mutable=list(mutable) or False)  # fmt: skip

    @staticmethod
    def _own(out, mutable, name: str):
        """A block's output applied as `name` -> (tokens, its `mutable` collections)."""
        if not mutable:
            return out, {}
        y, mutated = out
        return y, {k: v[name] for k, v in mutated.items()}

    def head(self, outer, x, temb, rows: int, w: int):
        """The image tokens of a rows x w latent slab -> (B, rows, w, C)."""
        return self._apply(self.module.ops, outer, "head", self.image_tokens(x), temb, rows, w)

    def image_tokens(self, x):
        """The image tokens of what passes between blocks."""
        return x


class JointStack(TokenStack):
    """A joint-attention (MMDiT) stack: the tokens between blocks are the pair (image tokens
    (B, T, D), text tokens (B, S, D)); the text stream travels with the image tokens it was
    computed beside."""

    def zeros(self, batch: int, tokens: int, ctx):
        return super().zeros(batch, tokens, ctx), jnp.zeros_like(ctx)

    def image_tokens(self, x):
        return x[0]

    def context(self, outer, encoder_hidden_states, extras: dict):
        """The step-invariant text tokens the text stream starts from."""
        return self._apply(self.module.ops, outer, "context", encoder_hidden_states)
