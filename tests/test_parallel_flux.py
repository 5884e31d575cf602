"""The parallel engine on an MMDiT (a micro FLUX.1): image tokens split into row patches, the
text stream on every device, each joint attention's image K/V the exchange (the text K/V stays
local), RoPE rows from the whole image's table. Exact strategies equal the single device; the
warm-up over every step equals sync_patch; HLO bytes equal the analytic model."""

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import rounding

from patchpar.models.flux import FluxConfig, FluxFn, FluxTransformer2DModel
from patchpar.parallel.engine import Plan, denoise, make_step
from patchpar.parallel.strategies import make_strategy
from patchpar.pipelines.single import unet_on_stack
from patchpar.sampling.guidance import Conditioning
from patchpar.sampling.loop import guided
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

GUIDANCE = 1.0  # FLUX.1-dev: the guidance scale is an input, not classifier-free guidance
MICRO = dict(
    in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
    num_attention_heads=3, joint_attention_dim=12, pooled_projection_dim=10,
    guidance_embeds=True, axes_dims_rope=[2, 2, 4],
)  # fmt: skip


@cache
def micro_flux() -> tuple[FluxFn, dict]:
    fn = FluxFn(FluxTransformer2DModel(FluxConfig.from_diffusers(MICRO)))
    params = fn.init(seed=3)
    rng = np.random.RandomState(0)
    # every parameter non-trivial (random_params leaves biases at 0 and norm scales at 1)
    params = jax.tree.map(lambda p: np.asarray(p + 0.1 * rng.randn(*p.shape), np.float32), params)
    return fn, params


def inputs(batch: int = 2, hw=(16, 12)):
    rng = np.random.RandomState(1)
    x = jnp.asarray(rng.randn(batch, *hw, 4), jnp.float32)
    extras = {
        "pooled_projections": jnp.asarray(rng.randn(1, batch, 10), jnp.float32),
        "guidance": jnp.full((1, batch), 3.5, jnp.float32),
    }
    cond = Conditioning(jnp.asarray(rng.randn(1, batch, 5, 12), jnp.float32), extras)
    return x, jnp.asarray(0.6), cond


@partial(jax.jit, static_argnums=0)
def single_guided(fn, params, x, t, cond):
    return guided(unet_on_stack(fn, params, x, t, cond), GUIDANCE)


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("patch", [2, 4])
def test_sync_patch_forward_on_an_mmdit_equals_single(patch):
    fn, params = micro_flux()
    x, t, cond = inputs()
    plan = Plan(make_strategy("sync_patch"), patch)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    ref = single_guided(fn, params, x, t, cond)
    assert out.shape == x.shape and max_diff(out, ref) <= rounding(ref)


@cache
def _sample(name: str, patch: int, **options):
    fn, params = micro_flux()
    x, _, cond = inputs()
    smp = get_sampler("euler")
    sched = smp.schedule(SchedulerConfig(), 4)
    plan = Plan(make_strategy(name, **options), patch)
    plan.validate(fn, x.shape[1:3], 4, GUIDANCE)
    out, state = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    return np.asarray(out), state


def test_exact_and_stale_sampling_runs_on_an_mmdit():
    """sync_patch's run equals single's; DistriFusion with warm-up covering every step equals
    sync_patch, and its steady phase (stale image K/V of every joint attention, double and
    single blocks alike) differs."""
    single, _ = _sample("single", 1)
    sync, _ = _sample("sync_patch", 2)
    assert max_diff(sync, single) <= rounding(single)
    warm, state = _sample("distrifusion", 2, warmup_steps=3)
    assert max_diff(warm, sync) <= rounding(sync) and jax.tree.leaves(state)
    stale, state = _sample("distrifusion", 2, warmup_steps=1)
    assert max_diff(stale, sync) > rounding(sync)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    want = [f"['{kind}_{i}']['attn']['kv']" for kind in ("single_transformer_blocks",
            "transformer_blocks") for i in range(2)]  # fmt: skip
    assert sorted(paths) == sorted(want), paths


@pytest.mark.parametrize(
    "name, devices, options",
    [
        ("ring", 4, {}),
        ("ulysses", 4, {}),  # 3 heads padded to 4
        pytest.param("ulysses", 4, {"ring_degree": 2}, marks=pytest.mark.slow),
    ],
)
def test_context_parallel_joint_attention_equals_single(name, devices, options):
    """Ring and Ulysses on the joint attention: the image tokens' Q/K/V travel, the text's
    stay local (folded into every softmax once; under Ulysses each device takes its heads of
    them and the text outputs' heads are gathered). One call equals single; the HLO bytes
    equal the analytic model."""
    from patchpar.measure.cost import measure

    fn, params = micro_flux()
    x, t, cond = inputs()
    plan = Plan(make_strategy(name, **options), devices)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    want = single_guided(fn, params, x, t, cond)
    assert max_diff(out, want) <= rounding(want)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


@pytest.mark.parametrize(
    "name, devices, options",
    [
        ("distrifusion", 2, {"warmup_steps": 1}),
        ("pcpp", 4, {"warmup_steps": 1, "send": "band", "align": "rows"}),
    ],
)
def test_hlo_bytes_equal_the_model_on_an_mmdit(name, devices, options):
    """Both phases' HLO bytes equal the analytic model: the image K/V of the 4 joint
    attentions (the text's K/V is never exchanged)."""
    from patchpar.measure.cost import measure

    fn, _ = micro_flux()
    x, _, _ = inputs()
    plan = Plan(make_strategy(name, **options), devices)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    warm = rec["phases"]["warmup"]["hlo"]
    # exact in warm-up: each device receives the other patches' image K/V of the 4 sites,
    # 2 (K, V) x 2 images (one guidance half: FLUX.1's scale is an input) x tokens x 24 x 4 B
    tokens = (16 // 2) * (12 // 2) * (devices - 1) // devices
    assert warm["all"]["max"] == 4 * 2 * 2 * tokens * 24 * 4, warm


@pytest.mark.parametrize(
    "devices, options, fsdp",
    [
        (3, {}, False),  # the micro model's 3 heads, one per device
        pytest.param(6, {"tp_degree": 3}, True, marks=pytest.mark.slow),  # 2 patches x 3, fsdp
    ],
)
def test_tensor_parallel_on_an_mmdit_equals_single(devices, options, fsdp):
    """Megatron over whole heads: double blocks split as a DiT's; a single block's proj_mlp
    and proj_out (its rows [attention | MLP]) are laid out in parts so each device's proj_out
    rows are its own heads' and MLP share's, one all-reduce per block output. One call equals
    single; the HLO bytes equal the analytic model; each device holds less weight."""
    from patchpar.measure.cost import measure
    from patchpar.parallel.rules import weight_bytes_per_device

    fn, params = micro_flux()
    x, t, cond = inputs()
    plan = Plan(make_strategy("tensor", **options), devices, fsdp=fsdp)
    plan.validate(fn, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(fn, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    want = single_guided(fn, params, x, t, cond)
    assert max_diff(out, want) <= rounding(want)
    rec = measure(fn, plan, x.shape[1:3], batch=2, params=params, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    assert rec["weight_bytes_per_device"] < weight_bytes_per_device(params, {}, {}, fn.logical)
    if not fsdp:  # 2 double blocks x 4 outputs + 2 single blocks x 1: 10 all-reduces
        (tp,) = [c for c in rec["phases"]["warmup"]["collectives"] if c["site"] == "tp"]
        assert tp["count"] == 10, tp


def test_tensor_parallel_needs_whole_heads_on_an_mmdit():
    fn, _ = micro_flux()
    with pytest.raises(ValueError, match=r"FLUX's 3 attention heads must split evenly.* \[3\]"):
        Plan(make_strategy("tensor"), 2).validate(fn, (16, 12), 4, GUIDANCE)


def test_columns_and_odd_rows_are_refused():
    fn, _ = micro_flux()
    with pytest.raises(ValueError, match="split by rows only"):
        Plan(make_strategy("naive_patch", split="col"), 2).validate(fn, (16, 12), 4, GUIDANCE)
    # 14 rows split unevenly (4, 4, 4, 2: tests/test_uneven.py); 6 are 3 units for 4 devices
    Plan(make_strategy("sync_patch"), 4).validate(fn, (14, 12), 4, GUIDANCE)
    with pytest.raises(
        ValueError, match=r"rows=6 are 3 unit\(s\) of 2 \(2 x 2 latent packing\): fewer than"
    ):
        Plan(make_strategy("sync_patch"), 4).validate(fn, (6, 12), 4, GUIDANCE)


@pytest.mark.parametrize("text", ["mean", pytest.param("first", marks=pytest.mark.slow)])
def test_text_stream_policies(text):
    """How the steady phase keeps the text stream: with warm-up over every step each policy
    equals sync_patch (the copies are equal then, nothing is sent); after warm-up `mean` and
    `first` differ from `own`. Their bytes: one all-reduce (mean) or all-gather (first) of the
    text tokens after each of the 4 blocks, in the steady phase only, HLO = analytic."""
    from patchpar.measure.cost import measure

    sync, _ = _sample("sync_patch", 2)
    warm, _ = _sample("distrifusion", 2, warmup_steps=3, text=text)
    assert max_diff(warm, sync) <= rounding(sync)
    own, _ = _sample("distrifusion", 2, warmup_steps=1)
    kept, _ = _sample("distrifusion", 2, warmup_steps=1, text=text)
    assert max_diff(kept, own) > 1e-6
    fn, _ = micro_flux()
    x, _, _ = inputs()
    rec = {
        t: measure(fn, Plan(make_strategy("distrifusion", text=t), 2), x.shape[1:3], 2, flops=False)
        for t in ("own", text)
    }
    assert all(ph["analytic_matches_hlo"] for r in rec.values() for ph in r["phases"].values())
    steady = {t: r["phases"]["steady"]["hlo"] for t, r in rec.items()}
    # 2 devices: either policy receives the other device's copy of the text tokens after each
    # block whose text a later block reads (3 of 4): 2 images x 512 T5 tokens (what abstract
    # lowering assumes for FLUX) x 24 x 4 bytes each
    text_bytes = 3 * 2 * 512 * 24 * 4
    assert steady[text]["text"]["max"] == text_bytes, steady[text]
    assert steady[text]["all"]["max"] == steady["own"]["all"]["max"] + text_bytes
    assert rec[text]["phases"]["warmup"]["hlo"] == rec["own"]["phases"]["warmup"]["hlo"]


def test_a_text_stream_policy_needs_an_mmdit():
    from parallel_helpers import micro_unet

    unet, _ = micro_unet("sd")
    with pytest.raises(ValueError, match="text='mean' says how an MMDiT keeps its text stream"):
        Plan(make_strategy("distrifusion", text="mean"), 2).validate(unet, (16, 16), 10, 5.0)
    with pytest.raises(ValueError, match=r"text='all'; known: \['own', 'mean', 'first'\]"):
        make_strategy("pcpp", text="all")


def test_the_flux_stack_composes_to_the_model():
    """Input part, the double then the single blocks (each run as block 0 of its kind, the
    (image, text) tokens passed on) and the output part are the model's call: what PipeFusion
    splits over stages."""
    from patchpar.models.sites import IDENTITY

    fn, params = micro_flux()
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
    assert stack.segment_layers == (2, 2) and max_diff(got, want) <= 1e-5


@pytest.mark.parametrize(
    "stages", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_pipefusion_on_an_mmdit(stages):
    """PipeFusion over the double- and single-stream blocks as two segments (the second run
    back from the last stage to the first, so each device holds 1/S of each kind; a token
    pair (image, text) hops between stages). Warm-up over every step equals single; after one
    exact step the displaced patches differ from it, by less than naive patches do; the HLO
    bytes equal the analytic model in both phases."""
    from patchpar.measure.cost import measure

    single, _ = _sample("single", 1)
    warm, _ = _sample("pipefusion", stages, warmup_steps=4)
    assert max_diff(warm, single) <= rounding(single)
    piped, state = _sample("pipefusion", stages, warmup_steps=1)
    naive, _ = _sample("naive_patch", 2)
    if stages > 1:  # M = 4: the least that splits 8 token rows, >= 2 (S - 1) + 1
        assert rounding(single) < max_diff(piped, single) < max_diff(naive, single)
    else:  # one stage, one patch: both segments on the same device, every K/V fresh
        assert max_diff(piped, single) <= rounding(single)
    fn, _ = micro_flux()
    x, _, _ = inputs()
    plan = Plan(make_strategy("pipefusion", warmup_steps=1), stages)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


def test_pipefusion_on_an_mmdit_names_the_patches_that_fit():
    fn, _ = micro_flux()
    with pytest.raises(ValueError, match=r"use num_patches >= 3"):
        Plan(make_strategy("pipefusion", num_patches=2), 2).validate(fn, (16, 12), 4, GUIDANCE)
    with pytest.raises(ValueError, match=r"2 blocks cannot fill 4 stages .* \[2, 2\]"):
        Plan(make_strategy("pipefusion"), 4).validate(fn, (16, 12), 4, GUIDANCE)


def _displaced_reference(warmup: int, patches: int, split=None) -> np.ndarray:
    """PipeFusion's result without a pipeline, on the micro FLUX: `warmup` exact steps, then
    each step's patches in order through the whole model (each with its own text stream from
    the context), every joint attention's image K/V a whole-image buffer in which the earlier
    patches are this step's and the later ones last step's."""
    from test_pipefusion import SequentialKV  # the whole-image K/V buffer per layer

    def call(rows, at, x_in, t, buffers):
        ops = SequentialKV(rows, at, dict(buffers))
        eps = guided(unet_on_stack(fn.with_ops(ops), params, x_in, t, cond), GUIDANCE)
        return eps, ops.buffers

    fn, params = micro_flux()
    x, _, cond = inputs()
    smp = get_sampler("euler")
    sched = smp.schedule(SchedulerConfig(), 4)
    x = x * sched.init_noise_sigma
    split = split or (x.shape[1] // patches,) * patches  # latent rows of each patch
    starts = np.cumsum((0,) + split)
    parts = [x[:, starts[m] : starts[m + 1]] for m in range(patches)]
    tokens = tuple(r // 2 for r in split)  # token rows (2 x 2 patches)
    hist = [smp.init_carry(p) for p in parts]
    buffers: dict = {}
    for i in range(4):
        t = sched.timesteps[i]
        if i < warmup:
            whole = smp.scale_input(sched, i, jnp.concatenate(parts, axis=1))
            eps, buffers = call((sum(tokens),), 0, whole, t, buffers)
            eps = [eps[:, starts[m] : starts[m + 1]] for m in range(patches)]
        else:
            eps = [None] * patches
        for m in range(patches):
            if i >= warmup:
                x_in = smp.scale_input(sched, i, parts[m])
                eps[m], buffers = call(tokens, m, x_in, t, buffers)
            parts[m], hist[m] = smp.step(sched, i, parts[m], eps[m], hist[m])
    return np.asarray(jnp.concatenate(parts, axis=1))


@pytest.mark.parametrize(
    "stages, patches, split",
    [
        # uneven: 3 patches of 8 token rows, each its own rows (two segments, the text hop)
        (2, 3, (6, 6, 4)),
        pytest.param(2, 4, None, marks=pytest.mark.slow),
        pytest.param(2, 8, None, marks=pytest.mark.slow),
    ],
)
def test_pipelined_mmdit_steps_are_displaced_patch_attention(stages, patches, split):
    """The two segments' schedule (the single blocks run back from the last stage, a token
    pair hopping) computes what PipeFusion means: patches in order, this step's image K/V for
    the earlier ones and last step's for the later ones, each patch its own text stream."""
    got, _ = _sample("pipefusion", stages, warmup_steps=1, num_patches=patches)
    want = _displaced_reference(1, patches, split)
    assert max_diff(got, want) <= rounding(want)
