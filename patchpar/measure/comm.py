"""Communication bytes from HLO text: every collective of a program, the bytes each device
receives, attributed to the site kind that issued it (DESIGN.md §4).

Convention, per collective over a group of n devices, S = bytes of one device's operand:
- collective-permute: a device receives S for each source->target pair that targets it;
- all-gather: (n-1) x S (the other devices' parts);
- all-reduce: 2 (n-1)/n x S (ring: reduce-scatter, then all-gather);
- reduce-scatter: (n-1)/n x S;  all-to-all: (n-1)/n x S.
Async `-start`/`-done` pairs count once (at the start). Site kinds come from the named scopes
the parallel layer puts around its collectives (`pp_halo`, `pp_gn`, `pp_kv`, `pp_cfg`).
Use the pre-optimisation HLO to count bf16 as bf16: the CPU backend upcasts bf16 collectives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
OPS = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
SITES = ("halo", "gn", "kv", "cfg")  # pp_<site> scopes; anything else is "other"

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(OPS) + r")(?P<async>-start|-done)?\("
)
_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")


@dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # the result type's arrays (dtype, dims)
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute source -> target
    groups: tuple[tuple[int, ...], ...] = ()  # replica groups (device ids)
    site: str = "other"
    is_async: bool = False

    def operand_bytes(self) -> int:
        """Bytes of one device's operand (the unit S of the convention above)."""
        sizes = [int(np.prod(d, dtype=np.int64)) * DTYPE_BYTES[t] for t, d in self.arrays]
        if self.op == "collective-permute":
            return sizes[0]  # async start: (operand, result, contexts...)
        if self.op == "all-gather":
            if self.is_async:  # (operand, result)
                return sizes[0]
            return sizes[0] // self.group_size()
        if self.op == "reduce-scatter":
            return sum(sizes) * self.group_size()
        return sum(sizes)  # all-reduce (possibly a tuple of operands), all-to-all

    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    def received(self, num_devices: int) -> np.ndarray:
        """Bytes each device receives, (num_devices,) int64."""
        out = np.zeros(num_devices, np.int64)
        s = self.operand_bytes()
        if self.op == "collective-permute":
            for _, dst in self.pairs:
                out[dst] += s
            return out
        for group in self.groups or (tuple(range(num_devices)),):
            n = len(group)
            per = {
                "all-gather": (n - 1) * s,
                "all-reduce": 2 * (n - 1) * s // n,
                "reduce-scatter": (n - 1) * s // n,
                "all-to-all": (n - 1) * s // n,
            }[self.op]
            out[list(group)] += per
        return out


def _parse_groups(attr: str) -> tuple[tuple[int, ...], ...]:
    attr = attr.strip()
    if attr.startswith("{"):
        return tuple(
            tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", attr)
        )
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attr)  # iota form
    if not m:
        raise ValueError(f"cannot parse replica groups {attr!r}")
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape))


def _attr(line: str, name: str) -> str | None:
    m = re.search(
        name + r"=(\{(?:[^{}]|\{[^{}]*\})*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line
    )
    return m.group(1) if m else None


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text (`-done` halves of async pairs skipped)."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group("async") == "-done":
            continue
        arrays = tuple(
            (t, tuple(int(d) for d in dims.split(",") if d.strip()))
            for t, dims in _ARRAY.findall(m.group("type"))
            if t in DTYPE_BYTES
        )
        pairs = ()
        if m.group("op") == "collective-permute":
            pairs = tuple(
                tuple(g) for g in _parse_groups(_attr(line, "source_target_pairs") or "{}")
            )
        groups = ()
        if (g := _attr(line, "replica_groups")) is not None:
            groups = _parse_groups(g)
        op_name = re.search(r'op_name="([^"]*)"', line)
        site = "other"
        if op_name:
            found = [s for s in SITES if f"pp_{s}" in op_name.group(1)]
            site = found[-1] if found else "other"
        out.append(
            Collective(m.group("op"), arrays, pairs, groups, site, m.group("async") == "-start")
        )
    return out


@dataclass
class CommCount:
    """Bytes received per device, by site kind: (num_devices,) arrays."""

    num_devices: int
    by_site: dict[str, np.ndarray] = field(default_factory=dict)

    def add(self, site: str, received: np.ndarray) -> None:
        self.by_site[site] = self.by_site.get(site, np.zeros(self.num_devices, np.int64)) + received

    @property
    def per_device(self) -> np.ndarray:
        total = np.zeros(self.num_devices, np.int64)
        for v in self.by_site.values():
            total = total + v
        return total

    def summary(self) -> dict:
        """max (the bottleneck device), mean and total over devices, overall and by site."""

        def stats(v):
            return {"max": int(v.max()), "mean": float(v.mean()), "total": int(v.sum())}

        sites = {k: stats(v) for k, v in sorted(self.by_site.items()) if v.any()}
        return {"all": stats(self.per_device), **sites}


def count_hlo(hlo_text: str, num_devices: int) -> CommCount:
    count = CommCount(num_devices)
    for c in parse_collectives(hlo_text):
        count.add(c.site, c.received(num_devices))
    return count


def hlo_text_with_metadata(lowered) -> str:
    """Pre-optimisation HLO of a `jax.jit(...).lower(...)` result, with op_name metadata."""
    from jaxlib import _hlo

    options = _hlo.HloPrintOptions()
    options.print_metadata = True
    options.print_large_constants = False
    return lowered.compiler_ir("hlo").as_hlo_module().to_string(options)
