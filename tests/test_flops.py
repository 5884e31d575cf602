"""FLOPs are the program's whatever the attention kernel: a loop's body counts as often as the
loop runs (XLA's own cost analysis takes it once)."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from patchpar.lab.config import build_plan
from patchpar.measure.cost import measure
from patchpar.measure.flops import program_flops
from patchpar.models.attention import AttentionSpec
from patchpar.models.presets import abstract_denoiser

MATMUL = 2 * 64**3  # one (64, 64) @ (64, 64)


def test_loops_count_as_often_as_they_run():
    a = jnp.ones((64, 64))

    def nested(a, b):
        def inner(x, _):
            return x @ b, None

        return lax.fori_loop(0, 3, lambda i, x: lax.scan(inner, x, None, length=7)[0], a)

    low = jax.jit(nested).lower(a, a)
    assert low.cost_analysis()["flops"] == pytest.approx(MATMUL, rel=1e-3)  # XLA: once
    assert program_flops(low) == pytest.approx(21 * MATMUL, rel=1e-3)
    # a phase's loop over steps counts once (FLOPs per step), its inner loops in full
    assert program_flops(low, outer_once=True) == pytest.approx(7 * MATMUL, rel=1e-3)

    def late_start(a, b):  # fori_loop(5, 20): 15 trips
        return lax.fori_loop(5, 20, lambda i, x: x @ b, a)

    assert program_flops(jax.jit(late_start).lower(a, a)) == pytest.approx(15 * MATMUL, rel=1e-3)

    def branches(a, b, p):  # a conditional counts its dearest branch, as XLA's analysis does
        return lax.cond(p, lambda: a @ b, lambda: lax.fori_loop(0, 4, lambda i, x: x @ b, a))

    low = jax.jit(branches).lower(a, a, True)
    assert program_flops(low) == pytest.approx(4 * MATMUL, rel=1e-3)

    def unbounded(a, b, n):  # a loop whose bound is data: counted once, and said so
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] @ b), (0, a))[1]

    with pytest.warns(UserWarning, match="trip count is not a constant bound"):
        got = program_flops(jax.jit(unbounded).lower(a, a, 5))
    assert got == pytest.approx(MATMUL, rel=1e-3)


@pytest.mark.parametrize(
    "model, strategy, latent",
    [
        pytest.param("tiny", "sync_patch", 32, marks=pytest.mark.slow),
        ("tiny-dit", "distrifusion", 32),
        ("tiny-dit", "pipefusion", 32),
    ],  # fmt: skip
)
def test_chunked_attention_flops_equal_xla(model, strategy, latent):
    """Blocks of 64 queries and keys: the chunked kernel loops 4 x 4 times at the tiny UNet's
    first attention level (1024 tokens) and over the DiT's 256 tokens; pipefusion's phases are
    loops over steps whose inner loops are the kernel's."""
    flops = {}
    for impl in ("xla", "chunked"):
        unet = abstract_denoiser(model, jnp.float32, AttentionSpec(impl, 64, 64))
        plan = build_plan(strategy, {}, 2, 1)
        r = measure(unet, plan, (latent, latent), batch=1)
        flops[impl] = [r["phases"][p]["flops_per_device"] for p in ("warmup", "steady")]
    for x, c in zip(flops["xla"], flops["chunked"], strict=True):
        assert c == pytest.approx(x, rel=0.01)


def test_pcpp_on_2_devices_attends_to_its_one_neighbour_band_alone():
    """On a patch axis of 2 each patch has one neighbour: its keys are own + that band (L +
    band), not own + two bands with the missing one masked (L + 2 band, 1.5x at portion 1).
    At portion 1 the steady step's work is DistriFusion's."""
    unet = abstract_denoiser("tiny-dit", jnp.float32, AttentionSpec("xla"))

    def steady(strategy, **options):
        r = measure(unet, build_plan(strategy, options, 2, 1), (32, 32), batch=1)
        return r["phases"]["steady"]["flops_per_device"]

    df = steady("distrifusion")
    assert steady("pcpp", portion=1.0, send="band") == pytest.approx(df, rel=0.005)
    assert steady("pcpp", portion=1.0, send="full") == pytest.approx(df, rel=0.005)
    assert steady("pcpp", portion=0.25, send="band") < 0.95 * df
