"""Step caches' bad input: options out of range, a cache that would skip or predict nothing in
so few steps, an unknown cache or option, a cache the family lacks or a program it does not
fit; each a one-line error naming the value and what fits."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from test_parallel_dit import GUIDANCE, micro_dit  # noqa: E402

from patchpar.parallel.engine import Plan  # noqa: E402
from patchpar.parallel.strategies import make_strategy  # noqa: E402
from patchpar.sampling.cache import (  # noqa: E402
    FirstBlockCache,
    TaylorSeer,
    make_cache,
)


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
