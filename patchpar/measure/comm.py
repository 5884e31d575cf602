"""Communication bytes from HLO text: every collective of a program, the bytes each device
receives, attributed to the site kind that issued it (docs/design.md §5).

Convention, per collective over a group of n devices, S = bytes of one device's operand:
- collective-permute: a device receives S for each source->target pair that targets it;
- all-gather: (n-1) x S (the other devices' parts);
- all-reduce: 2 (n-1)/n x S (ring: reduce-scatter, then all-gather);
- reduce-scatter: (n-1)/n x S;  all-to-all: (n-1)/n x S.
S sums every operand of a tuple collective; `replica_groups={}` is one group of all devices.
Async `-start`/`-done` pairs count once (at the start), sized by their operand part; an op
wrapped in a generic `async-start(..., calls=...)` is counted from the wrapped computation. Site kinds come from the named scopes
the parallel layer puts around its collectives (`pp_halo`, `pp_gn`, `pp_kv`, `pp_cfg`,
`pp_tp`, `pp_fsdp`, `pp_pipe`, `pp_text`, `pp_cache`).
Use the pre-optimisation HLO to count bf16 as bf16: the CPU backend upcasts bf16 collectives.
A collective inside a while loop (a scanned stack of blocks) counts as often as the loop runs
(`measure.flops.computation_runs`: its trip count, where a constant bounds it); `outer_once`
counts the entry's own loops once (a phase's loop over steps, whose body is one step).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from patchpar.measure.flops import computation_runs
from patchpar.measure.hlo import hlo_text_with_metadata  # noqa: F401 (its public name here too)

DTYPE_BYTES = {  # bytes per element (int4: half a byte, XLA's packed s4/u4)
    "s4": 0.5,
    "u4": 0.5,
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
SITES = (
    "halo",
    "gn",
    "kv",
    "cfg",
    "tp",
    "fsdp",
    "pipe",
    "text",
    "cache",
)  # pp_<site> scopes; anything else is "other"

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+[({]")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>\(.*?\)|\w+\[[^\]]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>" + "|".join(OPS) + r")(?P<async>-start|-done)?\("
)
_ARRAY_AT = re.compile(r"(\w+)\[([^\]]*)\](?:\{[^}]*\})?")


Shape = tuple[tuple[str, tuple[int, ...]], ...]  # arrays (dtype, dims), flattened


@dataclass(frozen=True)
class Collective:
    op: str  # one of OPS
    operand: Shape  # one device's operand(s); a tuple collective has several
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute source -> target
    groups: tuple[tuple[int, ...], ...] = ()  # replica groups (device ids); () = all devices
    site: str = "other"
    is_async: bool = False

    def operand_bytes(self) -> int:
        """Bytes of one device's operand(s) (the unit S of the convention above)."""
        return sum(
            math.ceil(int(np.prod(d, dtype=np.int64)) * DTYPE_BYTES[t]) for t, d in self.operand
        )

    def group_list(self, num_devices: int) -> tuple[tuple[int, ...], ...]:
        """The replica groups; `replica_groups={}` (or none) is one group of every device."""
        return self.groups or (tuple(range(num_devices)),)

    def received(self, num_devices: int) -> np.ndarray:
        """Bytes each device receives, (num_devices,) int64."""
        out = np.zeros(num_devices, np.int64)
        s = self.operand_bytes()
        if self.op == "collective-permute":
            for _, dst in self.pairs:
                out[dst] += s
            return out
        for group in self.group_list(num_devices):
            n = len(group)
            per = {
                "all-gather": (n - 1) * s,
                "all-reduce": 2 * (n - 1) * s // n,
                "reduce-scatter": (n - 1) * s // n,
                "all-to-all": (n - 1) * s // n,
            }[self.op]
            out[list(group)] += per
        return out


def _split_type(text: str):
    """An HLO type as nested tuples of (dtype, dims) arrays: `(f32[2], (bf16[3,4]{1,0}))`."""
    text = re.sub(r"/\*.*?\*/", "", text)  # long tuples carry /*index=5*/ comments
    pos = 0

    def parse():
        nonlocal pos
        while text[pos] == " ":
            pos += 1
        if text[pos] == "(":
            pos += 1
            items = []
            while True:
                while text[pos] in " ,":
                    pos += 1
                if text[pos] == ")":
                    pos += 1
                    return tuple(items)
                items.append(parse())
        m = _ARRAY_AT.match(text, pos)
        if not m:
            raise ValueError(f"cannot parse HLO type {text!r} at {pos}")
        pos = m.end()
        dims = tuple(int(d) for d in m.group(2).split(",") if d.strip())
        return (m.group(1), dims)

    return parse()


def _flat(t) -> Shape:
    if isinstance(t[0], str):  # one array
        return ((t[0], t[1]),) if t[0] in DTYPE_BYTES else ()
    return tuple(a for item in t for a in _flat(item))


def _operand(op: str, is_async: bool, type_text: str, groups) -> Shape:
    """One device's operand(s) from the instruction's result type. An async `-start` returns
    (operands, results, ...) and its first element is the operand (all-reduce-start returns
    just the results, the operand's shape); a synchronous op returns its results."""
    t = _split_type(type_text)
    if is_async and op != "all-reduce":
        return _flat(t[0])
    arrays = _flat(t)
    if op in ("all-gather", "reduce-scatter"):  # result = operand x or / group size
        g = len(groups[0])
        out = []
        for dt, dims in arrays:  # which dimension was gathered does not matter: (elements,)
            n = int(np.prod(dims, dtype=np.int64))
            out.append((dt, (n // g if op == "all-gather" else n * g,)))
        return tuple(out)
    return arrays


def _parse_groups(attr: str) -> tuple[tuple[int, ...], ...]:
    attr = attr.strip()
    if attr.startswith("{"):  # `{}` has no groups: every device (see Collective.group_list)
        groups = (
            tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"\{([\d,\s]*)\}", attr)
        )
        return tuple(g for g in groups if g)
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


def parse_collectives(
    hlo_text: str, num_devices: int | None = None, outer_once: bool = False
) -> list[Collective]:
    """Every collective in an HLO module's text (`-done` halves of async pairs skipped), one
    entry per time it runs (a loop's body: its trip count). `num_devices` resolves
    `replica_groups={}` (all devices) for all-gather / reduce-scatter, whose operand size
    depends on the group size; `outer_once`: the entry's own loops run once."""
    runs = computation_runs(hlo_text, outer_once)
    out = []
    comp = None
    for line in hlo_text.splitlines():
        if (h := _HEADER.match(line)) and line.rstrip().endswith("{"):
            comp = h.group("name")
            continue
        m = _INSTR.match(line)
        if not m or m.group("async") == "-done":
            continue
        op, is_async = m.group("op"), m.group("async") == "-start"
        pairs = ()
        if op == "collective-permute":
            pairs = tuple(
                tuple(g) for g in _parse_groups(_attr(line, "source_target_pairs") or "{}")
            )
        groups = ()
        if (g := _attr(line, "replica_groups")) is not None:
            groups = _parse_groups(g)
        if not groups and num_devices is not None:  # replica_groups={}: every device
            groups = (tuple(range(num_devices)),)
        if op in ("all-gather", "reduce-scatter") and not groups and not is_async:
            raise ValueError(
                f"{op} with replica_groups={{}} (all devices): pass num_devices to size it"
            )
        operand = _operand(op, is_async, m.group("type"), groups)
        op_name = re.search(r'op_name="([^"]*)"', line)
        site = "other"
        if op_name:
            found = [s for s in SITES if f"pp_{s}" in op_name.group(1)]
            site = found[-1] if found else "other"
        out += [Collective(op, operand, pairs, groups, site, is_async)] * runs.get(comp, 1)
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
    return count_collectives(parse_collectives(hlo_text, num_devices), num_devices)


def count_collectives(collectives: list[Collective], num_devices: int) -> CommCount:
    count = CommCount(num_devices)
    for c in collectives:
        count.add(c.site, c.received(num_devices))
    return count


def collective_groups(collectives: list[Collective], num_devices: int) -> list[dict]:
    """Collectives grouped by (op, group size, site): how many, and the bytes the busiest device
    receives summed over them; what a latency model needs (patchpar/measure/projection.py)."""
    groups: dict[tuple[str, int, str], dict] = {}
    for c in collectives:
        n = max(len(g) for g in c.group_list(num_devices))
        if c.op == "collective-permute":  # the devices a permute connects
            n = len({d for pair in c.pairs for d in pair}) or 1
        g = groups.setdefault(
            (c.op, n, c.site),
            {"op": c.op, "group": n, "site": c.site, "count": 0, "received_bytes": 0},
        )
        g["count"] += 1
        g["received_bytes"] += int(c.received(num_devices).max())
    return [groups[k] for k in sorted(groups)]
