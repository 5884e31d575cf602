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

import contextlib
import functools
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from patchpar.hardware import Profile
from patchpar.measure.flops import program_flops

OVERLAPS = ("auto", "none", "step", "next-step")
VAE_MODES = ("off", "rows", "none")  # one device, row patches, left out
PHASES = ("warmup", "steady")


@dataclass(frozen=True)
class Workload:
    """Costs of one generation under a plan, per device (JSON-able; one cache line)."""

    model: str
    resolution: int
    strategy: str  # Strategy.describe()
    devices: int
    cfg: int
    batch: int
    dtype: str
    unet_batch: int  # images per UNet call on one device (2 x batch with cfg=1)
    phases: dict  # warmup / steady -> {"flops_per_device": float, "collectives": [group, ...]}
    synchronous_sites: dict  # phase -> sites whose collectives the step waits for
    stale_bytes_per_device: int
    warmup_steps: int | None  # a stale strategy's warm-up option (see sync_offset)
    encode_flops: float  # text encoders, the CFG pair, one device
    decode_flops: float  # VAE decode of the batch, one device
    data: int = 1  # devices splitting the images (absent from cache lines written before)
    fsdp: bool = False  # weights sharded, gathered per layer
    comm_groups: int | None = None  # the packed stale exchange's groups (None: per site)
    # synchronous steps = warmup_steps + sync_offset: DistriFusion's counter (1), PipeFusion's
    # full passes (0)
    sync_offset: int = 1
    drain_steps: int = 0  # loop iterations beyond the steady steps (a pipeline's drain)
    # the steady model runs on one step in step_stride (AsyncDiff stride 2: the odd steps,
    # each a round giving two steps' predictions)
    step_stride: int = 1
    quant: str = "none"  # the denoiser's quant mode (patchpar.quant)
    # what lowered it (WORKLOAD_VERSION): a cache line of another version is not served
    version: int = 1

    def key(self) -> tuple:
        return workload_key(
            self.model,
            self.resolution,
            self.strategy,
            self.devices,
            self.cfg,
            self.batch,
            self.dtype,
            self.data,
            self.fsdp,
            self.quant,
        )

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Workload:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def plan_label(plan) -> str:
    """The strategy's description, and its step cache's (a workload of one kind of cached step:
    `sampling.cache.Forced`)."""
    cache = "" if plan.cache is None else f" + {plan.cache.describe()}"
    return plan.strategy.describe() + cache


def workload_key(
    model, resolution, strategy, devices, cfg, batch, dtype, data=1, fsdp=False, quant="none"
) -> tuple:
    return (
        str(model),
        int(resolution),
        str(strategy),
        int(devices),
        int(cfg),
        int(batch),
        str(dtype),
        int(data),
        bool(fsdp),
        str(quant),
    )


def synchronous_sites(plan, phase: str) -> list[str]:
    """Sites whose collectives a step waits for: all in the warm-up phase (and in every phase of
    a strategy without stale state); in the steady phase every site but those whose op sends
    for a stale buffer (read at the next step): the CFG output gather, tensor parallelism's
    all-reduces, FSDP's weight gathers (each waits for its layer's input), anything outside a
    site, GroupNorm statistics with `gn=sync`, and `compact`'s fresh compressed halos and K/V."""
    from patchpar.parallel.strategies.base import StaleStrategy

    every = ["halo", "gn", "kv", "cfg", "tp", "fsdp", "pipe", "other"]
    if phase == "warmup" or not isinstance(plan.strategy, StaleStrategy):
        # (a pipeline's hops: the next slot's compute needs them)
        return every
    ops = plan.strategy.ops("steady", plan.patch)
    stale = {op.kind for op in ops.sites() if op.sends_stale()}
    return [s for s in every if s not in stale and s != "pipe"]


def compute_workload(
    model: str, resolution: int, plan, batch: int = 1, dtype: str = "bfloat16", log=None,
    quant: str = "none",
):  # fmt: skip
    """Lower one denoiser call per phase with abstract parameters (no weights) and read its FLOPs
    and collectives, plus the text encoders' and the VAE decoder's FLOPs. The attention kernel
    is `xla` here, the reference, whose program is the quickest to lower (the FLOPs are counted
    with loops unrolled, `measure.flops`, and the bytes are the same for every kernel).
    Validates like `run`. `quant`: the denoiser quantized (`patchpar.quant`, abstract weights):
    its int8/fp8 products' FLOPs are counted apart (`quantized_flops_per_device`)."""
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.attention import XLA
    from patchpar.models.presets import abstract_denoiser, latent_factor

    if not plan.comm:
        raise ValueError("a plan with stand-in collectives (comm=False) has nothing to project")
    f = latent_factor(model)
    if resolution <= 0 or resolution % f:
        raise ValueError(
            f"resolution={resolution}: must be a positive multiple of {f} (the VAE factor)"
        )
    jdtype = getattr(jnp, dtype)
    unet = abstract_denoiser(model, jdtype, XLA)
    params = None
    if quant != "none":
        from patchpar.quant import quantize_abstract

        unet, params = quantize_abstract(unet, unet.abstract_params(), quant)
    latent = resolution // f
    r = measure(
        unet, plan, (latent, latent), batch=batch, params=params, flops=True, memory=False,
        log=log,
    )  # fmt: skip
    keys = ("flops_per_device", "collectives", "quantized_flops_per_device", "quantized_types")
    phases = {name: {k: r["phases"][name].get(k) for k in keys} for name in PHASES}
    if log is not None:
        log("lowering the text encoders and the VAE decoder (their FLOPs)")
    halves = unet.guidance_halves  # prompts encoded per image: with a negative one, or not
    encode, decode = _encode_decode_flops(model, resolution, batch, jdtype, halves)
    stride = getattr(plan.strategy, "stride", 1)
    drain = 0 if stride == 2 else plan.strategy.phase_iterations("steady", 1, plan.patch) - 1
    return Workload(
        model=str(model),
        resolution=resolution,
        strategy=plan_label(plan),
        devices=plan.devices,
        cfg=plan.cfg,
        batch=batch,
        dtype=dtype,
        unet_batch=batch * max(1, halves // plan.cfg),
        phases=phases,
        synchronous_sites={p: synchronous_sites(plan, p) for p in PHASES},
        stale_bytes_per_device=int(r["stale_bytes_per_device"]),
        warmup_steps=getattr(plan.strategy, "warmup_steps", None),
        encode_flops=encode,
        decode_flops=decode,
        data=plan.data,
        fsdp=plan.fsdp_degree > 1,
        comm_groups=plan.strategy.packed_groups(),
        sync_offset=plan.program.sync_offset,
        drain_steps=drain,
        step_stride=stride,
        quant=quant,
        version=WORKLOAD_VERSION,
    )


@functools.lru_cache(maxsize=32)
def _encode_decode_flops(
    model: str, resolution: int, batch: int, dtype, halves: int = 2
) -> tuple[float, float]:
    """FLOPs of the text encoders (halves x batch prompts: the negative ones too with CFG; as
    many tokens as the family's pipeline reads: 77 CLIP tokens, T5's 120 / 300 for PixArt-α /
    Σ, FLUX's 512; `Family.text_programs`) and of the VAE decoder on the batch, from the lowered programs of the components' configs (a
    preset's, or a folder's); 0 for a model without a VAE."""
    import jax

    from patchpar.models.presets import component_config, model_family
    from patchpar.parallel.vae import VAEPlan, lowered_decode

    programs = model_family(model).text_programs(
        lambda sub: component_config(model, sub), halves * batch, dtype
    )
    encode = 0.0
    for module, ids in programs:
        params = jax.eval_shape(lambda i, m=module: m.init(jax.random.key(0), i)["params"], ids)
        lowered = jax.jit(lambda p, i, m=module: m.apply({"params": p}, i)).lower(params, ids)
        encode += program_flops(lowered)
    decode = 0.0
    if (vae := _preset_vae(model, dtype)) is not None:
        side = resolution // vae.config.downsample_factor
        z = (batch, side, side, vae.config.latent_channels)
        low = lowered_decode(vae, jax.eval_shape(lambda: vae.init(0)), z, VAEPlan())
        decode = program_flops(low)
    return encode, decode


def _preset_vae(model: str, dtype):
    """A preset's or folder's VAE (abstract use only; the `xla` attention kernel, the
    reference), or None: a pixel-space model."""
    from patchpar.models.api import VAEFn
    from patchpar.models.attention import XLA
    from patchpar.models.presets import component_config
    from patchpar.models.vae import AutoencoderKL, VAEConfig

    cfg = component_config(model, "vae")
    if cfg is None:
        return None
    return VAEFn(AutoencoderKL(VAEConfig.from_diffusers(cfg, "vae"), dtype, attn=XLA))


@functools.lru_cache(maxsize=32)
def decode_collectives(model: str, resolution: int, devices: int, batch: int, dtype: str):
    """The collectives of the VAE decoder on `devices` row patches (halos, GroupNorm, ring
    hops), grouped as a workload's (`collective_groups`), from the lowered program (abstract
    weights); [] on one device or for a model without a VAE."""
    import jax
    import jax.numpy as jnp

    from patchpar.measure.comm import collective_groups, hlo_text_with_metadata, parse_collectives
    from patchpar.parallel.vae import VAEPlan, lowered_decode

    vae = _preset_vae(model, getattr(jnp, dtype))
    if devices == 1 or vae is None:
        return []
    side = resolution // vae.config.downsample_factor
    z = (batch, side, side, vae.config.latent_channels)
    params = jax.eval_shape(lambda: vae.init(0))
    text = hlo_text_with_metadata(lowered_decode(vae, params, z, VAEPlan("rows", devices)))
    return collective_groups(parse_collectives(text, devices), devices)


# Bump when a change to the sites or the engine changes what a lowered program holds (its
# collectives, bytes or FLOPs): cached workloads of other versions are lowered again.
# Version 2: a diffusers folder's text encoders and VAE are counted (version 1 counted a
# preset's only, so a preset's version-1 workload is still valid: `_valid`).
WORKLOAD_VERSION = 2


def _valid(w: Workload) -> bool:
    from patchpar.models.presets import PRESETS

    return w.version == WORKLOAD_VERSION or (w.version == 1 and w.model in PRESETS)


def default_cache_path() -> Path:
    """$PATCHPAR_HOME/workloads.jsonl (default ~/.cache/patchpar), beside the model folders."""
    from patchpar.models.presets import home

    return home() / "workloads.jsonl"


class WorkloadCache:
    """Workloads in a JSON-lines file, one per (model, resolution, strategy, devices, cfg,
    batch, dtype, data, fsdp) and WORKLOAD_VERSION; each new one written at once (the file
    rewritten to a temp file and renamed over it: a killed process leaves it whole). A line
    that does not read is skipped with a warning naming the file and line."""

    def __init__(self, path: str | Path | None = None, log=None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.log = log  # hears a line as a workload missing from the cache is lowered
        self._items: dict[tuple, Workload] = {}
        if self.path.is_file():
            for number, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    w = Workload.from_json(json.loads(line))
                except (ValueError, TypeError, KeyError) as e:
                    warnings.warn(
                        f"{self.path}:{number}: not a workload ({type(e).__name__}: {e}); "
                        "skipped (it is lowered again when asked for)",
                        stacklevel=2,
                    )
                    continue
                if _valid(w):
                    self._items[w.key()] = w

    def _write(self, w: Workload) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = self.path.read_text() if self.path.is_file() else ""
        if old and not old.endswith("\n"):
            old += "\n"
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".workloads-")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(old + json.dumps(w.to_json(), sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def get(self, model, resolution, plan, batch=1, dtype="bfloat16", quant="none") -> Workload:
        key = workload_key(
            model,
            resolution,
            plan_label(plan),
            plan.devices,
            plan.cfg,
            batch,
            dtype,
            plan.data,
            plan.fsdp_degree > 1,
            quant,
        )
        if key not in self._items:
            if self.log is not None:
                self.log(
                    f"{model} {resolution}px {plan.strategy.name} on {plan.devices} device(s): "
                    f"not in the workload cache ({self.path}); lowering it with abstract weights"
                )
            w = compute_workload(model, resolution, plan, batch, dtype, self.log, quant)
            self._write(w)
            self._items[key] = w
        return self._items[key]

    def __iter__(self):
        return iter(self._items.values())


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


def phase_time(
    w: Workload, phase: str, hw: Profile, overlap: str, compute_s: float | None = None
) -> PhaseTime:
    """One denoising step of `phase` on the busiest device."""
    p = w.phases[phase]
    compute = compute_s
    if compute_s is None:  # a quantized model's int8/fp8 products at those units' peak
        quantized, kinds = p.get("quantized_flops_per_device") or 0.0, p.get("quantized_types")
        compute = hw.compute_s(p["flops_per_device"], quantized, (kinds or [None])[0])
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
    encode = hw.compute_s(w.encode_flops)
    # no decode: left out, or a pixel-space model (no VAE: nothing to price, not even a call)
    one_device = 0.0 if vae == "none" or not w.decode_flops else hw.compute_s(w.decode_flops)
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
    single_step = m.get("single", hw.compute_s(single.phases["warmup"]["flops_per_device"]))
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
