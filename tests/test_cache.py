"""Step caches (patchpar.sampling.cache) under patch parallelism: each cache with the exact
strategies against the same cache on one device, what a predicted step exchanges, and what a
stale site reads after a skipped step, on even and uneven patches (a decision's sums over the
image's rows alone, not the padding). Parity with diffusers' hooks: test_cache_parity.py; bad
input: test_cache_inputs.py."""

import sys
from functools import cache
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_parallel_dit import GUIDANCE, inputs, max_diff, micro_dit  # noqa: E402

from patchpar.parallel.engine import Plan, make_step  # noqa: E402
from patchpar.parallel.strategies import make_strategy  # noqa: E402
from patchpar.sampling.cache import (  # noqa: E402
    CACHE,
    CLOSEST,
    FirstBlockCache,
    TaylorSeer,
)

STEPS = 6
THRESHOLD = 0.5  # on the micro DiT's 6 DDIM steps: 2 of them skipped
MARGIN = 1e-3  # a data-dependent decision's statistic at least this far (relative) from its
# threshold: float rounding (1e-7 relative, on any machine, any number of devices) cannot
# flip it, so two programs (or patchpar and diffusers) must take it alike


def _computed(state) -> int:
    return int(np.asarray(state[CACHE]["computed"]).ravel()[0])


def _far_from_the_threshold(state) -> None:
    """Every data-dependent decision of a run was taken `MARGIN` away from its threshold (the
    state's `CLOSEST`): another program's rounding takes the same ones."""
    closest = float(np.asarray(state[CACHE][CLOSEST]).ravel()[0])
    assert MARGIN < closest < np.inf, closest


@cache
def _run(name: str, devices: int, cfg: int = 1, threshold: float | None = THRESHOLD, **options):
    """(final latent, stale state) of the micro DiT under a strategy, with the first-block
    cache (threshold None: without)."""
    c = None if threshold is None else FirstBlockCache(threshold)
    return _run_with(name, devices, cfg, c, **options)


@cache
def _run_with(name: str, devices: int, cfg: int, c, model: str = "dit", **options):
    """(final latent, stale state) of the micro DiT (or UNet) under a strategy with cache `c`."""
    gs, sampler = GUIDANCE, "ddim"
    if model == "dit":
        fn, params = micro_dit()
        x, _, cond = inputs()
    elif model == "flux":  # guidance is its input; flow matching
        from test_parallel_flux import inputs as flux_inputs
        from test_parallel_flux import micro_flux

        fn, params = micro_flux()
        x, _, cond = flux_inputs()
        gs, sampler = 1.0, "euler"
    else:
        from parallel_helpers import inputs as unet_inputs
        from parallel_helpers import micro_unet

        fn, params = micro_unet("sd")
        x, _, cond = unet_inputs("sd")
    from parallel_helpers import denoise_cached

    return denoise_cached(fn, params, x, cond, c, name, devices, cfg, gs, sampler, STEPS, **options)


def test_the_cache_skips_some_steps_and_sync_patch_equals_one_device():
    """One device with the cache skips some steps (and differs from the uncached run);
    sync_patch with the cache, on 2 and 4 patches and with the guidance halves apart, skips
    the same steps (the decision from all-reduced sums) and equals it."""
    one, state = _run("single", 1)
    assert 1 < _computed(state) < STEPS
    _far_from_the_threshold(state)
    plain, _ = _run("single", 1, threshold=None)
    assert max_diff(one, plain) > 1e-3
    for devices, cfg in ((2, 1), (4, 1), (4, 2), (3, 1)):  # 3: uneven patches, padded
        out, st = _run("sync_patch", devices, cfg)
        assert _computed(st) == _computed(state), (devices, cfg)
        assert max_diff(out, one) <= 1e-4, (devices, cfg)


@pytest.mark.parametrize("cache", ["fbcache", pytest.param("taylorseer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["ulysses", "ring", "tensor"])
def test_the_other_exact_parallelisms_with_a_cache_equal_one_device(name, cache):
    """Ulysses and Ring (tokens over the patch axis) and tensor parallelism (heads over the
    model axis, the residual whole on every device): the same steps as one device, and its
    latent."""
    c = FirstBlockCache(THRESHOLD) if cache == "fbcache" else TaylorSeer(interval=2, warmup=1)
    one, state = _run_with("single", 1, 1, c)
    if cache == "fbcache":  # (taylorseer's steps are a schedule)
        _far_from_the_threshold(state)
    out, st = _run_with(name, 2, 1, c)
    assert _computed(st) == _computed(state)
    assert max_diff(out, one) <= 1e-4


@pytest.mark.parametrize(
    "name, options",
    [
        ("distrifusion", {"warmup_steps": 1}),
        pytest.param(
            "distrifusion", {"warmup_steps": 1, "comm_groups": "per_site"}, marks=pytest.mark.slow
        ),
        pytest.param("pcpp", {"warmup_steps": 1, "portion": 0.5}, marks=pytest.mark.slow),
        pytest.param("compact", {}, marks=pytest.mark.slow),
    ],
)
def test_a_cache_that_never_skips_changes_nothing(name, options):
    """A threshold no step's change stays under computes every step: the strategy's own run,
    stale buffers included (the model in parts is the same arithmetic in other programs:
    float32 rounding apart, as sync_patch from single)."""
    cached, state = _run(name, 4, threshold=1e-12, **options)
    plain, plain_state = _run(name, 4, threshold=None, **options)
    assert _computed(state) == STEPS
    assert max_diff(cached, plain) <= 1e-4
    if name == "compact":  # its buffers are int2 bases: a rounding apart flips a level
        return
    stale = {k: v for k, v in state.items() if k != CACHE}
    for a, b in zip(jax.tree.leaves(stale), jax.tree.leaves(plain_state), strict=True):
        assert max_diff(a, b) <= 1e-4


@pytest.mark.parametrize("model", ["dit", pytest.param("unet", marks=pytest.mark.slow)])
def test_taylorseer_under_sync_patch_equals_one_device(model):
    """The prediction is elementwise over each device's output: sync_patch on 2 and 4 patches
    (and with the guidance halves apart) computes the same steps and equals one device."""
    c = TaylorSeer(interval=2, warmup=1, order=2)
    one, state = _run_with("single", 1, 1, c, model)
    assert _computed(state) == 3  # steps 0, 2 and 4 of 6
    plain, _ = _run_with("single", 1, 1, None, model)
    assert max_diff(one, plain) > 1e-3
    for devices, cfg in ((2, 1), (4, 1), (4, 2), (3, 1)):  # 3: uneven patches, padded
        out, st = _run_with("sync_patch", devices, cfg, c, model)
        assert _computed(st) == 3, (devices, cfg)
        assert max_diff(out, one) <= 1e-4, (devices, cfg)


def test_teacache_under_sync_patch_equals_one_device():
    """TeaCache's decision comes from all-reduced sums, as the first-block cache's: sync_patch
    on 2 and 4 patches of the micro FLUX takes one device's steps and equals it; its last step
    (bound to the run's length) computes. (The random micro model's input moves far more per
    step than a trained FLUX's, and the rescaling is a 4th-degree polynomial: its threshold
    here is large.)"""
    from patchpar.sampling.cache import TeaCache

    c = TeaCache(200.0).bind(STEPS)
    one, state = _run_with("single", 1, 1, c, "flux")
    assert 2 <= _computed(state) < STEPS
    _far_from_the_threshold(state)
    plain, _ = _run_with("single", 1, 1, None, "flux")
    assert max_diff(one, plain) > 1e-3
    for devices in (2, 4, 3):  # 3: uneven patches, padded
        out, st = _run_with("sync_patch", devices, 1, c, "flux")
        assert _computed(st) == _computed(state), devices
        assert max_diff(out, one) <= 1e-4, devices


def test_a_predicted_step_exchanges_nothing():
    """A steady DistriFusion step that TaylorSeer predicts leaves every stale buffer as it came
    in (no site ran); a computed one leaves the uncached step's."""
    fn, params = micro_dit()
    x, t, cond = inputs()
    strategy = make_strategy("distrifusion", warmup_steps=1)
    plain = Plan(strategy, 2)
    mesh = plain.mesh()
    _, stale = jax.jit(make_step(fn, plain, "warmup", "row", GUIDANCE, mesh))(
        params, x, t, cond, None
    )
    stale = jax.tree.map(lambda a: a * 0.5, stale)
    ref_out, ref_state = jax.jit(make_step(fn, plain, "steady", "row", GUIDANCE, mesh))(
        params, x, t, cond, stale
    )
    plan = Plan(strategy, 2, cache=TaylorSeer(interval=2, warmup=1))
    step = jax.jit(make_step(fn, plan, "steady", "row", GUIDANCE, mesh))
    state = step(params, x * 0.8, t, cond, stale)[1][CACHE]  # step 0 computes
    for n, predicts in ((1, True), (2, False)):  # after 1 warm-up step, one step in 2 computes
        cache_state = {**state, "step": state["step"] * 0 + n}
        out, new = step(params, x, t, cond, {**stale, CACHE: cache_state})
        kept = {k: v for k, v in new.items() if k != CACHE}
        want = stale if predicts else ref_state
        for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(want), strict=True):
            assert max_diff(a, b) <= (0 if predicts else 1e-5)
        assert (max_diff(out, ref_out) > 1e-3) == predicts


def test_a_stale_strategy_runs_with_the_cache():
    out, state = _run("distrifusion", 4, warmup_steps=1)
    assert 1 < _computed(state) < STEPS and np.isfinite(out).all()


def test_a_skipped_step_keeps_the_skipped_blocks_stale_buffers():
    """One steady DistriFusion step with the cache: when it skips, the first block's buffers
    are what it sent this step (as without the cache) and every later block's buffers are the
    ones it read, so a stale site's next read is from the last step that ran it; when it
    computes, every buffer is the uncached step's."""
    fn, params = micro_dit()
    x, t, cond = inputs()
    strategy = make_strategy("distrifusion", warmup_steps=1)
    plain = Plan(strategy, 2)
    mesh = plain.mesh()
    warm = jax.jit(make_step(fn, plain, "warmup", "row", GUIDANCE, mesh))
    _, stale = warm(params, x, t, cond, None)
    # the buffers a steady step reads: last step's, made different from this step's K/V
    stale = jax.tree.map(lambda a: a * 0.5, stale)
    steady = jax.jit(make_step(fn, plain, "steady", "row", GUIDANCE, mesh))
    ref_out, ref_state = steady(params, x, t, cond, stale)
    for threshold, skips in ((1e9, True), (1e-12, False)):
        plan = Plan(strategy, 2, cache=FirstBlockCache(threshold))
        step = jax.jit(make_step(fn, plan, "steady", "row", GUIDANCE, mesh))
        # a first step (it computes) on another latent: the residuals the skip reuses
        cache_state = step(params, x * 0.8, t, cond, stale)[1][CACHE]
        cache_state = {**cache_state, "computed": cache_state["computed"] * 0}
        out, state = step(params, x, t, cond, {**stale, CACHE: cache_state})
        assert _computed(state) == (0 if skips else 1)
        first, later = "transformer_blocks_0", "transformer_blocks_1"
        # (another program, the same arithmetic: float rounding apart on any machine)
        assert max_diff(state[first]["attn1"]["kv"], ref_state[first]["attn1"]["kv"]) <= 1e-5
        kept = stale[later]["attn1"]["kv"] if skips else ref_state[later]["attn1"]["kv"]
        assert max_diff(state[later]["attn1"]["kv"], kept) <= (0 if skips else 1e-5)
        assert (max_diff(out, ref_out) > 1e-3) == skips


# ---------------------------------------------------------------------------- diffusers parity
