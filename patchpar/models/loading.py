"""Diffusers-format checkpoints (config.json + *.safetensors) <-> Flax parameter trees.

PyTorch keys map onto Flax paths mechanically: a numeric key part joins its parent
(`down_blocks.0.resnets.1` -> `down_blocks_0/resnets_1`), `weight` becomes the Flax leaf that
exists in the target tree (`kernel`, `scale` or `embedding`), conv kernels go from OIHW to
HWIO and linear kernels are transposed. The target tree comes from `jax.eval_shape(init)`, so
every expected key and shape is checked: missing or mis-shaped keys raise `CheckpointError`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path

import jax
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict


class CheckpointError(ValueError):
    """A checkpoint folder, file or key that does not fit the model."""


def read_config(folder: Path, name: str = "config.json") -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    path = folder / name
    if not path.is_file():
        raise CheckpointError(
            f"{str(path)!r} is missing (a diffusers-format component folder has {name})"
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {e}") from e


def weight_files(folder: Path) -> list[Path]:
    """The *.safetensors files `read_state_dict` reads from `folder`: the full-precision ones
    where it holds variants too (model.fp16.safetensors); [] where it holds none."""
    files = sorted(Path(folder).glob("*.safetensors"))
    plain = [f for f in files if f.name.count(".") == 1]
    return plain or files


def read_state_dict(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of the *.safetensors files in `folder` (sharded files are merged)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    files = weight_files(folder)
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {str(folder)!r} (found: {sorted(p.name for p in folder.iterdir())})"
        )
    state: dict[str, np.ndarray] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error type (or OSError) on bad bytes
            size = f.stat().st_size
            raise CheckpointError(
                f"{str(f)!r} ({size} bytes) is not a readable safetensors file: {e}"
            ) from None
    return state


def _flax_key(torch_key: str) -> tuple[str, ...]:
    parts: list[str] = []
    for p in torch_key.split("."):
        if p.isdigit() and parts:
            parts[-1] = f"{parts[-1]}_{p}"
        else:
            parts.append(p)
    return tuple(parts)


_WEIGHT_LEAVES = ("kernel", "scale", "embedding")
# non-parameter buffers that checkpoints carry and the Flax models recompute
_BUFFERS = ("position_ids",)


def _to_flax(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 5:
        return arr.transpose(2, 3, 4, 1, 0)  # (O, I, kt, kh, kw) -> (kt, kh, kw, I, O)
    if leaf == "kernel" and arr.ndim == 4:
        return arr.transpose(2, 3, 1, 0)  # (O, I, kh, kw) -> (kh, kw, I, O)
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T  # (O, I) -> (I, O)
    return arr


def _to_torch(arr: np.ndarray, leaf: str) -> np.ndarray:
    if leaf == "kernel" and arr.ndim == 5:
        return arr.transpose(4, 3, 0, 1, 2)
    if leaf == "kernel" and arr.ndim == 4:
        return arr.transpose(3, 2, 0, 1)
    if leaf == "kernel" and arr.ndim == 2:
        return arr.T
    return arr


def check_finite_tensor(value: np.ndarray, key: str, where: str) -> None:
    """CheckpointError naming a weight tensor that holds NaN or Inf: a model loaded from it
    would only ever produce non-finite (black) images."""
    if value.dtype.kind not in "fV":  # integer buffers; "V": bfloat16 (ml_dtypes)
        return
    v = value if value.dtype.kind == "f" else value.astype(np.float32)
    bad = ~np.isfinite(v)
    if not bad.any():
        return
    nan = int(np.isnan(v).sum())
    raise CheckpointError(
        f"{where}: weight {key!r} {tuple(value.shape)} holds {nan} NaN and "
        f"{int(bad.sum()) - nan} Inf value(s) of {value.size}; the checkpoint "
        f"is damaged (or was saved after a diverged step): replace it"
    )


def state_dict_to_params(
    state: dict[str, np.ndarray], abstract_params, where: str, dtype=None
) -> dict:
    """Convert a PyTorch state dict to the Flax tree whose shapes `abstract_params` gives."""
    expected = flatten_dict(abstract_params)
    # torch-style name of each expected flax path
    by_torch: dict[tuple[str, ...], tuple[str, ...]] = {}
    for path in expected:
        leaf = path[-1]
        by_torch[path[:-1] + (("weight",) if leaf in _WEIGHT_LEAVES else (leaf,))] = path
    out = {}
    unused = []
    for key, arr in state.items():
        path = by_torch.get(_flax_key(key))
        if path is None:
            if not key.endswith(_BUFFERS):
                unused.append(key)
            continue
        value = _to_flax(np.asarray(arr), path[-1])
        check_finite_tensor(value, key, where)
        want = expected[path]
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{where}: key {key!r} has shape {tuple(arr.shape)}, the model config needs "
                f"{tuple(_to_torch(np.empty(want.shape), path[-1]).shape)}"
            )
        out[path] = value.astype(dtype or want.dtype)
    if unused:
        warnings.warn(
            f"{where}: {len(unused)} checkpoint key(s) that the model config does not use were "
            f"ignored (a config that does not match its weights?): {sorted(unused)[:8]}",
            stacklevel=2,
        )
    missing = [p for p in expected if p not in out]
    if missing:
        names = [_torch_name(p) for p in missing]
        raise CheckpointError(
            f"{where}: {len(missing)} key(s) missing from the checkpoint, e.g. {names[:5]}"
        )
    return jax.tree_util.tree_map(jax.numpy.asarray, unflatten_dict(out))


def params_to_state_dict(params) -> dict[str, np.ndarray]:
    """Inverse of `state_dict_to_params`: PyTorch key names and layouts (for writing folders)."""
    return {
        _torch_name(path): np.ascontiguousarray(_to_torch(np.asarray(value), path[-1]))
        for path, value in flatten_dict(params).items()
    }


def _torch_name(path: tuple[str, ...]) -> str:
    parts = []
    for p in path[:-1]:
        head, _, tail = p.rpartition("_")
        parts.append(f"{head}.{tail}" if tail.isdigit() and head in _LIST_NAMES else p)
    return ".".join(parts + ["weight" if path[-1] in _WEIGHT_LEAVES else path[-1]])


# Module names that diffusers / transformers keep in lists (ModuleList / Sequential).
_LIST_NAMES = {
    "down_blocks",
    "up_blocks",
    "resnets",
    "attentions",
    "downsamplers",
    "upsamplers",
    "transformer_blocks",
    "single_transformer_blocks",  # FLUX
    "to_out",
    "net",
    "layers",
    "block",  # T5
    "layer",
    "resample",  # the Wan VAE's upsamplers (nn.Sequential)
}


def write_component(folder: Path, config: dict, params, rename=None) -> None:
    """Write config.json and diffusion_pytorch_model.safetensors (or model.safetensors for
    transformers components, when config has `architectures`); `rename` maps the state dict's
    keys to the checkpoint's where a module names a layer otherwise (Wan's blocks)."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    fname = (
        "model.safetensors" if "architectures" in config else "diffusion_pytorch_model.safetensors"
    )
    state = params_to_state_dict(params)
    save_file(state if rename is None else rename(state), str(folder / fname),
              metadata={"format": "pt"})  # fmt: skip


DERIVED = "quantized-*"  # files patchpar writes beside the weights (`quant.save_quantized`)


def weights_digest(folder: str | Path, files: list[Path] | None = None) -> str:
    """SHA-256 (16 hex digits) of `files` of a model folder (relative names and contents;
    default every file: weights, configs, tokenizer), so records made from different weights
    differ. Files patchpar derives from the weights (quantized checkpoints) are not counted:
    they are not the model's. Cached per process by the files' `stamp`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {str(folder)!r} does not exist")
    if files is None:
        files = [
            p
            for p in folder.rglob("*")
            if p.is_file()
            and not p.relative_to(folder).parts[0].startswith(".")
            and not p.match(DERIVED)
        ]
    return _digest(folder.resolve(), stamp(folder, files))


def stamp(folder: Path, files: list[Path]) -> tuple:
    """((relative name, size, mtime, ctime, inode) of each file, sorted): any write or
    replacement of a file changes it (a file's ctime cannot be set back), so a digest cached
    under it is the files' digest."""
    out = []
    for p in sorted(files):
        st = p.stat()
        rel = str(p.relative_to(folder))
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return tuple(out)


@functools.cache
def _digest(folder: Path, stamp: tuple) -> str:
    h = hashlib.sha256()
    for rel, *_ in stamp:
        h.update(rel.encode() + b"\0")
        with open(folder / rel, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def write_scheduler(folder: Path, config: dict) -> None:
    """`scheduler/scheduler_config.json` of a pipeline folder."""
    (folder / "scheduler").mkdir(parents=True, exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config, indent=2))
