"""XLA:CPU options patchpar sets before JAX starts its backend (importing `patchpar` does it).

Measured on a 2-core AMD EPYC (Zen 3, AVX2) with jaxlib 0.10.2, the SD-like UNet of
`experiments/bench_unet.py` at a 32x32 latent, batch 2, float32, both cores, XLA attention:

- jaxlib's default routes dots through YNNPACK *fusions* (`dot` in
  `xla_cpu_experimental_ynn_fusion_type`): 1.34 s per call;
- no YNNPACK (`=` empty: Eigen dots and convolutions): 0.84 s;
- YNNPACK for single dots and convolutions only (`individual_dot,individual_convolution`):
  0.76 s; with the chunked attention kernel 0.40-0.43 s;
- YNNPACK for single dots, Eigen for convolutions (`individual_dot`, below): 0.32 s (diffusers:
  0.47 s in the same run). A 3x3 convolution alone, 64 channels at 64x64, batch 2: Eigen 5.0 ms,
  YNNPACK 10.2 ms, PyTorch 8.5 ms.

A flag the user already set in XLA_FLAGS wins; PATCHPAR_XLA_DEFAULTS=0 turns all of this off.
The flags are CPU-only: GPU and TPU backends ignore them.
"""

from __future__ import annotations

import os

CPU_FLAGS = {
    "--xla_cpu_experimental_ynn_fusion_type": "individual_dot",
}


def apply_defaults() -> list[str]:
    """Append patchpar's XLA:CPU defaults to XLA_FLAGS (those the user has not set); returns
    the flags added. Has no effect once JAX has started its backend."""
    if os.environ.get("PATCHPAR_XLA_DEFAULTS", "1") == "0":
        return []
    current = os.environ.get("XLA_FLAGS", "")
    added = [f"{k}={v}" for k, v in CPU_FLAGS.items() if k not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def in_effect() -> dict[str, str]:
    """patchpar's XLA:CPU options as XLA_FLAGS has them now (for records)."""
    flags = dict(f.split("=", 1) for f in os.environ.get("XLA_FLAGS", "").split() if "=" in f)
    return {k: flags.get(k, "(jaxlib default)") for k in CPU_FLAGS}
