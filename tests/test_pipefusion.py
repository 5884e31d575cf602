"""PipeFusion on a micro PixArt (5 blocks, so 2 and 4 stages split unevenly): warm-up over
every step and one stage with one patch equal `single`; the pipelined steps equal a sequential
reference of displaced patch attention written here (each layer attends over a whole-image
K/V buffer in which the patches before the current one are this step's and the later ones the
previous step's), whatever the number of stages; bytes from HLO equal the analytic model."""

from dataclasses import dataclass, field
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import reordered, rounding
from test_parallel_dit import GUIDANCE, MICRO, inputs, max_diff

from patchpar.models.api import PixArtFn
from patchpar.models.pixart import PixArtConfig, PixArtTransformer2DModel
from patchpar.models.sites import SiteOps
from patchpar.parallel.engine import Plan, denoise, weight_bytes
from patchpar.parallel.strategies import make_strategy
from patchpar.pipelines.single import unet_on_stack
from patchpar.sampling.loop import guided
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

STEPS = 4


@cache
def micro_dit(layers: int = 5) -> tuple[PixArtFn, dict]:
    fn = PixArtFn(
        PixArtTransformer2DModel(PixArtConfig.from_diffusers({**MICRO, "num_layers": layers}))
    )
    params = fn.init(seed=3)
    rng = np.random.RandomState(0)
    params = jax.tree.map(lambda p: np.asarray(p + 0.1 * rng.randn(*p.shape), np.float32), params)
    return fn, params


def _schedule():
    smp = get_sampler("dpmpp_2m")  # a history per patch: the multistep solver's previous x0
    return smp, smp.schedule(SchedulerConfig(), STEPS)


@cache
def sample(name: str, devices: int, cfg: int = 1, **options) -> np.ndarray:
    fn, params = micro_dit()
    x, _, cond = inputs()
    smp, sched = _schedule()
    plan = Plan(make_strategy(name, **options), devices, cfg)
    plan.validate(fn, x.shape[1:3], STEPS, GUIDANCE)
    out, _ = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    return np.asarray(out)


def test_the_stack_composes_to_the_model():
    """Input part, blocks and output part run one after another on the whole latent are the
    model's call (what PipeFusion splits over stages)."""
    from patchpar.models.sites import IDENTITY

    fn, params = micro_dit()
    x, t, cond = inputs()
    ctx, extras = cond.context[1], {k: v[1] for k, v in cond.extras.items()}
    ts = jnp.broadcast_to(t, (x.shape[0],))
    stack, outer = fn.stack, fn.stack.outer(params)
    hidden = stack.context(outer, ctx, extras)
    temb = stack.time(outer, ts, extras)
    h = stack.embed(outer, IDENTITY, x)
    for block in stack.blocks(params):
        h, _ = stack.block(outer, IDENTITY, block, h, hidden, temb, x.shape[2] // 2)
    got = stack.head(outer, h, temb, *x.shape[1:3])
    want = fn(params, x, ts, ctx, **extras)
    assert got.shape == want.shape and max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("stages", [2, 4])
def test_warmup_over_every_step_equals_single(stages):
    got = sample("pipefusion", stages, warmup_steps=STEPS)
    assert max_diff(got, sample("single", 1)) <= 1e-4


def test_one_stage_and_one_patch_is_single():
    """M = S = 1: the one patch's fresh K/V fill the whole buffer every step."""
    assert max_diff(sample("pipefusion", 1, warmup_steps=1), sample("single", 1)) <= 1e-4


@pytest.mark.slow
def test_cfg_split_equals_the_same_pipeline_without():
    """cfg=2 (guidance halves on two pipelines, the prediction gathered per patch) equals
    cfg=1 on the same stages, to float32 rounding of a different batch."""
    for options in ({"warmup_steps": STEPS}, {"warmup_steps": 1, "num_patches": 4}):
        one = sample("pipefusion", 2, **options)
        assert max_diff(sample("pipefusion", 4, 2, **options), one) <= reordered(one)


@dataclass(frozen=True)
class SequentialKV(SiteOps):
    """The reference's site: one device, one row patch `at` at a time, of `rows` token rows
    each (one: the whole image), every layer's whole-image K/V kept in a Python dict by
    module path (eager, no tracing). Each patch is computed at its own size (no padding)."""

    rows: tuple = (1,)
    at: int = 0
    buffers: dict = field(default_factory=dict, compare=False, hash=False)

    def self_attn_kv(self, mod, k, v, row=None):
        """The layer's whole-image K/V with this patch's written in (what both a DiT's
        self-attention and an MMDiT's joint attention attend to)."""
        tokens, key = k.shape[1], mod.scope.path
        if len(self.rows) == 1:
            self.buffers[key] = (k, v)
        else:
            start = sum(self.rows[: self.at]) * tokens // self.rows[self.at]
            span = slice(start, start + tokens)
            kb, vb = self.buffers[key]
            self.buffers[key] = (kb.at[:, span].set(k), vb.at[:, span].set(v))
        return *self.buffers[key], None

    def positions(self, mod, table, rows, cols):
        whole = np.asarray(table(sum(self.rows), cols))
        start = sum(self.rows[: self.at]) * cols
        return jnp.asarray(whole[start : start + rows * cols])


@partial(jax.jit, static_argnums=(0, 1, 2))
def _reference_call(fn, rows, at, params, x_in, t, cond, buffers):
    """One model call of the reference on patch `at` (or the whole image), K/V buffers in and
    out: the site mutates a dict made inside this trace."""
    ops = SequentialKV(rows, at, dict(buffers))
    eps = guided(unet_on_stack(fn.with_ops(ops), params, x_in, t, cond), GUIDANCE)
    return eps, ops.buffers


@cache
def displaced_reference(warmup: int, patches: int, split: tuple | None = None) -> np.ndarray:
    """PipeFusion's result without a pipeline: `warmup` exact steps, then each step's patches
    in order through the whole model, each with its own sampler history (`split`: each
    patch's latent rows, where they differ)."""
    fn, params = micro_dit()
    x, _, cond = inputs()
    smp, sched = _schedule()
    x = x * sched.init_noise_sigma
    split = split or (x.shape[1] // patches,) * patches
    starts = np.cumsum((0,) + split)
    parts = [x[:, starts[m] : starts[m + 1]] for m in range(patches)]
    tokens = tuple(r // 2 for r in split)  # token rows (2 x 2 patches)
    hist = [smp.init_carry(p) for p in parts]
    buffers: dict = {}
    for i in range(STEPS):
        t = sched.timesteps[i]
        if i < warmup:
            whole = smp.scale_input(sched, i, jnp.concatenate(parts, axis=1))
            eps, buffers = _reference_call(fn, (sum(tokens),), 0, params, whole, t, cond, buffers)
            eps = [eps[:, starts[m] : starts[m + 1]] for m in range(patches)]
        else:
            eps = [None] * patches
        for m in range(patches):
            if i >= warmup:
                x_in = smp.scale_input(sched, i, parts[m])
                eps[m], buffers = _reference_call(fn, tokens, m, params, x_in, t, cond, buffers)
            parts[m], hist[m] = smp.step(sched, i, parts[m], eps[m], hist[m])
    return np.asarray(jnp.concatenate(parts, axis=1))


@pytest.mark.parametrize(
    "stages, patches",
    [
        pytest.param(2, 4, marks=pytest.mark.slow),  # the default tier: uneven (2, 5) below
        pytest.param(4, 4, marks=pytest.mark.slow),
        pytest.param(2, 2, marks=pytest.mark.slow),
        pytest.param(4, 8, marks=pytest.mark.slow),
    ],
)
def test_pipelined_steps_are_displaced_patch_attention(stages, patches):
    """After one full pass, the pipeline's result is that of patches computed in order with
    this step's K/V for the earlier patches and last step's for the later ones: it depends on
    M, not on the number of stages, and it is not the exact result."""
    got = sample("pipefusion", stages, warmup_steps=1, num_patches=patches)
    ref = displaced_reference(1, patches)
    assert max_diff(got, ref) <= 1e-4
    assert max_diff(got, sample("single", 1)) > 1e-2


@pytest.mark.parametrize(
    "stages, patches, split",
    [
        (2, 5, (4, 4, 4, 2, 2)),  # patch 3 padded over the first rows of patch 4's slot
        pytest.param(2, 3, (6, 6, 4), marks=pytest.mark.slow),
        pytest.param(3, 5, (4, 4, 4, 2, 2), marks=pytest.mark.slow),
    ],
)
def test_uneven_patches_are_displaced_patch_attention_on_their_own_rows(stages, patches, split):
    """M patches that do not divide the 8 token rows: each computed padded to the largest,
    its own rows' K/V written where its rows start; the same as the reference computing each
    patch at its own size."""
    got = sample("pipefusion", stages, warmup_steps=1, num_patches=patches)
    want = displaced_reference(1, patches, split)  # latents of ~150: 1e-5 of their scale
    assert max_diff(got, want) <= rounding(want)


@pytest.mark.slow
def test_uneven_patches_with_warmup_over_every_step_are_single():
    """Every step a whole-image pass: exact, whatever the patches."""
    exact = sample("pipefusion", 2, warmup_steps=STEPS, num_patches=3)
    want = sample("single", 1)
    assert max_diff(exact, want) <= rounding(want)


def test_placed_stages_hold_their_own_blocks_and_give_the_same_images():
    """`placed_params` stacks the blocks once and puts each stage's on its device (5 blocks
    on 2 stages: 3 + 2 and a padding block); the pipeline reads them as they are, with the
    same result as stacking inside the program."""
    from patchpar.parallel.engine import placed_params

    fn, params = micro_dit()
    x, _, cond = inputs()
    smp, sched = _schedule()
    plan = Plan(make_strategy("pipefusion", warmup_steps=1, num_patches=4), 2)
    staged = placed_params(plan, fn, params)
    (blocks,), (real,) = staged.blocks, staged.real  # one segment of identical blocks
    shard = blocks["attn1"]["to_q"]["kernel"].addressable_shards[0].data
    assert shard.shape[0] == 3 and np.asarray(real).tolist() == [True] * 5 + [False]
    out, _ = denoise(fn, plan, smp, staged, cond, sched, x * sched.init_noise_sigma, GUIDANCE)
    want = sample("pipefusion", 2, warmup_steps=1, num_patches=4)
    assert max_diff(out, want) <= reordered(want)  # another program, the same arithmetic


@pytest.mark.parametrize(
    "devices, cfg, data, patches",
    [(2, 1, 1, None), (4, 1, 1, 8), pytest.param(8, 2, 2, None, marks=pytest.mark.slow)],
)
def test_bytes_memory_and_weights_per_stage(devices, cfg, data, patches):
    """Per step, stage s > 0 receives the whole image's tokens once (M patches of T/M), stage
    0 the whole latent, in both phases; HLO equals the analytic model. Each stage holds a
    full-image K/V buffer for its own blocks only, and its share of the blocks' weights."""
    from patchpar.measure.cost import measure

    fn, params = micro_dit()
    x, _, _ = inputs(batch=2 * data)
    plan = Plan(make_strategy("pipefusion", num_patches=patches), devices, cfg, data=data)
    rec = measure(fn, plan, x.shape[1:3], batch=x.shape[0], params=params, flops=False)
    b, h, w, c = x.shape
    g = 2 // cfg  # guidance halves on a device
    d, tokens = fn.config.inner_dim, (h // 2) * (w // 2)
    stages = plan.patch
    hidden, latent = g * (b // data) * tokens * d * 4, (b // data) * h * w * c * 4
    cfg_bytes = latent if cfg == 2 else 0
    want = [latent + cfg_bytes] + [hidden + cfg_bytes] * (stages - 1)
    for phase, entry in rec["phases"].items():
        assert entry["analytic_matches_hlo"], (phase, entry)
        assert entry["hlo"]["pipe"]["max"] + cfg_bytes == max(want), (phase, entry["hlo"])
        assert entry["hlo"]["all"]["total"] == sum(want) * devices // stages
    per_stage = -(-fn.config.num_layers // stages)  # 5 blocks: 3 + 2, or 2 + 1 + 1 + 1
    assert rec["stale_bytes_per_device"] == 2 * per_stage * g * (b // data) * tokens * d * 4
    whole = weight_bytes(Plan(make_strategy("single")), fn, params)
    assert rec["weight_bytes_per_device"] == weight_bytes(plan, fn, params) < whole


def test_uneven_patches_count_their_padding_apart():
    """3 patches of 6, 6, 4 latent rows, each sent padded to 6 rows: HLO equals the analytic
    model, and a ninth of what the hops carry is padding (2 of 18 rows), counted apart; the
    warm-up's whole-image pass sends no padding but the latent's, patch by patch."""
    from patchpar.measure.cost import measure

    fn, params = micro_dit()
    x, _, _ = inputs()
    plan = Plan(make_strategy("pipefusion", num_patches=3), 2)
    rec = measure(fn, plan, x.shape[1:3], batch=x.shape[0], params=params, flops=False)
    b, h, w, c = x.shape
    hidden = 2 * b * (18 // 2) * (w // 2) * fn.config.inner_dim * 4  # 3 x 3 token rows
    latent = b * 18 * w * c * 4  # 3 patches of 6 rows back to the first stage
    for entry in rec["phases"].values():
        assert entry["analytic_matches_hlo"]
    steady, warm = rec["phases"]["steady"], rec["phases"]["warmup"]
    assert steady["hlo"]["pipe"]["total"] == hidden + latent
    assert steady["padding"]["pipe"]["total"] == (hidden + latent) // 9
    assert warm["padding"]["pipe"]["total"] == latent // 9


def test_bad_input_names_what_would_fit():
    from patchpar.models.presets import abstract_denoiser

    fn, _ = micro_dit()
    hw = (16, 12)  # 8 token rows

    def check(devices, cfg=1, fsdp=False, steps=STEPS, model=fn, latent=hw, **options):
        plan = Plan(make_strategy("pipefusion", **options), devices, cfg, fsdp=fsdp)
        plan.validate(model, latent, steps, GUIDANCE)

    with pytest.raises(ValueError, match="a unet has none .* use sync_patch, distrifusion or pcpp"):
        check(2, model=abstract_denoiser("tiny"), latent=(32, 32))
    with pytest.raises(ValueError, match=r"num_patches=2 must be an integer >= the 4 stage"):
        check(4, num_patches=2)
    with pytest.raises(ValueError, match=r"rows=16 are 8 token rows .* fewer than num_patches=9"):
        check(2, num_patches=9)
    with pytest.raises(ValueError, match=r"rows=15 are not whole token rows .* a multiple of 2"):
        check(2, latent=(15, 12))
    with pytest.raises(ValueError, match="5 blocks cannot fill 8 stages .* at most 5 devices"):
        check(8)
    with pytest.raises(ValueError, match=r"warmup_steps=0 must be an integer in \[1, steps=4\]"):
        check(2, warmup_steps=0)
    with pytest.raises(ValueError, match="does not combine with fsdp"):
        check(2, fsdp=True)
    check(4, cfg=2, num_patches=8)  # 2 stages x 2 guidance halves, 8 patches of 1 token row
