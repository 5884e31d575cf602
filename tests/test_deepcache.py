"""DeepCache on a micro UNet: one device equals a reference written here from the UNet's parts
(every `interval`-th step runs every block and keeps the deep features, the input of the
shallow branch's up blocks; the other steps run the shallow branch on them); under sync_patch
it equals one device; a reused steady DistriFusion step keeps the deep blocks' stale buffers;
bytes of a reused step are the shallow branch's; bad input is a one-line error."""

import sys
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from parallel_helpers import GUIDANCE, compiled, denoise_cached, inputs, micro_unet  # noqa: E402

from patchpar.models.sites import IDENTITY  # noqa: E402
from patchpar.parallel.engine import Plan  # noqa: E402
from patchpar.parallel.strategies import make_strategy  # noqa: E402
from patchpar.sampling.cache import CACHE, DeepCache, make_cache  # noqa: E402
from patchpar.sampling.loop import guided  # noqa: E402
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler  # noqa: E402

STEPS = 6


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def _computed(state) -> int:
    return int(np.asarray(state[CACHE]["computed"]).ravel()[0])


@cache
def run(name: str, devices: int, c, cfg: int = 1, **options):
    """(final latent, state) of the micro SD UNet under a strategy with DeepCache `c`, at
    this file's guidance (the reference's)."""
    fn, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    return denoise_cached(fn, params, x, cond, c, name, devices, cfg, GUIDANCE, "ddim", STEPS,
                          **options)  # fmt: skip


def reference(c: DeepCache) -> np.ndarray:
    """DeepCache's schedule run step by step from the UNet's parts (each part one compiled
    call: the same arithmetic as op by op, without compiling each op's own program)."""
    fn, params = micro_unet("sd")
    x, _, cond = inputs("sd")
    smp = get_sampler("ddim")
    sched = smp.schedule(SchedulerConfig(), STEPS)
    module, v = fn.module.clone(ops=IDENTITY), {"params": params}
    n = module.num_blocks
    down, up = module.branch_bounds(c.branch)
    g, b = cond.context.shape[:2]
    prologue = compiled(lambda xs, ts, ctx: module.apply(v, xs, ts, ctx, method="prologue"))
    epilogue = compiled(lambda last, aux: module.apply(v, last, aux, method="epilogue"))
    blocks = compiled(
        lambda start, stop, hs, aux: module.apply(v, start, stop, hs, aux, method="blocks")
    )

    lat = x * sched.init_noise_sigma
    carry, feature = smp.init_carry(lat), None
    for i in range(STEPS):
        x_in = smp.scale_input(sched, i, lat)
        xs = jnp.broadcast_to(x_in[None], (g,) + x_in.shape).reshape((g * b,) + x_in.shape[1:])
        ts = jnp.broadcast_to(sched.timesteps[i], (g * b,))
        ctx = cond.context.reshape((g * b,) + cond.context.shape[2:])
        hs, aux = prologue(xs, ts, ctx)
        shallow = blocks(0, down, hs, aux)
        if i % c.interval == 0:
            deep = blocks(down, up, shallow, aux)
            feature, skips = deep[0], len(deep[1])
        else:  # the shallow down blocks' skips, but those the deep part consumes
            deep = (feature, shallow[1][:skips])
        last = blocks(up, n, deep, aux)
        out = epilogue(last, aux)
        eps = guided(out.reshape((g, b) + out.shape[1:]), GUIDANCE)
        lat, carry = smp.step(sched, i, lat, eps, carry)
    return np.asarray(lat)


@pytest.mark.parametrize("interval, branch", [(2, 0), pytest.param(3, 1, marks=pytest.mark.slow)])
def test_one_device_equals_the_reference(interval, branch):
    c = DeepCache(interval, branch)
    out, state = run("single", 1, c)
    assert _computed(state) == len(range(0, STEPS, interval))
    assert max_diff(out, reference(c)) <= 1e-4
    plain, _ = run("single", 1, None)
    assert max_diff(out, plain) > 1e-3


def test_sync_patch_equals_one_device():
    """The reused features are each device's rows; the shallow branch's sites exchange as the
    strategy says: sync_patch on 2 and 4 patches (and the guidance halves apart) equals one
    device."""
    c = DeepCache(2)
    one, state = run("single", 1, c)
    for devices, cfg in ((2, 1), (4, 2)):
        out, st = run("sync_patch", devices, c, cfg)
        assert _computed(st) == _computed(state) == 3, (devices, cfg)
        assert max_diff(out, one) <= 1e-4, (devices, cfg)


@pytest.mark.slow  # fbcache's skipped step keeps its buffers in the default tier
def test_a_reused_step_keeps_the_deep_blocks_stale_buffers():
    """One steady DistriFusion step with DeepCache: when it reuses the deep features, the deep
    blocks' stale buffers are the ones it read (they did not run, so a stale site there next
    reads the last full step's activation) and the shallow branch's are this step's; a full
    step leaves every buffer as the uncached step does."""
    from patchpar.parallel.engine import make_step

    fn, params = micro_unet("sd")
    x, t, cond = inputs("sd")
    strategy = make_strategy("distrifusion", warmup_steps=1)
    plain = Plan(strategy, 2)
    mesh = plain.mesh()
    _, stale = jax.jit(make_step(fn, plain, "warmup", "row", GUIDANCE, mesh))(
        params, x, t, cond, None
    )
    stale = jax.tree.map(lambda a: a * 0.5, stale)
    _, ref_state = jax.jit(make_step(fn, plain, "steady", "row", GUIDANCE, mesh))(
        params, x, t, cond, stale
    )
    plan = Plan(
        strategy, 2, cache=DeepCache(2)
    )  # micro UNet: down 0, downsample 0, down 1, mid, up 0, up 1; shallow: down 0, up 1
    step = jax.jit(make_step(fn, plan, "steady", "row", GUIDANCE, mesh))
    state = step(params, x * 0.8, t, cond, stale)[1][CACHE]  # step 0: every block
    # reused: level 0's downsampler, level 1, the mid block, up block 0
    deep = ("down_blocks_0/downsamplers_0", "down_blocks_1", "mid_block", "up_blocks_0")
    paths = lambda t: {jax.tree_util.keystr(k, simple=True, separator="/"): v  # noqa: E731
                       for k, v in jax.tree_util.tree_leaves_with_path(t)}  # fmt: skip
    read, fresh = paths(stale), paths(ref_state)
    for n, reuses in ((1, True), (2, False)):
        _, new = step(
            params, x, t, cond, {**stale, CACHE: {**state, "step": state["step"] * 0 + n}}
        )
        got = paths({k: v for k, v in new.items() if k != CACHE})
        assert got.keys() == read.keys()
        changed = []
        for key, a in got.items():
            if not reuses or key.startswith("down_blocks_0/resnets"):  # as uncached (same input)
                assert max_diff(a, fresh[key]) <= 1e-5, (n, key)
            elif key.startswith(deep):  # did not run: as read
                assert max_diff(a, read[key]) == 0, (n, key)
            else:  # the shallow up blocks ran on the reused features: sent this step
                changed.append(max_diff(a, read[key]) > 1e-3)
        assert not reuses or (changed and all(changed)), changed


@pytest.mark.slow
def test_bytes_of_a_reused_step_are_the_shallow_branchs():
    """sync_patch with DeepCache forced to each branch: HLO bytes equal the analytic model,
    and a reused step's are its shallow blocks' sites only (fewer, not none)."""
    from patchpar.measure.cost import measure
    from patchpar.sampling.cache import Forced

    fn, params = micro_unet("sd")
    x, _, _ = inputs("sd")
    counts = {}
    for compute in (True, False):
        plan = Plan(make_strategy("sync_patch"), 2, cache=Forced(DeepCache(2), compute))
        rec = measure(fn, plan, x.shape[1:3], batch=x.shape[0], params=params, flops=False)
        phase = rec["phases"]["warmup"]
        assert phase["analytic_matches_hlo"], phase
        counts[compute] = phase["hlo"]["all"]["total"]
    assert 0 < counts[False] < counts[True]


def test_bad_input_is_named():
    from test_parallel_dit import micro_dit

    unet, _ = micro_unet("sd")
    dit, _ = micro_dit()
    with pytest.raises(ValueError, match="cache 'deepcache' does not exist for a pixart"):
        DeepCache().validate(dit, STEPS)
    with pytest.raises(ValueError, match=r"deepcache interval=0: must be an integer >= 1"):
        DeepCache(interval=0)
    with pytest.raises(ValueError, match=r"deepcache branch=-1: must be an integer >= 0"):
        DeepCache(branch=-1)
    levels = unet.module.levels
    with pytest.raises(
        ValueError, match=rf"this UNet has {levels} levels.* branch <= {levels - 1}"
    ):
        DeepCache(branch=levels).validate(unet, STEPS)
    with pytest.raises(ValueError, match="every step computes, nothing is reused"):
        DeepCache(interval=1).validate(unet, STEPS)
    with pytest.raises(ValueError, match=r"cache 'deepcache' has no option \['threshold'\]"):
        make_cache("deepcache", threshold=0.1)
    with pytest.raises(ValueError, match="cache 'deepcache' with strategy 'asyncdiff'"):
        plan = Plan(make_strategy("asyncdiff", warmup_steps=1), 2, cache=DeepCache())
        plan.validate(unet, (16, 16), STEPS, GUIDANCE)
