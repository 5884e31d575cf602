"""Where parameters live: every UNet parameter carries logical axis names, and a rule set maps
logical axes to mesh axes (MaxDiffusion's `logical_axis_rules`, written as data).

Logical axes (one name per dimension; None = never split):
- `heads`: attention heads x head dim (to_q/to_k/to_v outputs, to_out input);
- `mlp`: the feed-forward inner width (net.2 input); `mlp_gated`: GEGLU's projection output,
  [h | gate], each half split alike (laid out as (2, mlp) while placed);
- `conv_mid`: a ResNet block's middle channels (conv1 and time_emb_proj outputs, norm2,
  conv2 input);
- `embed`: model widths everything else reads whole (kept whole by the rules below).

Rule sets: `replicated` (every parameter whole on every device: patch, data and context
parallelism) and `tensor` (Megatron: heads, mlp and conv_mid split over the `model` axis, as
the released DistriFusion's tensor-parallel baseline). Weight bytes per device follow from the
rules (`weight_bytes_per_device`).
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import PartitionSpec as P

from patchpar.parallel.mesh import AXES, MODEL

LOGICAL_AXES = ("heads", "mlp", "mlp_gated", "conv_mid", "embed")

# (path pattern, logical axes of the parameter); the first match wins, no match = replicated
_ATTN = r"attn[12]/"
_RESNET = r"resnets_\d+/"
LOGICAL: tuple[tuple[str, tuple], ...] = (
    (_ATTN + r"to_[qkv]/kernel$", ("embed", "heads")),
    (_ATTN + r"to_[qkv]/bias$", ("heads",)),
    (_ATTN + r"to_out_0/kernel$", ("heads", "embed")),
    (r"ff/net_0/proj/kernel$", ("embed", "mlp_gated")),
    (r"ff/net_0/proj/bias$", ("mlp_gated",)),
    (r"ff/net_2/kernel$", ("mlp", "embed")),
    (_RESNET + r"conv1/kernel$", (None, None, "embed", "conv_mid")),
    (_RESNET + r"(conv1|time_emb_proj|norm2)/(bias|scale)$", ("conv_mid",)),
    (_RESNET + r"time_emb_proj/kernel$", ("embed", "conv_mid")),
    (_RESNET + r"conv2/kernel$", (None, None, "conv_mid", "embed")),
)

RULES: dict[str, dict[str, str | None]] = {
    "replicated": {},
    "tensor": {"heads": MODEL, "mlp": MODEL, "mlp_gated": MODEL, "conv_mid": MODEL},
}


def check_rules(rules: dict[str, str | None]) -> None:
    """Errors naming the rule: an unknown logical axis, an unknown mesh axis, or one mesh axis
    given to two dimensions of the same parameter."""
    bad = sorted(set(rules) - set(LOGICAL_AXES))
    if bad:
        raise ValueError(f"rules name unknown logical axes {bad}; known: {list(LOGICAL_AXES)}")
    axes = [a for a in rules.values() if a is not None]
    if set(axes) - set(AXES):
        raise ValueError(
            f"rules map to unknown mesh axes {sorted(set(axes) - set(AXES))}; mesh axes: "
            f"{list(AXES)}"
        )
    for pattern, names in LOGICAL:
        mapped = [(n, rules.get(n)) for n in names if n and rules.get(n)]
        seen: dict[str, str] = {}
        for name, axis in mapped:
            if axis in seen:
                raise ValueError(
                    f"rules put mesh axis {axis!r} on both {seen[axis]!r} and {name!r}, two "
                    f"dimensions of the parameters matching {pattern!r}: an axis can split one "
                    f"dimension of a parameter only"
                )
            seen[axis] = name


def logical_axes(path: str, ndim: int) -> tuple:
    """Logical axis names of the parameter at `path` ('down_blocks_0/.../to_q/kernel')."""
    for pattern, names in LOGICAL:
        if re.search(pattern, path):
            return names
    return (None,) * ndim


def _leaves(params):
    return {"/".join(k): v for k, v in flatten_dict(params).items()}


def _spec(names: tuple, rules: dict) -> tuple:
    """Mesh axis per dimension; `mlp_gated` becomes two dimensions (2, mlp) while placed."""
    out = []
    for name in names:
        axis = rules.get(name) if name else None
        out += [None, axis] if name == "mlp_gated" else [axis]
    return tuple(out)


def placed(params, rules: dict, local_shapes=None, degrees: dict[str, int] | None = None):
    """(params laid out for placement, their PartitionSpecs). `mlp_gated` dimensions become
    (2, mlp) so that each device's share holds its part of both halves (a reshape, no copy).
    `local_shapes` (the modules' parameter shapes on one device) and the mesh `degrees` pad
    split `heads` dimensions with zero heads up to local x degree, where the heads do not
    divide (DistriFusion's tensor parallelism splits them unevenly instead; a zero head adds
    nothing to the output)."""
    check_rules(rules)
    local = _leaves(local_shapes) if local_shapes is not None else {}
    out, specs = {}, {}
    for path, leaf in _leaves(params).items():
        names = logical_axes(path, leaf.ndim)
        axes = _spec(names, rules)
        if not any(axes):  # whole on every device, as it is
            out[path], specs[path] = leaf, P()
            continue
        specs[path] = P(*axes)
        if path in local:  # pad split heads to whole heads per device
            pad = []
            for i, name in enumerate(names):
                k = (degrees or {}).get(rules.get(name), 1) if name else 1
                target = local[path].shape[i] * k
                pad.append((0, target - leaf.shape[i]))
                if target != leaf.shape[i] and name != "heads":
                    raise ValueError(f"{path}: {name} of {leaf.shape[i]} does not split {k} ways")
            leaf = jnp.pad(leaf, pad) if any(p for _, p in pad) else leaf
        shape = []
        for dim, name in zip(leaf.shape, names, strict=True):
            shape += [2, dim // 2] if name == "mlp_gated" else [dim]
        out[path] = jnp.reshape(leaf, tuple(shape))
    tree = lambda d: unflatten_dict({tuple(k.split("/")): v for k, v in d.items()})  # noqa: E731
    return tree(out), tree(specs)


def unplaced(local_params):
    """Inside `shard_map`: this device's shares back in the modules' shapes ((2, mlp / m) ->
    2 x mlp / m for `mlp_gated`)."""
    out = {}
    for path, leaf in _leaves(local_params).items():
        names = logical_axes(path, leaf.ndim - 1)
        if "mlp_gated" in names and leaf.ndim == len(names) + 1:
            at = names.index("mlp_gated")
            leaf = leaf.reshape(leaf.shape[:at] + (-1,) + leaf.shape[at + 2 :])
        out[tuple(path.split("/"))] = leaf
    return unflatten_dict(out)


def weight_bytes_per_device(params, rules: dict, degrees: dict[str, int]) -> int:
    """Parameter bytes one device holds under `rules` on a mesh of `degrees` ({axis: size})."""
    total = 0
    for path, leaf in _leaves(params).items():
        axes = {rules.get(n) for n in logical_axes(path, leaf.ndim) if n and rules.get(n)}
        split = math.prod(degrees.get(a, 1) for a in axes)
        total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize // split
    return total


def check_split(unet_config, model: int) -> None:
    """Every split width divides by the model degree: the ResNet widths and their GroupNorm
    groups; ValueError naming the sizes and the degrees that would divide. (Heads need not:
    they are padded with zero heads, `placed`.)"""
    if model == 1:
        return
    cfg = unet_config
    sizes = {
        "block_out_channels": tuple(cfg.block_out_channels),
        "norm_num_groups": (cfg.norm_num_groups,),
    }
    every = [v for vs in sizes.values() for v in vs]
    fits = [d for d in range(1, max(every) + 1) if all(v % d == 0 for v in every)]
    for what, values in sizes.items():
        if any(v % model for v in values):
            raise ValueError(
                f"tensor parallel over model={model}: {what} {list(values)} are not all "
                f"divisible by {model} (ResNet middle channels and their GroupNorm groups are "
                f"split); degrees that divide every split width: {fits}"
            )
