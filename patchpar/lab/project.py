"""`patchpar project`: the latency a strategy would take on real hardware, projected from the
exact per-device FLOPs and collectives of its programs (patchpar/measure/projection.py) and a
hardware profile (patchpar/hardware/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from patchpar.lab.calibrate import MEASURED
from patchpar.lab.config import (
    LOWERED_DTYPES as DTYPES,
)
from patchpar.lab.config import (
    AbstractModel,
    CacheConfig,
    DecodeMesh,
    StrategyConfig,
    sections_plan,
)
from patchpar.lab.configio import FromFlags

if TYPE_CHECKING:
    from patchpar.measure.workload import Workload


@dataclass(frozen=True)
class ProjectConfig(FromFlags):
    """Projected latency of one generation and speedup over one device, split into compute,
    exposed communication, text encoding and VAE decode, per hardware profile; end to end with
    the decode on one device and on row patches (mesh.vae_parallel), and without it (the
    papers' protocol). The model, mesh, strategy and cache sections are `patchpar run`'s, with
    their short flags (`--strategy distrifusion --devices 4 --quant int8`)."""

    model: AbstractModel = field(default_factory=AbstractModel)
    mesh: DecodeMesh = field(default_factory=DecodeMesh)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    resolution: int = 0
    """Square image size in pixels (0: 1024); a video model's frame height (0: its own, 480
    for Wan)."""
    width: int = 0
    """A video model's frame width in pixels (0: its own, 832 for Wan); images are square."""
    frames: int | None = None
    """A video model's frames, 4k + 1 for Wan's VAE (default: the model's, 81 for Wan); cut into
    patches by mesh.layout."""
    batch: int = 1
    """Images per generation (the UNet batch is 2 x batch with cfg=1)."""
    steps: int = 50
    """Denoising steps (DistriFusion's figures: 50-step DDIM)."""
    dtype: str = "bfloat16"
    """float32 or bfloat16 (bytes per element of the exchanged activations)."""
    hardware: str = "a100-sxm"
    """A profile name (see `--hardware all`), a profile YAML path, or `all`: one row each; or
    one profile per patch device, comma-separated (a mixed node: `a100-sxm,l40s`)."""
    overlap: str = "auto"
    """How long a stale collective may run: auto (next-step where the profile's collectives
    are asynchronous, else none), none, step (patchpar's compiled loop: within the step's
    iteration) or next-step (the released DistriFusion code: until the layer's next use)."""
    workloads: Path | None = None
    """Workload cache (JSON lines); default $PATCHPAR_HOME/workloads.jsonl (PATCHPAR_HOME
    defaults to ~/.cache/patchpar). A new point is lowered with abstract weights once."""
    cache_computed_steps: int | None = None
    """With a step cache: the steps that run every block (fbcache's are data: give them, e.g.
    from a measured run's cache_computed_steps; taylorseer's follow from its schedule)."""
    timings: Path | None = None
    """Records of experiments/device/shard_timing.py: where one matches a profile and this
    point, its timed per-device program replaces the fitted compute curve."""
    json: bool = False
    """Print one JSON object per profile instead of the table."""

    def plan(self):
        """The strategy with its options, placed on the mesh, with the step cache."""
        return sections_plan(self.strategy, self.mesh, self.cache)

    def size(self) -> int | str:
        """What the projection lowers: a square image's side, or a video model's "HxWxF"
        (`measure.workload.video_size`), each part not given the model's own."""
        from patchpar.measure.workload import video_label
        from patchpar.models.presets import abstract_denoiser, model_family

        name = self.model.name
        if not model_family(name).video:
            if self.width or self.frames is not None:
                what = f"width={self.width}" if self.width else f"frames={self.frames}"
                raise ValueError(
                    f"{what}: {name} makes square images here (--resolution); width and frames "
                    f"are a video model's (wan2.1-1.3b, ...)"
                )
            return self.resolution or 1024
        unet = abstract_denoiser(name)
        dh, dw = unet.default_size
        frames = unet.default_frames if self.frames is None else self.frames
        return video_label(self.resolution or dh, self.width or dw, frames)


def check_project(config: ProjectConfig) -> list[str]:
    """Every check of the config before any lowering, all the problems raised together
    (`checks.Problems`, one line each); returns the options given that have no effect here
    (the projection prices a model's FLOPs and bytes, a quantized one's at its int8/fp8 peak:
    the model's quant counts, its attention kernel and scanned blocks do not)."""
    from patchpar import hardware
    from patchpar.lab.checks import Problems, check_lowering
    from patchpar.measure.projection import OVERLAPS
    from patchpar.measure.workload import video_size
    from patchpar.models.presets import latent_factor, square_latent
    from patchpar.quant import check_mode

    m, mesh = config.model, config.mesh
    problems = Problems.collect()
    if config.dtype not in DTYPES:
        problems.lines.append(f"dtype={config.dtype!r}; known: {list(DTYPES)}")
    if config.overlap not in OVERLAPS:
        problems.lines.append(f"overlap={config.overlap!r}; known: {list(OVERLAPS)}")
    steps_ok = isinstance(config.steps, int) and config.steps >= 1
    if not steps_ok:
        problems.lines.append(f"steps={config.steps!r}: must be a positive integer")
    if config.batch < 1:
        problems.lines.append(f"batch={config.batch!r}: must be >= 1")
    with problems.check():
        try:
            check_mode(m.quant)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
    with problems.check():
        if config.hardware != "all":
            for name in config.hardware.split(","):
                hardware.load(name.strip())
    with problems.check():
        check_mixed(config)
    if config.timings is not None and not Path(config.timings).is_file():
        problems.lines.append(f"timings={str(config.timings)!r}: no such file")
    latent, video = None, None
    with problems.check():
        video = video_size(size := config.size())
        if video is None:
            latent = square_latent(m.name, size)
        else:
            latent = (
                square_latent(m.name, video[0], "resolution"),
                square_latent(m.name, video[1], "width"),
            )
    with problems.check():  # a known mode and tile, a decode that there is, one projected
        try:
            mesh.vae_plan()
        except ValueError as e:
            raise ValueError(f"mesh.{e}") from None
        if mesh.vae_parallel != "off" and latent_factor(m.name) == 1:
            raise ValueError(
                f"mesh.vae_parallel={mesh.vae_parallel!r}: model {m.name!r} works in pixel "
                f"space (no VAE), so there is no decode to place; leave vae_parallel at off"
            )
        if mesh.vae_parallel == "tiles":
            raise ValueError(
                "mesh.vae_parallel='tiles': the projection prices the decode on one device (off) "
                "or on row patches (rows); tiles are measured, not projected "
                "(experiments/vae_decode.py)"
            )
    plan = None
    with problems.check():
        plan = config.plan()
    if plan is not None and steps_ok:
        with problems.check():  # the plan against the model, with the steps
            if latent is not None and config.batch >= 1:
                frames = None if video is None else video[2]
                check_lowering(m.name, latent, plan, config.batch, config.steps, frames=frames,
                               layout=mesh.layout)  # fmt: skip
            else:  # what needs no size
                plan.strategy.validate(config.steps, plan.patch, plan.cfg)
    if plan is not None and (steps_ok or plan.cache is None):
        with problems.check():
            cache_schedule(plan.cache, config.steps, config.cache_computed_steps)
            if plan.cache is not None and config.timings is not None:
                raise ValueError(
                    f"timings={str(config.timings)!r} with cache {plan.cache.name!r}: the timed "
                    f"programs are uncached ones; project a cache with the profiles' fitted "
                    f"compute"
                )
    problems.raise_any()
    unused = [
        f"model.{k}={getattr(m, k)!r} has no effect in project: it prices FLOPs and bytes, "
        f"which the {what} does not change"
        for k, what in (("attention", "kernel"), ("block_q", "kernel's blocking"),
                        ("block_kv", "kernel's blocking"), ("scan_blocks", "scanned loop"))
        if getattr(m, k) != getattr(AbstractModel(), k)
    ]  # fmt: skip
    if config.overlap != ProjectConfig.overlap and not stale_kinds(plan):
        unused.append(
            f"overlap={config.overlap!r} has no effect: {plan.strategy.name} sends nothing for a "
            f"later step, so every collective is waited for"
        )
    if plan.cache is not None:
        unused += plan.cache.idle_options(config.steps)
    return unused


def run_project(config: ProjectConfig, log=lambda msg: None) -> list[dict]:
    """The projection of the config's point on each profile (see ProjectConfig); `log` hears
    the progress of lowering what the workload cache lacks, and the options that have no
    effect."""
    from patchpar import hardware
    from patchpar.lab.config import build_plan
    from patchpar.lab.results import read_records
    from patchpar.measure.projection import Mixed, project
    from patchpar.measure.workload import WorkloadCache, decode_collectives
    from patchpar.models.presets import latent_factor
    from patchpar.sampling.cache import Forced

    for line in check_project(config):
        log(f"patchpar: warning: {line}")
    m, vae_parallel = config.model, config.mesh.vae_parallel
    mixed = None  # one profile per patch device
    if config.hardware == "all":
        profiles = hardware.load_all()
    elif "," in config.hardware:
        mixed = tuple(hardware.load(x.strip()) for x in config.hardware.split(","))
    else:
        profiles = [hardware.load(config.hardware)]
    timings = []
    if config.timings is not None:
        timings = read_records(Path(config.timings), skip_bad=True)
    plan = config.plan()
    pixel_space = latent_factor(m.name) == 1
    computed = cache_schedule(plan.cache, config.steps, config.cache_computed_steps)
    cache = WorkloadCache(config.workloads, log)
    size, layout = config.size(), config.mesh.layout

    def workload(p, quant=m.quant):
        return cache.get(m.name, size, p, config.batch, config.dtype, quant, layout)

    if config.mesh.patch_weights == MEASURED:  # each device's speed from its profile
        plan = profile_weighted(plan, mixed, workload(replace(plan, cache=None)), m.name,
                                size, log, layout)  # fmt: skip
    one = build_plan("single", {}, 1, 1)
    w, single = workload(replace(plan, cache=None)), workload(one, "none")
    if mixed is not None:
        profiles = [Mixed(mixed, tuple(w.patch_rows) if w.patch_rows else None)]
    cached = None
    if computed is not None:  # each kind of step's programs: computed, skipped (predicted)
        cached = {
            (where, kind): workload(
                replace(p, cache=Forced(plan.cache, kind == "computed")),
                m.quant if where == "plan" else "none",
            )
            for where, p in (("plan", plan), ("single", one))
            for kind in ("computed", "skipped")
        }
    kinds = w.phases["warmup"].get("quantized_types") or [None]
    n = plan.devices // plan.data
    if n > 1 and not pixel_space:
        log(f"lowering the VAE decoder on {n} row patches (its collectives)")
    try:
        dcoll = decode_collectives(m.name, size, n, config.batch // plan.data, config.dtype)
    except ValueError as e:  # the latent's rows do not split: no decode on row patches here
        if vae_parallel == "rows":
            raise
        log(f"no decode on row patches: {e}")
        dcoll = None
    vaes = ("off", "rows", "none") if dcoll is not None else ("off", "none")
    rows = []
    for hw in profiles:
        measured = timed_compute(timings, hw.name, w) if timings else None
        if timings and measured is None:
            log(
                f"patchpar: warning: {config.timings} has no timing of this point on {hw.name} "
                f"(model, resolution, dtype, batch, strategy on {w.devices} patches, and a "
                f"one-patch run); its compute is the profile's fitted curve"
            )
        by_vae = {
            vae: project(w, single, hw, config.steps, config.overlap, measured, vae, dcoll)
            for vae in vaes
        }
        by_rows = by_vae.get("rows")
        p = by_vae[vae_parallel]
        extra = {}
        if cached is not None:
            extra = cached_latency(cached, single, hw, config, computed, dcoll, p)
        rows.append(
            {
                **extra,
                "model": m.name,
                "resolution": size,
                **({"layout": layout} if isinstance(size, str) else {}),
                "strategy": w.strategy,
                "devices": w.devices,
                "cfg": w.cfg,
                "batch": config.batch,
                "steps": config.steps,
                "dtype": config.dtype,
                "quant": m.quant,
                "quant_emulated": hw.emulates(kinds[0]),
                "patch_rows": w.patch_rows,
                **p.to_json(),
                "latency_decode_one_device_s": by_vae["off"].latency_s,
                "latency_decode_rows_s": by_rows.latency_s if by_rows else None,
                "latency_no_decode_s": by_vae["none"].latency_s,
                "decode_one_device_s": by_vae["off"].decode_s,
                "decode_rows_s": by_rows.decode_s if by_rows else None,
                "pixel_space": pixel_space,
            }
        )
    return rows


def check_mixed(config: ProjectConfig) -> None:
    """One profile per patch device (`--hardware a100-sxm,l40s`); weights `measured` need them."""
    names = config.hardware.split(",")
    if len(names) > 1:
        plan = config.plan()
        if len(names) != plan.patch or plan.patch != plan.devices:
            raise ValueError(
                f"hardware={config.hardware!r}: {len(names)} profiles for {plan.patch} patch "
                f"device(s) of {plan.devices}; a mixed node takes one profile per device, every "
                f"device a patch device (cfg 1, data 1, no tensor parallelism)"
            )
    elif config.mesh.patch_weights == MEASURED:
        raise ValueError(
            f"mesh.patch_weights=measured: the projection takes each device's speed from its "
            f"own profile; give one per patch device (--hardware a100-sxm,l40s), not "
            f"{config.hardware!r}"
        )


def profile_weighted(plan, profiles, even, model: str, resolution, log, layout="frames"):
    """`plan` with patch weights from each device's profile: its speed on the even split's
    largest patch (`even`: that plan's workload) relative to the fastest, floored to a unit."""
    from patchpar.measure.calibrate import speed_weights
    from patchpar.measure.workload import denoiser_on
    from patchpar.parallel.split import floored

    flops = even.phases["steady"]["flops_per_device"]
    weights = speed_weights([p.compute_s(flops) for p in profiles])
    unet, latent = denoiser_on(model, resolution, plan, layout)
    weights = floored(weights, latent[0], unet.row_multiple)
    log("patch weights from the profiles: " + ",".join(f"{x:.3g}" for x in weights))
    return replace(plan, patch_weights=weights)


def cache_schedule(cache, steps: int, computed_steps: int | None) -> list[bool] | None:
    """Which steps run every block under `cache` (None: no cache): its own schedule, or for a
    cache that decides from the data `computed_steps` spread evenly (the first included)."""
    if cache is None:
        if computed_steps is not None:
            raise ValueError(
                f"cache_computed_steps={computed_steps}: there is no cache (set --cache)"
            )
        return None
    own = cache.schedule(steps)
    n = computed_steps
    if own is not None:
        if n is not None and n != sum(own):
            raise ValueError(
                f"cache_computed_steps={n}: {cache.describe()} computes {sum(own)} of {steps} "
                f"steps by its schedule; leave it unset"
            )
        return own
    ok = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= steps
    if not ok:
        raise ValueError(
            f"cache_computed_steps={n!r}: cache {cache.name!r} decides from the data which "
            f"steps run, so the projection needs their number: an integer in [1, {steps}] "
            f"(a measured run records it as cache_computed_steps)"
        )
    at = {k * steps // n for k in range(n)}
    return [s in at for s in range(steps)]


def cached_latency(cached, single, hw, config, computed, dcoll, p) -> dict:
    """The cached run's latency from each kind of step's projected step time, per phase, weighted
    by the steps of that kind (`computed`: per step, whether it runs every block), beside
    `single` with the same cache; the rest (encode, decode) as the uncached projection `p`."""
    from patchpar.measure.projection import project, warmup_phase_steps

    def step_times(w, ref, on=hw):
        q = project(w, ref, on, config.steps, config.overlap, None, config.mesh.vae_parallel, dcoll)
        return {ph: v["step_s"] for ph, v in q.phases.items()}

    one_hw = getattr(hw, "single", hw)  # a mixed node's one-device runs: its fastest chip

    comp = step_times(cached["plan", "computed"], single)
    skip = step_times(cached["plan", "skipped"], single)
    n_warm = warmup_phase_steps(cached["plan", "computed"], config.steps)
    denoise = sum(
        (comp if ran else skip)["warmup" if s < n_warm else "steady"]
        for s, ran in enumerate(computed)
    )
    one_c = step_times(cached["single", "computed"], single, one_hw)["warmup"]
    one_s = step_times(cached["single", "skipped"], single, one_hw)["warmup"]
    one = sum(one_c if ran else one_s for ran in computed)
    single_other = p.single_latency_s - config.steps * one_hw.compute_s(
        single.phases["warmup"]["flops_per_device"]
    )
    latency = denoise + p.other_s
    single_cached = one + single_other
    return {
        "cache": cached["plan", "computed"]
        .strategy.split(" + ", 1)[1]
        .removesuffix(" forced to compute"),
        "cache_computed_steps": sum(computed),
        "latency_cached_s": latency,
        "single_cached_latency_s": single_cached,
        "speedup_cached": p.single_latency_s / latency,
        "speedup_vs_single_same_cache": single_cached / latency,
    }


def stale_kinds(plan) -> set[str]:
    """The site kinds whose steady-phase collectives send for a later step (what `overlap`
    prices); empty for a strategy whose every collective is waited for."""
    from patchpar.parallel.strategies.base import StaleStrategy

    if not isinstance(plan.strategy, StaleStrategy):
        return set()
    return {op.kind for op in plan.strategy.ops("steady", plan.patch).sites() if op.sends_stale()}


def timed_compute(records: list[dict], hardware: str, w: Workload) -> dict | None:
    """Measured seconds per UNet call for `w` on `hardware` from experiments/device/
    shard_timing.py records: {"warmup", "steady", "single"}, or None where they lack this
    point (same model, resolution, dtype, patches = devices with cfg=1, strategy, and the
    one-patch `single` run of the same attention kernel; records that name no kernel, written
    before shard_timing.py recorded it, match each other: give one kernel's files). The script
    times the steady program of a stale strategy, with its stale exchanges stood in by copies on
    the core and left out (`stale_exchange`; records without the field stood them in): the
    steady phase takes the program without them where it was timed (the exchange overlaps the
    step, carried by the interconnect: no core time), the warm-up phase the stood-in one (its
    exact exchanges are exposed and priced apart; the two phases differ by the stale buffers'
    writes)."""
    if w.cfg != 1:
        return None
    ok = [
        r
        for r in records
        if r.get("status") == "ok"
        and r.get("hardware") == hardware
        and str(r.get("model")) == w.model
        and r.get("resolution") == w.resolution
        and r.get("dtype") == w.dtype
        and r.get("unet_batch") == w.unet_batch
    ]
    mine = [r for r in ok if r["patches"] == w.devices and r["strategy"] == w.strategy]
    # a program timed with its sends dropped (`--stale-exchange dropped`) is no run's program
    mine = [r for r in mine if r.get("stale_exchange") != "dropped"]
    if not mine:
        return None
    kernel = lambda r: (r.get("attention"), r.get("block_q"), r.get("block_kv"))  # noqa: E731
    single = [r for r in ok if r["patches"] == 1 and kernel(r) == kernel(mine[-1])]
    if not single:
        return None
    stood = [r for r in mine if r.get("stale_exchange", "stand_in") == "stand_in"] or mine
    out = [r for r in mine if r.get("stale_exchange") == "left_out"] or stood
    return {
        "warmup": stood[-1]["unet_call_s_median"],
        "steady": out[-1]["unet_call_s_median"],
        "single": single[-1]["unet_call_s_median"],
    }
