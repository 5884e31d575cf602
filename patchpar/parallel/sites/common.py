"""What every site op shares (docs/design.md §2): the phase names, the Flax collections that
hold stale buffers and pending sends, the trace-time log of site calls for the analytic byte
models, and `exchange`, the one place where the patch axis's collectives are issued.

A site op is a small frozen dataclass, one per site kind, built by a strategy for one phase.
Its collectives all go through `exchange`, which sends a list of payloads (one dict per site)
with one collective per (collective, dtype) over their flat concatenation, inside the site's
`pp_<site>` named scope (so that `patchpar.measure.comm` attributes the bytes to the site):
- `gather`: all-gather over `patch` -> (n, *shape), patches in order;
- `other`: on a patch axis of 2, the other device's payload (a gather's other half);
- `down`: device i receives device i-1's payload, device 0 zeros;
- `up`: device i receives device i+1's payload, the last device zeros;
- `mean`: the mean over `patch` (all-reduce).
On a patch axis of 2 every collective is a swap, one collective-permute 0 <-> 1 (the same
bytes; over gloo a permute's latency is a fraction of an all-gather's or all-reduce's):
`other` is one; `down` and `up` of the same dtype and size go as one; `mean` swaps and
averages the two, (x + other) / 2, the same value on both devices, as the all-reduce's.
A stand-in (`local`) does the same arithmetic on its own payload in place of the other's.
One flat buffer per (collective, dtype) on a CPU; on a TPU or GPU every payload its own
collective (`packs_flat`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from patchpar.parallel.codecs import Codec, from_rows, rows_bytes, to_rows
from patchpar.parallel.mesh import PATCH
from patchpar.parallel.sites.compress import Link
from patchpar.parallel.split import Rows, is_even

PHASES = ("warmup", "steady")  # exact exchanges (and buffers written), then stale ones
STALE = "stale"  # Flax collection: the buffers a stale site reads at step t (written at t-1)
SEND = "send"  # Flax collection: a steady site's pending sends, exchanged packed by the engine
COLLECTIVES = ("gather", "other", "down", "up", "mean")

_LOG: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "patchpar_site_log", default=None
)


@contextlib.contextmanager
def record_sites():
    """Collect (op, info) for every site call traced inside the block (for the analytic byte
    models, `op.received_bytes(info, p)`; tracing only, nothing is computed)."""
    log: list = []
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


@contextlib.contextmanager
def shapes_only():
    """Inside the block site calls are not recorded (for tracing a module's parameter shapes:
    `jax.eval_shape` of its init; the ops there should be `with_stand_ins()` ones)."""
    token = _LOG.set(None)
    try:
        yield
    finally:
        _LOG.reset(token)


_TRACES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "patchpar_site_traces", default=None
)


@contextlib.contextmanager
def repeated(n: int):
    """Site calls traced inside the block run `n` times (the body of a scanned stack of
    blocks, `patchpar.models.scan`): recorded n times. The body is traced inside `one_trace`,
    and of its traces (a lifted scan may trace it more than once) the last one counts."""
    log = _LOG.get()
    if log is None:
        yield
        return
    traces: list = []
    token = _TRACES.set(traces)
    try:
        yield
    finally:
        _TRACES.reset(token)
    if traces:
        log.extend(traces[-1] * n)


@contextlib.contextmanager
def one_trace():
    """One trace of a repeated body (`repeated`): its site calls recorded apart."""
    traces = _TRACES.get()
    if traces is None:
        yield
        return
    body: list = []
    token, outer = _LOG.set(body), _TRACES.set(None)
    try:
        yield
    finally:
        _TRACES.reset(outer)
        _LOG.reset(token)
    traces.append(body)


def note(op, **info) -> None:
    """Record one site call (shapes and sizes) for the analytic byte models."""
    log = _LOG.get()
    if log is not None:
        log.append((op, info))


def bits(dtype) -> int:
    """Bits per element (int4: 4, not its 1-byte itemsize)."""
    dt = jnp.dtype(dtype)
    for info in (jnp.iinfo, jnp.finfo):  # ml_dtypes' int4, float8 and bfloat16 included
        try:
            return info(dt).bits
        except ValueError:
            pass
    return 8 * dt.itemsize


def nbytes(info: dict) -> int:
    """One device's operand bytes of a recorded site call (an itemsize of 0.5: int4 values,
    packed two to a byte)."""
    return math.ceil(math.prod(info["shape"]) * info["itemsize"])


@dataclass(frozen=True)
class Site:
    """One site kind's op. `local`: every collective is a stand-in of the same shape (no
    communication, wrong values: each device's compute alone, `Plan(comm=False)`)."""

    kind: ClassVar[str] = "site"
    local: bool = False

    def received_bytes(self, info: dict, p: int) -> int:
        """Bytes device p of the patch axis receives for one call (the conventions of
        `patchpar.measure.comm`), from the op's rules and the call's local shapes alone."""
        raise NotImplementedError

    def released_bytes(self, info: dict, p: int) -> int:
        """The same for the released code's traffic pattern (analytic only); patchpar's own by
        default."""
        return self.received_bytes(info, p)

    def sends_stale(self) -> bool:
        """Whether this op, in the steady phase, sends for a stale buffer (what is packed)."""
        return False

    def padding_bytes(self, info: dict, p: int) -> int:
        """Of `received_bytes`, those that are padding (uneven patches: a slab's rows after its
        patch's own, `parallel.split`); 0 by default (a halo's rows and the statistics are
        all image)."""
        return 0


@dataclass(frozen=True)
class PatchSite(Site):
    """A site over the row patches: `n` devices on the patch axis, in one phase. `packed`:
    in the steady phase, leave the sends for the engine's packed exchange
    (`patchpar.parallel.exchange`) instead of exchanging at the site. `link`: how the steady
    phase's payloads are compressed and extrapolated (`sites.compress.Link`; None: sent as
    they are). `wire`: a per-token codec (`codecs.to_rows`) every exact exchange of the site
    goes through (an exact strategy's fp8 on the wire; stateless: each payload is coded, sent
    and decoded in the same step; None: sent as they are). `rows`: the latent rows of each
    patch where they differ (`parallel.split`: every slab padded to the largest patch's rows;
    None: an even split, no padding). `slab`: the latent rows of the local slab where it holds
    its patch's own rows alone (`split.Rows.own_slab`; None: padded)."""

    n: int = 1
    phase: str = "warmup"
    packed: bool = False
    link: Link | None = None
    wire: Codec | None = None
    rows: tuple[int, ...] | None = None
    slab: int | None = None
    buffers: ClassVar[tuple[str, ...]] = ()  # the stale buffers a send of this site refreshes

    def __post_init__(self):
        if self.phase not in PHASES:
            raise ValueError(f"phase={self.phase!r}; known: {list(PHASES)}")

    @property
    def warmup(self) -> bool:
        return self.phase == "warmup"

    @property
    def split(self) -> Rows | None:
        """The uneven split's per-device figures (`split.Rows`); None where it is even."""
        return None if is_even(self.rows) else Rows(self.rows, self.local, self.slab)

    def send(self, mod, sends: dict[str, jax.Array]) -> None:
        """A stale site's exchange for step t+1: with `packed`, left in the `send` collection
        for the engine; otherwise exchanged here and its new stale buffers written."""
        wire = self.link.encode(mod, self.kind, sends) if self.link else sends
        if self.packed:
            mod.variable(SEND, self.kind, lambda: wire)
            return
        got = exchange(self.kind, [wire], self.n, self.local)[0]
        held = self.link.held(mod, self.kind, sends) if self.link else {}
        for name, value in self.absorb(got, held, wire).items():
            mod.put_variable(STALE, name, value)

    def exchange_now(self, mod, sends: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A fresh exchange at the site: what was received, or with a link in the steady phase
        the estimate of it (its variables updated)."""
        if self.link is None or self.warmup:
            if self.wire is not None:
                wire = {c: to_rows(x, self.wire) for c, x in sends.items()}
                got = exchange(self.kind, [wire], self.n, self.local)[0]
                return {c: from_rows(got[c], self.wire, sends[c].dtype) for c in got}
            got = exchange(self.kind, [sends], self.n, self.local)[0]
            if self.link is not None:
                self.link.start(mod, self.kind, sends, got)
            return got
        wire = self.link.encode(mod, self.kind, sends)
        got = exchange(self.kind, [wire], self.n, self.local)[0]
        held = self.link.held(mod, self.kind, sends)
        est, new = self.link.update(self.kind, wire, got, held)
        for name, value in new.items():
            mod.put_variable(STALE, name, value)
        return est

    def absorb(self, got: dict, held: dict, sent: dict) -> dict[str, jax.Array]:
        """The new stale variables from what a send received (`held`: the site's stale
        variables before; `sent`: its own wire payloads)."""
        if self.link is None:
            return self.receive(got)
        est, new = self.link.update(self.kind, sent, got, held)
        return {**self.receive(est), **new}

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes one payload of `shape` takes on the wire in this phase."""
        if self.warmup or self.link is None:
            return rows_bytes(shape, itemsize, self.wire)
        return self.link.wire_bytes(shape, itemsize)

    def receive(self, got: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The stale buffers for step t+1 from what a send received: {buffer name: value}."""
        raise NotImplementedError


class CollectiveInBranch(Exception):
    """A site exchanged inside a call traced under `no_collectives` (a program's branch, which
    only some devices run: a collective there would wait for the others forever)."""


_NO_COLLECTIVES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "patchpar_no_collectives", default=False
)


@contextlib.contextmanager
def no_collectives():
    """Inside the block a site that exchanges raises `CollectiveInBranch` (while tracing); the
    site calls recorded in the block are kept only if it ends without."""
    token = _NO_COLLECTIVES.set(True)
    outer = _LOG.get()
    log_token = _LOG.set([] if outer is not None else None)
    try:
        yield
        if outer is not None:
            outer.extend(_LOG.get())
    finally:
        _LOG.reset(log_token)
        _NO_COLLECTIVES.reset(token)


def exchange(
    site: str, sends: Sequence[dict[str, jax.Array]], n: int, local: bool = False
) -> list[dict[str, jax.Array]]:
    """Exchange every payload of `sends` (one dict {collective: array} per site) over the patch
    axis of `n` devices: one collective per (collective, dtype) over the flat concatenation of
    those payloads, in the `pp_<site>` scope. Returns what each site received, in its shapes
    (`gather`: a leading axis of n)."""
    if _NO_COLLECTIVES.get() and not local:
        raise CollectiveInBranch(site)
    got: list[dict[str, jax.Array]] = [{} for _ in sends]
    groups: dict[tuple[str, jnp.dtype], list[int]] = {}
    for i, s in enumerate(sends):
        for c, a in s.items():
            if c not in COLLECTIVES:
                raise ValueError(f"unknown collective {c!r}; known: {list(COLLECTIVES)}")
            if c == "other" and n != 2:
                raise ValueError(f"collective 'other' needs a patch axis of 2, not {n}")
            groups.setdefault((c, jnp.dtype(a.dtype)), []).append(i)
    if not packs_flat():  # each payload its own collective, issued together
        groups = {(c, dt, i): [i] for (c, dt), members in groups.items() for i in members}
    with jax.named_scope(f"pp_{site}"):
        for key, members in groups.items():
            c, dt = key[:2]
            if c == "up" and n == 2 and ("down", dt) + key[2:] in groups:
                continue  # went with `down` as one swap
            flat = _pack([sends[i][c] for i in members])
            if c == "down" and n == 2 and ("up", dt) + key[2:] in groups:
                ups = groups[("up", dt) + key[2:]]
                flat_up = _pack([sends[i]["up"] for i in ups])
                if flat_up.shape == flat.shape:
                    down, up = _swap(flat, flat_up, local)
                    _unpack(down, members, sends, "down", got)
                    _unpack(up, ups, sends, "up", got)
                    continue
                _unpack(_collective("up", flat_up, n, local), ups, sends, "up", got)
            _unpack(_collective(c, flat, n, local), members, sends, c, got)
    return got


def packs_flat() -> bool:
    """Whether `exchange` packs the payloads of one collective kind and dtype into one flat
    buffer: on a CPU, where each collective pays gloo's latency. On a TPU or GPU flattening is
    a relayout copy of every payload at both ends (its tiled layout is not a flat one), and
    the collectives are asynchronous and cheap to issue: each payload goes as a collective of
    its own, all issued at the same point of the program."""
    return jax.default_backend() == "cpu"


def _pack(parts: list[jax.Array]) -> jax.Array:
    if len(parts) == 1:
        return parts[0]
    return jnp.concatenate([p.reshape(-1) for p in parts])


def _unpack(received, members, sends, c, got) -> None:
    """Cut a collective's result back into the members' shapes (a gather keeps its n axis)."""
    if len(members) == 1:
        got[members[0]][c] = received
        return
    lead = received.shape[:1] if c == "gather" else ()
    at = 0
    for i in members:
        shape = sends[i][c].shape
        size = math.prod(shape)
        piece = received[:, at : at + size] if lead else received[at : at + size]
        got[i][c] = piece.reshape(lead + shape)
        at += size


def stand_in(x):
    """What a collective's local stand-in returns (`Plan(comm=False)`: one device's compute
    alone): `x`, opaque to XLA's passes, as a real collective's result is. A bare broadcast
    standing in for an all-gather was moved by XLA into the attention kernel's loop over query
    blocks and rebuilt there once per block (PixArt-α at 1024² on 4 patches, TPU v5e: 12 of the
    program's 46 ms, results/tpu_v5e/shards_n4_profiled/ops.md); a real gather's result is
    made once, where it arrives."""
    return lax.optimization_barrier(x)


def _collective(c: str, x: jax.Array, n: int, local: bool) -> jax.Array:
    if c == "gather":  # (n, *x.shape); the stand-in repeats the local part n times (n, not the
        # mesh's axis size: experiments/device/shard_timing.py runs one device's program of an
        # n-way plan on a one-device mesh)
        if local:
            return stand_in(jnp.broadcast_to(x, (n,) + x.shape))
        return lax.all_gather(x, PATCH, axis=0)
    if c == "other":
        return stand_in(x) if local else _swapped(x)
    if c == "mean" and n == 2:
        return (x + (stand_in(x) if local else _swapped(x))) / 2
    if local:
        return stand_in(x)
    if c == "mean":
        return lax.pmean(x, PATCH)
    if c == "down":
        return lax.ppermute(x, PATCH, [(i, i + 1) for i in range(n - 1)])
    return lax.ppermute(x, PATCH, [(i + 1, i) for i in range(n - 1)])


def _swapped(x: jax.Array) -> jax.Array:
    """On a patch axis of 2: the other device's x."""
    return lax.ppermute(x, PATCH, [(0, 1), (1, 0)])


def _swap(down: jax.Array, up: jax.Array, local: bool) -> tuple[jax.Array, jax.Array]:
    """On a patch axis of 2: device 0 sends its `down` payload to device 1, device 1 its `up`
    payload to device 0, by one collective-permute. -> (received down, received up), zeros
    where nothing comes (as `down` and `up` apart)."""
    first = lax.axis_index(PATCH) == 0
    got = jnp.where(first, down, up)
    got = stand_in(got) if local else _swapped(got)
    zero = jnp.zeros_like(got)
    return jnp.where(first, zero, got), jnp.where(first, got, zero)
