"""FLOPs of a lowered program with every loop counted as often as it runs.

XLA's cost analysis (`Lowered.cost_analysis`) counts a while loop's body once, whatever its
trip count. A blockwise attention kernel (`chunked`: a `lax.scan` over key/value blocks around
a `lax.map` over query blocks) is such a loop, so its FLOPs came out as one block's: SD 1.5
at 512² on 2 devices counted 682 G per call with `chunked` against 804 G with `xla`. Here the
pre-optimisation HLO module is read as computations; each while loop's trip count is read from
its condition (`counter < N`, the counter's initial value a constant: what `lax.scan`,
`lax.map` and a `fori_loop` with static bounds lower to), and

    F(c) = X(c) + sum over the loops w of c: n_w F(body_w) - X(body_w)

where X is XLA's own count of a computation (its loops once) and F the count with loops
unrolled; a `conditional` counts its most expensive branch, as XLA's does. XLA's cost model
stays the one unit (every other op is counted as XLA counts it), so `xla` and `chunked` agree
within their own work: the online softmax's rescaling is the only difference. A kernel that is
a custom call (`cudnn`, `splash`) has no FLOPs in XLA's analysis, so its attention is not
counted: compare FLOPs of `xla` or `chunked` programs.

`outer_once=True` counts the outermost loops once: a denoising phase's program is a loop over
steps, and its FLOPs per step are one iteration's (its inner loops unrolled).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from functools import cached_property

_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+[({]")  # `(params) -> type {` or `{`
_OPCODE = re.compile(r"\s*(?P<op>[\w\-]+)\(")
_ATTR = re.compile(
    r"\b(to_apply|body|condition|calls|true_computation|false_computation|select|scatter)"
    r"=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_OPERANDS = re.compile(r"%([\w.\-]+)")
_CONSTANT = re.compile(r"constant\((-?\d+)\)")
_INDEX = re.compile(r"index=(\d+)")
_DIRECTION = re.compile(r"direction=(\w+)")
_METADATA = re.compile(r", metadata=\{[^{}]*\}")


@dataclass
class _Instr:
    name: str
    op: str
    args: str  # the text inside the opcode's parentheses
    attrs: str  # what follows them
    root: bool
    type: str = ""  # the result's HLO type (`s32[2,64,32]{2,1,0}`)


@dataclass
class _Computation:
    name: str
    lines: list[str]
    entry: bool
    instrs: dict[str, _Instr] = field(default_factory=dict)
    root: str | None = None


_BRANCH_KINDS = ("branch", "true_computation", "false_computation")


def _called(instr: _Instr):
    """(kind, computation) of every computation an instruction calls."""
    yield from _ATTR.findall(instr.attrs)
    for kind, names in _BRANCHES.findall(instr.attrs):
        for callee in _OPERANDS.findall(names):
            yield ("branch" if kind == "branch_computations" else "called"), callee


def _skip_type(line: str, pos: int) -> int:
    """Position after the result type that starts at `pos` (a tuple type nests parentheses)."""
    while line[pos] == " ":
        pos += 1
    if line[pos] != "(":
        end = line.find(" ", pos)
        return len(line) if end < 0 else end
    depth = 0
    for i in range(pos, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return i + 1
    raise RuntimeError(f"unbalanced HLO type in {line!r}")


def _closing(line: str, pos: int) -> int:
    """Index of the parenthesis closing the one opened just before `pos`."""
    depth = 1
    for i in range(pos, len(line)):
        depth += {"(": 1, ")": -1}.get(line[i], 0)
        if depth == 0:
            return i
    return len(line)


def _parse(text: str) -> dict[str, _Computation]:
    comps: dict[str, _Computation] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{"):
                current = _Computation(m.group("name"), [line], bool(m.group(1)))
            continue
        current.lines.append(line)
        if line.strip() == "}":
            comps[current.name] = current
            current = None
            continue
        body = line.strip()
        root = body.startswith("ROOT ")
        body = body.removeprefix("ROOT ")
        name, eq, rest = body.partition(" = ")
        if not eq:
            continue
        after = _skip_type(rest, 0)
        m = _OPCODE.match(rest, after)
        if not m:
            continue
        close = _closing(rest, m.end())
        instr = _Instr(
            name.lstrip("%"), m.group("op"), rest[m.end() : close], rest[close:], root,
            rest[:after].strip(),
        )  # fmt: skip
        current.instrs[instr.name] = instr
        if root:
            current.root = instr.name
    return comps


class HloFlops:
    """The FLOPs of one HLO module's text, loops unrolled (see the module docstring)."""

    def __init__(self, text: str, backend):
        self.text = text
        self.backend = backend
        self.comps = _parse(text)
        self._x: dict[str, float] = {}
        self._corr: dict[tuple[str, bool], float] = {}
        self.loops: list[int | None] = []  # every loop's trip count met (None: not found)

    @cached_property
    def entry(self) -> str:
        return next(c.name for c in self.comps.values() if c.entry)

    def total(self, outer_once: bool = False) -> float:
        return self.xla(self.entry) + self._correction(self.entry, outer_once)

    # ------------------------------------------------------------------ XLA's count

    def xla(self, name: str) -> float:
        """XLA's cost analysis of computation `name` as an entry (its loops counted once)."""
        if name not in self._x:
            from jax._src.lib import _jax
            from jaxlib import _hlo

            module = _hlo.hlo_module_from_text(self._module_text(name))
            cost = _jax.hlo_module_cost_analysis(self.backend, module)
            self._x[name] = float(cost.get("flops", 0.0))
        return self._x[name]

    def _module_text(self, name: str) -> str:
        """A module whose entry is computation `name`, with every computation it reaches."""
        order, seen, todo = [], set(), [name]
        while todo:
            c = todo.pop()
            if c in seen or c not in self.comps:
                continue
            seen.add(c)
            order.append(c)
            todo += [callee for _, callee in self._callees(self.comps[c])]
        parts = []
        for c in reversed(list(self.comps)):  # callees before callers, as in the module
            if c not in seen:
                continue
            lines = [_METADATA.sub("", ln) for ln in self.comps[c].lines]
            head = lines[0].removeprefix("ENTRY ")
            lines[0] = ("ENTRY " + head) if c == name else head
            parts.append("\n".join(lines))
        return "HloModule flops_part\n\n" + "\n\n".join(reversed(parts)) + "\n"

    @staticmethod
    def _callees(comp: _Computation):
        for instr in comp.instrs.values():
            yield from _called(instr)

    # ------------------------------------------------------------------ loops

    def trip_count(self, comp: _Computation, instr: _Instr) -> int | None:
        """`n` of a while loop `counter < n` whose counter starts at a constant, else None."""
        attrs = dict(_ATTR.findall(instr.attrs))
        cond = self.comps.get(attrs.get("condition", ""))
        if cond is None or cond.root is None:
            return None
        cmp = cond.instrs[cond.root]
        if cmp.op != "compare" or (_DIRECTION.search(cmp.attrs) or [None, ""])[1] != "LT":
            return None
        lhs, rhs = (_OPERANDS.findall(cmp.args) + [None, None])[:2]
        counter, limit = cond.instrs.get(lhs), cond.instrs.get(rhs)
        if counter is None or limit is None or counter.op != "get-tuple-element":
            return None
        stop = _CONSTANT.search(limit.op + "(" + limit.args + ")")
        index = _INDEX.search(counter.attrs)
        init = comp.instrs.get((_OPERANDS.findall(instr.args) or [""])[0])
        if stop is None or index is None or init is None or init.op != "tuple":
            return None
        start_name = _OPERANDS.findall(init.args)[int(index.group(1))]
        start = comp.instrs.get(start_name)
        if start is None or start.op != "constant":
            return None
        first = _CONSTANT.search("constant(" + start.args + ")")
        return None if first is None else max(int(stop.group(1)) - int(first.group(1)), 0)

    def _correction(self, name: str, outer: bool) -> float:
        """F(c) - X(c) for computation `name`; `outer`: its loops are outermost, counted once."""
        key = (name, outer)
        if key in self._corr:
            return self._corr[key]
        comp = self.comps[name]
        corr = 0.0
        for instr in comp.instrs.values():
            attrs = dict(_ATTR.findall(instr.attrs))
            if instr.op == "while":
                n = self.trip_count(comp, instr)
                self.loops.append(n)
                body = attrs["body"]
                if n is None and not outer and self.xla(body):
                    warnings.warn(
                        f"a while loop ({instr.name}) whose trip count is not a constant bound: "
                        f"its body's FLOPs are counted once (a lower bound)",
                        stacklevel=2,
                    )
                n = 1 if (outer or n is None) else n
                inner = self._correction(body, False)
                corr += (n - 1) * self.xla(body) + n * inner if n != 1 else inner
            elif instr.op == "conditional":
                branches = [c for k, c in _called(instr) if k in _BRANCH_KINDS]
                fixes = [self._correction(b, outer) for b in branches]
                if any(fixes):
                    full = max(self.xla(b) + f for b, f in zip(branches, fixes, strict=True))
                    corr += full - max(self.xla(b) for b in branches)
            elif instr.op in ("call", "async-start"):
                callee = attrs.get("to_apply") or attrs.get("calls")
                if callee in self.comps:
                    corr += self._correction(callee, outer)
        self._corr[key] = corr
        return corr


def computation_runs(text: str, outer_once: bool = False) -> dict[str, int]:
    """How many times each computation of an HLO module's text runs per run of its entry: a
    while loop's body as often as its trip count says (once where it is not a constant bound),
    times its caller's. `outer_once`: the entry's own loops once (a phase's loop over steps)."""
    hlo = HloFlops(text, backend=None)
    runs: dict[str, int] = {}
    if not any(c.entry for c in hlo.comps.values()):
        return runs  # not a module this reading follows: every computation once

    def visit(name: str, n: int, outer: bool) -> None:
        runs[name] = runs.get(name, 0) + n
        comp = hlo.comps[name]
        for instr in comp.instrs.values():
            if instr.op == "while":
                k = hlo.trip_count(comp, instr)
                body = dict(_ATTR.findall(instr.attrs))["body"]
                visit(body, n * (1 if outer or k is None else k), False)
                continue
            for _, callee in _called(instr):
                if callee in hlo.comps and hlo.comps[callee].instrs:
                    visit(callee, n, outer)

    visit(hlo.entry, 1, outer_once)
    return runs


def program_flops(
    lowered, outer_once: bool = False, text: str | None = None, xla_flops: float | None = None
) -> float:
    """FLOPs per device of a lowered (`jax.jit(...).lower(...)`) program, every loop counted as
    often as it runs; `outer_once`: the outermost loops (a phase's steps) once. `text` (its
    pre-optimisation HLO, `hlo.hlo_text_with_metadata`) and `xla_flops` (its
    `cost_analysis()` FLOPs), where the caller has them already, save making them again."""

    if text is None:
        from patchpar.measure.hlo import hlo_text_with_metadata

        text = hlo_text_with_metadata(lowered)
    if xla_flops is None:
        xla_flops = float((lowered.cost_analysis() or {}).get("flops", float("nan")))
    try:
        count = HloFlops(text, _counting_backend())
        if xla_flops == xla_flops:  # a TPU's Lowered has no count before compiling: NaN
            count._x[count.entry] = xla_flops
        return count.total(outer_once)
    except Exception as e:  # a module this reading does not know: XLA's count, said to be low
        warnings.warn(
            f"FLOPs: the program's loops could not be read ({type(e).__name__}: {e}); XLA's "
            f"count, which takes each loop's body once, is used (a lower bound)",
            stacklevel=2,
        )
        return xla_flops


def _counting_backend():
    """The backend whose cost model counts: the CPU's where the process has one (one unit on
    every machine; a TPU client gives no FLOPs for a module before compiling it), else the
    default device's."""
    import jax

    try:
        return jax.devices("cpu")[0].client
    except RuntimeError:
        return jax.devices()[0].client


# ---------------------------------------------------------------- quantized products

QUANTIZED_TYPES = {"s8": "int8", "u8": "int8", "s4": "int4", "u4": "int4",
                   "f8e4m3fn": "fp8", "f8e5m2": "fp8"}  # fmt: skip
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")


class _QuantizedFlops(HloFlops):
    """`HloFlops` counting only the dots whose operands are int8/int4/fp8 (Qwix's quantized
    products), 2 x the result's elements x the contracted size each, loops unrolled as
    `HloFlops` unrolls XLA's count; `kinds` says which quantized types were met."""

    def __init__(self, text: str):
        super().__init__(text, backend=None)
        self.kinds: set[str] = set()

    def xla(self, name: str) -> float:
        if name in self._x:
            return self._x[name]
        comp = self.comps.get(name)
        total = 0.0
        for instr in comp.instrs.values() if comp else ():
            if instr.op == "dot":
                total += self._dot(comp, instr)
            called = list(_called(instr))
            branches = [c for k, c in called if k in _BRANCH_KINDS]
            total += sum(self.xla(c) for k, c in called if k not in _BRANCH_KINDS)
            total += max((self.xla(c) for c in branches), default=0.0)
        self._x[name] = total
        return total

    def _dot(self, comp: _Computation, instr: _Instr) -> float:
        operands = _OPERANDS.findall(instr.args)
        lhs = comp.instrs.get(operands[0]) if operands else None
        m = _ARRAY.match(lhs.type) if lhs is not None else None
        if m is None or m.group(1) not in QUANTIZED_TYPES:
            return 0.0
        self.kinds.add(QUANTIZED_TYPES[m.group(1)])
        dims = [int(d) for d in m.group(2).split(",") if d]
        contracted = _LHS_CONTRACTING.search(instr.attrs)
        k = 1
        for i in contracted.group(1).split(",") if contracted and contracted.group(1) else []:
            k *= dims[int(i)]
        out = _ARRAY.match(instr.type)
        n = 1
        for d in out.group(2).split(",") if out and out.group(2) else []:
            n *= int(d)
        return 2.0 * n * k


def quantized_flops(text: str, outer_once: bool = False) -> tuple[float, list[str]]:
    """(FLOPs of the quantized products, int8/int4/fp8 operands, of a program's
    pre-optimisation HLO `text`, loops counted as `program_flops` counts them; the quantized
    types met)."""
    q = _QuantizedFlops(text)
    return q.total(outer_once), sorted(q.kinds)
