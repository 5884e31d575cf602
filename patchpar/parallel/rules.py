"""Where parameters live: every parameter of a model carries logical axis names (its family's
table of path patterns, the denoiser's `logical`), and a rule set maps logical axes to mesh
axes (MaxDiffusion's `logical_axis_rules`, written as data).

Logical axes (one name per dimension; None = never split):
- `heads`: attention heads x head dim (to_q/to_k/to_v outputs, to_out input);
- `mlp`: the feed-forward inner width (net.2 input; net.0's output in a DiT's GELU
  feed-forward); `mlp_gated`: GEGLU's projection output, [h | gate], each half split alike
  (laid out as (2, mlp) while placed);
- `conv_mid`: a ResNet block's middle channels (conv1 and time_emb_proj outputs, norm2,
  conv2 input);
- `embed`: the model width a layer reads or writes whole (a hidden size: 320 ... 1280, or the
  text width for cross-attention K/V); every parameter has at most one;
- `conv_in`: a layer's input width where its output is `embed` (conv_in's latent channels,
  shortcut, sampler, projection and embedding inputs);
- `conv_out`: the UNet's output (latent) channels.

Rule sets: `replicated` (every parameter whole on every device: patch, data and context
parallelism), `tensor` (Megatron: heads, mlp and conv_mid split over the `model` axis, as
the released DistriFusion's tensor-parallel baseline) and `fsdp` (ZeRO-3 / MaxDiffusion's
`fsdp` rule: `embed` sharded over every device that runs the same weights, `(data, cfg,
patch)`; combines with `tensor`). The `model` axis splits weights for good (each device
computes with its share); any other axis only shards them at rest: the layer gathers them
(`all_gather`, site `fsdp`) just before it runs and drops them after. Weight bytes per device
follow from the rules (`weight_bytes_per_device`).
"""

from __future__ import annotations

import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import PartitionSpec as P

from patchpar.models.scan import first_layer_path
from patchpar.parallel.mesh import AXES, CFG, DATA, MODEL, PATCH, divisors
from patchpar.parallel.sites.common import bits

LOGICAL_AXES = ("heads", "mlp", "mlp_gated", "conv_mid", "embed", "conv_in", "conv_out")
FSDP_AXES = (DATA, CFG, PATCH)  # the devices that hold the same weights (all but `model`)

# A model family's table: (path pattern, logical axes of the parameter), the first match wins
# (`models.unet.LOGICAL`, `models.pixart.LOGICAL`; the denoiser's `logical`). No match: a
# kernel is (..., conv_in, embed), a bias or scale (embed,) (`logical_axes`).
Table = tuple[tuple[str, tuple], ...]

_KERNEL = ("conv_in", "embed")  # any kernel the table does not name: (..., in, out)

Axes = str | tuple[str, ...] | None  # what a rule maps a logical axis to: mesh axis (or axes)
RULES: dict[str, dict[str, Axes]] = {
    "replicated": {},
    "tensor": {"heads": MODEL, "mlp": MODEL, "mlp_gated": MODEL, "conv_mid": MODEL},
    "fsdp": {"embed": FSDP_AXES},
}


def _axes(value: Axes) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


def parts(name: str) -> tuple[str, int]:
    """A logical name -> (the logical axis whose rule it follows, the equal parts its
    dimension is made of, each split alike): `mlp_gated` is 2 parts, `<axis>*<k>` k parts of
    `<axis>`, any other name 1 part of itself."""
    if name == "mlp_gated":
        return name, 2
    base, star, k = name.partition("*")
    return (base, int(k)) if star else (name, 1)


def _rule(rules: dict, name: str | None) -> tuple[str, ...]:
    """The mesh axes `rules` give the logical dimension `name` (None: never split)."""
    return _axes(rules.get(parts(name)[0])) if name else ()


def check_rules(rules: dict[str, Axes], table: Table = ()) -> None:
    """Errors naming the rule: an unknown logical axis, an unknown mesh axis, or one mesh axis
    given to two dimensions of the same parameter (of `table`'s patterns or any other kernel)."""
    bad = sorted(set(rules) - set(LOGICAL_AXES))
    if bad:
        raise ValueError(f"rules name unknown logical axes {bad}; known: {list(LOGICAL_AXES)}")
    axes = [a for v in rules.values() for a in _axes(v)]
    if set(axes) - set(AXES):
        raise ValueError(
            f"rules map to unknown mesh axes {sorted(set(axes) - set(AXES))}; mesh axes: "
            f"{list(AXES)}"
        )
    for pattern, names in tuple(table) + (("any other kernel", _KERNEL),):
        mapped = [(n, a) for n in names for a in _rule(rules, n)]
        seen: dict[str, str] = {}
        for name, axis in mapped:
            if axis in seen:
                raise ValueError(
                    f"rules put mesh axis {axis!r} on both {seen[axis]!r} and {name!r}, two "
                    f"dimensions of the parameters matching {pattern!r}: an axis can split one "
                    f"dimension of a parameter only"
                )
            seen[axis] = name


def logical_axes(path: str, ndim: int, table: Table) -> tuple:
    """Logical axis names of the parameter at `path` ('down_blocks_0/.../to_q/kernel') in a
    family's `table`. A block's parameter in a scanned stack (`patchpar.models.scan`) has a
    layer axis in front, never split."""
    if (first := first_layer_path(path)) is not None:
        return (None,) + logical_axes(first, ndim - 1, table)
    for pattern, names in table:
        if re.search(pattern, path):
            return names
    if path.endswith("/kernel") and ndim >= 2:  # (kh, kw,) in, out: a layer writing `embed`
        return (None,) * (ndim - 2) + _KERNEL
    return ("embed",) if ndim == 1 else (None,) * ndim


def _leaves(params):
    return {"/".join(k): v for k, v in flatten_dict(params).items()}


def _arrays(path: str, leaf, table: Table):
    """A parameter's arrays with the logical axes of each, and how to put them back: a plain
    parameter is its one array; a quantized weight (`patchpar.quant`: Qwix's quantized values
    and their scales, a pytree) is its values, shaped as the weight, and its scales, of the
    same rank with size 1 along the dimensions they are shared over (which then have no
    logical axis: never split). The first array has the weight's shape."""
    arrays, treedef = jax.tree.flatten(leaf)
    shape = arrays[0].shape
    names = logical_axes(path, len(shape), table)
    each = [
        tuple(n if a == w else None for n, a, w in zip(names, x.shape, shape, strict=True))
        for x in arrays
    ]
    return arrays, each, treedef


def _spec(names: tuple, rules: dict) -> tuple:
    """Mesh axis per dimension; a dimension of k > 1 parts becomes two, (k, dim / k), while
    placed (`parts`)."""
    out = []
    for name in names:
        axes = _rule(rules, name)
        axis = None if not axes else axes[0] if len(axes) == 1 else axes
        out += [None, axis] if name and parts(name)[1] > 1 else [axis]
    return tuple(out)


def placed(
    params,
    rules: dict,
    table: Table,
    local_shapes=None,
    degrees: dict[str, int] | None = None,
):
    """(params laid out for placement, their PartitionSpecs). A dimension of k parts (`parts`:
    `mlp_gated`, `mlp*5`) becomes (k, dim / k) so that each device's share holds its share of every part (a reshape, no copy).
    `local_shapes` (the modules' parameter shapes on one device) and the mesh `degrees` pad
    `heads` split over `model` with zero heads up to local x degree, where the heads do not
    divide (DistriFusion's tensor parallelism splits them unevenly instead; a zero head adds
    nothing to the output). Dimensions sharded at rest (FSDP) must divide: `check_sharded`.
    A quantized weight's values and scales are placed alike (`_arrays`)."""
    check_rules(rules, table)
    if degrees is not None:
        check_sharded(params, rules, degrees, table)
    local = _leaves(local_shapes) if local_shapes is not None else {}
    out, specs = {}, {}
    for path, leaf in _leaves(params).items():
        arrays, each, treedef = _arrays(path, leaf, table)
        mine = jax.tree.leaves(local[path]) if path in local else [None] * len(arrays)
        laid, laid_specs = [], []
        for x, names, shape in zip(arrays, each, mine, strict=True):
            x, spec = _placed_array(path, x, names, rules, shape, degrees)
            laid.append(x)
            laid_specs.append(spec)
        out[path] = jax.tree.unflatten(treedef, laid)
        specs[path] = jax.tree.unflatten(treedef, laid_specs)
    return _tree(out), _tree(specs)


def _placed_array(path: str, leaf, names: tuple, rules: dict, local, degrees):
    """One array of a parameter laid out for placement, and its PartitionSpec (`placed`)."""
    axes = _spec(names, rules)
    if not any(axes):  # whole on every device, as it is
        return leaf, P()
    if local is not None:  # pad heads split over `model` to whole heads per device
        pad = []
        for i, name in enumerate(names):
            split = MODEL in _rule(rules, name)
            k = (degrees or {}).get(MODEL, 1) if split else 1
            target = local.shape[i] * k
            pad.append((0, target - leaf.shape[i]))
            if target != leaf.shape[i] and name != "heads":
                raise ValueError(f"{path}: {name} of {leaf.shape[i]} does not split {k} ways")
        leaf = jnp.pad(leaf, pad) if any(p for _, p in pad) else leaf
    shape = []
    for dim, name in zip(leaf.shape, names, strict=True):
        k = parts(name)[1] if name else 1
        shape += [k, dim // k] if k > 1 else [dim]
    return jnp.reshape(leaf, tuple(shape)), P(*axes)


def _tree(flat: dict):
    return unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def unplaced(local_params, table: Table, rules: dict | None = None):
    """Inside `shard_map`: this device's shares back in the modules' shapes ((k, dim / k / m)
    -> k x dim / k / m for a dimension of k parts). With `rules`, a share sharded at rest over axes other than
    `model` (FSDP) comes boxed (`nn.Partitioned`, names = those axes per dimension) for the
    layer that owns it to gather just before it runs (`PatchOps.layer`); a quantized weight's
    values and scales each on their own."""
    out = {}
    for path, leaf in _leaves(local_params).items():
        arrays, treedef = jax.tree.flatten(leaf)
        names = logical_axes(path, arrays[0].ndim - 1, table)  # if a dimension of k parts
        laid = []
        for x in arrays:
            multi = [i for i, n in enumerate(names) if n and parts(n)[1] > 1]
            if multi and x.ndim == len(names) + 1:
                at = multi[0]
                x = x.reshape(x.shape[:at] + (-1,) + x.shape[at + 2 :])
            laid.append(x)
        shape = laid[0].shape
        names = logical_axes(path, len(shape), table)
        out_arrays = []
        for x in laid:
            mine = [n if a == w else None for n, a, w in zip(names, x.shape, shape, strict=True)]
            rest = [_rule(rules, n) if rules else () for n in mine]
            rest = [tuple(a for a in axes if a != MODEL) or None for axes in rest]
            out_arrays.append(nn.Partitioned(x, names=tuple(rest)) if any(rest) else x)
        out[tuple(path.split("/"))] = jax.tree.unflatten(treedef, out_arrays)
    return unflatten_dict(out)


def _split(names: tuple, rules: dict, degrees: dict[str, int]) -> list:
    """(dimension, logical name, ways) of every dimension `rules` split, for one array."""
    out = []
    for dim, name in enumerate(names):
        ways = math.prod(degrees.get(a, 1) for a in _rule(rules, name))
        if ways > 1:
            out.append((dim, name, ways))
    return out


def weight_bytes_per_device(params, rules: dict, degrees: dict[str, int], table: Table) -> int:
    """Parameter bytes one device holds under `rules` on a mesh of `degrees` ({axis: size});
    a quantized weight: its values (int4: half a byte each) and its scales."""
    total = 0
    for path, leaf in _leaves(params).items():
        arrays, each, _ = _arrays(path, leaf, table)
        for x, names in zip(arrays, each, strict=True):
            split = math.prod(w for _, _, w in _split(names, rules, degrees))
            total += math.prod(x.shape) * bits(x.dtype) // 8 // split
    return total


def check_sharded(params, rules: dict, degrees: dict[str, int], table: Table) -> None:
    """Every dimension sharded at rest (over axes other than `model`: FSDP) divides by its
    degree; ValueError naming the parameter, the size and the degrees that divide them all."""
    bad, sizes = [], set()
    for path, leaf in _leaves(params).items():
        arrays, each, _ = _arrays(path, leaf, table)
        for x, names in zip(arrays, each, strict=True):
            for dim, name, _ in _split(names, rules, degrees):
                axes = [a for a in _rule(rules, name) if a != MODEL]
                ways = math.prod(degrees.get(a, 1) for a in axes)
                if ways == 1:
                    continue
                sizes.add(x.shape[dim])
                if x.shape[dim] % ways:
                    bad.append((path, name, x.shape[dim], ways, axes))
    if bad:
        path, name, size, ways, axes = bad[0]
        fits = [d for d in divisors(max(sizes)) if all(s % d == 0 for s in sizes)]
        raise ValueError(
            f"fsdp over {' x '.join(axes)} = {ways} devices: {len(bad)} parameter(s) do not "
            f"shard evenly, e.g. {path} ({name} = {size}); every sharded width is one of "
            f"{sorted(sizes)}: the devices sharing weights (devices / model) must be one of "
            f"{fits}"
        )
