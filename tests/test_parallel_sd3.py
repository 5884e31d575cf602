"""The parallel engine on SD3 (a micro SD3.5: QK RMSNorm, a dual-attention block, the
context_pre_only last block): image tokens split into row patches, the text stream on every
device, each joint attention's image K/V and each dual block's image self-attention the
exchanges, position rows from the whole image's cropped table. Exact strategies equal the
single device; the warm-up over every step equals sync_patch; HLO bytes equal the analytic
model; PipeFusion on an SD3 without dual blocks."""

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import rounding

from patchpar.models.sd3 import SD3Config, SD3Fn, SD3Transformer2DModel
from patchpar.parallel.engine import Plan, denoise, make_step
from patchpar.parallel.strategies import make_strategy
from patchpar.pipelines.single import unet_on_stack
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.loop import guided
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

GUIDANCE = 3.0  # classifier-free guidance: two halves
MICRO = dict(
    sample_size=8, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
    num_attention_heads=3, joint_attention_dim=12, caption_projection_dim=24,
    pooled_projection_dim=10, pos_embed_max_size=16, qk_norm="rms_norm",
    dual_attention_layers=[0],
)  # fmt: skip
# for PipeFusion (each segment of identical blocks fills the stages): no dual blocks (one
# segment), and two dual blocks then two plain ones (two segments)
KINDS = {
    "dual": MICRO,
    "plain": {**MICRO, "dual_attention_layers": [], "num_layers": 4},
    "dual2": {**MICRO, "dual_attention_layers": [0, 1], "num_layers": 4},
}


@cache
def micro_sd3(kind: str = "dual") -> tuple[SD3Fn, dict]:
    fn = SD3Fn(SD3Transformer2DModel(SD3Config.from_diffusers(KINDS[kind])))
    params = fn.init(seed=3)
    rng = np.random.RandomState(0)
    # every parameter non-trivial (random_params leaves biases at 0 and norm scales at 1)
    params = jax.tree.map(lambda p: np.asarray(p + 0.1 * rng.randn(*p.shape), np.float32), params)
    return fn, params


def inputs(batch: int = 2, hw=(16, 12)):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(batch, *hw, 4), jnp.float32)
    extras = {"pooled_projections": jnp.asarray(rng.randn(2, batch, 10), jnp.float32)}
    cond = Conditioning(jnp.asarray(rng.randn(2, batch, 5, 12), jnp.float32), extras)
    return x, jnp.asarray(0.6), cond


@partial(jax.jit, static_argnums=0)
def single_guided(fn, params, x, t, cond):
    return guided(unet_on_stack(fn, params, x, t, cond), GUIDANCE)


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def one_call(name, devices, **options):
    fn, params = micro_sd3()
    x, t, cond = inputs()
    plan = Plan(make_strategy(name, **options.pop("strategy", {})), devices, **options)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    want = single_guided(fn, params, x, t, cond)
    return max_diff(out, want) / rounding(want), plan


@pytest.mark.parametrize(
    "name, devices, options",
    [
        ("sync_patch", 2, {}),
        pytest.param("sync_patch", 4, {}, marks=pytest.mark.slow),
        ("sync_patch", 4, {"cfg": 2}),
        pytest.param("ring", 4, {}, marks=pytest.mark.slow),
        ("ulysses", 4, {}),  # 3 heads padded to 4
        pytest.param("tensor", 3, {}, marks=pytest.mark.slow),
        ("compact", 2, {"strategy": {"codec": "none"}}),  # the codec off: exact
        pytest.param("tensor", 4, {}, marks=pytest.mark.slow),  # 3 heads padded to 4
        pytest.param("sync_patch", 2, {"fsdp": True}, marks=pytest.mark.slow),
    ],
)
def test_exact_strategies_on_sd3_equal_single(name, devices, options):
    """One guided call equals single; the HLO bytes equal the analytic model (both the joint
    attentions and the dual block's image self-attention counted)."""
    from patchpar.measure.cost import measure

    apart, plan = one_call(name, devices, **options)
    assert apart <= 1  # float rounding apart
    fn, params = micro_sd3()
    x, _, _ = inputs()
    rec = measure(fn, plan, x.shape[1:3], batch=2, params=params, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


@cache
def _sample(name: str, patch: int, kind: str = "dual", **options):
    fn, params = micro_sd3(kind)
    x, _, cond = inputs()
    smp = get_sampler("euler")
    sched = smp.schedule(SchedulerConfig(), 4)
    plan = Plan(make_strategy(name, **options), patch)
    plan.validate(fn, x.shape[1:3], 4, GUIDANCE)
    out, state = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    return np.asarray(out), state


@pytest.mark.slow
def test_exact_and_stale_sampling_runs_on_sd3():
    """sync_patch's run equals single's; DistriFusion and PCPP with warm-up covering every step
    equal sync_patch, and their steady phases (stale image K/V of every joint attention and of
    the dual block's second attention) differ."""
    single, _ = _sample("single", 1)
    sync, _ = _sample("sync_patch", 2)
    assert max_diff(sync, single) <= rounding(single)
    for name in ("distrifusion", "pcpp"):
        warm, _ = _sample(name, 2, warmup_steps=3)
        assert max_diff(warm, sync) <= rounding(sync), name
    stale, state = _sample("distrifusion", 2, warmup_steps=1)
    assert max_diff(stale, sync) > rounding(sync)
    # compressed (CompactFusion's int8 residuals), a stale codec and extrapolation all run;
    # each differs from the exact run, int8 by less than the stale exchange does
    compact, _ = _sample("compact", 2, codec="int8")
    assert 0 < max_diff(compact, sync) < max_diff(stale, sync)
    for opts in ({"codec": "int2"}, {"extrapolate": 0.5}):
        other, _ = _sample("distrifusion", 2, warmup_steps=1, **opts)
        assert max_diff(other, stale) > 1e-6, opts
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    want = [f"['transformer_blocks_{i}']['attn']['kv']" for i in range(3)]
    assert sorted(paths) == sorted([*want, "['transformer_blocks_0']['attn2']['kv']"]), paths


@pytest.mark.parametrize(
    "name, devices, options",
    [
        ("distrifusion", 2, {"warmup_steps": 1}),
        ("pcpp", 4, {"warmup_steps": 1, "send": "band", "align": "rows"}),
        ("distrifusion", 2, {"warmup_steps": 1, "text": "mean"}),
        ("compact", 2, {"codec": "int8"}),
        ("distrifusion", 2, {"warmup_steps": 1, "codec": "int2"}),
    ],
)
def test_hlo_bytes_equal_the_model_on_sd3(name, devices, options):
    """Both phases' HLO bytes equal the analytic model: the image K/V of the 3 joint
    attentions and the dual block's self-attention (the text's K/V is never exchanged)."""
    from patchpar.measure.cost import measure

    fn, _ = micro_sd3()
    x, _, _ = inputs()
    plan = Plan(make_strategy(name, **options), devices)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    warm = rec["phases"]["warmup"]["hlo"]
    # exact in warm-up: each device receives the other patches' image K/V of the 4 sites,
    # 2 (K, V) x 2 halves (CFG) x 2 images x tokens x 24 x 4 B
    tokens = (16 // 2) * (12 // 2) * (devices - 1) // devices
    assert warm["all"]["max"] == 4 * 2 * 2 * 2 * tokens * 24 * 4, warm


@pytest.mark.parametrize("kind, segments", [("plain", (4,)), ("dual2", (2, 2))])
def test_the_sd3_stack_composes_to_the_model(kind, segments):
    """Input part, the joint blocks as runs of one kind (dual-attention blocks, then plain
    ones; the context_pre_only last block lifted to its run's kind with the same image tokens)
    and the output part are the model's call: what PipeFusion splits over stages."""
    from patchpar.models.sites import IDENTITY

    fn, params = micro_sd3(kind)
    x, t, cond = inputs()
    extras = {k: v[0] for k, v in cond.extras.items()}
    ts = jnp.broadcast_to(t, (x.shape[0],))
    stack, outer = fn.stack, fn.stack.outer(params)
    ctx = stack.context(outer, cond.context[0], extras)
    temb = stack.time(outer, ts, extras)
    h = stack.embed(outer, IDENTITY, x, ctx=ctx)
    for k, blocks in enumerate(stack.segment_blocks(params)):
        for block in blocks:
            h, _ = stack.block(outer, IDENTITY, block, h, ctx, temb, x.shape[2] // 2, segment=k)
    got = stack.head(outer, h, temb, *x.shape[1:3])
    want = fn(params, x, ts, cond.context[0], **extras)
    assert stack.segment_layers == segments and max_diff(got, want) <= 1e-5


@pytest.mark.parametrize(
    "kind, stages",
    [
        pytest.param("plain", 1, marks=pytest.mark.slow),
        pytest.param("plain", 2, marks=pytest.mark.slow),
        pytest.param("dual2", 2, marks=pytest.mark.slow),  # FLUX.1's: the default tier's
    ],
)
def test_pipefusion_on_sd3(kind, stages):
    """PipeFusion over the joint blocks (a token pair hops between stages; a dual block's
    stage keeps both attentions' image K/V). Warm-up over every step equals single; after one
    exact step the displaced patches differ from it, by less than naive patches do; the HLO
    bytes equal the analytic model."""
    from patchpar.measure.cost import measure

    single, _ = _sample("single", 1, kind)
    warm, _ = _sample("pipefusion", stages, kind, warmup_steps=4)
    assert max_diff(warm, single) <= rounding(single)
    piped, state = _sample("pipefusion", stages, kind, warmup_steps=1)
    naive, _ = _sample("naive_patch", 2, kind)
    if stages > 1:
        assert rounding(single) < max_diff(piped, single) < max_diff(naive, single)
    else:
        assert max_diff(piped, single) <= rounding(single)
    fn, _ = micro_sd3(kind)
    x, _, _ = inputs()
    plan = Plan(make_strategy("pipefusion", warmup_steps=1), stages)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


def test_sd3_bad_splits_are_one_line_errors():
    fn, _ = micro_sd3()
    with pytest.raises(ValueError, match=r"1 blocks cannot fill 2 stages .* \[1, 2\]"):
        Plan(make_strategy("pipefusion"), 2).validate(fn, (16, 12), 4, GUIDANCE)
    with pytest.raises(ValueError, match="split by rows only"):
        Plan(make_strategy("naive_patch", split="col"), 2).validate(fn, (16, 12), 4, GUIDANCE)
    with pytest.raises(ValueError, match=r"rows=6 are 3 unit\(s\) of 2 \(patch size 2\)"):
        Plan(make_strategy("sync_patch"), 4).validate(fn, (6, 12), 4, GUIDANCE)
    with pytest.raises(ValueError, match=r"feed-forward width 96 is not divisible by 5"):
        Plan(make_strategy("tensor"), 5).validate(fn, (16, 12), 4, GUIDANCE)
