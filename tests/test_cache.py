"""Step caches (patchpar.sampling.cache): the first-block cache against diffusers'
`apply_first_block_cache` hook on the same PixArt and FLUX weights (the same skipped steps, the
same latents), the cache under patch parallelism against the cache on one device, what a stale
site reads after a skipped step, and bad input."""

import sys
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_parallel_dit import GUIDANCE, inputs, max_diff, micro_dit  # noqa: E402

from patchpar.parallel.engine import Plan, make_step  # noqa: E402
from patchpar.parallel.sites import STALE  # noqa: E402
from patchpar.parallel.strategies import make_strategy  # noqa: E402
from patchpar.sampling.cache import (  # noqa: E402
    CACHE,
    CLOSEST,
    FirstBlockCache,
    TaylorSeer,
    make_cache,
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
    for devices, cfg in ((2, 1), (4, 1), (4, 2)):
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
    for devices, cfg in ((2, 1), (4, 1), (4, 2)):
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
    for devices in (2, 4):
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


def _torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    return torch


def _diffusers_loop(ref, call, x0: np.ndarray, ts, apply, owner, method: str, decided,
                    margin=None):  # fmt: skip
    """`apply(ref)` (a diffusers cache hook), then the loop x <- x - 0.1 * call(ref, x, t) in
    one cache context, with `owner.method` wrapped to record each step's decision
    (`decided(hook, result)`: whether every block ran, None for a call that does not decide)
    and, for a data-dependent one, how far its statistic was from the threshold
    (`margin(hook, args)`, relative): (final x, decisions, margins)."""
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    torch = _torch()
    decisions, margins = [], []
    original = getattr(owner, method)

    def recorded(self, *args):
        m = None if margin is None else margin(self, *args)  # before the call changes state
        out = original(self, *args)
        if (d := decided(self, out)) is not None:
            decisions.append(d)
            if m is not None:
                margins.append(m)
        return out

    setattr(owner, method, recorded)
    try:
        apply(ref)
        _set_cache_context(ref, CacheContext("cond"))
        x = x0
        with torch.no_grad():
            for t in ts:
                x = x - 0.1 * call(ref, x, t)
    finally:
        setattr(owner, method, original)
    return x, decisions, margins


def _diffusers_fbcache(ref, threshold: float, call, x0: np.ndarray, ts):
    """diffusers' first-block cache hook on `ref` over the loop: (final x, decisions, margins:
    the first block's relative residual change against the threshold, each step after the
    first)."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks import first_block_cache as fbc

    def margin(hook, residual):
        prev = hook.state_manager.get_state().head_block_residual
        if prev is None:
            return None  # the first step: computed, nothing compared
        change = ((residual - prev).abs().mean() / prev.abs().mean()).item()
        return abs(change / threshold - 1)

    config = FirstBlockCacheConfig(threshold=threshold)
    return _diffusers_loop(ref, call, x0, ts, lambda m: apply_first_block_cache(m, config),
                           fbc.FBCHeadBlockHook, "_should_compute_remaining_blocks",
                           lambda hook, out: bool(out), margin)  # fmt: skip


def _diffusers_taylorseer(ref, call, x0: np.ndarray, ts, **options):
    """diffusers' TaylorSeer hook in its lite mode (the output projection predicted, the blocks
    skipped), factors in float32, over the loop: (final x, decisions: proj_out's hook's)."""
    from diffusers.hooks import taylorseer_cache as tsc

    config = tsc.TaylorSeerCacheConfig(use_lite_mode=True, taylor_factors_dtype=_torch().float32,
                                       **options)  # fmt: skip
    return _diffusers_loop(ref, call, x0, ts, lambda m: tsc.apply_taylorseer_cache(m, config),
                           tsc.TaylorSeerCacheHook, "_measure_should_compute",
                           lambda hook, out: None if out[1].is_inactive else bool(out[0]))  # fmt: skip


def _ours(fn, params, c, cond, x0: np.ndarray, ts, channels: int):
    """The same loop with patchpar's cache `c` on one device (`parallel.cached.cached_call`, as
    the single-device pipeline runs it): (final x, per step whether the blocks ran)."""
    from patchpar.parallel.cached import cached_call

    @jax.jit
    def step(x, t, state):
        out, _, state = cached_call(c, fn.module, {"params": params}, [STALE], lambda m: {},
                                    x, t, cond, state, lambda v: v)  # fmt: skip
        return x - 0.1 * out[0, ..., :channels], state

    x, state, decisions = jnp.asarray(x0), None, []
    for t in ts:
        before = 0 if state is None else int(state["computed"])
        x, state = step(x, jnp.float32(t), state)
        decisions.append(int(state["computed"]) > before)
    return np.asarray(x), decisions


def _check(ours, theirs, ours_dec, theirs_dec, margins=()):
    """The same decisions and outputs as the reference; every data-dependent decision taken
    far from its threshold (`MARGIN`), so equal decisions hold on any machine."""
    from torch_refs import close

    assert min(margins, default=1.0) > MARGIN, margins  # the case tests the rule, not rounding
    assert ours_dec == theirs_dec
    assert 2 <= sum(theirs_dec) < len(theirs_dec)  # some steps skipped, some computed
    close(ours, theirs)


def _pixart(tmp_path):
    """PixArt-Σ-like weights in diffusers and in patchpar, ten steps on two images (one with a
    masked caption): (reference, patchpar's fn and params, call(ref, x, t), cond, x0, ts)."""
    torch = _torch()
    from test_dit_models import SIGMA, make_pixart

    from patchpar.models.api import load_pixart
    from patchpar.sampling.guidance import Conditioning

    ref = make_pixart(SIGMA)
    ref.save_pretrained(tmp_path)
    fn, params = load_pixart(tmp_path)
    rng = np.random.RandomState(0)
    x0 = rng.randn(2, 8, 8, 4).astype(np.float32)
    ctx = rng.randn(2, 6, 20).astype(np.float32)
    mask = np.array([[1] * 6, [1, 1, 1, 0, 0, 0]], np.int32)
    ts = np.linspace(999, 50, 10).astype(np.float32)

    def call(ref, x, t):
        out = ref(
            torch.tensor(x.transpose(0, 3, 1, 2)),
            encoder_hidden_states=torch.tensor(ctx),
            timestep=torch.tensor([t, t]),
            encoder_attention_mask=torch.tensor(mask),
        ).sample
        return out[:, :4].numpy().transpose(0, 2, 3, 1)  # fmt: skip

    cond = Conditioning(jnp.asarray(ctx)[None], {"encoder_attention_mask": jnp.asarray(mask)[None]})
    return ref, fn, params, call, cond, x0, ts


def _flux(tmp_path):
    """FLUX.1-dev-like weights (guidance input 3.5), as `_pixart`."""
    torch = _torch()
    from test_flux_models import DEV, image_ids, make_flux, pack

    from patchpar.models import load_denoiser
    from patchpar.sampling.guidance import Conditioning

    ref = make_flux(DEV)
    ref.save_pretrained(tmp_path)
    fn, params = load_denoiser(tmp_path)
    rng = np.random.RandomState(0)
    h = w = 8
    x0 = rng.randn(2, h, w, 4).astype(np.float32)
    ctx = rng.randn(2, 5, 24).astype(np.float32)
    pooled = rng.randn(2, 20).astype(np.float32)
    g = np.array([3.5, 3.5], np.float32)
    ts = np.linspace(1.0, 0.1, 10).astype(np.float32)

    def call(ref, x, t):
        out = ref(hidden_states=torch.tensor(pack(x)), encoder_hidden_states=torch.tensor(ctx),
                  pooled_projections=torch.tensor(pooled), timestep=torch.tensor([t, t]),
                  img_ids=torch.tensor(image_ids(h, w)), txt_ids=torch.zeros(5, 3),
                  guidance=torch.tensor(g)).sample.numpy()  # fmt: skip
        out = out.reshape(2, h // 2, w // 2, 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)
        return out.reshape(2, h, w, 4)

    extras = {"pooled_projections": jnp.asarray(pooled)[None], "guidance": jnp.asarray(g)[None]}
    return ref, fn, params, call, Conditioning(jnp.asarray(ctx)[None], extras), x0, ts


CASES = {"pixart": (_pixart, 0.1), "flux": (_flux, 0.5)}  # the fbcache threshold of each


@pytest.mark.parametrize("family", list(CASES))
def test_fbcache_matches_diffusers(tmp_path, family):
    make, threshold = CASES[family]
    ref, fn, params, call, cond, x0, ts = make(tmp_path)
    theirs, theirs_dec, margins = _diffusers_fbcache(ref, threshold, call, x0, ts)
    ours, ours_dec = _ours(fn, params, FirstBlockCache(threshold), cond, x0, ts, 4)
    _check(ours, theirs, ours_dec, theirs_dec, margins)


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("order", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_taylorseer_matches_diffusers(tmp_path, family, order):
    """patchpar's `taylorseer` is diffusers' TaylorSeer hook in lite mode: the same steps
    computed (warm-up 2, then one in 3), the same predicted outputs (first and second order)."""
    ref, fn, params, call, cond, x0, ts = CASES[family][0](tmp_path)
    theirs, theirs_dec, _ = _diffusers_taylorseer(  # a fixed schedule: no margins
        ref, call, x0, ts, cache_interval=3, disable_cache_before_step=2, max_order=order
    )
    c = TaylorSeer(interval=3, warmup=2, order=order)
    ours, ours_dec = _ours(fn, params, c, cond, x0, ts, 4)
    _check(ours, theirs, ours_dec, theirs_dec)


def _flux_modulated(block, args, kwargs):
    """diffusers' FLUX double block: norm1's modulated image input."""
    return block.norm1(kwargs["hidden_states"], emb=kwargs["temb"])[0]


def _pixart_modulated(block, args, kwargs):
    """diffusers' BasicTransformerBlock (ada_norm_single): norm1 with its shift and scale."""
    hs = args[0] if args else kwargs["hidden_states"]
    t = kwargs["timestep"]
    mods = (block.scale_shift_table[None] + t.reshape(hs.shape[0], 6, -1)).chunk(6, dim=1)
    return block.norm1(hs) * (1 + mods[1]) + mods[0]


def _teacache_reference(ref, call, x0: np.ndarray, ts, threshold: float, coefficients, modulated):
    """TeaCache4FLUX's rule (ali-vilab/TeaCache) on diffusers' transformer, by hooks: before
    the first block, its modulated image input (`modulated`) and the decision (the first and
    last steps compute; else the relative L1 change rescaled by `coefficients` accumulates, and
    a step computes, and resets it, once it reaches the threshold); before norm_out, a computed
    step keeps the blocks' image residual and a skipped one gets the entering tokens plus the
    last residual (its blocks ran and are discarded: the same numbers as not running them).
    -> (final x, decisions, margins: each accumulated change against the threshold)."""
    torch = _torch()
    st = {"step": 0, "acc": 0.0, "prev": None, "res": None, "entering": None, "compute": True}
    decisions, margins = [], []
    rescale = np.poly1d(coefficients)

    def before_first(module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        m = modulated(module, args, kwargs)
        if st["step"] in (0, len(ts) - 1):
            st["compute"], st["acc"] = True, 0.0
        else:
            rel = ((m - st["prev"]).abs().mean() / st["prev"].abs().mean()).item()
            st["acc"] += rescale(rel)
            st["compute"] = st["acc"] >= threshold
            margins.append(abs(st["acc"] / threshold - 1))
            if st["compute"]:
                st["acc"] = 0.0
        st["prev"], st["entering"] = m, hs
        st["step"] += 1
        decisions.append(bool(st["compute"]))

    def before_norm_out(module, args):
        hs, rest = args[0], args[1:]
        if st["compute"]:
            st["res"] = hs - st["entering"]
            return None
        return (st["entering"] + st["res"], *rest)

    hooks = [ref.transformer_blocks[0].register_forward_pre_hook(before_first, with_kwargs=True),
             ref.norm_out.register_forward_pre_hook(before_norm_out)]  # fmt: skip
    try:
        x = x0
        with torch.no_grad():
            for t in ts:
                x = x - 0.1 * call(ref, x, t)
    finally:
        for h in hooks:
            h.remove()
    return x, decisions, margins


@pytest.mark.parametrize("family", ["flux", "pixart"])
def test_teacache_matches_its_rule_on_diffusers(tmp_path, family):
    """patchpar's `teacache` takes the steps and gives the latents of TeaCache4FLUX's rule run
    on diffusers' modules (the first and last steps computed), with the family's rescaling:
    FLUX.1-dev-like weights with the published polynomial, PixArt with patchpar's own fit."""
    from patchpar.models.flux.model import TEACACHE_COEFFICIENTS as FLUX_TEACACHE
    from patchpar.models.pixart.model import TEACACHE_COEFFICIENTS as PIXART_TEACACHE
    from patchpar.sampling.cache import TeaCache

    build, threshold, coefficients, modulated = {
        "flux": (_flux, 0.3, FLUX_TEACACHE, _flux_modulated),
        "pixart": (_pixart, 0.5, PIXART_TEACACHE, _pixart_modulated),
    }[family]
    ref, fn, params, call, cond, x0, ts = build(tmp_path)
    theirs, theirs_dec, margins = _teacache_reference(ref, call, x0, ts, threshold, coefficients,
                                                      modulated)  # fmt: skip
    ours, ours_dec = _ours(fn, params, TeaCache(threshold).bind(len(ts)), cond, x0, ts, 4)
    _check(ours, theirs, ours_dec, theirs_dec, margins)
    assert theirs_dec[-1]


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "options, message",
    [
        ({"interval": 0}, "interval=0: must be an integer >= 1"),
        ({"interval": 2.5}, "interval=2.5: must be an integer >= 1"),
        ({"warmup": 0}, "warmup=0: must be an integer >= 1"),
        ({"order": True}, "order=True: must be an integer >= 0"),
        ({"stop": 0}, "stop=0: must be an integer >= 1"),
    ],
)
def test_taylorseer_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=f"taylorseer {message}"):
        TaylorSeer(**options)


def test_taylorseer_that_would_predict_nothing_is_named():
    """Step `warmup` is the first that may be predicted (with 4 steps and warm-up 3, the last
    is); a run that ends there, an interval of 1 or a `stop` at the warm-up computes every
    step, and the error names the option that does it and what would fit."""
    fn, _ = micro_dit()
    assert TaylorSeer(warmup=3).schedule(4) == [True, True, True, False]
    Plan(make_strategy("single"), cache=TaylorSeer(warmup=3)).validate(fn, (16, 12), 4, GUIDANCE)
    for c, steps, why in (
        (TaylorSeer(warmup=3), 3, r"warmup=3 covers every step; use warmup <= 2$"),
        (TaylorSeer(interval=1), 8, r"interval=1 computes every step .*; use interval >= 2$"),
        (TaylorSeer(warmup=3, stop=3), 8, r"stop=3 computes every step from it on, and step 3 "
                                          r"\(warmup=3\) .*; use stop >= 4 \(or unset: never\)$"),
    ):  # fmt: skip
        plan = Plan(make_strategy("single"), cache=c)
        with pytest.raises(ValueError, match=rf"taylorseer\(.*\) with {steps} steps: every step "
                                             rf"computes, nothing is predicted: {why}"):  # fmt: skip
            plan.validate(fn, (16, 12), steps, GUIDANCE)


def test_taylorseer_stop_at_or_after_the_run_never_stops():
    """`stop` is diffusers' disable_cache_after_step: from that step on every step computes. A
    stop of `steps` or more never comes, which is what unset means: allowed, the same run; a
    stop at the last step computes it."""
    fn, _ = micro_dit()
    for stop in (4, 100):
        c = TaylorSeer(warmup=3, stop=stop)
        Plan(make_strategy("single"), cache=c).validate(fn, (16, 12), 4, GUIDANCE)
        assert c.schedule(4) == TaylorSeer(warmup=3).schedule(4)
    assert TaylorSeer(warmup=3, stop=4).schedule(8) == [True] * 3 + [False] + [True] * 4
    last = TaylorSeer(warmup=1, interval=2, stop=5)
    Plan(make_strategy("single"), cache=last).validate(fn, (16, 12), 6, GUIDANCE)
    assert last.schedule(6)[-1] and not TaylorSeer(warmup=1, interval=2).schedule(6)[-1]


def test_caches_that_would_skip_nothing_in_so_few_steps_are_named():
    """The first step runs every block (fbcache, teacache) or the whole UNet (deepcache), and
    teacache's last one too: a run of no more steps skips nothing. One more step does."""
    from test_wire import _family  # weightless micro denoisers: validate reads shapes

    from patchpar.sampling.cache import DeepCache, TeaCache

    dit, flux, unet = (_family(f)[0] for f in ("pixart", "flux", "unet"))
    fbc, first = FirstBlockCache(), r"the first step runs every block .*; use at least 2 steps"
    tea, ends = TeaCache(), r"the first and the last step always run every block; use at least 3"
    deep, whole = DeepCache(), r"the first step runs the whole UNet .*; use at least 2 steps"
    for c, fn, steps, nothing, why in (
        (fbc, dit, 1, "skipped", first),
        (tea, flux, 2, "skipped", ends),
        (deep, unet, 1, "reused", whole),
        (DeepCache(interval=1), unet, 8, "reused", r"interval=1 runs the whole UNet at every step"),
    ):
        start = rf"^{c.name}\(.*\) with {steps} steps: every step computes, nothing is {nothing}: "
        with pytest.raises(ValueError, match=start + why):
            c.validate(fn, steps)
    for c, fn, steps in ((fbc, dit, 2), (tea, flux, 3), (deep, unet, 2), (DeepCache(2), unet, 8)):
        c.validate(fn, steps)


@pytest.mark.parametrize("threshold", [0, -0.1, float("nan"), float("inf"), "0.1", True])
def test_a_threshold_that_is_not_positive_is_named(threshold):
    with pytest.raises(ValueError, match=r"fbcache threshold=.*must be a finite number > 0"):
        FirstBlockCache(threshold)


def test_unknown_caches_and_options_are_named():
    assert make_cache("none") is None and make_cache(None) is None
    assert make_cache("fbcache", threshold=0.2) == FirstBlockCache(0.2)
    with pytest.raises(ValueError, match=r"cache='teacash'; known: none, fbcache, taylorseer"):
        make_cache("teacash")
    with pytest.raises(ValueError, match=r"cache 'fbcache' has no option \['interval'\]"):
        make_cache("fbcache", interval=3)
    with pytest.raises(ValueError, match=r"cache options \['threshold'\] given without a cache"):
        make_cache("none", threshold=0.1)


def test_a_cache_the_family_lacks_or_a_program_it_does_not_fit_is_named():
    from parallel_helpers import micro_unet

    unet, _ = micro_unet("sd")
    plan = Plan(make_strategy("sync_patch"), 2, cache=FirstBlockCache())
    with pytest.raises(ValueError, match=r"cache 'fbcache' does not exist for a unet denoiser"):
        plan.validate(unet, (16, 16), 4, 7.5)
    plan = Plan(make_strategy("naive_patch", split="alternate"), 2, cache=TaylorSeer())
    with pytest.raises(ValueError, match=r"cache 'taylorseer' with naive_patch\(split='alternate'"):
        plan.validate(unet, (16, 16), 8, 7.5)
    fn, _ = micro_dit()
    plan = Plan(make_strategy("pipefusion"), 2, cache=FirstBlockCache())
    with pytest.raises(
        ValueError, match=r"cache 'fbcache' with strategy 'pipefusion': not defined"
    ):
        plan.validate(fn, (16, 12), 4, GUIDANCE)


def test_teacache_bad_input_is_named():
    from patchpar.sampling.cache import TeaCache

    for bad in (0, -1.0, float("nan"), "0.25", True):
        with pytest.raises(ValueError, match=r"teacache threshold=.*must be a finite number > 0"):
            TeaCache(bad)
    # the run's length is the pipeline's to set, not an option
    with pytest.raises(ValueError, match=r"cache 'teacache' has no option \['steps'\]"):
        make_cache("teacache", steps=10)
    assert TeaCache(0.4).bind(28).describe() == "teacache(threshold=0.4)"
    from test_parallel_sd3 import micro_sd3

    fn, _ = micro_sd3()  # no published rescaling, and no trained SD3 to fit one on
    plan = Plan(make_strategy("single"), cache=TeaCache())
    with pytest.raises(ValueError, match=r"cache 'teacache' does not exist for a sd3"):
        plan.validate(fn, (16, 16), 4, GUIDANCE)


def test_pixart_teacache_rescaling_is_the_recorded_fit():
    """PixArt's TeaCache polynomial is the one `experiments/teacache_fit.py` recorded, from a
    clean tree, on the trained fmnist-dit; it rescales the changes it was fitted on closely."""
    import json

    from patchpar.models.pixart.model import TEACACHE_COEFFICIENTS

    rec = json.loads((Path(__file__).parents[1] / "results/teacache_fit/fit.json").read_text())
    assert tuple(rec["coefficients"]) == TEACACHE_COEFFICIENTS
    assert rec["model"] == "fmnist-dit" and not rec["provenance"]["git_dirty"]
    x, y = np.asarray(rec["pairs"]).T
    fitted = np.polyval(TEACACHE_COEFFICIENTS, x)
    assert 1 - np.sum((y - fitted) ** 2) / np.sum((y - y.mean()) ** 2) == pytest.approx(rec["r2"])
    assert rec["r2"] > 0.9
