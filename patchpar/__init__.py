"""patchpar: patch-parallel diffusion inference in JAX (docs/design.md)."""

from patchpar.xla_flags import apply_defaults as _apply_xla_defaults

_apply_xla_defaults()
