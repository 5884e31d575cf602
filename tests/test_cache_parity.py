"""Step caches against their references on the same PixArt and FLUX weights: the first-block
cache and TaylorSeer against diffusers' hooks (`apply_first_block_cache`,
`apply_taylorseer_cache`: the same skipped steps, the same latents), TeaCache against its rule
applied on diffusers' models, and PixArt's TeaCache polynomial against its recorded fit."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


from test_cache import MARGIN  # noqa: E402

from patchpar.parallel.sites import STALE  # noqa: E402
from patchpar.sampling.cache import (  # noqa: E402
    FirstBlockCache,
    TaylorSeer,
)


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
