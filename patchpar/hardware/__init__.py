"""Hardware profiles for the latency projection (patchpar/measure/projection.py): one YAML file
per chip and interconnect in this folder, every figure with its source.

A profile holds what a data sheet or a benchmark gives (peak dense FLOP/s, HBM bandwidth, link
bandwidth per direction, topology, per-collective latency) and a `compute` block with the
projection's fitted constants (at most 3), the points they were fitted on and the command that
fitted them, or `borrow: <profile>` to use another profile's constants (said in every output).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

FOLDER = Path(__file__).resolve().parent
TOPOLOGIES = {
    # how a device's collective traffic uses its links: bytes/s = link x efficiency x factor
    "nvswitch": 1.0,  # every GPU reaches every other at its full link rate (NVLink + NVSwitch)
    "pcie-switch": 1.0,  # peer-to-peer over PCIe through a switch or the root complex
    "pcie-host": 0.5,  # no peer-to-peer: each transfer is staged through host memory (two hops)
    "torus": 2.0,  # TPU ICI: a ring along one torus axis sends over both of its links at once
    "tcp": 1.0,  # processes over loopback TCP (gloo): measured per collective kind instead
    "ethernet": 1.0,  # one NIC per device through a switch, full duplex (NCCL over sockets)
}
OPS = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")
SOURCED = (  # figures that must name their source in `sources`
    "peak_flops",
    "hbm_bytes_per_s",
    "link_bytes_per_s",
    "topology",
    "link_efficiency",
    "collective_latency_s",
    "launch_s",
    "async_collectives",
)
REQUIRED = ("name", "description", *SOURCED, "compute", "sources")
MAX_FITTED = 3


@dataclass(frozen=True)
class Profile:
    """One chip and interconnect. Latency per collective of `op` over n devices, alpha(op) being
    its latency at 2 devices: alpha x (n - 1) for all-gather, reduce-scatter and all-reduce,
    which run as rings (n - 1 steps, each a hop; NCCL's rings, and its intra-node tree, a
    chain, alike), alpha x log2(n) for an all-to-all (direct sends), alpha for a
    collective-permute (one hop); bandwidth from the link, its efficiency and the topology, or
    measured per op (`collective_bytes_per_s`)."""

    name: str
    description: str
    peak_flops: float  # dense bf16 (fp32 for a CPU), per device
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per direction, per device
    topology: str
    link_efficiency: float  # fraction of the link a collective reaches (NCCL's bus bandwidth)
    collective_latency_s: dict[str, float]  # per op, at 2 devices
    launch_s: float  # host cost of issuing one collective: exposed even when it overlaps
    async_collectives: bool  # can a collective run while the device computes?
    flop_efficiency: float  # fitted: fraction of peak a large UNet call reaches
    call_overhead_s: float  # fitted: fixed time per model call (launches, small kernels)
    compute_note: str  # fitted on what (or borrowed from which profile)
    sources: dict[str, str] = field(default_factory=dict)
    # dense int8 / fp8 matrix peaks (None: no such units, the products are emulated)
    peak_flops_int8: float | None = None
    peak_flops_fp8: float | None = None
    collective_bytes_per_s: dict[str, float] = field(default_factory=dict)  # measured, per op
    path: str = ""

    def compute_s(self, flops: float, quantized: float = 0.0, kind: str | None = None) -> float:
        """Seconds for one model call of `flops` on one device: flops / (peak x e) + c, i.e. an
        efficiency e x w / (w + c x peak x e) that falls for small work w per device. Of them,
        `quantized` FLOPs are products of `kind` (int8, fp8: a quantized model's) at that
        peak, where the chip has it (`quantized_peak`; else at `peak_flops`: emulated)."""
        e = self.flop_efficiency
        rest = (flops - quantized) / (self.peak_flops * e)
        return rest + quantized / (self.quantized_peak(kind) * e) + self.call_overhead_s

    def quantized_peak(self, kind: str | None) -> float:
        """The dense peak of `kind`'s products (int4 runs on the int8 units); `peak_flops`
        where the chip has none (emulated: `emulates`)."""
        peak = {"int8": self.peak_flops_int8, "int4": self.peak_flops_int8,
                "fp8": self.peak_flops_fp8}.get(kind or "")  # fmt: skip
        return peak or self.peak_flops

    def emulates(self, kind: str | None) -> bool:
        return kind is not None and self.quantized_peak(kind) == self.peak_flops

    def efficiency(self, flops: float) -> float:
        """Fraction of peak one call of `flops` reaches under the fitted model."""
        return flops / self.peak_flops / self.compute_s(flops) if flops else 0.0

    def latency_s(self, op: str, n: int) -> float:
        alpha = self.collective_latency_s.get(op, max(self.collective_latency_s.values()))
        if op == "collective-permute":
            return alpha
        if op == "all-to-all":
            return alpha * max(1.0, math.log2(n))
        return alpha * max(1, n - 1)  # ring steps

    def bytes_per_s(self, op: str) -> float:
        if op in self.collective_bytes_per_s:
            return self.collective_bytes_per_s[op]
        return self.link_bytes_per_s * self.link_efficiency * TOPOLOGIES[self.topology]

    def collective_s(self, op: str, n: int, count: int, received_bytes: float) -> float:
        """`count` collectives of `op` over n devices whose busiest device receives
        `received_bytes` in all: latency per collective plus bytes at the collective rate."""
        return count * self.latency_s(op, n) + received_bytes / self.bytes_per_s(op)


def names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.yaml"))


def load(name_or_path: str | Path) -> Profile:
    """A profile by name (a file of this folder) or from a YAML file's path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = FOLDER / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown hardware {str(name_or_path)!r}; known: {names()}")
    elif not path.is_file():
        raise ValueError(f"hardware profile {str(path)!r} does not exist; known: {names()}")
    return _parse(yaml.safe_load(path.read_text()) or {}, path)


def load_all() -> list[Profile]:
    return [load(n) for n in names()]


def write_fit(name: str, efficiency: float, call_overhead_s: float, fitted_on: str, command: str):
    """Replace the `compute` block of this folder's profile `name` with fitted constants (the
    experiments that fit them call this; the rest of the file, comments included, stays)."""
    path = FOLDER / f"{name}.yaml"
    block = (
        "compute:\n"
        f"  flop_efficiency: {efficiency:.4f}\n"
        f"  call_overhead_s: {call_overhead_s:.6f}\n"
        f'  fitted_on: "{fitted_on}"\n'
        f'  command: "{command}"\n'
    )
    new, n = re.subn(r"(?m)^compute:\n(?:  .*\n)+", block, path.read_text())
    if n != 1:
        raise ValueError(f"hardware profile {path}: no compute block to replace")
    path.write_text(new)


def _parse(raw: dict, path: Path) -> Profile:
    where = str(path)
    for key in REQUIRED:
        if key not in raw:
            raise ValueError(f"hardware profile {where}: missing field {key!r}")
    missing = [k for k in SOURCED if not str(raw["sources"].get(k, "")).strip()]
    if missing:
        raise ValueError(f"hardware profile {where}: no source given for {missing} (in `sources`)")
    if raw["topology"] not in TOPOLOGIES:
        raise ValueError(
            f"hardware profile {where}: topology={raw['topology']!r}; known: {sorted(TOPOLOGIES)}"
        )
    lat = raw["collective_latency_s"]
    bad = [op for op in list(lat) + list(raw.get("collective_bytes_per_s", {})) if op not in OPS]
    if bad or not lat:
        raise ValueError(
            f"hardware profile {where}: collective_latency_s needs ops from {list(OPS)}; got {bad or 'none'}"
        )
    for key in ("peak_flops_int8", "peak_flops_fp8"):  # optional: each with its source
        if key in raw and not str(raw["sources"].get(key, "")).strip():
            raise ValueError(f"hardware profile {where}: no source given for ['{key}']")
        if key in raw and (not isinstance(raw[key], (int, float)) or raw[key] <= 0):
            raise ValueError(
                f"hardware profile {where}: {key}={raw[key]!r} must be a positive number"
            )
    for key in ("peak_flops", "hbm_bytes_per_s", "link_bytes_per_s", "link_efficiency"):
        if not isinstance(raw[key], (int, float)) or raw[key] <= 0:
            raise ValueError(
                f"hardware profile {where}: {key}={raw[key]!r} must be a positive number"
            )
    compute = raw["compute"] or {}
    if "borrow" in compute:
        other_path = FOLDER / f"{compute['borrow']}.yaml"
        if not other_path.is_file():
            raise ValueError(
                f"hardware profile {where}: compute.borrow={compute['borrow']!r}; known: {names()}"
            )
        other_raw = yaml.safe_load(other_path.read_text()) or {}
        if "borrow" in (other_raw.get("compute") or {}):
            raise ValueError(
                f"hardware profile {where}: compute.borrow={compute['borrow']!r} borrows in turn; "
                "borrow from a profile with fitted constants"
            )
        other = _parse(other_raw, other_path)
        eff, call = other.flop_efficiency, other.call_overhead_s
        note = f"borrowed from {other.name} (not fitted on this hardware)"
    else:
        for key in ("flop_efficiency", "call_overhead_s", "fitted_on"):
            if key not in compute:
                raise ValueError(f"hardware profile {where}: missing field 'compute.{key}'")
        fitted = [k for k in compute if k not in ("fitted_on", "command")]
        if len(fitted) > MAX_FITTED:
            raise ValueError(
                f"hardware profile {where}: {len(fitted)} fitted constants {fitted}; at most {MAX_FITTED}"
            )
        eff, call = float(compute["flop_efficiency"]), float(compute["call_overhead_s"])
        if not 0 < eff <= 1 or call < 0:
            raise ValueError(
                f"hardware profile {where}: compute.flop_efficiency={eff} must be in (0, 1] and "
                f"compute.call_overhead_s={call} >= 0"
            )
        note = f"fitted on {compute['fitted_on']}"
    return Profile(
        name=raw["name"],
        description=raw["description"],
        peak_flops=float(raw["peak_flops"]),
        hbm_bytes_per_s=float(raw["hbm_bytes_per_s"]),
        link_bytes_per_s=float(raw["link_bytes_per_s"]),
        topology=raw["topology"],
        link_efficiency=float(raw["link_efficiency"]),
        collective_latency_s={k: float(v) for k, v in lat.items()},
        launch_s=float(raw["launch_s"]),
        async_collectives=bool(raw["async_collectives"]),
        flop_efficiency=eff,
        call_overhead_s=call,
        compute_note=note,
        sources=dict(raw["sources"]),
        collective_bytes_per_s={
            k: float(v) for k, v in (raw.get("collective_bytes_per_s") or {}).items()
        },
        path=where,
        peak_flops_int8=float(raw["peak_flops_int8"]) if "peak_flops_int8" in raw else None,
        peak_flops_fp8=float(raw["peak_flops_fp8"]) if "peak_flops_fp8" in raw else None,
    )
