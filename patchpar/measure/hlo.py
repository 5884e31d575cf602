"""A lowered program's HLO text, for the counters of bytes (`measure.comm`) and FLOPs
(`measure.flops`)."""

from __future__ import annotations


def hlo_text_with_metadata(lowered) -> str:
    """Pre-optimisation HLO of a `jax.jit(...).lower(...)` result, with op_name metadata."""
    from jaxlib import _hlo

    options = _hlo.HloPrintOptions()
    options.print_metadata = True
    options.print_large_constants = False
    return lowered.compiler_ir("hlo").as_hlo_module().to_string(options)
