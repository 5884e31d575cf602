"""Strategies on a video: the micro Wan transformer on a 3-frame latent laid out as a tall image
by frames, by rows and as a 3 x 2 grid of blocks, 4 UniPC steps with guidance. Each layout's
`single` is the same video; exact strategies equal it (<= float32 rounding of the latents'
scale); DistriFusion with warm-up over every step equals sync_patch; a stale run is not exact;
HLO bytes equal the analytic model."""

from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import rounding

from patchpar.models.wan import Video, wan_denoiser
from patchpar.parallel.engine import Plan, denoise
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.experts import Experts
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=40, num_layers=2)  # fmt: skip
STEPS, GUIDANCE = 4, 5.0


@cache
def micro(layout: str):
    fn = wan_denoiser(TINY, Video(3, layout))
    return fn, fn.init(seed=1)


def inputs():
    rng = np.random.RandomState(0)
    x = rng.randn(2, 3, 8, 6, 4).astype(np.float32)  # (B, F, H, W, C)
    ctx = rng.randn(2, 2, 5, 16).astype(np.float32)  # (guidance halves, B, S, D)
    return jnp.asarray(x), Conditioning(jnp.asarray(ctx), {})


def run_of(layout: str, name: str, devices: int, **options):
    """(fn, params, plan, sampler, schedule, cond, tall latent) of a run on the micro model."""
    fn, params = micro(layout)
    x, cond = inputs()
    tall = fn.video.to_tall(x, 2)
    smp = get_sampler("unipc")
    sched = smp.schedule(SchedulerConfig(flow=True, shift=3.0), STEPS)
    plan = Plan(make_strategy(name, **options), devices, 1)
    plan.validate(fn, tall.shape[1:3], STEPS, GUIDANCE)
    return fn, params, plan, smp, sched, cond, tall


@cache
def sample(layout: str, name: str, devices: int, **options) -> np.ndarray:
    """The denoised video (B, F, H, W, C), whatever the layout."""
    fn, params, plan, smp, sched, cond, tall = run_of(layout, name, devices, **options)
    out, _ = denoise(fn, plan, smp, params, cond, sched, tall, GUIDANCE)
    return np.asarray(fn.video.from_tall(out, 2))


def test_every_layout_is_the_same_video_on_one_device():
    want = sample("frames", "single", 1)
    for layout in ("rows", "3x2"):
        assert np.abs(sample(layout, "single", 1) - want).max() <= rounding(want)


@pytest.mark.parametrize(
    "layout, name, devices",
    [
        ("frames", "sync_patch", 3),  # a frame per device
        pytest.param("rows", "sync_patch", 2, marks=pytest.mark.slow),  # half of every frame's rows
        ("3x2", "sync_patch", 6),  # a block of one frame x two token rows per device
        pytest.param("frames", "ring", 4, marks=pytest.mark.slow),  # 3 token rows each: frames cut
        pytest.param("rows", "ulysses", 2, marks=pytest.mark.slow),
        pytest.param("frames", "sync_patch", 5, marks=pytest.mark.slow),  # uneven: 3,3,2,2,2
    ],
)
def test_exact_strategies_on_a_video_equal_single(layout, name, devices):
    want = sample(layout, "single", 1)
    assert np.abs(sample(layout, name, devices) - want).max() <= rounding(want)


def test_weights_sharded_at_rest_on_a_video_equal_single():
    """FSDP (`Plan(fsdp=True)`): every parameterised layer of Wan, the condition embedder's
    time and text projections too, gathers its weights where it runs."""
    fn, params, _, smp, sched, cond, tall = run_of("rows", "single", 1)
    plan = Plan(make_strategy("sync_patch"), 2, 1, fsdp=True)
    plan.validate(fn, tall.shape[1:3], STEPS, GUIDANCE)
    out, _ = denoise(fn, plan, smp, params, cond, sched, tall, GUIDANCE)
    want = sample("rows", "single", 1)
    assert np.abs(np.asarray(fn.video.from_tall(out, 2)) - want).max() <= rounding(want)


@pytest.mark.parametrize("layout", ["frames", pytest.param("rows", marks=pytest.mark.slow)])
def test_distrifusion_on_a_video(layout):
    exact = sample(layout, "sync_patch", 3 if layout == "frames" else 2)
    devices = 3 if layout == "frames" else 2
    warm = sample(layout, "distrifusion", devices, warmup_steps=STEPS - 1)
    assert np.abs(warm - exact).max() <= rounding(exact)
    stale = sample(layout, "distrifusion", devices, warmup_steps=1)
    assert np.abs(stale - exact).max() > 1e-3 * np.abs(exact).max()  # stale: not exact


@pytest.mark.parametrize(
    "layout, devices, frames, rows",
    [
        pytest.param("frames", 3, 1, 8, marks=pytest.mark.slow),  # a frame each
        pytest.param("3x2", 6, 1, 4, marks=pytest.mark.slow),  # a frame's half each
        ("1x2", 2, 3, 4),  # every frame's half each, as a block (frame after frame)
        pytest.param("rows", 2, 3, 4, marks=pytest.mark.slow),  # every frame's half each
    ],
)
def test_naive_patch_on_a_video_is_each_block_denoised_alone(layout, devices, frames, rows):
    """Each device denoises its slab as a video of its own: every block of `frames` frames x
    `rows` latent rows equals `single` on that block alone, its positions its own."""
    naive = sample(layout, "naive_patch", devices)
    fn, params = micro("frames")
    x, cond = inputs()
    smp = get_sampler("unipc")
    sched = smp.schedule(SchedulerConfig(flow=True, shift=3.0), STEPS)
    alone_fn = fn.with_video(Video(frames))
    for f0 in range(0, 3, frames):
        for r0 in range(0, 8, rows):
            block = x[:, f0 : f0 + frames, r0 : r0 + rows]
            out, _ = denoise(alone_fn, Plan(make_strategy("single"), 1), smp, params, cond, sched,
                             alone_fn.video.to_tall(block, 2), GUIDANCE)  # fmt: skip
            alone = np.asarray(alone_fn.video.from_tall(out, 2))
            got = naive[:, f0 : f0 + frames, r0 : r0 + rows]
            assert np.abs(got - alone).max() <= rounding(alone), (f0, r0)
    assert np.abs(naive - sample(layout, "single", 1)).max() > 1e-3  # seams: not exact


def test_naive_patch_refuses_a_video_slab_that_cuts_a_frame():
    with pytest.raises(ValueError, match=r"3 latent frames do not split into 2 whole videos; "
                                         r"devices that divide them: \[3\]"):  # fmt: skip
        run_of("frames", "naive_patch", 2)
    with pytest.raises(ValueError, match=r"naive_patch on a video over uneven patches \(6, 6, 4,"):
        run_of("frames", "naive_patch", 5)
    with pytest.raises(ValueError, match=r"layout='3x2': 3 x 2 = 6 blocks for 2 patch devices"):
        run_of("3x2", "naive_patch", 2)  # a grid of other blocks than devices


def test_hlo_bytes_equal_the_analytic_model_on_a_video():
    from patchpar.measure.cost import measure

    fn, params = micro("rows")
    plan = Plan(make_strategy("distrifusion", warmup_steps=1), 2)
    rec = measure(fn, plan, (24, 6), batch=2, params=params, flops=False)
    for entry in rec["phases"].values():
        assert entry["analytic_matches_hlo"], entry
    # every device receives the other's K/V: 2 layers x (K and V) x 2 images x 2 guidance
    # halves x 18 tokens x 24 wide x 4 bytes
    assert rec["phases"]["steady"]["hlo"]["kv"]["max"] == 2 * 2 * 2 * 2 * 18 * 24 * 4


# ---------------------------------------------------------------------------- layer-split strategies


@pytest.mark.slow
def test_the_stack_composes_to_the_model():
    """Wan's parts (text, time, patches, each block with its rows of the RoPE table, head) run
    one after another are the model's call: what PipeFusion and AsyncDiff split."""
    from patchpar.models.sites import IDENTITY

    fn, params = micro("rows")
    x, cond = inputs()
    tall = fn.video.to_tall(x, 2)
    ts = jnp.asarray([700.0, 300.0])
    stack, outer = fn.stack, fn.stack.outer(params)
    ctx = stack.context(outer, cond.context[1], {})
    temb = stack.time(outer, ts, {})
    h = stack.embed(outer, IDENTITY, tall)
    for block in stack.segment_blocks(params)[0]:
        h, _ = stack.block(outer, IDENTITY, block, h, ctx, temb, tall.shape[2] // 2)
    got = stack.head(outer, h, temb, *tall.shape[1:3])
    want = fn(params, tall, ts, cond.context[1])
    assert got.shape == want.shape and np.abs(got - want).max() <= rounding(want)


@pytest.mark.parametrize(
    "layout, name, devices",
    [("frames", "pipefusion", 2), pytest.param("rows", "asyncdiff", 2, marks=pytest.mark.slow)],
)
def test_layer_split_strategies_on_a_video(layout, name, devices):
    """PipeFusion (patches of the tall image streamed through 2 stages, each layer's whole-video
    K/V buffer) and AsyncDiff (a block per device, a step apart): warm-up over every step equals
    single; after one exact step they are not exact; HLO bytes equal the analytic model."""
    from patchpar.measure.cost import measure

    want = sample(layout, "single", 1)
    warm = sample(layout, name, devices, warmup_steps=STEPS)
    assert np.abs(warm - want).max() <= rounding(want)
    stale = sample(layout, name, devices, warmup_steps=1)
    assert np.abs(stale - want).max() > 1e-3 * np.abs(want).max()
    fn, params = micro(layout)
    plan = Plan(make_strategy(name, warmup_steps=1), devices)
    rec = measure(fn, plan, (24, 6), batch=2, params=params, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


# ---------------------------------------------------------------------------- two experts

EXPERTS = Experts((0, 2), (GUIDANCE, 3.0))  # Wan 2.2: the high-noise one, then the low-noise one


@cache
def with_experts(layout: str, name: str, devices: int, same: bool = False, **options):
    """The video denoised by two experts (the second of other weights, or the same with
    `same`, then at one scale), and the run's (fn, plan, smp, params, cond, sched, tall)."""
    fn, params, plan, smp, sched, cond, tall = run_of(layout, name, devices, **options)
    experts = Experts(EXPERTS.starts, (GUIDANCE, GUIDANCE)) if same else EXPERTS
    both = (params, params if same else fn.init(seed=2))
    out, _ = denoise(fn, plan, smp, both, cond, sched, tall, GUIDANCE, experts)
    return np.asarray(fn.video.from_tall(out, 2)), (fn, plan, smp, both, cond, sched, tall)


def test_two_experts_on_a_video():
    """Wan 2.2's two experts (`sampling.experts`): sync_patch equals single; DistriFusion with
    warm-up over every step equals sync_patch; one expert twice at one scale is that denoiser
    alone (the sampler's history runs on across the switch); each expert has its own warm-up
    (chaining the phase programs gives `denoise`; without the second's warm-up it differs); the
    one-device program of the pipelines is the same run."""
    from patchpar.parallel.engine import expert_phases
    from patchpar.pipelines.single import denoise_single

    want, (fn, _, smp, both, cond, sched, tall) = with_experts("frames", "single", 1)
    alone, _ = denoise_single(fn, smp, None, both, cond, sched, tall, GUIDANCE, EXPERTS)
    assert np.abs(np.asarray(fn.video.from_tall(alone, 2)) - want).max() <= rounding(want)
    exact = with_experts("frames", "sync_patch", 3)[0]
    assert np.abs(exact - want).max() <= rounding(want)
    warm = with_experts("frames", "distrifusion", 3, warmup_steps=STEPS - 1)[0]  # every step
    assert np.abs(warm - exact).max() <= rounding(exact)
    once = sample("frames", "sync_patch", 3)
    assert np.abs(with_experts("frames", "sync_patch", 3, same=True)[0] - once).max() <= rounding(
        once
    )

    stale, run = with_experts("frames", "distrifusion", 3, warmup_steps=0)
    assert np.abs(stale - exact).max() > 1e-3 * np.abs(exact).max()
    phases = expert_phases(run[1], STEPS, EXPERTS)
    assert phases == [(0, "warmup", (0, 1), False), (0, "steady", (1, 2), False),
                      (1, "warmup", (2, 3), True), (1, "steady", (3, 4), False)]  # fmt: skip
    assert np.abs(chained(run, phases) - stale).max() <= rounding(stale)
    # without the low-noise expert's warm-up: its first step on the other's stale activations
    merged = phases[:2] + [(1, "steady", (2, 4), False)]
    assert np.abs(chained(run, merged) - stale).max() > 1e-3 * np.abs(stale).max()


def chained(run, phases) -> np.ndarray:
    """The video of `run` (a `with_experts` run's setup) by its phase programs in turn."""
    from patchpar.parallel.engine import denoise_phase

    fn, plan, smp, both, cond, sched, tall = run
    x, loop = tall, None
    for k, phase, span, restart in phases:
        x, loop = denoise_phase(fn, plan, smp, phase, both, cond, sched, x, loop,
                                EXPERTS.scales[k], span=span, expert=k, restart=restart)  # fmt: skip
    return np.asarray(fn.video.from_tall(x, 2))


@pytest.mark.slow
@pytest.mark.parametrize("layout, name", [("frames", "pipefusion"), ("rows", "asyncdiff")])
def test_layer_split_strategies_with_two_experts(layout, name):
    """PipeFusion and AsyncDiff with two experts: warm-up over every step equals single; with
    one warm-up step, each expert's span starts with its own (restarted: the program's K/V or
    component outputs dropped), the phase programs chain to the run, and it is not exact."""
    from patchpar.parallel.engine import expert_phases

    want = with_experts(layout, "single", 1)[0]
    warm = with_experts(layout, name, 2, warmup_steps=STEPS)[0]
    assert np.abs(warm - want).max() <= rounding(want)
    stale, run = with_experts(layout, name, 2, warmup_steps=1)
    assert np.isfinite(stale).all() and np.abs(stale - want).max() > 1e-3 * np.abs(want).max()
    phases = expert_phases(run[1], STEPS, EXPERTS)
    assert [p[1:] for p in phases] == [("warmup", (0, 1), False), ("steady", (1, 2), False),
                                       ("warmup", (2, 3), True), ("steady", (3, 4), False)]  # fmt: skip
    assert np.abs(chained(run, phases) - stale).max() <= rounding(stale)
