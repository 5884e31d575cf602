"""AsyncDiff on a micro PixArt (5 blocks, so 2 and 4 components split unevenly): warm-up over
every step and one component equal `single`; the asynchronous steps equal a sequential
reference written here (component k at step t runs on component k-1's output of step t-1,
component 0 on the embedded latent of step t, the last one's output the step's prediction);
cfg=2 equals cfg=1; bytes from HLO equal the analytic model; the components are balanced by
FLOPs; bad input is a one-line error."""

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import compiled, reordered, rounding
from test_parallel_dit import GUIDANCE, inputs, max_diff
from test_pipefusion import micro_dit

from patchpar.models.sites import IDENTITY
from patchpar.parallel.asyncdiff import _text, balanced_split, boundaries, component_bounds
from patchpar.parallel.engine import Plan, denoise
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.loop import guided
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

STEPS = 5


def _schedule():
    smp = get_sampler("dpmpp_2m")  # a solver history: kept on the first device
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


def reference(fn, params, bounds, warmup, x, cond, smp, sched, scale, stride=1) -> np.ndarray:
    """AsyncDiff's schedule run step by step on one device from the model's own parts (the
    prologue op by op, where a DiT's `aux` keeps its Python sizes; the blocks and the epilogue
    each one compiled call). Stride 2: the model runs on odd steps (rounds), the components on
    the next step's timestep and the last one again on this step's; an even step takes the
    round before's next-step prediction (after warm-up on an even step: the last warm-up
    step's)."""
    module = fn.module.clone(ops=IDENTITY)
    v = {"params": params}
    g, b = cond.context.shape[:2]
    flat = lambda a: a.reshape((g * b,) + a.shape[2:])  # noqa: E731
    added = {k: flat(a) for k, a in cond.added().items()}
    steps = sched.timesteps.shape[0]

    def prologue(x_in, i):
        xs = jnp.broadcast_to(x_in[None], (g,) + x_in.shape).reshape((g * b,) + x_in.shape[1:])
        ts = jnp.broadcast_to(sched.timesteps[i], (g * b,))
        return module.apply(v, xs, ts, flat(cond.context), **added, method="prologue")

    @compiled
    def blocks(lo, hi, h_in, aux):
        return module.apply(v, lo, hi, h_in, aux, method="blocks")

    @compiled
    def predict(hs, aux):
        out = fn.prediction(module.apply(v, hs, aux, method="epilogue"))
        return guided(out.reshape((g, b) + out.shape[1:]), scale)

    lat = x * sched.init_noise_sigma
    carry, outs, pending = smp.init_carry(lat), None, None
    for i in range(steps):
        x_in = smp.scale_input(sched, i, lat)
        if stride == 2 and i >= warmup and i % 2 == 0:
            eps = pending
        else:
            nxt = min(i + 1, steps - 1) if stride == 2 and i >= warmup else i
            hs, aux = prologue(x_in, nxt)
            new = []
            for k, (lo, hi) in enumerate(bounds):
                h_in = hs if i < warmup or k == 0 else outs[k - 1]
                hs = blocks(lo, hi, h_in, aux)
                new.append(hs)
            eps = pending = predict(hs, aux)
            if stride == 2 and i >= warmup:  # the last component on this step's timestep
                _, aux = prologue(x_in, i)
                h_in = outs[-2] if len(bounds) > 1 else prologue(x_in, i)[0]
                eps = predict(blocks(*bounds[-1], h_in, aux), aux)
            outs = new
        lat, carry = smp.step(sched, i, lat, eps, carry)
    return np.asarray(lat)


def test_balanced_split():
    assert balanced_split([1.0] * 5, 2) == [(0, 3), (3, 5)]
    assert balanced_split([1.0] * 5, 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]
    # FLUX-like: heavier blocks first; the largest component is as small as it can be
    assert balanced_split([2.0] * 3 + [1.0] * 6, 3) == [(0, 2), (2, 5), (5, 9)]
    assert balanced_split([3.0, 1.0, 1.0, 1.0], 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4"):
        balanced_split([1.0] * 3, 4)


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_warmup_over_every_step_equals_single(devices):
    assert max_diff(sample("asyncdiff", devices, warmup_steps=STEPS), sample("single", 1)) <= 1e-4


def test_one_component_is_single():
    assert max_diff(sample("asyncdiff", 1, warmup_steps=1), sample("single", 1)) <= 1e-4


@pytest.mark.parametrize("devices, warmup", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_asynchronous_steps_equal_the_reference(devices, warmup):
    fn, params = micro_dit()
    x, _, cond = inputs()
    bounds = component_bounds(fn, devices, x, cond)
    assert bounds == [(0, 3), (3, 5)] if devices == 2 else [(0, 2), (2, 3), (3, 4), (4, 5)]
    got = sample("asyncdiff", devices, warmup_steps=warmup)
    smp, sched = _schedule()
    want = reference(fn, params, bounds, warmup, x, cond, smp, sched, GUIDANCE)
    # the micro DiT's latents reach ~190: the reference's own programs round another way (1.2e-4
    # apart, 8 ulps there); a wrong component split or warm-up is 70-85 apart
    assert max_diff(got, want) <= rounding(want)
    assert max_diff(got, sample("single", 1)) > 1e-3  # stale inputs change the image


@pytest.mark.slow
@pytest.mark.parametrize("devices, warmup", [(3, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_stride_two_equals_the_reference(devices, warmup):
    """S = devices - 1 components; warm-up 1 starts on a round, 2 on a reused step."""
    fn, params = micro_dit()
    x, _, cond = inputs()
    bounds = component_bounds(fn, devices - 1, x, cond)
    got = sample("asyncdiff", devices, warmup_steps=warmup, stride=2)
    smp, sched = _schedule()
    want = reference(fn, params, bounds, warmup, x, cond, smp, sched, GUIDANCE, stride=2)
    assert max_diff(got, want) <= rounding(want)
    stride1 = reference(fn, params, bounds, warmup, x, cond, smp, sched, GUIDANCE)
    assert max_diff(got, stride1) > 1e-3  # not stride 1's schedule on the same components
    assert max_diff(sample("asyncdiff", devices, warmup_steps=STEPS, stride=2),
                    sample("single", 1)) <= 1e-4  # fmt: skip


@pytest.mark.slow
def test_cfg_split_equals_the_same_components_without():
    one = sample("asyncdiff", 2, warmup_steps=2)
    assert max_diff(sample("asyncdiff", 4, 2, warmup_steps=2), one) <= reordered(one)


@pytest.mark.parametrize("devices, cfg, data, stride", [(2, 1, 1, 1), (8, 2, 2, 1), (4, 1, 1, 2)])
def test_bytes_equal_the_analytic_model(devices, cfg, data, stride):
    """Steady step (stride 2: a round): device k > 0 receives component k-1's output (the
    tokens between blocks; stride 2: the extra device the last component's input too), device
    0 the guided prediction (stride 2: this step's and the next's); warm-up: nothing but the
    guidance halves' gather. The released code broadcasts each to every device."""
    from patchpar.measure.cost import measure

    fn, params = micro_dit()
    x, _, _ = inputs(batch=2 * data)
    plan = Plan(make_strategy("asyncdiff", stride=stride), devices, cfg, data=data)
    rec = measure(fn, plan, x.shape[1:3], batch=x.shape[0], params=params, flops=False)
    b, h, w, c = x.shape
    g, d = 2 // cfg, plan.patch
    n = d - stride + 1  # components
    tokens, hid = (h // 2) * (w // 2), fn.config.inner_dim
    hidden, latent = g * (b // data) * tokens * hid * 4, (b // data) * h * w * c * 4
    cfg_bytes = latent if cfg == 2 else 0
    steady, warm = rec["phases"]["steady"], rec["phases"]["warmup"]
    for entry in (steady, warm):
        assert entry["analytic_matches_hlo"], entry
    assert "pipe" not in warm["hlo"] and warm["hlo"]["all"]["max"] == cfg_bytes
    per_device = [latent * stride] + [hidden] * (d - 1)
    assert steady["hlo"]["pipe"]["total"] == sum(per_device) * devices // d
    assert steady["hlo"]["pipe"]["max"] == max(per_device)
    # released: every device receives every other component's output and the prediction(s)
    senders = list(range(n - 1, d))  # of a prediction: the last component's devices
    released = sum(
        hidden * sum(k != p for k in range(n - 1)) + latent * sum(q != p for q in senders)
        for p in range(d)
    )
    assert steady["released"]["pipe"]["total"] == released * devices // d
    assert rec["weight_bytes_per_device"] == sum(a.nbytes for a in jax.tree.leaves(params))
    # the component before's output (stride 2: and the next step's prediction)
    assert rec["stale_bytes_per_device"] == hidden + (stride == 2) * latent


def test_bad_input_names_what_would_fit():
    from patchpar.sampling.cache import FirstBlockCache

    fn, _ = micro_dit()
    hw = (16, 12)

    def check(devices, cfg=1, fsdp=False, steps=STEPS, model=fn, latent=hw, cache=None, **opts):
        opts = {"warmup_steps": 1, **opts}
        plan = Plan(make_strategy("asyncdiff", **opts), devices, cfg, fsdp=fsdp, cache=cache)
        plan.validate(model, latent, steps, GUIDANCE)

    with pytest.raises(ValueError, match="8 components .* stack of 5 blocks: .* at most 5"):
        check(8)
    with pytest.raises(ValueError, match=r"warmup_steps=0 must be an integer in \[1, steps=5\]"):
        check(2, warmup_steps=0)
    with pytest.raises(ValueError, match=r"warmup_steps=9 must be an integer in \[1, steps=5\]"):
        Plan(make_strategy("asyncdiff"), 2).validate(fn, hw, STEPS, GUIDANCE)  # default 9
    with pytest.raises(ValueError, match="does not combine with fsdp"):
        check(2, fsdp=True)
    with pytest.raises(ValueError, match=r"latent rows=15 not divisible by patch size 2 = 2"):
        check(2, latent=(15, 12))
    with pytest.raises(
        ValueError, match=r"cache 'fbcache' with strategy 'asyncdiff': not defined; .* at once"
    ):
        check(2, cache=FirstBlockCache())
    with pytest.raises(ValueError, match=r"stride=3; known: \[1, 2\]"):
        check(2, stride=3)
    with pytest.raises(ValueError, match=r"stride=2 runs S >= 2 components on S \+ 1 .* 2 dev"):
        check(2, stride=2)
    with pytest.raises(ValueError, match=r"6 components \(7 devices .* stride 2\) .* at most 6"):
        check(7, stride=2)  # 5 blocks
    check(4, cfg=2)


@pytest.mark.parametrize(
    "family",
    [pytest.param("flux", marks=pytest.mark.slow), pytest.param("sd3", marks=pytest.mark.slow)],
)
def test_on_an_mmdit(family):
    """FLUX.1 (double- then single-stream blocks: the token pair (image, text) hops between
    components; the heavier double blocks balanced against the single ones by FLOPs) and SD3:
    warm-up over every step equals single, the asynchronous steps the reference, HLO bytes the
    analytic model."""
    from patchpar.measure.cost import measure

    if family == "flux":
        from test_parallel_flux import GUIDANCE as scale
        from test_parallel_flux import inputs as mm_inputs
        from test_parallel_flux import micro_flux as micro
    else:
        from test_parallel_sd3 import GUIDANCE as scale
        from test_parallel_sd3 import inputs as mm_inputs
        from test_parallel_sd3 import micro_sd3 as micro
    fn, params = micro()
    x, _, cond = mm_inputs()
    smp = get_sampler("euler")
    sched = smp.schedule(SchedulerConfig(), 4)

    def run(devices, warmup):
        plan = Plan(make_strategy("asyncdiff", warmup_steps=warmup), devices)
        plan.validate(fn, x.shape[1:3], 4, scale)
        out, _ = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, scale)
        return np.asarray(out)

    single = run(1, 1)
    assert max_diff(run(2, 4), single) <= rounding(single)
    bounds = component_bounds(fn, 2, x, cond)
    assert len(bounds) == 2 and bounds[0][0] == 0 and bounds[-1][1] == fn.module.num_blocks
    got = run(2, 1)
    want = reference(fn, params, bounds, 1, x, cond, smp, sched, scale)
    # SD3's micro latents grow to ~100: float32 rounding of another order of the same ops
    assert max_diff(got, want) <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert max_diff(got, single) > 1e-3 * max(1.0, float(np.abs(single).max()))
    plan = Plan(make_strategy("asyncdiff", warmup_steps=1), 2)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec


@pytest.mark.parametrize(
    "kind, devices, stride",
    [
        pytest.param("sd", 2, 1, marks=pytest.mark.slow),  # the DiT and the MMDiT: above
        pytest.param("sdxl", 3, 1, marks=pytest.mark.slow),
        pytest.param("sd", 3, 2, marks=pytest.mark.slow),
    ],
)
def test_on_a_unet(kind, devices, stride):
    """A UNet's blocks are its levels' down blocks, the mid block and its up blocks; the skip
    connections not yet consumed travel with the activation, so components pass activations
    of different shapes (each packed flat, its own size on the wire). Warm-up over every step
    equals single, the asynchronous steps the reference, HLO bytes the analytic model."""
    from parallel_helpers import GUIDANCE as scale
    from parallel_helpers import inputs as unet_inputs
    from parallel_helpers import micro_unet

    from patchpar.measure.cost import measure

    fn, params = micro_unet(kind)
    x, _, cond = unet_inputs(kind)
    smp = get_sampler("dpmpp_2m")
    sched = smp.schedule(SchedulerConfig(), 4)

    def run(n, warmup):
        plan = Plan(make_strategy("asyncdiff", warmup_steps=warmup, stride=stride), n)
        plan.validate(fn, x.shape[1:3], 4, scale)
        out, _ = denoise(fn, plan, smp, params, cond, sched, x * sched.init_noise_sigma, scale)
        return np.asarray(out)

    single = np.asarray(denoise(fn, Plan(make_strategy("single"), 1), smp, params, cond, sched,
                                x * sched.init_noise_sigma, scale)[0])  # fmt: skip
    assert max_diff(run(devices, 4), single) <= rounding(single)
    parts = devices - stride + 1
    bounds = component_bounds(fn, parts, x, cond)
    assert len(bounds) == parts and bounds[-1][1] == fn.module.num_blocks
    got = run(devices, 1)
    want = reference(fn, params, bounds, 1, x, cond, smp, sched, scale, stride=stride)
    assert max_diff(got, want) <= rounding(want) and max_diff(got, single) > rounding(single)
    plan = Plan(make_strategy("asyncdiff", warmup_steps=1, stride=stride), devices)
    rec = measure(fn, plan, x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    steady = rec["phases"]["steady"]["hlo"]["pipe"]
    latent = x.size * 4  # the guided prediction, to device 0
    # each boundary's own size: x and the skips not yet consumed, of both guidance halves
    passed, _ = boundaries(fn, tuple(bounds), x.shape[1:] + (jnp.float32,), _text(cond), 4)
    sizes = [sum(a.size * 4 for a in jax.tree.leaves(t)) for t in passed]
    assert len(set(sizes)) == len(sizes) and min(sizes) > latent
    # stride 2: two predictions to device 0, the last boundary to the last two devices
    total = stride * latent + sum(sizes) + (stride == 2) * sizes[-1]
    assert steady["total"] == total and steady["max"] == max(*sizes, stride * latent)


@pytest.mark.slow
def test_project_stride_two(tmp_path):
    """`patchpar project` of stride 2 prices a round on the odd steady steps only (2 exact
    steps of 8, then rounds at steps 3, 5 and 7); a latent whose rows the 3 devices do not
    divide decodes on uneven row patches (priced, not refused)."""
    from patchpar.lab.project import ProjectConfig, run_project
    from patchpar.lab.project_table import format_project

    config = ProjectConfig.from_flags(model="tiny-dit", resolution=128, strategy="asyncdiff", stride=2,
                           warmup_steps=2, devices=3, steps=8, workloads=tmp_path / "w.jsonl")  # fmt: skip
    (r,) = run_project(config)
    assert r["warmup_phase_steps"] == 2 and r["steady_steps"] == 6
    assert r["decode_rows_s"] > 0 and r["latency_decode_rows_s"] > r["latency_no_decode_s"]
    warm, steady = r["phases"]["warmup"]["step_s"], r["phases"]["steady"]["step_s"]
    assert r["latency_no_decode_s"] == pytest.approx(2 * warm + 3 * steady + r["encode_s"])
    assert "— /" not in format_project([r])
