"""What every family's denoiser (`family.Denoiser`) shares: a frozen dataclass over its Flax
module (`module`), whose config, quant mode, site ops, attention kernel and scanned blocks it
hands on; a family adds its inputs, its row multiple, its stack and its parallel checks."""

from __future__ import annotations

import dataclasses
from typing import Any

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

    def with_attention(self, spec):
        """The same denoiser with another attention kernel (`models.attention.AttentionSpec`)."""
        return dataclasses.replace(self, module=self.module.clone(attn=spec))
