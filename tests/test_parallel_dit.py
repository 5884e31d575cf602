"""The parallel engine on a diffusion transformer (a micro PixArt): a row slab is a run of whole
tokens, each device adds its rows of the whole image's position table, and self-attention K/V is
the only exchange. Exact strategies equal the single device; stale ones differ from it."""

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from patchpar.models.api import PixArtFn
from patchpar.models.pixart import PixArtConfig, PixArtTransformer2DModel
from patchpar.parallel.engine import Plan, denoise, make_step
from patchpar.parallel.strategies import make_strategy
from patchpar.pipelines.single import unet_on_stack
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.loop import guided
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

GUIDANCE = 4.5
MICRO = dict(
    num_attention_heads=3, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
    caption_channels=12, sample_size=16, patch_size=2, use_additional_conditions=True,
)  # fmt: skip


@cache
def micro_dit() -> tuple[PixArtFn, dict]:
    fn = PixArtFn(PixArtTransformer2DModel(PixArtConfig.from_diffusers(MICRO)))
    params = fn.init(seed=3)
    rng = np.random.RandomState(0)
    # every parameter non-trivial (random_params leaves biases and the modulation tables at 0)
    params = jax.tree.map(lambda p: np.asarray(p + 0.1 * rng.randn(*p.shape), np.float32), params)
    return fn, params


def inputs(batch: int = 2, hw=(16, 12)):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(batch, *hw, 4), jnp.float32)
    mask = np.ones((2, batch, 5), np.int32)
    mask[:, 1, 3:] = 0  # the second image's text is shorter
    extras = {
        "encoder_attention_mask": jnp.asarray(mask),
        "resolution": jnp.broadcast_to(jnp.asarray([128.0, 96.0]), (2, batch, 2)),
        "aspect_ratio": jnp.broadcast_to(jnp.asarray([1.33]), (2, batch, 1)),
    }
    cond = Conditioning(jnp.asarray(rng.randn(2, batch, 5, 12), jnp.float32), extras)
    return x, jnp.asarray(400.0), cond


@partial(jax.jit, static_argnums=0)
def single_guided(fn, params, x, t, cond):
    return guided(unet_on_stack(fn, params, x, t, cond), GUIDANCE)


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("patch, cfg", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_sync_patch_forward_on_a_dit_equals_single(patch, cfg):
    fn, params = micro_dit()
    x, t, cond = inputs()
    plan = Plan(make_strategy("sync_patch"), patch * cfg, cfg)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    ref = single_guided(fn, params, x, t, cond)
    assert out.shape == x.shape and max_diff(out, ref) <= 1e-4


@cache
def _sample(name: str, patch: int, **options):
    fn, params = micro_dit()
    x, _, cond = inputs()
    smp = get_sampler("dpmpp_2m")
    sched = smp.schedule(SchedulerConfig(), 4)
    plan = Plan(make_strategy(name, **options), patch)
    plan.validate(fn, x.shape[1:3], 4, GUIDANCE)
    out, state = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    return np.asarray(out), state


def test_exact_and_stale_sampling_runs_on_a_dit():
    """sync_patch's run equals single's; DistriFusion with warm-up covering every step equals
    sync_patch, and its steady phase (stale K/V, the only site a DiT has) differs."""
    single, _ = _sample("single", 1)
    sync, _ = _sample("sync_patch", 2)
    assert max_diff(sync, single) <= 1e-4
    warm, state = _sample("distrifusion", 2, warmup_steps=3)
    assert max_diff(warm, sync) <= 1e-4 and jax.tree.leaves(state)
    stale, state = _sample("distrifusion", 2, warmup_steps=1)
    assert max_diff(stale, sync) > 1e-4
    # a DiT has no halos and no GroupNorm: the stale buffers are the blocks' K/V only
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    assert paths == [f"['transformer_blocks_{i}']['attn1']['kv']" for i in range(2)], paths
    naive, _ = _sample("naive_patch", 2)
    assert max_diff(naive, single) > 1e-3


@pytest.mark.parametrize(
    "name, devices, options",
    [
        pytest.param("ring", 4, {}, marks=pytest.mark.slow),  # the UNet's context-parallel site
        pytest.param("ulysses", 4, {}, marks=pytest.mark.slow),
        ("pcpp", 4, {"warmup_steps": 1, "send": "band"}),
        ("pcpp", 4, {"warmup_steps": 1, "send": "full", "align": "rows"}),
    ],
)
def test_every_patch_strategy_on_a_dit(name, devices, options):
    """Ring and Ulysses (context-parallel self-attention) equal single in one call; PCPP's band
    (in tokens) is exact in its warm-up step. HLO bytes of both phases equal the analytic
    model."""
    from patchpar.measure.cost import measure

    fn, params = micro_dit()
    x, t, cond = inputs()
    plan = Plan(make_strategy(name, **options), devices)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    assert max_diff(out, single_guided(fn, params, x, t, cond)) <= 1e-4
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    steady = rec["phases"].get("steady")
    if name == "pcpp":  # neighbours' K/V only: less than all patches' K/V
        assert 0 < steady["hlo"]["all"]["max"] < rec["phases"]["warmup"]["hlo"]["all"]["max"]


def test_a_row_aligned_band_keeps_whole_token_rows():
    """pcpp align=rows on the DiT: 2 token rows (of 6 tokens) per patch on 4 devices; portion
    0.3 keeps one whole row of each neighbour (6 tokens), where align=tokens keeps 4. The
    buffers come from the warm-up's exact K/V, sent whole and cropped by rows (send=full)."""
    _, tokens = _sample("pcpp", 4, warmup_steps=1, portion=0.3)
    _, rows = _sample("pcpp", 4, warmup_steps=1, portion=0.3, align="rows")
    above = lambda s: s["transformer_blocks_0"]["attn1"]["kv_above"]  # noqa: E731
    assert above(tokens).shape[-2] == 4 and above(rows).shape[-2] == 6
    warm, _ = _sample("pcpp", 4, warmup_steps=3, align="rows")
    sync, _ = _sample("sync_patch", 4)
    assert max_diff(warm, sync) <= 1e-4


# (strategy, devices, cfg, data, fsdp, options): the micro DiT has 3 heads (padded to 4 over
# model=2) and a 96-wide GELU feed-forward (split, not gated as a UNet's GEGLU)
WEIGHT_CASES = [
    pytest.param("tensor", 2, 1, 1, False, {}, marks=pytest.mark.slow),
    ("tensor", 8, 2, 1, False, {"tp_degree": 2}),  # cfg 2 x patch 2 x model 2
    ("sync_patch", 4, 1, 1, True, {}),  # FSDP over patch
    ("sync_patch", 8, 2, 2, False, {}),  # data 2 x cfg 2 x patch 2
    pytest.param("tensor", 8, 1, 2, True, {"tp_degree": 2}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, devices, cfg, data, fsdp, options", WEIGHT_CASES)
def test_tensor_fsdp_and_data_parallel_on_a_dit_equal_single(
    name, devices, cfg, data, fsdp, options
):
    """Weights split by the DiT's own logical axes (its feed-forward is `mlp`, not
    `mlp_gated`), sharded at rest, or images split over data: one call equals single, and the
    HLO's bytes equal the analytic model."""
    from patchpar.measure.cost import measure
    from patchpar.parallel.rules import weight_bytes_per_device

    fn, params = micro_dit()
    x, t, cond = inputs(batch=2 * data)
    plan = Plan(make_strategy(name, **options), devices, cfg, data=data, fsdp=fsdp)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE, x.shape[0])
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    assert max_diff(out, single_guided(fn, params, x, t, cond)) <= 1e-4
    rec = measure(fn, plan, x.shape[1:3], batch=x.shape[0], params=params, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    whole = weight_bytes_per_device(params, {}, {}, fn.logical)
    assert (rec["weight_bytes_per_device"] < whole) == (plan.model > 1 or fsdp)


def test_a_dit_feed_forward_is_split_not_gated():
    from patchpar.parallel.rules import logical_axes

    fn, _ = micro_dit()
    path = "transformer_blocks_0/ff/net_0/proj/kernel"
    assert logical_axes(path, 2, fn.logical) == ("embed", "mlp")
    with pytest.raises(ValueError, match="feed-forward width 96 is not divisible by 5"):
        fn.check_split(5)


def test_a_column_split_of_a_dit_is_refused():
    fn, _ = micro_dit()
    for split in ("col", "alternate"):
        plan = Plan(make_strategy("naive_patch", split=split), 2)
        with pytest.raises(ValueError, match="split by rows only; use split=row"):
            plan.validate(fn, (16, 12), 4, GUIDANCE)
