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

**Several CPU devices in one process** (`--xla_force_host_platform_device_count`, or
`jax_num_cpu_devices`) leave the option unset: jaxlib's own default. With jaxlib 0.10.2 on 2
cores, a sharded program that repeats the UNet (a denoising loop) returns wrong values for the
first images of a large batch with `individual_dot`, `dot`, `reduce` or no YNNPACK at all
(`sync_patch` on 8 devices with 200 fmnist images, 5 calls: images 0-3 wrong by 0.029; 2 devices
with 400 images in an 8-call loop: images 0-12 wrong by up to 0.2). One-device programs are
right, so are the same programs pinned to one core (`taskset -c 0`: XLA then splits no loop
across threads), and so are they with jaxlib's default or with `eltwise` in the list. It is a
race in XLA:CPU, not in patchpar's sites (the programs are pure); `experiments/xla_cpu_race.py`
reproduces it (~20 s per setting). `individual_dot,eltwise`, patchpar's earlier choice, breaks
every non-square image on several devices ("Instruction with unsupported layout in YNN fusion":
an `eltwise` fusion is handed a transposed operand); jaxlib's default runs them, and costs the
same here (the race script, 2 devices: 27.3 s against 29.5-31.2 s; two parallel test files,
8 devices: 93 s against 90 s). Launched workers (`--processes`, one device on one core) keep
`individual_dot`.

A flag the user already set in XLA_FLAGS wins; PATCHPAR_XLA_DEFAULTS=0 turns all of this off.
The flags are CPU-only: GPU and TPU backends ignore them. XLA stops reading XLA_FLAGS at the
first word that does not start with `--` (it takes what follows for a file name or ignores it),
so such a word would silently drop every flag after it, patchpar's included.
"""

from __future__ import annotations

import os

YNN = "--xla_cpu_experimental_ynn_fusion_type"
CPU_FLAGS = {YNN: "individual_dot"}
SHARED_PROCESS_FLAGS: dict[str, str | None] = {YNN: None}  # None: unset, jaxlib's default
DEVICE_COUNT = "--xla_force_host_platform_device_count"
SET_BY_PATCHPAR = "PATCHPAR_XLA_SET"  # the XLA_FLAGS words patchpar put there


def _flags() -> list[str]:
    return os.environ.get("XLA_FLAGS", "").split()


def host_device_count() -> int:
    """CPU devices JAX will start in this process, as XLA_FLAGS or JAX_NUM_CPU_DEVICES say."""
    for word in _flags():
        key, _, value = word.partition("=")
        if key == DEVICE_COUNT and value.isdigit():
            return int(value)
    env = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    return int(env) if env.isdigit() else 1


def wanted(devices: int) -> dict[str, str | None]:
    """patchpar's XLA:CPU options for a process with `devices` CPU devices (None: unset)."""
    return SHARED_PROCESS_FLAGS if devices > 1 else CPU_FLAGS


def apply_defaults(devices: int | None = None) -> list[str]:
    """Put patchpar's XLA:CPU defaults for `devices` CPU devices in this process (default: as
    XLA_FLAGS / JAX_NUM_CPU_DEVICES say) into XLA_FLAGS; returns the flags set. A flag the user
    set stays; one patchpar set (named in PATCHPAR_XLA_SET) is replaced. Call it again when the
    device count changes before JAX starts its backend; afterwards it has no effect."""
    if os.environ.get("PATCHPAR_XLA_DEFAULTS", "1") == "0":
        return []
    ours = os.environ.get(SET_BY_PATCHPAR, "").split()  # inherited by subprocesses too
    words = _flags()
    added = []
    for key, value in wanted(devices or host_device_count()).items():
        present = [w for w in words if w.partition("=")[0] == key]
        if any(w not in ours for w in present):  # the user's
            continue
        words = [w for w in words if w not in present]  # patchpar's own earlier value
        ours = [w for w in ours if w not in present]
        if value is not None:
            words.append(f"{key}={value}")
            ours.append(f"{key}={value}")
            added.append(f"{key}={value}")
    os.environ["XLA_FLAGS"] = " ".join(words)
    os.environ[SET_BY_PATCHPAR] = " ".join(ours)
    return added


def in_effect() -> dict[str, str]:
    """patchpar's XLA:CPU options as XLA_FLAGS has them now (for records)."""
    flags = dict(w.split("=", 1) for w in _flags() if "=" in w)
    return {k: flags.get(k, "(jaxlib default)") for k in CPU_FLAGS}
