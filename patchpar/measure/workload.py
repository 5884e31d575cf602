"""What one image's generation costs per device (`Workload`), read from the programs XLA is
given: FLOPs per device per denoiser call and every collective for the warm-up and the steady
phase, the stale buffers, the one-device text encoding and VAE decode (`compute_workload`);
cached on disk by model, resolution, plan and dtype (`WorkloadCache`). `measure.projection`
prices it on a hardware profile."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from patchpar.measure.flops import program_flops
from patchpar.parallel.split import fmt, is_even

PHASES = ("warmup", "steady")


@dataclass(frozen=True)
class Workload:
    """Costs of one generation under a plan, per device (JSON-able; one cache line)."""

    model: str
    resolution: int | str  # a square image's side; a video's "HxWxF" (`video_size`)
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
    patch_rows: list | None = None  # uneven patches: each patch device's latent rows
    # what lowered it (WORKLOAD_VERSION): a cache line of another version is not served
    version: int = 1
    layout: str = "frames"  # a video's layout of patches (`models.wan.model.Video`)

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
            self.layout,
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
    rows = "" if plan.patch_weights is None else f" patch_weights={fmt(plan.patch_weights)}"
    rows += "" if plan.uneven_compute == "auto" else f" uneven_compute={plan.uneven_compute}"
    return plan.strategy.describe() + rows + cache


def workload_key(
    model, resolution, strategy, devices, cfg, batch, dtype, data=1, fsdp=False, quant="none",
    layout="frames",
) -> tuple:  # fmt: skip
    return (
        str(model),
        resolution if isinstance(resolution, str) else int(resolution),
        str(strategy),
        int(devices),
        int(cfg),
        int(batch),
        str(dtype),
        int(data),
        bool(fsdp),
        str(quant),
        str(layout),
    )


def video_size(resolution) -> tuple[int, int, int] | None:
    """(height, width, frames) of a video's size "HxWxF"; None for an image's side (an int)."""
    if not isinstance(resolution, str):
        return None
    try:
        h, w, f = (int(v) for v in resolution.split("x"))
    except ValueError:
        raise ValueError(
            f"resolution={resolution!r}: a video's size is HEIGHTxWIDTHxFRAMES (480x832x81)"
        ) from None
    return h, w, f


def video_label(height: int, width: int, frames: int) -> str:
    return f"{height}x{width}x{frames}"


def denoiser_on(model: str, resolution, plan, layout: str = "frames", unet=None):
    """(the denoiser as it runs at `resolution` under `plan`, the latent (rows, w) it takes): an
    image's square latent, or a video's tall one with the denoiser on its layout (`on_video`,
    checked against the plan's row patches); `unet` default the model's abstract one."""
    from patchpar.models.presets import abstract_denoiser, latent_factor, square_latent
    from patchpar.models.presets import temporal_factor as temporal

    unet = abstract_denoiser(model) if unet is None else unet
    size = video_size(resolution)
    if size is None:
        side = square_latent(model, resolution)
        return unet, (side, side)
    from patchpar.models.video import on_video
    from patchpar.pipelines.checks import check_image_size

    h, w, frames = size
    frame = check_image_size(unet, latent_factor(model), h, w)
    patches = plan.patch if plan is not None and plan.splits_row_patches else None
    return on_video(unet, frames, layout, temporal(model), frame, patches)


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
    model: str, resolution: int | str, plan, batch: int = 1, dtype: str = "bfloat16", log=None,
    quant: str = "none", layout: str = "frames",
):  # fmt: skip
    """Lower one denoiser call per phase with abstract parameters (no weights) and read its FLOPs
    and collectives, plus the text encoders' and the VAE decoder's FLOPs. The attention kernel
    is `xla` here, the reference, whose program is the quickest to lower (the FLOPs are counted
    with loops unrolled, `measure.flops`, and the bytes are the same for every kernel).
    Validates like `run`. `quant`: the denoiser quantized (`patchpar.quant`, abstract weights):
    its int8/fp8 products' FLOPs are counted apart (`quantized_flops_per_device`). A video
    model: `resolution` is "HxWxF", the patches cut by `layout` (`denoiser_on`)."""
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.attention import XLA
    from patchpar.models.presets import abstract_denoiser

    if not plan.comm:
        raise ValueError("a plan with stand-in collectives (comm=False) has nothing to project")
    jdtype = getattr(jnp, dtype)
    unet, latent = denoiser_on(model, resolution, plan, layout,
                               abstract_denoiser(model, jdtype, XLA))  # fmt: skip
    params = None
    if quant != "none":
        from patchpar.quant import quantize_abstract

        unet, params = quantize_abstract(unet, unet.abstract_params(), quant)
    r = measure(unet, plan, latent, batch=batch, params=params, flops=True, memory=False, log=log)
    keys = ("flops_per_device", "collectives", "quantized_flops_per_device", "quantized_types")
    phases = {name: {k: r["phases"][name].get(k) for k in keys} for name in PHASES}
    rows = plan.patch_rows(latent[0], unet)
    for name in PHASES:  # uneven: whether each device computes its own rows or the padded slab
        own = not is_even(rows) and plan.cache is None and r["phases"][name]["branches"]
        phases[name]["own_rows"] = own
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
        patch_rows=None if is_even(rows) else list(rows),
        version=WORKLOAD_VERSION,
        layout=layout,
    )


@functools.lru_cache(maxsize=32)
def _encode_decode_flops(
    model: str, resolution: int | str, batch: int, dtype, halves: int = 2
) -> tuple[float, float]:
    """FLOPs of the text encoders (halves x batch prompts: the negative ones too with CFG; as
    many tokens as the family's pipeline reads: 77 CLIP tokens, T5's 120 / 300 for PixArt-α /
    Σ, FLUX's 512; `Family.text_programs`) and of the VAE decoder on the batch, from the lowered programs of the components' configs (a
    preset's, or a folder's); 0 for a model without a VAE."""
    import jax

    from patchpar.models.presets import component_config, model_family
    from patchpar.parallel.vae import VAEPlan

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
        params = jax.eval_shape(lambda: vae.init(0))
        decode = program_flops(_lowered_decode(vae, params, model, resolution, batch, VAEPlan()))
    return encode, decode


def _lowered_decode(vae, params, model: str, resolution, batch: int, plan):
    """The VAE decode of `batch` latents of an image's side or a video's "HxWxF", lowered."""
    from patchpar.models.presets import temporal_factor
    from patchpar.models.video import latent_frames
    from patchpar.parallel.vae import lowered_decode, lowered_decode_video

    f = vae.config.downsample_factor
    size = video_size(resolution)
    if size is None:
        side = resolution // f
        return lowered_decode(vae, params, (batch, side, side, vae.config.latent_channels), plan)
    h, w, frames = size
    z = (batch, latent_frames(frames, temporal_factor(model)), h // f, w // f, vae.config.z_dim)
    return lowered_decode_video(vae, params, z, plan)


def _preset_vae(model: str, dtype):
    """A preset's or folder's VAE (abstract use only; the family's, `Family.abstract_vae`), or
    None: a pixel-space model."""
    from patchpar.models.presets import component_config, model_family

    cfg = component_config(model, "vae")
    return None if cfg is None else model_family(model).abstract_vae(cfg, dtype)


@functools.lru_cache(maxsize=32)
def decode_collectives(model: str, resolution, devices: int, batch: int, dtype: str):
    """The collectives of the VAE decoder on `devices` row patches (halos, GroupNorm, ring
    hops), grouped as a workload's (`collective_groups`), from the lowered program (abstract
    weights); [] on one device or for a model without a VAE."""
    import jax
    import jax.numpy as jnp

    from patchpar.measure.comm import collective_groups, hlo_text_with_metadata, parse_collectives
    from patchpar.parallel.vae import VAEPlan

    vae = _preset_vae(model, getattr(jnp, dtype))
    if devices == 1 or vae is None:
        return []
    params = jax.eval_shape(lambda: vae.init(0))
    low = _lowered_decode(vae, params, model, resolution, batch, VAEPlan("rows", devices))
    text = hlo_text_with_metadata(low)
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
    batch, dtype, data, fsdp, quant, layout) and WORKLOAD_VERSION; each new one written at once (the file
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

    def get(self, model, resolution, plan, batch=1, dtype="bfloat16", quant="none",
            layout="frames") -> Workload:  # fmt: skip
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
            layout,
        )
        if key not in self._items:
            if self.log is not None:
                size = resolution if video_size(resolution) else f"{resolution}px"
                self.log(
                    f"{model} {size} {plan.strategy.name} on {plan.devices} device(s): "
                    f"not in the workload cache ({self.path}); lowering it with abstract weights"
                )
            w = compute_workload(model, resolution, plan, batch, dtype, self.log, quant, layout)
            self._write(w)
            self._items[key] = w
        return self._items[key]

    def __iter__(self):
        return iter(self._items.values())
