"""`patchpar comm`: what one denoiser call (UNet or DiT) costs under a strategy, from the compiled program."""

from __future__ import annotations

from dataclasses import dataclass, field

from patchpar.lab.config import (
    LOWERED_DTYPES as DTYPES,
)
from patchpar.lab.config import (
    AbstractModel,
    CacheConfig,
    PlanMesh,
    StrategyConfig,
    sections_plan,
)
from patchpar.lab.configio import FromFlags


@dataclass(frozen=True)
class CommConfig(FromFlags):
    """Bytes received per device per denoiser call (warm-up and steady phase, by site kind), FLOPs
    and stale-buffer memory per device, lowered with abstract parameters (no weights needed).
    The model, mesh and strategy sections are `patchpar run`'s (`--strategy.warmup-steps`
    means one thing in both), with their short flags (`--strategy distrifusion --devices 4`)."""

    model: AbstractModel = field(default_factory=AbstractModel)
    mesh: PlanMesh = field(default_factory=PlanMesh)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    resolution: int = 0
    """Image height in pixels (latent = resolution / the VAE factor; 1 for pixel space); 0:
    1024, a video model's own frame height (480 for Wan)."""
    width: int = 0
    """Image width in pixels (0: the resolution, a square; a video model's own frame width)."""

    def size(self) -> tuple[int, int]:
        """(height, width) in pixels: an image's unset width its height (a square, 1024 where
        neither is given); a video's unset sides the model's own frame's (as `project`)."""
        from patchpar.models.presets import abstract_denoiser, model_family

        if model_family(self.model.name).video:
            dh, dw = abstract_denoiser(self.model.name).default_size
            return self.resolution or dh, self.width or dw
        h = self.resolution or 1024
        return h, self.width or h

    frames: int | None = None
    """A video model's frames, 4k + 1 for Wan's VAE (default: the model's, 81 for Wan); cut into
    patches by mesh.layout."""
    batch: int = 0
    """Images per call (0: one per data slice, = mesh.data); with cfg=1 the UNet batch is 2 x
    batch (the CFG pair)."""
    dtype: str = "bfloat16"
    """float32 or bfloat16."""
    memory: bool = True
    """Compile each phase and report memory per device (`--no-memory`: lower only, faster; the
    attention kernel then has no effect: it changes only the memory)."""
    json: bool = False
    """Print one JSON record instead of the table."""

    def plan(self):
        """The strategy with its options, placed on the mesh."""
        return sections_plan(self.strategy, self.mesh, CacheConfig())


def check_comm(config: CommConfig) -> list[str]:
    """Every check of the config before lowering, all the problems raised together
    (`checks.Problems`, one line each), the plan against the model's config.json included;
    returns the options given that have no effect."""
    import jax.numpy as jnp

    from patchpar.lab.checks import Problems, check_lowering
    from patchpar.models.attention import resolve
    from patchpar.models.presets import square_latent

    m = config.model
    problems = Problems.collect()
    dtype_ok = config.dtype in DTYPES
    if not dtype_ok:
        problems.lines.append(f"dtype={config.dtype!r}; known: {list(DTYPES)}")
    model_ok = False
    with problems.check():
        m.check(config.strategy.name)
        model_ok = True
    with problems.check():  # its message names model.attention
        resolve(m.attention_spec(), getattr(jnp, config.dtype if dtype_ok else "float32"))
    latent = None
    with problems.check():
        h, w = config.size()
        latent = square_latent(m.name, h), square_latent(m.name, w, "width")
    if config.batch < 0:
        problems.lines.append(f"batch={config.batch}: must be >= 0 (0: one per data slice)")
    plan = None
    with problems.check():
        plan = config.plan()
    if None not in (plan, latent) and model_ok and config.batch >= 0:  # against the model
        with problems.check():
            check_lowering(m.name, latent, plan, config.batch or plan.data, 1_000_000,
                           m.scan_blocks, config.frames, config.mesh.layout)  # fmt: skip
    problems.raise_any()
    given = [f"model.{k}={getattr(m, k)!r}" for k in ("attention", "block_q", "block_kv")
             if getattr(m, k) != getattr(AbstractModel(), k)]  # fmt: skip
    if config.memory or not given:
        return []
    return [
        f"{', '.join(given)} has no effect with --no-memory: the kernel changes only the memory "
        f"(bytes are the same for every kernel, and FLOPs for xla and chunked; cudnn and splash "
        f"are custom calls, whose FLOPs XLA does not count)"
    ]


def run_comm(config: CommConfig, log=lambda msg: None) -> dict:
    """What one denoiser call costs under the config's plan (see CommConfig); `log` hears the
    progress of lowering and compiling, and the options that have no effect."""
    import jax.numpy as jnp

    from patchpar.lab.checks import check_video
    from patchpar.measure.cost import measure
    from patchpar.models.attention import resolve
    from patchpar.models.presets import abstract_denoiser, latent_factor

    for line in check_comm(config):
        log(f"patchpar: warning: {line}")
    m, plan = config.model, config.plan()
    dtype = getattr(jnp, config.dtype)
    spec = resolve(m.attention_spec(), dtype)
    unet = abstract_denoiser(m.name, dtype, spec).with_scan(m.scan_blocks)
    params = None
    if m.quant != "none":
        from patchpar.quant import quantize_abstract

        unet, params = quantize_abstract(unet, unet.abstract_params(), m.quant)
    f = latent_factor(m.name)
    height, width = config.size()
    hw = (height // f, width // f)
    unet, hw = check_video(m.name, unet, hw, config.frames, config.mesh.layout, plan)
    batch = config.batch or plan.data
    r = measure(unet, plan, hw, batch=batch, params=params, memory=config.memory, log=log)
    st, wu = r["phases"]["steady"], r["phases"]["warmup"]
    memory = {}
    if config.memory:
        memory = {
            "memory_per_device_bytes": st["memory"]["total"],
            "memory_per_device": st["memory"],
            "memory_backend": jax_backend(),
        }
    return {
        "model": m.name,
        "resolution": height,
        "width": width,
        **(
            {
                "frames": config.frames or unet.default_frames,
                "latent_frames": unet.video.frames,
                "layout": config.mesh.layout,
            }
            if hasattr(unet, "video")
            else {}
        ),  # fmt: skip
        "latent_hw": list(hw),
        "devices": plan.devices,
        "cfg": plan.cfg,
        "strategy": plan.strategy.describe(),
        "dtype": config.dtype,
        "quant": m.quant,
        "scan_blocks": m.scan_blocks,
        "batch": batch,
        "steady_bytes_per_device": st["hlo"]["all"]["max"],
        "warmup_bytes_per_device": wu["hlo"]["all"]["max"],
        "steady_bytes_mean": st["hlo"]["all"]["mean"],
        "steady_bytes_total": st["hlo"]["all"]["total"],
        "warmup_bytes_mean": wu["hlo"]["all"]["mean"],
        "warmup_bytes_total": wu["hlo"]["all"]["total"],
        "steady_by_site": {k: v for k, v in st["hlo"].items() if k != "all"},
        "warmup_by_site": {k: v for k, v in wu["hlo"].items() if k != "all"},
        # of those, uneven patches' padding rows (by site kind and "all"; empty: none)
        "steady_padding": st.get("padding", {}),
        "warmup_padding": wu.get("padding", {}),
        "flops_per_device": st.get("flops_per_device"),
        "stale_bytes_per_device": r["stale_bytes_per_device"],
        "weight_bytes_per_device": r["weight_bytes_per_device"],
        "weight_rules": plan.rules_name,
        "mesh": r["mesh"],
        "analytic_matches_hlo": st["analytic_matches_hlo"] and wu["analytic_matches_hlo"],
        # analytic: what the released DistriFusion / PCPP code's pattern would move instead
        "released_steady_bytes_per_device": st["released"]["all"]["max"],
        "released_warmup_bytes_per_device": wu["released"]["all"]["max"],
        "released_steady_by_site": {k: v for k, v in st["released"].items() if k != "all"},
        "released_warmup_by_site": {k: v for k, v in wu["released"].items() if k != "all"},
        "attention": spec.impl,
        "attention_blocks": [spec.block_q, spec.block_kv],
        **memory,
    }


def size_label(rec: dict) -> str:
    """`1024px`, `1024x768px`, or a video's `480x832px x 81 frames (layout frames)`."""
    w = rec.get("width", rec["resolution"])
    px = f"{rec['resolution']}px" if w == rec["resolution"] else f"{rec['resolution']}x{w}px"
    if "frames" in rec:
        px += f" x {rec['frames']} frames (layout {rec['layout']})"
    return px


def jax_backend() -> str:
    import jax

    return jax.default_backend()


def format_comm(rec: dict) -> str:
    mb = lambda b: f"{b / 2**20:10.3f}"  # noqa: E731
    lines = [
        f"{rec['strategy']} | {rec['model']} {size_label(rec)} {rec['dtype']} | "
        f"{rec['devices']} devices | "
        f"batch {rec['batch']}",
        "",
        f"{'MiB received per model call':28s} {'warm-up':>10s} {'steady':>10s}   (busiest device; mean; total)",
    ]
    sites = sorted(set(rec["steady_by_site"]) | set(rec["warmup_by_site"]))
    zero = {"max": 0, "mean": 0.0, "total": 0}
    for site in sites:
        w, s = rec["warmup_by_site"].get(site, zero), rec["steady_by_site"].get(site, zero)
        lines.append(f"  {site:26s} {mb(w['max'])} {mb(s['max'])}")
    lines += [
        f"  {'all (busiest device)':26s} {mb(rec['warmup_bytes_per_device'])} {mb(rec['steady_bytes_per_device'])}",
        f"  {'all (mean over devices)':26s} {mb(rec['warmup_bytes_mean'])} {mb(rec['steady_bytes_mean'])}",
        f"  {'all (total over devices)':26s} {mb(rec['warmup_bytes_total'])} {mb(rec['steady_bytes_total'])}",
    ]
    pw, ps = (rec.get(k, {}).get("all", zero) for k in ("warmup_padding", "steady_padding"))
    if pw["max"] or ps["max"]:  # uneven patches: the most padding one device receives
        lines.append(f"  {'padding rows (most on one)':26s} {mb(pw['max'])} {mb(ps['max'])}")
    lines += [
        "",
        "The released code's pattern for the same call (analytic, not measured: halos and",
        "statistics all-gathered from every device, the model output all-gathered every step):",
    ]
    r_sites = sorted(set(rec["released_steady_by_site"]) | set(rec["released_warmup_by_site"]))
    for site in r_sites:
        w = rec["released_warmup_by_site"].get(site, zero)
        s = rec["released_steady_by_site"].get(site, zero)
        lines.append(f"  {site:26s} {mb(w['max'])} {mb(s['max'])}")
    lines += [
        f"  {'all (busiest device)':26s} {mb(rec['released_warmup_bytes_per_device'])} "
        f"{mb(rec['released_steady_bytes_per_device'])}",
        "",
        f"FLOPs per device (steady step): {rec['flops_per_device'] / 1e9:.2f} G",
        f"stale buffers per device: {rec['stale_bytes_per_device'] / 2**20:.2f} MiB",
        f"weights per device: {rec['weight_bytes_per_device'] / 2**20:.2f} MiB "
        f"(rules {rec.get('weight_rules', 'replicated')}, mesh "
        f"{' x '.join(f'{k}={v}' for k, v in rec['mesh'].items())})",
    ]
    if rec.get("memory_per_device_bytes") is not None:
        m = rec["memory_per_device"]
        lines += [
            f"memory per device, steady step ({rec['attention']} attention, compiled for "
            f"{rec['memory_backend']}): {rec['memory_per_device_bytes'] / 2**30:.3f} GiB",
            f"  arguments {m['arguments'] / 2**30:.3f}  outputs {m['outputs'] / 2**30:.3f}  "
            f"temporaries {m['temporaries'] / 2**30:.3f}  aliased {m['aliased'] / 2**30:.3f} GiB",
        ]
    lines += [
        f"HLO count equals the analytic model: {'yes' if rec['analytic_matches_hlo'] else 'NO'}",
    ]
    return "\n".join(lines)
