"""A stack of identical blocks as one loop (`lax.scan`), for a shorter compile (docs/design.md
§8): XLA compiles one block instead of `n` copies of it.

`Layers(block, fields, n)` is a Flax module that runs `block(*fields)` n times, each time with
its own parameters and site state: every Flax collection of the block (`params`, the stale
buffers, the pending sends) gets a leading layer axis of n (`nn.scan`, `variable_axes` 0). The
block is called as `block(*carry, *shared)` and returns the new carry (one array or a tuple);
`shared` inputs (the text context, the timestep's modulations, a Python int such as the tokens
per image row) are the same for every layer.

Parameters stay in the unrolled layout everywhere outside a model call (`<name>_<i>` per
block, as diffusers' checkpoints and every loader have them): `stack(params, name, n)` makes the
scanned layout (`<name>: {"layer": leaves with a leading n}`), which a denoiser with `scan` on
does once before its programs run (`Denoiser.prepare`), or at each call when given the unrolled
layout (a copy of the blocks' weights inside the program).

A site call traced inside the loop runs n times: the analytic byte models record it n times
(`SiteOps.repeated`), and the HLO's collectives inside a loop count as often as it
runs (`measure.comm.parse_collectives`). A step's pending sends of a scanned stack have the
layer axis in front (`parallel.exchange.exchange_packed` takes it).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from patchpar.models.sites import IDENTITY, SiteOps

LAYER = "layer"  # the block's name inside a scanned stack (its parameters: <stack>/scan/layer/...)
SCANNED = f"/scan/{LAYER}/"  # in a parameter's path: a leading layer axis
_SCANNED_PATH = re.compile(rf"_scan_(\d+){SCANNED}")


def first_layer_path(path: str) -> str | None:
    """A scanned run's parameter path ('<name>_scan_<lo>/scan/layer/...') as its first block's
    ('<name>_<lo>/...'), whose rules it follows; None for a path outside a scanned run."""
    out, n = _SCANNED_PATH.subn(r"_\1/", path, count=1)
    return out if n else None


class Scannable:
    """What a denoiser (`Denoiser`) with a scannable module gets: `scanned`, `with_scan` and
    `prepare`, its module's `scan` field and `stack_params` (the scanned layout of unrolled
    parameters) doing the work."""

    @property
    def scanned(self) -> bool:
        return self.module.scan

    def with_scan(self, on: bool = True):
        """Its runs of identical blocks as scanned loops, or unrolled."""
        return dataclasses.replace(self, module=self.module.clone(scan=on))

    def prepare(self, params):
        """The parameters as its module takes them: with `scan` on, each scanned run's blocks
        stacked (once before a run's programs; a call given the unrolled layout stacks them
        itself)."""
        return self.module.stack_params(params) if self.module.scan else params


class _Body(nn.Module):
    """One layer: the block on the carry and the shared inputs; (new carry, nothing)."""

    block: Any  # the block's Flax module class
    fields: tuple  # its constructor's positional fields
    ops: SiteOps
    after: Any = None  # after(ops, block module, output) -> output

    @nn.compact
    def __call__(self, carry, *shared):
        with self.ops.one_trace():  # nn.scan may trace the body more than once: record one
            block = self.block(*self.fields, name=LAYER)
            out = block(*carry, *shared)
            if self.after is not None:
                out = self.after(self.ops, block, out)
        return (out if isinstance(out, tuple) else (out,)), None


class Layers(nn.Module):
    """`n` blocks `block(*fields)` as one scanned loop: `Layers(...)(carry, *shared)` with
    `carry` a tuple of the arrays every block takes first and returns."""

    block: Any
    fields: tuple
    n: int
    ops: SiteOps = IDENTITY  # the blocks' site ops (their byte models count the n layers)
    after: Any = None  # after(ops, block module, output) -> output, inside the loop

    @nn.compact
    def __call__(self, carry: tuple, *shared):
        scan = nn.scan(
            _Body,
            variable_axes={True: 0},  # every collection per layer
            split_rngs={"params": True},
            in_axes=(nn.broadcast,) * len(shared),
            metadata_params={nn.PARTITION_NAME: None},  # FSDP's boxed shares: a layer axis
            length=self.n,
        )
        with self.ops.repeated(self.n):
            out, _ = scan(self.block, self.fields, self.ops, self.after, name="scan")(
                tuple(carry), *shared
            )
        return out


def runs(kinds) -> list[tuple[int, int]]:
    """[lo, hi) of every run of consecutive equal `kinds` (one kind per block: blocks of one
    kind are identical and can share a scanned loop)."""
    out, lo = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[lo]:
            out.append((lo, i))
            lo = i
    return out


def scanned_runs(kinds) -> list[tuple[int, int]]:
    """The runs a model with `scan` on runs as loops: those of two blocks or more."""
    return [(lo, hi) for lo, hi in runs(kinds) if hi - lo > 1]


def key(name: str, lo: int) -> str:
    """The parameters' key of the scanned run of blocks `name`_<i> starting at block `lo`."""
    return f"{name}_scan_{lo}"


def stack(params: dict, name: str, kinds) -> dict:
    """Unrolled parameters (`<name>_<i>`) -> each scanned run's stacked (`<name>_scan_<lo>`:
    {"scan": {"layer": leaves (hi - lo, ...)}}), the other blocks and keys as they are.
    Parameters already stacked are returned as they are."""
    out = dict(params)
    for lo, hi in scanned_runs(kinds):
        names = [f"{name}_{i}" for i in range(lo, hi)]
        if key(name, lo) in out and names[0] not in out:
            continue
        missing = [k for k in names if k not in out]
        if missing:
            raise ValueError(
                f"cannot stack blocks {name}_{lo}..{hi - 1}: {missing[0]} is missing from the "
                f"parameters"
            )
        parts = [out.pop(k) for k in names]
        out[key(name, lo)] = {"scan": {LAYER: jax.tree.map(lambda *xs: jnp.stack(xs), *parts)}}
    return out


def stack_nested(params: dict, name: str) -> dict:
    """`stack` in every dict of a nested parameter tree that holds blocks `<name>_0` and
    `<name>_1` (identical blocks numbered from 0: a UNet's transformers)."""
    if not isinstance(params, dict):
        return params
    out = {k: stack_nested(v, name) for k, v in params.items()}
    if f"{name}_0" in out and f"{name}_1" in out:
        n = sum(1 for k in out if k.startswith(f"{name}_") and k[len(name) + 1 :].isdigit())
        out = stack(out, name, [0] * n)
    return out


def build(model, name: str, kinds, make, after=None) -> None:
    """In a model's `setup`: its blocks `<name>_<i>` (one kind per block in `kinds`), each its
    own module (`model.<name>[str(i)]`), or with `model.scan` each run of two or more
    identical blocks as one `Layers` loop (`model.<name>_scan_<lo>`) and the others unrolled.
    `make(i)`: (block class, its constructor's fields) of block i; `after(ops, block, out)`:
    what the model does to a block's output before the next block reads it."""
    loops = scanned_runs(kinds) if model.scan else []
    looped = {i for lo, hi in loops for i in range(lo, hi)}
    blocks = {}
    for i in range(len(kinds)):
        if i not in looped:
            cls, fields = make(i)
            blocks[str(i)] = cls(*fields)
    setattr(model, name, blocks)
    for lo, hi in loops:
        setattr(model, key(name, lo), Layers(*make(lo), hi - lo, model.ops, after))


def run(model, name: str, kinds, lo: int, hi: int, carry: tuple, shared: tuple, one) -> tuple:
    """Blocks [lo, hi) of `build`'s stack on `carry` (a tuple); `one(i, carry)` runs unrolled
    block i. A scanned run runs whole: ValueError where [lo, hi) cuts one."""
    loops = {a: b for a, b in scanned_runs(kinds)} if model.scan else {}
    for a, b in loops.items():
        if a < lo < b or a < hi < b:
            raise ValueError(
                f"{name} [{lo}, {hi}) cuts the scanned run of blocks [{a}, {b}): with "
                f"model.scan_blocks on, a scanned run runs whole; turn scan_blocks off for a "
                f"step cache or strategy that runs blocks apart"
            )
    i = lo
    while i < hi:
        if i in loops:
            carry = getattr(model, key(name, i))(carry, *shared)
            i = loops[i]
        else:
            carry = one(i, carry)
            i += 1
    return carry


def refuse_apart(name: str, i: int) -> None:
    """ValueError: block `name`_`i` runs inside a scanned run of blocks, so it cannot run
    alone (as a step cache's first block, TeaCache's first-block input or a stage would)."""
    raise ValueError(
        f"{name}_{i} runs inside a scanned run of blocks: with model.scan_blocks on, a scanned "
        f"run runs whole; turn scan_blocks off for a step cache or strategy that runs blocks apart"
    )
