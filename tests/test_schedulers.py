"""Each scheduler against diffusers' step, 10 steps, fed the same model outputs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import jax.numpy as jnp  # noqa: E402

from patchpar.sampling.schedulers import SchedulerConfig, get_sampler  # noqa: E402

SD = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
)
REFS = {
    "ddim": lambda **kw: diffusers.DDIMScheduler(clip_sample=False, set_alpha_to_one=False, **kw),
    "euler": lambda **kw: diffusers.EulerDiscreteScheduler(**kw),
    "dpmpp_2m": lambda **kw: diffusers.DPMSolverMultistepScheduler(
        algorithm_type="dpmsolver++", solver_order=2, **kw
    ),
}


def run_both(name, ref, n, seed=0):
    """Yields (ours, theirs) after each step; both are fed the same random model outputs."""
    ref.set_timesteps(n)
    sampler = get_sampler(name)
    sched = sampler.schedule(SchedulerConfig.from_diffusers(dict(ref.config)), n)
    np.testing.assert_allclose(np.asarray(sched.timesteps), ref.timesteps.numpy(), rtol=0, atol=0)
    assert float(sched.init_noise_sigma) == pytest.approx(float(ref.init_noise_sigma), rel=1e-6)
    rng = np.random.RandomState(seed)
    x = rng.randn(2, 8, 8, 4).astype(np.float32) * float(ref.init_noise_sigma)
    xr, xj = torch.tensor(x), jnp.asarray(x)
    carry = sampler.init_carry(xj)
    for i, t in enumerate(ref.timesteps):
        out = rng.randn(*x.shape).astype(np.float32)
        scaled_r = ref.scale_model_input(xr, t).numpy()
        scaled_j = np.asarray(sampler.scale_input(sched, i, xj))
        yield scaled_j, scaled_r
        xr = ref.step(torch.tensor(out), t, xr).prev_sample
        xj, carry = sampler.step(sched, i, xj, jnp.asarray(out), carry)
        yield np.asarray(xj), xr.numpy()


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing", None])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_matches_diffusers_for_10_steps(name, spacing, prediction):
    kw = dict(SD, prediction_type=prediction)
    if spacing:
        kw["timestep_spacing"] = spacing
    for ours, theirs in run_both(name, REFS[name](**kw), 10):
        # 1e-5 of the sample's scale: samples reach |x| ~ 40 (Euler's sigma_max ~ 14.6), where
        # one float32 ulp is ~4e-6.
        scale = max(1.0, float(np.abs(theirs).max()))
        assert np.abs(ours - theirs).max() <= 1e-5 * scale


def test_ddim_clip_sample_matches_diffusers():
    ref = diffusers.DDIMScheduler(
        **SD, clip_sample=True, clip_sample_range=1.0, set_alpha_to_one=True
    )
    for ours, theirs in run_both("ddim", ref, 10, seed=1):
        assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, float(np.abs(theirs).max()))


def test_unknown_sampler_lists_known():
    with pytest.raises(
        ValueError,
        match=r"unknown sampler 'plms'; known: \['ddim', 'dpmpp_2m', 'euler', 'flow_euler', 'unipc'\]",
    ):
        get_sampler("plms")


@pytest.mark.parametrize("steps", [0, -3, 1001, 2.5])
def test_bad_step_count(steps):
    with pytest.raises(ValueError, match=r"steps=.*need an integer in \[1, 1000\]"):
        get_sampler("ddim").schedule(SchedulerConfig(), steps)


@pytest.mark.parametrize(
    "key, value",
    [
        ("prediction_type", "sample"),
        ("beta_schedule", "squaredcos_cap_v2"),
        ("use_karras_sigmas", True),
    ],
)
def test_unsupported_scheduler_config(key, value):
    with pytest.raises(ValueError, match=key):
        SchedulerConfig.from_diffusers({**SD, key: value})


# Wan's scheduler: UniPC on flow sigmas (its scheduler_config.json's settings)
WAN = dict(
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
    predict_x0=True,
    solver_type="bh2",
    lower_order_final=True,
    final_sigmas_type="zero",
    beta_schedule="linear",
    beta_start=0.0001,
    beta_end=0.02,
)


@pytest.mark.parametrize(
    "steps, shift",
    [
        (10, 3.0),
        pytest.param(4, 5.0, marks=pytest.mark.slow),
        (2, 1.0),
        pytest.param(1, 3.0, marks=pytest.mark.slow),
    ],  # fmt: skip
)
def test_flow_unipc_matches_diffusers(steps, shift):
    """Predictor and corrector of every step, first order at both ends, the integer timestep
    inputs; fed the same random velocities (shift 1: the first sigma is 1 - 1e-6)."""
    ref = diffusers.UniPCMultistepScheduler(**{**WAN, "flow_shift": shift})
    for ours, theirs in run_both("unipc", ref, steps):
        assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, float(np.abs(theirs).max()))


@pytest.mark.parametrize(
    "key, value",
    [("solver_order", 3), ("solver_type", "bh1"), ("predict_x0", False), ("flow_shift", -1.0)],
)
def test_unsupported_flow_unipc_settings_are_named(key, value):
    cfg = {"_class_name": "UniPCMultistepScheduler", **WAN, key: value}
    with pytest.raises(ValueError, match=f"{key}={value!r}"):
        SchedulerConfig.from_diffusers(cfg)
