"""Schedulers as pure functions with one signature (DDIM, Euler discrete, DPM-Solver++ 2M, and
flow matching's Euler for FLUX-style models).

A `Schedule` (a pytree of arrays, built once per step count) holds everything a step needs;
every sampler answers

    scale_input(schedule, i, x)                     -> model input at step i
    step(schedule, i, x, model_output, carry)       -> (x at step i+1, carry)
    init_carry(x)                                   -> the solver's history (multistep methods)

with `i` a (possibly traced) step index, so a whole phase of the loop compiles once.
Numbers follow diffusers' DDIMScheduler, EulerDiscreteScheduler,
DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2) with their
SD defaults, and FlowMatchEulerDiscreteScheduler (`flow_euler`: sigmas from 1 to 1/N,
shifted by a fixed `shift` or by mu from the image's token count, the model's output a
velocity); `SchedulerConfig.from_diffusers` reads `scheduler/scheduler_config.json`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from patchpar.sampling import unipc


@dataclass(frozen=True)
class SchedulerConfig:
    num_train_timesteps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"  # linear | scaled_linear
    prediction_type: str = "epsilon"  # epsilon | v_prediction
    # leading | linspace | trailing; None = the sampler's own diffusers default
    # (DDIM: leading, Euler and DPM-Solver: linspace), as `Scheduler.from_config` gives.
    timestep_spacing: str | None = None
    steps_offset: int = 1
    set_alpha_to_one: bool = False  # DDIM: alpha of the step after the last
    clip_sample: bool = False  # DDIM: clip the x0 prediction to +-clip_sample_range
    clip_sample_range: float = 1.0
    # flow matching (FlowMatchEulerDiscreteScheduler): the model predicts a velocity
    flow: bool = False
    shift: float = 1.0  # sigma -> shift sigma / (1 + (shift - 1) sigma), when not dynamic
    use_dynamic_shifting: bool = False  # shift by mu from the image's tokens (FLUX.1-dev)
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    image_seq_len: int | None = None  # the image's tokens (set per size: `at_tokens`)
    # where a flow sampler's n sigmas come from, before the shift: "linspace" = linspace(1, 1/n)
    # (what FluxPipeline passes the scheduler), "scheduler" = linspace from the scheduler's
    # sigma_max to its (shifted) sigma_min (StableDiffusion3Pipeline passes none); the family's
    # pipeline decides (`Family.flow_sigmas`)
    flow_sigmas: str = "linspace"

    def at_tokens(self, tokens: int) -> SchedulerConfig:
        """This config for an image of `tokens` tokens (what dynamic shifting reads)."""
        from dataclasses import replace

        return replace(self, image_seq_len=int(tokens)) if self.use_dynamic_shifting else self

    def mu(self) -> float:
        """FLUX's resolution-dependent shift: linear in the image's tokens, base_shift at
        base_image_seq_len and max_shift at max_image_seq_len (diffusers' calculate_shift)."""
        if self.image_seq_len is None:
            raise ValueError(
                "this flow-matching scheduler shifts by the image's size "
                "(use_dynamic_shifting): give it the image's tokens (SchedulerConfig.at_tokens)"
            )
        m = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return self.image_seq_len * m + self.base_shift - m * self.base_image_seq_len

    @classmethod
    def from_diffusers(
        cls, cfg: dict, where: str = "scheduler/scheduler_config.json"
    ) -> SchedulerConfig:
        is_unipc = cfg.get("_class_name", "UniPCMultistepScheduler") == "UniPCMultistepScheduler"
        if is_unipc and cfg.get("use_flow_sigmas"):  # (an in-memory config has no class name)
            return cls._unipc_flow(cfg, where)
        checks = {
            "beta_schedule": ("linear", "scaled_linear"),
            "prediction_type": ("epsilon", "v_prediction"),
            "timestep_spacing": ("leading", "linspace", "trailing", None),
        }
        for key, ok in checks.items():
            if key in cfg and cfg[key] not in ok:
                raise ValueError(
                    f"{where}: {key}={cfg[key]!r} not supported (supported: {list(ok)})"
                )
        for key in (
            "use_karras_sigmas",
            "use_exponential_sigmas",
            "use_beta_sigmas",
            "thresholding",
            "rescale_betas_zero_snr",
        ):
            if cfg.get(key):
                raise ValueError(f"{where}: {key}=True is not supported")
        if cfg.get("trained_betas") is not None:
            raise ValueError(f"{where}: trained_betas is not supported")
        flow = cfg.get("_class_name") == "FlowMatchEulerDiscreteScheduler"
        if flow:
            for key, want in (
                ("invert_sigmas", False),
                ("shift_terminal", None),
                ("stochastic_sampling", False),
                ("time_shift_type", "exponential"),
            ):
                if cfg.get(key, want) != want:
                    raise ValueError(f"{where}: {key}={cfg[key]!r} is not supported ({want!r})")
        # An in-memory diffusers config lists the keys it left at the class default; like
        # `Scheduler.from_config`, treat those as unset so each sampler takes its own default.
        unset = set(cfg.get("_use_default_values", ()))
        fields = set(cls.__dataclass_fields__) - {"flow", "image_seq_len", "flow_sigmas"}
        return cls(**{k: v for k, v in cfg.items() if k in fields and k not in unset}, flow=flow)

    @classmethod
    def _unipc_flow(cls, cfg: dict, where: str) -> SchedulerConfig:
        """A flow-matching UniPCMultistepScheduler (Wan's): the settings `unipc` implements,
        checked (ValueError naming the value and what is supported)."""
        want = {
            "prediction_type": "flow_prediction",
            "solver_order": 2,
            "solver_type": "bh2",
            "predict_x0": True,
            "lower_order_final": True,
            "final_sigmas_type": "zero",
            "thresholding": False,
            "use_dynamic_shifting": False,
            "shift_terminal": None,
            "disable_corrector": [],
            "solver_p": None,
            "timestep_spacing": "linspace",
        }
        for key, value in want.items():
            if (
                key in cfg
                and cfg[key] != value
                and not (key == "disable_corrector" and not cfg[key])
            ):
                raise ValueError(
                    f"{where}: {key}={cfg[key]!r} is not supported by the flow UniPC sampler "
                    f"({value!r})"
                )
        shift = cfg.get("flow_shift", 1.0)
        if not isinstance(shift, (int, float)) or shift <= 0:
            raise ValueError(f"{where}: flow_shift={shift!r} must be a positive number")
        big = cfg.get("num_train_timesteps", 1000)
        return cls(num_train_timesteps=big, flow=True, shift=float(shift))

    def alphas_cumprod(
        self,
    ) -> np.ndarray:  # (T,) float64; schedules are cast to float32 at the end
        t = self.num_train_timesteps
        if self.beta_schedule == "linear":
            betas = np.linspace(self.beta_start, self.beta_end, t, dtype=np.float64)
        else:
            betas = np.linspace(self.beta_start**0.5, self.beta_end**0.5, t, dtype=np.float64) ** 2
        return np.cumprod(1.0 - betas)

    def spacing(self, default: str) -> str:
        return self.timestep_spacing or default


@struct.dataclass
class Schedule:
    """Per-step arrays of one sampler at one step count (a pytree; `v_prediction` is static)."""

    timesteps: jax.Array  # (n,) the model's timestep input at each step
    sigmas: jax.Array  # (n+1,) noise levels (Euler / DPM); DDIM: sqrt((1-a)/a) of t and prev
    alphas: jax.Array  # (n,) DDIM: alpha_cumprod at t
    alphas_prev: jax.Array  # (n,) DDIM: alpha_cumprod at the previous timestep
    init_noise_sigma: jax.Array  # () scale of the initial Gaussian latent
    clip_x0: jax.Array  # () DDIM: clip range of the x0 prediction, 0 = off
    v_prediction: bool = struct.field(pytree_node=False)
    coef: jax.Array | None = None  # (n, k) a multistep solver's per-step coefficients (UniPC)


def _spaced_timesteps(
    cfg: SchedulerConfig, n: int, spacing: str, *, plus_one: bool = False
) -> np.ndarray:
    """Timesteps, descending. DPM-Solver spaces n+1 points and drops the last (plus_one)."""
    t = cfg.num_train_timesteps
    m = n + 1 if plus_one else n
    if spacing == "linspace":
        ts = np.linspace(0, t - 1, m).round()[::-1] if plus_one else np.linspace(0, t - 1, m)[::-1]
    elif spacing == "leading":
        ts = (np.arange(0, m) * (t // m)).round()[::-1] + cfg.steps_offset
    else:  # trailing
        ts = np.round(np.arange(t, 0, -t / n)) - 1
    ts = ts.astype(np.float64)
    return ts[:-1] if plus_one and spacing != "trailing" else ts


def _check_steps(cfg: SchedulerConfig, n: int) -> None:
    if not isinstance(n, int) or n < 1 or n > cfg.num_train_timesteps:
        raise ValueError(f"steps={n!r}: need an integer in [1, {cfg.num_train_timesteps}]")


def _check_ddpm(cfg: SchedulerConfig, name: str) -> None:
    if cfg.flow:
        raise ValueError(
            f"sampler {name!r} needs a DDPM-style model; this one is flow-matching "
            f"(FlowMatchEulerDiscreteScheduler): use flow_euler"
        )


def _sigmas_at(ac: np.ndarray, ts: np.ndarray) -> np.ndarray:
    sig = ((1 - ac) / ac) ** 0.5
    return np.interp(ts, np.arange(len(sig)), sig)


def _schedule(ts, sigmas, alphas, alphas_prev, init, cfg, clip: float = 0.0) -> Schedule:
    f = lambda a: jnp.asarray(np.asarray(a, np.float64), jnp.float32)  # noqa: E731
    return Schedule(
        f(ts),
        f(sigmas),
        f(alphas),
        f(alphas_prev),
        f(init),
        f(clip),
        cfg.prediction_type == "v_prediction",
    )


# ---------------------------------------------------------------- DDIM (eta = 0)


def ddim_schedule(cfg: SchedulerConfig, n: int) -> Schedule:
    _check_steps(cfg, n)
    _check_ddpm(cfg, "ddim")
    ac = cfg.alphas_cumprod()
    spacing = cfg.spacing("leading")
    if spacing == "linspace":
        ts = np.linspace(0, cfg.num_train_timesteps - 1, n).round()[::-1]
    else:
        ts = _spaced_timesteps(cfg, n, spacing)
    ts = ts.astype(np.int64)
    prev = ts - cfg.num_train_timesteps // n
    final = 1.0 if cfg.set_alpha_to_one else ac[0]
    a_prev = np.where(prev >= 0, ac[np.clip(prev, 0, None)], final)
    clip = cfg.clip_sample_range if cfg.clip_sample else 0.0
    return _schedule(ts, np.zeros(n + 1), ac[ts], a_prev, 1.0, cfg, clip)


def _pred_x0_eps(s: Schedule, x, out, alpha):
    if s.v_prediction:
        return jnp.sqrt(alpha) * x - jnp.sqrt(1 - alpha) * out, jnp.sqrt(alpha) * out + jnp.sqrt(
            1 - alpha
        ) * x
    return (x - jnp.sqrt(1 - alpha) * out) / jnp.sqrt(alpha), out


def ddim_step(s: Schedule, i, x, out, carry):
    a, a_prev = s.alphas[i], s.alphas_prev[i]
    xf = x.astype(jnp.float32)
    x0, eps = _pred_x0_eps(s, xf, out.astype(jnp.float32), a)
    x0 = jnp.where(s.clip_x0 > 0, jnp.clip(x0, -s.clip_x0, s.clip_x0), x0)
    return (jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev) * eps).astype(x.dtype), carry


# ---------------------------------------------------------------- Euler (discrete)


def euler_schedule(cfg: SchedulerConfig, n: int) -> Schedule:
    _check_steps(cfg, n)
    _check_ddpm(cfg, "euler")
    ac = cfg.alphas_cumprod()
    spacing = cfg.spacing("linspace")
    ts = _spaced_timesteps(cfg, n, spacing)
    sig = np.concatenate([_sigmas_at(ac, ts), [0.0]])
    smax = float(sig.max())
    init = smax if spacing in ("linspace", "trailing") else (smax**2 + 1) ** 0.5
    return _schedule(ts, sig, np.zeros(n), np.zeros(n), init, cfg)


def sigma_scale_input(s: Schedule, i, x):
    return (x / jnp.sqrt(s.sigmas[i] ** 2 + 1)).astype(x.dtype)


def euler_step(s: Schedule, i, x, out, carry):
    sigma, sigma_next = s.sigmas[i], s.sigmas[i + 1]
    xf, of = x.astype(jnp.float32), out.astype(jnp.float32)
    if s.v_prediction:
        x0 = of * (-sigma / jnp.sqrt(sigma**2 + 1)) + xf / (sigma**2 + 1)
    else:
        x0 = xf - sigma * of
    return (xf + (xf - x0) / sigma * (sigma_next - sigma)).astype(x.dtype), carry


# ---------------------------------------------------------------- DPM-Solver++ 2M


def dpmpp_2m_schedule(cfg: SchedulerConfig, n: int) -> Schedule:
    _check_steps(cfg, n)
    _check_ddpm(cfg, "dpmpp_2m")
    ac = cfg.alphas_cumprod()
    ts = _spaced_timesteps(cfg, n, cfg.spacing("linspace"), plus_one=True)
    sig = np.concatenate([_sigmas_at(ac, ts), [0.0]])  # final_sigmas_type="zero"
    return _schedule(ts, sig, np.zeros(n), np.zeros(n), 1.0, cfg)


def _alpha_sigma_lambda(sigma):
    alpha = 1.0 / jnp.sqrt(sigma**2 + 1)
    sig = sigma * alpha
    return alpha, sig, jnp.log(alpha) - jnp.log(sig)


def dpmpp_2m_step(s: Schedule, i, x, out, carry):
    """Second order (midpoint) after the first step; first order at the first and last step."""
    prev_x0, have_prev = carry
    xf = x.astype(jnp.float32)
    a_s0, s_s0, l_s0 = _alpha_sigma_lambda(s.sigmas[i])
    if s.v_prediction:
        x0 = a_s0 * xf - s_s0 * out.astype(jnp.float32)
    else:
        x0 = (xf - s_s0 * out.astype(jnp.float32)) / a_s0
    a_t, s_t, l_t = _alpha_sigma_lambda(s.sigmas[i + 1])
    h = l_t - l_s0
    phi = jnp.expm1(-h)  # exp(-h) - 1; -1 at the final step (sigma_next = 0, h = inf)
    first = (s_t / s_s0) * xf - a_t * phi * x0  # = x0 at the final step
    _, _, l_s1 = _alpha_sigma_lambda(s.sigmas[jnp.maximum(i - 1, 0)])
    r0 = (l_s0 - l_s1) / h
    d1 = (x0 - prev_x0) / r0
    second = first - 0.5 * a_t * phi * d1
    last = i == s.timesteps.shape[0] - 1
    use_second = jnp.logical_and(have_prev, jnp.logical_not(last))
    x_next = jnp.where(use_second, second, first)
    return x_next.astype(x.dtype), (x0, jnp.asarray(True))


# ---------------------------------------------------------------- flow matching (Euler)


def flow_euler_schedule(cfg: SchedulerConfig, n: int) -> Schedule:
    """Sigmas linspace(1, 1/n) in float32 (FluxPipeline), or from the scheduler's sigma_max to
    its sigma_min in float64 (StableDiffusion3Pipeline; `cfg.flow_sigmas`), shifted
    (exponentially by mu with dynamic shifting, else by `shift`) as diffusers'
    FlowMatchEulerDiscreteScheduler, then 0;
    the model's timestep input is sigma (diffusers passes timesteps / 1000 = sigma x 1000 /
    1000, reproduced in float32)."""
    _check_steps(cfg, n)
    if not cfg.flow:
        raise ValueError(
            "sampler 'flow_euler' needs a flow-matching model (FlowMatchEulerDiscreteScheduler); "
            "this model's scheduler is DDPM-style: use ddim, euler or dpmpp_2m"
        )
    if cfg.flow_sigmas == "scheduler":  # SD3: in float64 from the scheduler's float32 ends
        big = np.float32(cfg.num_train_timesteps)
        lo = np.float32(1) / big  # the scheduler's last training sigma, shifted in float32
        lo = lo if cfg.use_dynamic_shifting else _shifted(cfg, np.float32(cfg.shift), lo)
        sig = np.linspace(1.0 * float(big), float(lo) * float(big), n) / float(big)
        sig = _shifted(cfg, cfg.shift, sig).astype(np.float32)
    elif cfg.flow_sigmas == "linspace":
        sig = _shifted(cfg, np.float32(cfg.shift), np.linspace(1.0, 1.0 / n, n).astype(np.float32))
    else:
        raise ValueError(f"flow_sigmas={cfg.flow_sigmas!r}; known: 'linspace', 'scheduler'")
    t = (sig * np.float32(cfg.num_train_timesteps)).astype(np.float32)
    t = (t / np.float32(1000)).astype(np.float32)
    sigmas = np.concatenate([sig, np.zeros(1, np.float32)])
    z = np.zeros(n)
    return Schedule(
        jnp.asarray(t), jnp.asarray(sigmas), jnp.asarray(z, jnp.float32),
        jnp.asarray(z, jnp.float32), jnp.asarray(1.0, jnp.float32), jnp.asarray(0.0, jnp.float32),
        False,
    )  # fmt: skip


def _shifted(cfg: SchedulerConfig, shift, sig: np.ndarray) -> np.ndarray:
    """Sigmas shifted as FlowMatchEulerDiscreteScheduler does, in sig's precision: by mu from
    the image's tokens (dynamic shifting: exp(mu) / (exp(mu) + 1/sigma - 1)) or by `shift`."""
    one = sig.dtype.type(1)
    if cfg.use_dynamic_shifting:
        e = sig.dtype.type(np.exp(cfg.mu()))
        return (e / (e + (one / sig - one))).astype(sig.dtype)
    shift = sig.dtype.type(shift)
    return (shift * sig / (one + (shift - one) * sig)).astype(sig.dtype)


def flow_euler_step(s: Schedule, i, x, out, carry):
    """x + (sigma_next - sigma) v, in float32, cast to the model output's dtype."""
    dt = s.sigmas[i + 1] - s.sigmas[i]
    return (x.astype(jnp.float32) + dt * out.astype(jnp.float32)).astype(out.dtype), carry


# ---------------------------------------------------------------- UniPC (flow matching)


def unipc_schedule(cfg: SchedulerConfig, n: int) -> Schedule:
    """diffusers' UniPCMultistepScheduler with `use_flow_sigmas` (Wan's): sigmas linspace(1,
    1/1000, n + 1) without the last, shifted by `shift` (its flow_shift) in float64, the first
    lowered by 1e-6 where it is 1, then 0; the model's timestep input is sigma x 1000 truncated
    to an integer, as the scheduler's int64 timesteps. Order 2 (bh2, x0 prediction), first
    order at the first and the last step, the corrector after every step but the first. Each
    step's scalars are computed here in float32 as the scheduler computes them (`coef`):
    predictor (a, m0, d), corrector (a, m0, d, t) and whether it runs."""
    _check_steps(cfg, n)
    if not cfg.flow:
        raise ValueError(
            "sampler 'unipc' is the flow-matching UniPC (use_flow_sigmas); this model's scheduler "
            "is DDPM-style: use ddim, euler or dpmpp_2m"
        )
    big = cfg.num_train_timesteps
    sig = np.linspace(1, 1 / big, n + 1)[:-1]
    sig = cfg.shift * sig / (1 + (cfg.shift - 1) * sig)
    if abs(sig[0] - 1) < 1e-6:
        sig[0] -= 1e-6
    t = np.trunc(sig * big).astype(np.float32)
    sigmas = np.concatenate([sig, [0.0]]).astype(np.float32)
    coef = unipc.coefficients(sigmas)
    z = jnp.zeros(n, jnp.float32)
    return Schedule(
        jnp.asarray(t), jnp.asarray(sigmas), z, z, jnp.asarray(1.0, jnp.float32),
        jnp.asarray(0.0, jnp.float32), False, jnp.asarray(coef),
    )  # fmt: skip


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class Sampler:
    name: str
    schedule: Callable[[SchedulerConfig, int], Schedule]
    step: Callable
    scale_input: Callable
    multistep: bool = False
    carry: Callable | None = None  # a solver's own carry (UniPC's): x -> its zeros

    def init_carry(self, x: jax.Array):
        if self.carry is not None:
            return self.carry(x)
        if self.multistep:
            return (jnp.zeros(x.shape, jnp.float32), jnp.asarray(False))
        return ()


def _identity_scale(s, i, x):
    return x


SAMPLERS: dict[str, Sampler] = {
    "ddim": Sampler("ddim", ddim_schedule, ddim_step, _identity_scale),
    "euler": Sampler("euler", euler_schedule, euler_step, sigma_scale_input),
    "dpmpp_2m": Sampler(
        "dpmpp_2m", dpmpp_2m_schedule, dpmpp_2m_step, _identity_scale, multistep=True
    ),
    "flow_euler": Sampler("flow_euler", flow_euler_schedule, flow_euler_step, _identity_scale),
    "unipc": Sampler(
        "unipc", unipc_schedule, unipc.step, _identity_scale, multistep=True, carry=unipc.carry
    ),
}
# samplers of DDPM-style (noise / v prediction) models; flow-matching models take flow_euler
DDPM_SAMPLERS = ("ddim", "euler", "dpmpp_2m")


def get_sampler(name: str) -> Sampler:
    try:
        return SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; known: {sorted(SAMPLERS)}") from None
