"""Latency projected from exact costs onto hardware profiles (docs/design.md §5).

A `Workload` is what one image's generation costs per device, read from the programs XLA is
given: FLOPs per device per UNet call and every collective (op, group, site, bytes the busiest
device receives) for the warm-up (synchronous) and the steady phase, the stale buffers, and the
one-device text encoding and VAE decode. `project` turns it into seconds on a `Profile`:

    step = compute + stale-buffer traffic + exposed communication
    compute = FLOPs / (peak x e) + c           (e, c fitted per profile; or a timed program)
    communication = sum over collectives of latency(op, n) + received bytes / collective rate
    latency = sync steps x warm-up step + steady steps x steady step + encode + decode

The decode (`vae`): `off`, the VAE decoder on one device (FLOPs / (peak x e) + c); `rows`, on
row patches over the plan's devices / data (the FLOPs split evenly, plus the rows program's
halo, GroupNorm and ring-hop collectives, all exposed: `decode_collectives`); `none`, left out,
as DistriFusion's and xDiT's published latencies (their benchmarks run the pipeline with
`output_type="latent"`).

Synchronous collectives (every warm-up one, every one of `sync_patch`, the CFG output gather,
GroupNorm with `gn=sync`) are exposed in full. A stale collective's result is needed only at
step t+1, so it can overlap compute; how much is the `overlap` window:
- `none`: the runtime runs collectives synchronously (XLA's CPU backend: all exposed);
- `step`: patchpar's compiled loop: a collective issued in step t must finish within step t's
  loop iteration; collectives are issued as their sites run and queue on the link, and what
  runs past the end of the compute is exposed. Per-site stale sends are issued evenly over the
  step's compute; a packed exchange in G groups (`comm_groups`) issues group g's collectives
  when its last site has run, after g/G of the compute (one group: at the end of the step,
  so none of it overlaps);
- `next-step`: the released DistriFusion code: a collective may run until the same layer of
  step t+1, so only communication beyond one whole step's compute is exposed.
Each issued collective's host cost (`launch_s`) is exposed whatever the window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from patchpar.hardware import Profile
from patchpar.measure.workload import PHASES, Workload

OVERLAPS = ("auto", "none", "step", "next-step")
VAE_MODES = ("off", "rows", "none")  # one device, row patches, left out


@dataclass(frozen=True)
class PhaseTime:
    compute_s: float  # FLOPs priced by the profile, or the timed program
    stale_traffic_s: float  # reading and writing the stale buffers at HBM bandwidth
    comm_s: float  # every collective's time, exposed or not
    exposed_comm_s: float
    collectives: int

    @property
    def step_s(self) -> float:
        return self.compute_s + self.stale_traffic_s + self.exposed_comm_s


@dataclass(frozen=True)
class Projection:
    hardware: str
    latency_s: float
    single_latency_s: float
    speedup: float
    compute_s: float  # all steps, compute and stale-buffer traffic
    exposed_comm_s: float  # all steps
    other_s: float  # text encoding and VAE decode (encode_s + decode_s)
    warmup_phase_steps: int
    steady_steps: int
    overlap: str
    compute_source: str
    phases: dict = field(default_factory=dict)  # phase -> PhaseTime as a dict
    encode_s: float = 0.0  # text encoding (one device)
    decode_s: float = 0.0  # VAE decode as `vae` places it
    vae: str = "off"  # off (one device), rows (row patches), none (left out)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Mixed:
    """A node of different chips, one profile per patch device in order (a mixed A100 + L40S
    node). A step's compute is its slowest device's: each device's FLOPs are its own rows'
    share of the largest patch's where the phase computes own rows (`own_rows`: a stale
    DiT's steady phase on uneven patches), the padded slab's otherwise. A collective runs at
    the slowest device's latency and rate; the one-device baseline (and the text encoding) on
    the fastest chip (`single`)."""

    profiles: tuple[Profile, ...]
    rows: tuple[int, ...] | None = None  # each patch device's latent rows (None: even)

    @property
    def name(self) -> str:
        return ",".join(p.name for p in self.profiles)

    @property
    def compute_note(self) -> str:
        return "; ".join(dict.fromkeys(f"{p.name}: {p.compute_note}" for p in self.profiles))

    @property
    def single(self) -> Profile:
        return min(self.profiles, key=lambda p: p.compute_s(1e15))

    def step_compute_s(self, flops, quantized=0.0, kind=None, own_rows=False) -> float:
        """The slowest device's seconds for one call whose largest patch costs `flops`."""
        n = len(self.profiles)
        share = [1.0] * n
        if own_rows and self.rows:
            share = [r / max(self.rows) for r in self.rows]
        return max(p.compute_s(flops * f, quantized * f, kind) for p, f in zip(
            self.profiles, share, strict=True))  # fmt: skip

    def compute_s(self, flops, quantized=0.0, kind=None) -> float:  # work split evenly
        return self.step_compute_s(flops, quantized, kind)

    def collective_s(self, op, n, count, received_bytes) -> float:
        return max(p.collective_s(op, n, count, received_bytes) for p in self.profiles)

    def emulates(self, kind) -> bool:
        return any(p.emulates(kind) for p in self.profiles)

    @property
    def launch_s(self) -> float:
        return max(p.launch_s for p in self.profiles)

    @property
    def async_collectives(self) -> bool:
        return all(p.async_collectives for p in self.profiles)

    @property
    def hbm_bytes_per_s(self) -> float:
        return min(p.hbm_bytes_per_s for p in self.profiles)


def phase_time(
    w: Workload, phase: str, hw: Profile | Mixed, overlap: str, compute_s: float | None = None
) -> PhaseTime:
    """One denoising step of `phase` on the busiest device."""
    p = w.phases[phase]
    compute = compute_s
    if compute_s is None:  # a quantized model's int8/fp8 products at those units' peak
        quantized, kinds = p.get("quantized_flops_per_device") or 0.0, p.get("quantized_types")
        args = (p["flops_per_device"], quantized, (kinds or [None])[0])
        own = bool(p.get("own_rows"))
        compute = hw.step_compute_s(*args, own) if isinstance(hw, Mixed) else hw.compute_s(*args)
    stale = 0.0
    if compute_s is None and w.stale_bytes_per_device:  # a timed program already holds it
        stale = (2 if phase == "steady" else 1) * w.stale_bytes_per_device / hw.hbm_bytes_per_s
    sync_sites = set(w.synchronous_sites[phase])
    exposed, total, count, async_parts = 0.0, 0.0, 0, []
    for g in p["collectives"]:
        t = hw.collective_s(g["op"], g["group"], g["count"], g["received_bytes"])
        total += t
        count += g["count"]
        if g["site"] in sync_sites or overlap == "none":
            exposed += t
        else:
            exposed += g["count"] * hw.launch_s
            async_parts.append((g["count"], t / g["count"]))
    if async_parts and overlap == "next-step":
        exposed += max(0.0, sum(n * d for n, d in async_parts) - compute)
    elif async_parts and overlap == "step":
        exposed += _queue_overrun(_issued(async_parts, w.comm_groups), compute)
    return PhaseTime(compute, stale, total, exposed, count)


def _issued(parts: list[tuple[int, float]], groups: int | None) -> list[tuple[float, float]]:
    """(fraction of the step's compute done when issued, seconds) of each stale collective:
    `parts` = (count, seconds each) per kind of collective. Per site (groups None): each kind's
    spread evenly over the step. Packed in G groups: each kind's count split evenly over the
    groups, group g's issued after g/G of the compute (its last site has run then)."""
    if groups is None:
        return [((j + 0.5) / n, d) for n, d in parts for j in range(n)]
    return [((g + 1) / groups, n * d / groups) for n, d in parts for g in range(groups)]


def _queue_overrun(issue: list[tuple[float, float]], compute: float) -> float:
    """Collectives issued at the given fractions of `compute` seconds, run one at a time on the
    link: how long the last one finishes after the compute."""
    finish = 0.0
    for frac, d in sorted(issue):
        finish = max(finish, frac * compute) + d
    return max(0.0, finish - compute)


def warmup_phase_steps(w: Workload, steps: int) -> int:
    """Steps run as the warm-up program: all of a strategy without stale state, else DistriFusion's
    `warmup_steps + 1` (its counter runs synchronously while counter <= warmup_steps)."""
    return steps if w.warmup_steps is None else min(steps, w.warmup_steps + w.sync_offset)


def project(
    w: Workload,
    single: Workload,
    hw: Profile,
    steps: int = 50,
    overlap: str = "auto",
    measured: dict | None = None,
    vae: str = "off",
    decode_collectives: list | None = None,
) -> Projection:
    """Latency of one generation under `w` on `hw`, and of the one-device run `single`.
    `measured` (optional) gives timed per-device compute in seconds per UNet call:
    {"warmup": s, "steady": s, "single": s}, used instead of the fitted curve. `vae`: the
    decode on one device (`off`), on row patches over w's devices / data (`rows`, whose
    collectives `decode_collectives` gives) or left out (`none`); `single` decodes on one
    device (or leaves it out with `none`)."""
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r}; known: {list(OVERLAPS)}")
    if vae not in VAE_MODES:
        raise ValueError(f"vae={vae!r}; known: {list(VAE_MODES)}")
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    if overlap == "auto":
        overlap = "next-step" if hw.async_collectives else "none"
    m = measured or {}
    n_warm = warmup_phase_steps(w, steps)
    times = {ph: phase_time(w, ph, hw, overlap, m.get(ph)) for ph in PHASES}
    one_hw = hw.single if isinstance(hw, Mixed) else hw  # one device: the fastest chip
    encode = one_hw.compute_s(w.encode_flops)
    # no decode: left out, or a pixel-space model (no VAE: nothing to price, not even a call)
    one_device = 0.0 if vae == "none" or not w.decode_flops else one_hw.compute_s(w.decode_flops)
    decode = one_device
    if vae == "rows" and w.decode_flops:  # images over data, each image's rows over the rest
        decode = hw.compute_s(w.decode_flops / w.devices) + sum(
            hw.collective_s(g["op"], g["group"], g["count"], g["received_bytes"])
            for g in decode_collectives or []
        )
    other = encode + decode
    steady = steps - n_warm
    runs = steady + (w.drain_steps if steady else 0)  # steady loop iterations with the model
    if w.step_stride == 2:  # the odd steps of [n_warm, steps)
        runs = steps // 2 - n_warm // 2
    latency = n_warm * times["warmup"].step_s + runs * times["steady"].step_s + other
    single_step = m.get("single", one_hw.compute_s(single.phases["warmup"]["flops_per_device"]))
    single_latency = steps * single_step + encode + one_device
    compute = sum(
        k * (times[ph].compute_s + times[ph].stale_traffic_s)
        for k, ph in ((n_warm, "warmup"), (runs, "steady"))
    )
    exposed = n_warm * times["warmup"].exposed_comm_s + runs * times["steady"].exposed_comm_s
    return Projection(
        hardware=hw.name,
        latency_s=latency,
        single_latency_s=single_latency,
        speedup=single_latency / latency,
        compute_s=compute,
        exposed_comm_s=exposed,
        other_s=other,
        warmup_phase_steps=n_warm,
        steady_steps=steady,
        overlap=overlap,
        compute_source="measured" if measured else hw.compute_note,
        phases={ph: {**asdict(t), "step_s": t.step_s} for ph, t in times.items()},
        encode_s=encode,
        decode_s=decode,
        vae=vae,
    )


def fit_compute(points: list[tuple[float, float, float]], peak_flops: float) -> tuple[float, float]:
    """Fit (flop_efficiency, call_overhead_s) of `Profile.compute_s` to points (flops in
    UNet calls, number of calls, measured seconds of those calls), minimising the relative
    error: seconds = flops / (peak x e) + calls x c, linear in (1/e, c)."""
    a = np.array([[f / peak_flops, n] for f, n, _ in points], float)
    y = np.array([s for _, _, s in points], float)
    wgt = 1.0 / y
    (inv_e, c), *_ = np.linalg.lstsq(a * wgt[:, None], y * wgt, rcond=None)
    if c < 0:  # no negative overhead: the best fit with c = 0
        (inv_e,), *_ = np.linalg.lstsq(a[:, :1] * wgt[:, None], y * wgt, rcond=None)
        c = 0.0
    if inv_e <= 0:
        raise ValueError(f"fit gave a non-positive 1/efficiency ({inv_e}); points: {points}")
    return float(1.0 / inv_e), float(c)
