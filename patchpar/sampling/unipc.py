"""UniPC (bh2, x0 prediction) on flow sigmas, as diffusers' UniPCMultistepScheduler with
`use_flow_sigmas` steps (Wan's sampler; `schedulers.unipc_schedule` makes its schedule): the
per-step scalars of the predictor and the corrector from the sigmas, in float32 as the scheduler
computes them, and the step that applies them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def coefficients(sigmas: np.ndarray) -> np.ndarray:
    """(n, 8) float32 per step i of n (sigmas: n + 1, the last 0): the predictor's (a, m0, d),
    the corrector's (a, m0, d, t) and whether it runs. Order 2, first order at the first step
    (multistep warm-up) and the last (lower_order_final)."""
    f32 = np.float32
    n = len(sigmas) - 1
    with np.errstate(divide="ignore"):
        alpha = (f32(1) - sigmas).astype(f32)
        lam = (np.log(alpha) - np.log(sigmas)).astype(f32)  # +inf at sigma 0
    order = [min(2, n - i, i + 1) for i in range(n)]
    coef = np.zeros((n, 8), f32)
    for i in range(n):
        coef[i, :3] = _unipc_predictor(sigmas, alpha, lam, i, order[i])
        if i > 0:  # the corrector of step i - 1's prediction, at step i
            coef[i, 3:7] = _unipc_corrector(sigmas, alpha, lam, i, order[i - 1])
            coef[i, 7] = 1
    return coef


def _unipc_h(alpha, lam, sigmas, s: int, t: int):
    """(hh = -h, h phi_1 = expm1(hh), B(h) = expm1(hh) (bh2)) from step s to t, float32."""
    f32 = np.float32
    with np.errstate(invalid="ignore"):
        hh = f32(-(lam[t] - lam[s]))
        phi1 = f32(np.expm1(hh))
    return hh, phi1, phi1


def _unipc_predictor(sigmas, alpha, lam, i: int, order: int):
    """x_next = a x + m0 m_i + d (m_{i-1} - m_i): UniP-`order` from sigma_i to sigma_{i+1}."""
    f32 = np.float32
    hh, phi1, bh = _unipc_h(alpha, lam, sigmas, i, i + 1)
    a = f32(sigmas[i + 1] / sigmas[i])
    m0 = f32(-alpha[i + 1] * phi1)
    d = f32(0)
    if order == 2:  # rhos_p = 0.5; D1 = (m_{i-1} - m_i) / r1
        r1 = f32((lam[i - 1] - lam[i]) / -hh)
        d = f32(-alpha[i + 1] * bh * f32(0.5) / r1)
    return a, m0, d


def _unipc_corrector(sigmas, alpha, lam, i: int, order: int):
    """At step i: x_i = a x_last + m0 m_{i-1} + d (m_{i-2} - m_{i-1}) + t (m_i - m_{i-1}), the
    UniC-`order` correction of the prediction from sigma_{i-1}."""
    f32 = np.float32
    hh, phi1, bh = _unipc_h(alpha, lam, sigmas, i - 1, i)
    a = f32(sigmas[i] / sigmas[i - 1])
    m0 = f32(-alpha[i] * phi1)
    if order == 1:
        return a, m0, f32(0), f32(-alpha[i] * bh * f32(0.5))
    r1 = f32((lam[i - 2] - lam[i - 1]) / -hh)
    phik = f32(phi1 / hh - 1)  # h phi_k(h) / h^k, k = 1, 2
    b1 = f32(phik / bh)
    phik = f32(phik / hh - f32(0.5))
    b2 = f32(phik * 2 / bh)
    rho = np.linalg.solve(np.array([[1, 1], [r1, 1]], f32), np.array([b1, b2], f32)).astype(f32)
    return a, m0, f32(-alpha[i] * bh * rho[0] / r1), f32(-alpha[i] * bh * rho[1])


def step(s, i, x, out, carry):
    """One UniPC step on a velocity `out`: x0 = x - sigma v; the corrector (from step 1) moves
    the sample the last predictor made, then the predictor steps from it; float32 inside."""
    last, m1, m2 = carry  # the sample before the last predictor, m_{i-1}, m_{i-2}
    c = s.coef[i]
    xf = x.astype(jnp.float32)
    m = xf - s.sigmas[i] * out.astype(jnp.float32)
    corrected = c[3] * last + c[4] * m1 + c[5] * (m2 - m1) + c[6] * (m - m1)
    xf = jnp.where(c[7] > 0, corrected, xf)
    x_next = c[0] * xf + c[1] * m + c[2] * (m1 - m)
    return x_next.astype(x.dtype), (xf, m, m1)


def carry(x: jax.Array):
    z = jnp.zeros(x.shape, jnp.float32)
    return (z, z, z)
