"""Quantized inference with Qwix (google/qwix, pinned 0.1.8; docs/design.md §6).

A denoiser is quantized after loading, on every family alike: `quantize(fn, params, mode)`
returns the same denoiser whose module is Qwix's post-training-quantization model of it and
its parameters stored quantized (each matmul weight an integer or fp8 array and its scales;
biases, norms and embeddings stay as they were). Modes:

- `w8`, `w4`: weight-only int8 / int4, per output channel; activations stay in the model's
  dtype (the weights are dequantized where they are used; the saving is memory);
- `int8`: dynamic-range int8 weights x activations (each activation row scaled by its own
  absolute maximum when it is used);
- `fp8`: the same in float8 e4m3 (`float8_e4m3fn`), scaled into its range (its largest finite
  value 448), so no value overflows.

What is quantized: every `dot_general` and `einsum` whose right operand is one of the module's
own weights (dense layers, projections, feed-forwards, the embedding and modulation layers).
Not quantized: convolutions (a UNet's ResNets, every family's patch embedding; Qwix quantizes
a convolution's input and kernel to one type, and with int8/fp8 its activation scale would
span a device's whole row slab, not a token, so a patch would quantize differently from the
whole image), and attention's products of two activations (queries x keys, probabilities x
values: a rule with no types on the attention modules' paths).

Qwix intercepts the JAX ops while a wrapped method of the module is traced, so the quantized
module runs inside the strategies' `shard_map` programs unchanged (every method the engine,
the caches and the programs call is wrapped). Dynamic activation scales are per token (per
row of the contraction), so a row patch quantizes its tokens as the whole image does.
Weight-only modes are then exact under the exact strategies (equal to one device <= 1e-4);
with int8/fp8 activations a token's quantization is discontinuous at bucket edges, so float
differences of one ulp between two programs (a patch's halo, an all-reduced statistic) can
round a value into the next bucket: the exact strategies equal one device within the
quantized model's own response to a 1e-7 relative change of its input (tests/test_quant.py).

XLA:CPU has no int8 or fp8 matrix units: it converts the operands and multiplies in int32 /
float32 (the same numbers, not faster). int4 activations are not offered (XLA:CPU cannot
compile an s4 x s4 product).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

MODES = ("w8", "w4", "int8", "fp8")
OPS = ("dot_general", "einsum")  # the products quantized (not convolutions: module docstring)
ATTENTION = r"(.*/)?attn[12]?"  # the attention modules' paths in every family


@dataclass(frozen=True)
class Mode:
    name: str
    weight: Any  # the weights' dtype
    act: Any  # the activations' dtype, None: weight-only
    summary: str

    @property
    def act_calibration(self) -> str:
        """int8: each row's absolute maximum at 127 (Qwix's default puts it at 127.5, a
        rounding tie, which XLA then breaks one way or the other depending on how it fuses
        the division: the same model gave other numbers inside `shard_map` than outside)."""
        return f"absmax,{127.5 / 127}" if self.act == jnp.int8 else "absmax"


_MODES = {
    "w8": Mode("w8", jnp.int8, None, "int8 weights, activations unquantized"),
    "w4": Mode("w4", jnp.int4, None, "int4 weights, activations unquantized"),
    "int8": Mode("int8", jnp.int8, jnp.int8, "int8 weights x int8 activations"),
    "fp8": Mode("fp8", jnp.float8_e4m3fn, jnp.float8_e4m3fn, "fp8 e4m3 weights x activations"),
}


def check_mode(mode: Any) -> Mode | None:
    """The mode named `mode` (None for `none`: not quantized), or a one-line error listing the
    modes."""
    if mode == "none":
        return None
    if mode in ("int4", "w4a4", "a4"):
        raise ValueError(
            f"quant={mode!r}: int4 activations are not offered (XLA cannot compile an int4 x "
            f"int4 product on CPU, and their error is large); weight-only int4 is 'w4'; "
            f"modes: {', '.join(MODES)}"
        )
    if mode not in _MODES:
        raise ValueError(
            f"quant={mode!r}: unknown; modes: none, "
            + ", ".join(f"{m} ({_MODES[m].summary})" for m in MODES)
        )
    return _MODES[mode]


def emulated(mode: str, device=None) -> str | None:
    """Why `mode`'s products are emulated on `device` (default: JAX's first device), or None
    where it has the matrix units (int8: GPUs of compute capability >= 7.5 and TPUs; fp8:
    GPUs of compute capability >= 8.9, H100/H200/L40S/RTX 4090). Emulated: XLA converts the
    operands and multiplies in a wider type: the numbers are the mode's, the speed is not."""
    m = check_mode(mode)
    if m is None or m.act is None:
        return None  # weight-only: dequantized to the compute dtype where used, everywhere
    device = device or jax.devices()[0]
    if device.platform == "gpu":
        try:
            cc = tuple(int(v) for v in str(device.compute_capability).split("."))
        except (AttributeError, ValueError):  # not CUDA (ROCm's gfx90a ...): not known to have them
            cc = (0, 0)
        need = (8, 9) if m.act == jnp.float8_e4m3fn else (7, 5)
        if cc >= need:
            return None
        version = ".".join(map(str, cc))
        return f"{device.device_kind} (compute capability {version}) has no {m.name} matrix units"
    if device.platform == "tpu" and m.act == jnp.int8:
        return None
    return f"{device.platform} ({device.device_kind}) has no {m.name} matrix units"


def mode_of(fn) -> str | None:
    """The quant mode `fn`'s module was quantized with; None: not quantized."""
    return fn.quant_mode


def _methods(cls) -> tuple[str, ...]:
    """Every public method a module class defines (above flax's Module), and `__call__`:
    all that Qwix must wrap, since the engine, the caches and the programs call the forward
    in parts (`method="blocks"` ...)."""
    import flax.linen as nn

    out = ["__call__"]
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            break
        for name, value in vars(klass).items():
            if name.startswith("_") or name == "setup" or name in out:
                continue
            if inspect.isfunction(value):
                out.append(name)
    return tuple(out)


def quantize(fn, params, mode: str):
    """(`fn` with its module quantized, its parameters stored quantized) for `mode`; the
    parameters as Qwix stores them (a weight: its quantized values and its scales)."""
    import qwix

    if check_mode(mode) is None:
        return fn, params
    qf, template = _quantized(fn, mode)
    return qf, qwix.quantize_params(jax.tree.map(jnp.asarray, params), template)


def quantize_abstract(fn, params, mode: str):
    """`quantize` on abstract parameters (`ShapeDtypeStruct`s, e.g. `Denoiser.abstract_params`
    of a full-size model): the quantized denoiser and its parameters' shapes and dtypes, no
    weight read or made."""
    import qwix

    if check_mode(mode) is None:
        return fn, params
    qf, template = _quantized(fn, mode, warn=False)
    return qf, jax.eval_shape(lambda p: qwix.quantize_params(p, template), params)


def _quantized(fn, mode: str, warn: bool = True):
    """(`fn` with Qwix's quantized model of its module, the quantized parameters' template)."""
    import qwix

    m = check_mode(mode)
    why = emulated(mode) if warn else None
    if why is not None:
        warnings.warn(
            f"quant={mode!r}: emulated: {why}; XLA converts the operands and multiplies in "
            f"a wider type (the numbers are {mode}'s, the speed is not)",
            stacklevel=3,
        )
    if getattr(fn, "scanned", False):
        raise ValueError(
            f"quant={mode!r} with scanned blocks: Qwix quantizes the unrolled model; quantize "
            f"it unrolled (scan_blocks off)"
        )
    done = mode_of(fn)
    if done is not None:
        raise ValueError(
            f"quant={mode!r}: this {fn.family} denoiser is already quantized ({done!r}); "
            f"quantize the float model once (load it again without quant)"
        )
    # the attention modules' own products (queries x keys, probabilities x values) have no
    # weight: left unquantized (their projections are submodules, quantized by the rule after)
    keep = qwix.QtRule(module_path=ATTENTION, weight_qtype=None, act_qtype=None)
    rule = qwix.QtRule(
        module_path=".*",
        weight_qtype=m.weight,
        act_qtype=m.act,
        op_names=OPS,
        act_calibration_method=m.act_calibration,
    )
    module = fn.module
    provider = qwix.PtqProvider([keep, rule])
    q = qwix.quantize_model(module, provider, methods=_methods(type(module)))
    if type(q) is type(module):  # Qwix's model is a subclass made for this call
        raise RuntimeError("qwix.quantize_model returned the module's own class")
    type(q).quant_mode = mode  # class attributes: clones (`clone(ops=...)`) keep them
    type(q).quant_activations = m.act is not None
    # the template Qwix quantizes the float parameters to: the quantized model's own, traced
    # abstractly on the smallest latent the family takes
    side = fn.row_multiple
    (x, t, ctx), added = fn.example_inputs(1, side, side)
    abstract = jax.eval_shape(q.init, jax.random.key(0), x, t, ctx, **added)["params"]
    return replace(fn, module=q), abstract


def weight_dtypes(params) -> dict[str, int]:
    """Bytes of the parameters by dtype (the quantized weights' values, their scales and
    what stays in the model's dtype; int4: half a byte per value)."""
    from patchpar.parallel.sites.common import bits

    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(params):
        name = jnp.dtype(leaf.dtype).name
        out[name] = out.get(name, 0) + leaf.size * bits(leaf.dtype) // 8
    return out


# ---------------------------------------------------------------- quantized checkpoints


def checkpoint_paths(folder, mode: str):
    """(arrays, metadata) of a denoiser folder's quantized checkpoint for `mode`."""
    from pathlib import Path

    folder = Path(folder)
    return folder / f"quantized-{mode}.npz", folder / f"quantized-{mode}.json"


def float_stamp(folder) -> tuple:
    """The stamp (`loading.stamp`: names, sizes, times, inodes) of the float weight files a
    denoiser folder's loader reads (`loading.weight_files`); ValueError when it holds none."""
    from pathlib import Path

    from patchpar.models.loading import stamp, weight_files

    files = weight_files(folder)
    if not files:
        raise ValueError(
            f"{str(folder)!r} holds no float weights (*.safetensors): a quantized checkpoint is "
            f"made from, and checked against, the float weights beside it (keep them there)"
        )
    return stamp(Path(folder), files)


def float_digest(folder) -> str:
    """SHA-256 (16 hex digits) of the float weight files a denoiser folder's loader reads
    (names and contents): the binding of a quantized checkpoint to the weights it was made
    from."""
    from patchpar.models.loading import weight_files, weights_digest

    float_stamp(folder)  # none: the error
    return weights_digest(folder, weight_files(folder))


def save_quantized(fn, qparams, folder, config: dict, read: tuple | None) -> None:
    """Write a quantized denoiser's parameters beside its float checkpoint (`folder`: the
    denoiser's folder, whose float weights `fn` and `qparams` were made from, as they were
    when read: `read`, their `float_stamp` then; `config`: its config.json). The metadata
    keeps the config and the float weights' digest and stamp, checked on load. Arrays are
    stored by their path in Qwix's tree, in bits (fp8 and bfloat16 as unsigned integers, int4
    one per int8); the metadata names each one's dtype."""
    import json
    import os
    from importlib.metadata import version

    import numpy as np

    mode = mode_of(fn)
    if mode is None:
        raise ValueError("save_quantized: this denoiser is not quantized (quantize it first)")
    now = float_stamp(folder)
    if read is None or now != read:
        why = "were not read from it" if read is None else "changed since they were read"
        raise ValueError(
            f"save_quantized: this denoiser's float weights {why} ({str(folder)!r}): a "
            f"quantized checkpoint must be of the floats beside it; load the folder again and "
            f"quantize"
        )
    floats = float_digest(folder)
    arrays, dtypes = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(qparams)[0]:
        key = jax.tree_util.keystr(path)
        a = np.asarray(leaf)
        dtypes[key] = a.dtype.name
        if a.dtype.name == "int4":
            a = a.astype(np.int8)
        elif a.dtype.kind not in "iuf" or a.dtype.name.startswith(("float8", "bfloat16")):
            a = a.view(f"u{a.dtype.itemsize}")
        arrays[key] = a
    npz, meta = checkpoint_paths(folder, mode)
    tmp = npz.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, npz)  # arrays first: a metadata file means a whole checkpoint
    info = {"mode": mode, "qwix": version("qwix"), "dtypes": dtypes, "config": config,
            "float_weights_sha256": floats, "float_weights_stamp": now}  # fmt: skip
    meta.with_suffix(".tmp").write_text(json.dumps(info, sort_keys=True))
    os.replace(meta.with_suffix(".tmp"), meta)


def load_quantized(fn, folder, mode: str, config: dict):
    """(the quantized denoiser, its parameters) from `folder`'s checkpoint for `mode`, checked
    against `config` (the denoiser folder's config.json), against the digest of the float
    weights beside it (a checkpoint of other weights is never used; the files are read to
    hash them only where their stamp changed since it was saved), against the tree the
    quantized model of `fn` takes, and for NaN/Inf in its float arrays (scales, fp8 values);
    ValueError (`CheckpointError`) naming the file, what differs and how to make it again."""
    import json
    import zipfile

    import numpy as np
    import qwix

    from patchpar.models.loading import CheckpointError, check_finite_tensor

    check_mode(mode)
    npz, meta = checkpoint_paths(folder, mode)
    again = f"quantize the float model again (Pipeline.quantized({mode!r}).save_quantized())"
    try:
        info = json.loads(meta.read_text())
        keys = {"config", "dtypes", "qwix"} - set(info)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
        raise CheckpointError(
            f"quantized checkpoint metadata {str(meta)!r} does not read ({type(e).__name__}: "
            f"{e}); delete it or {again}"
        ) from None
    if keys:
        raise CheckpointError(
            f"quantized checkpoint metadata {str(meta)!r} lacks {sorted(keys)}; {again}"
        )
    if info["config"] != config:
        keys = sorted(
            k for k in set(info["config"]) | set(config) if info["config"].get(k) != config.get(k)
        )
        raise CheckpointError(
            f"quantized checkpoint {str(npz)!r} was made from a denoiser of another config "
            f"(differs in {keys[:5]}); {again}"
        )
    made = info.get("float_weights_sha256")
    unchanged = made is not None and [list(f) for f in float_stamp(folder)] == info.get(
        "float_weights_stamp"
    )  # the files as they were when it was saved: no need to read them
    have = made if unchanged else float_digest(folder)
    if have != made:
        raise CheckpointError(
            f"quantized checkpoint {str(npz)!r} was made from other float weights than "
            f"{str(folder)!r} holds now (sha256 {made or 'not recorded'} then, {have} now); "
            f"{again}"
        )
    qf, template = _quantized(fn, mode)  # (warns where the products are emulated)
    template = jax.eval_shape(lambda p: qwix.quantize_params(p, template), fn.abstract_params())
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    try:
        stored = np.load(npz)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise CheckpointError(
            f"quantized checkpoint {str(npz)!r} does not read ({type(e).__name__}: {e}) though "
            f"its metadata {str(meta)!r} is there; {again}"
        ) from None
    leaves = []
    for path, want in flat:
        key = jax.tree_util.keystr(path)
        if key not in stored or info["dtypes"].get(key) != jnp.dtype(want.dtype).name:
            have = info["dtypes"].get(key, "nothing")
            raise CheckpointError(
                f"quantized checkpoint {str(npz)!r}: {key} holds {have}, the model takes "
                f"{jnp.dtype(want.dtype).name} {tuple(want.shape)} (another compute dtype or "
                f"qwix version: {info['qwix']}); {again}"
            )
        a = stored[key]
        a = a.astype(jnp.int4) if want.dtype == jnp.int4 else a.view(want.dtype)
        if a.shape != tuple(want.shape):
            raise CheckpointError(
                f"quantized checkpoint {str(npz)!r}: {key} is {a.shape}, the model takes "
                f"{tuple(want.shape)}; {again}"
            )
        check_finite_tensor(a, key, f"quantized checkpoint {str(npz)!r}")
        leaves.append(jnp.asarray(a))
    return qf, jax.tree_util.tree_unflatten(treedef, leaves)
