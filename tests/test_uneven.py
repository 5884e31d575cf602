"""Uneven row patches (`patchpar/parallel/split.py`): a latent whose rows the patch devices do
not divide runs on the most even split of whole row units, or on rows in proportion to given
weights, every slab padded to the largest patch's rows. The exact strategies equal `single`
(<= 1e-4 of the output's scale) at sizes that an even split refuses: `fmnist`'s 32 x 32 on 3
devices (12, 12, 8 rows), a DiT's and FLUX.1's, weighted rows; DistriFusion with warm-up over
every step equals sync_patch; the HLO bytes equal the analytic model, with the padding's
bytes counted apart; the strategies whose sites do not handle padding yet, and bad weights,
are refused in one line each."""

import functools

import numpy as np
import pytest
from torch_refs import rel_err

from patchpar.lab.cli import main
from patchpar.parallel.engine import Plan
from patchpar.parallel.split import pad_rows, split_rows, unpad_rows
from patchpar.parallel.strategies import make_strategy
from patchpar.pipelines import load_pipeline

SLOW = pytest.mark.slow


# ------------------------------------------------------------------------- the split itself


def test_the_most_even_split_of_whole_units():
    assert split_rows(32, 2, 4) == (16, 16)
    assert split_rows(32, 3, 4) == (12, 12, 8)  # 8 units: 3, 3, 2 (the first take the rest)
    assert split_rows(126, 4, 2) == (32, 32, 32, 30)  # FLUX.1 at 1008²: 63 token rows
    assert split_rows(12, 3, 4) == (4, 4, 4)


def test_weights_share_the_rows_by_largest_remainder():
    assert split_rows(64, 4, 4, (3, 2, 2, 1)) == (24, 16, 16, 8)
    assert split_rows(32, 3, 4, (3, 2, 1)) == (16, 12, 4)  # shares 4, 2.67, 1.33 units
    assert split_rows(32, 2, 4, (1, 1)) == (16, 16)
    assert sum(split_rows(120, 5, 2, (1.5, 1, 1, 0.7, 2))) == 120


@pytest.mark.parametrize(
    "args, message",
    [
        ((32, 3, 4, (1, 1)), "patch_weights=1,1: 2 weight(s) for 3 patch devices"),
        ((32, 3, 4, (1, 0, 1)), "patch_weights=1,0,1: 0 is not a positive number"),
        ((32, 3, 4, (1, -2, 1)), "-2 is not a positive number"),
        ((32, 3, 4, (10, 10, 0.5)), "fewer than its minimum of 4 (x): raise its weight to at "
                                    "least 2.86"),
        ((8, 3, 4), "latent rows=8 are 2 unit(s) of 4 (x): fewer than the 3 patch devices"),
        ((30, 2, 4), "latent rows=30 are not a multiple of 4 (x)"),
    ],
)  # fmt: skip
def test_a_split_that_cannot_be_made_names_why(args, message):
    with pytest.raises(ValueError) as e:
        split_rows(*args, why="x")
    assert message in str(e.value)


def test_padding_and_back():
    x = np.arange(2 * 10 * 3).reshape(2, 10, 3).astype(np.float32)
    padded = np.asarray(pad_rows(x, (4, 4, 2)))
    assert padded.shape == (2, 12, 3)
    assert (padded[:, 10:] == 0).all() and (padded[:, 8:10] == x[:, 8:10]).all()
    assert (np.asarray(unpad_rows(padded, (4, 4, 2))) == x).all()


# ------------------------------------------------------------------ exact against single


@functools.cache
def pipeline(model):
    return load_pipeline(model)


@functools.cache
def latent(model, hw, strategy, devices, weights=None, options=(), compute="own"):
    plan = Plan(make_strategy(strategy, **dict(options)), devices, 1, patch_weights=weights,
                uneven_compute=compute)  # fmt: skip
    out = pipeline(model)(
        ["a red bag"], height=hw[0], width=hw[1], steps=3, guidance_scale=5.0, plan=plan, seed=0
    )
    return np.asarray(out.latents)


@pytest.mark.parametrize(
    "model, hw, devices, weights, rows",
    [
        ("fmnist", (32, 32), 3, None, (12, 12, 8)),  # pixel space, 2^2 downsamplings
        ("fmnist", (32, 32), 3, (3, 2, 1), (16, 12, 4)),  # weighted rows
        pytest.param("tiny", (256, 256), 3, (3, 2, 1), (16, 12, 4), marks=SLOW),
        ("tiny-dit", (256, 256), 3, None, (12, 10, 10)),  # 2 x 2 patches
        pytest.param("tiny-flux", (240, 256), 4, None, (8, 8, 8, 6), marks=SLOW),  # 1008² small
        pytest.param("tiny-sd3", (256, 256), 3, None, (12, 10, 10), marks=SLOW),
        pytest.param("tiny-xl", (256, 256), 3, None, (12, 12, 8), marks=SLOW),
    ],
)  # fmt: skip
def test_sync_patch_on_uneven_patches_equals_single(model, hw, devices, weights, rows):
    pipe = pipeline(model)
    plan = Plan(make_strategy("sync_patch"), devices, 1, patch_weights=weights)
    latent_rows = hw[0] // pipe.latent_factor
    assert plan.row_split(latent_rows, pipe.unet) == rows  # what this test runs
    ref = latent(model, hw, "single", 1)
    got = latent(model, hw, "sync_patch", devices, weights)
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.parametrize(
    "model, hw, devices, strategy, options",
    [
        ("tiny-dit", (256, 256), 3, "ring", ()),
        pytest.param("tiny-flux", (240, 256), 4, "ulysses", (), marks=SLOW),
        ("tiny-flux", (240, 256), 4, "ring", (("ulysses_degree", 2),)),  # 2 x 2 hybrid
        pytest.param("tiny", (256, 256), 3, "ring", (), marks=SLOW),  # a UNet's attention
        pytest.param("tiny-dit", (256, 256), 3, "ulysses", (), marks=SLOW),
    ],
)  # fmt: skip
def test_ring_and_ulysses_on_uneven_patches_equal_single(model, hw, devices, strategy, options):
    """Each block of keys that travels carries its patches' own tokens' mask."""
    ref = latent(model, hw, "single", 1)
    got = latent(model, hw, strategy, devices, None, options)
    assert rel_err(got, ref) <= 1e-4


STALE = [
    ("distrifusion", ()),
    # whole neighbour K/V sent, cropped at the sender's own tokens
    pytest.param("pcpp", (), marks=SLOW),
    ("pcpp", (("send", "band"), ("align", "rows"), ("portion", 0.5))),  # the band alone
]
BAND = (("send", "band"), ("align", "rows"), ("portion", 0.5))
STALE_STEADY = [  # the default tier runs DistriFusion's; the bands' in the slow tier
    ("distrifusion", ()),
    pytest.param("pcpp", (), marks=SLOW),
    pytest.param("pcpp", BAND, marks=SLOW),
]


@pytest.mark.parametrize("strategy, options", STALE)
@pytest.mark.parametrize("model", ["fmnist", pytest.param("tiny-dit", marks=SLOW)])
def test_stale_strategies_with_warmup_over_every_step_equal_sync_patch(model, strategy, options):
    hw = (32, 32) if model == "fmnist" else (256, 256)
    exact = latent(model, hw, "sync_patch", 3)
    stale = latent(model, hw, strategy, 3, None, (("warmup_steps", 2), *options))
    assert rel_err(stale, exact) <= 1e-4


@pytest.mark.parametrize("strategy, options", STALE_STEADY)
def test_the_stale_phase_on_uneven_patches_stays_close(strategy, options):
    """The stale phase reads each patch's own rows (a band: the last own tokens of the patch
    above): one stale step of three stays within a few percent of the exact run."""
    exact = latent("fmnist", (32, 32), "sync_patch", 3)
    stale = latent("fmnist", (32, 32), strategy, 3, None, (("warmup_steps", 1), *options))
    assert np.isfinite(stale).all()
    assert rel_err(stale, exact) < 0.05


@SLOW
def test_a_halo_under_the_padding_fails_the_contract(monkeypatch):
    """The check above can fail: the rows from below placed under the slab's padding rather
    than under its patch's last row give another image."""
    import jax.numpy as jnp

    from patchpar.parallel.sites.halo import Halo

    monkeypatch.setattr(Halo, "_around", lambda self, x, buf, top: jnp.concatenate(
        [buf[:, :top], x, buf[:, top:]], axis=1))  # fmt: skip
    latent.cache_clear()
    try:
        plan = Plan(make_strategy("sync_patch"), 3, 1)
        out = pipeline("fmnist")(["a bag"], height=32, width=32, steps=2, guidance_scale=5.0,
                                 plan=plan, seed=0)  # fmt: skip
        ref = pipeline("fmnist")(["a bag"], height=32, width=32, steps=2, guidance_scale=5.0,
                                 seed=0)  # fmt: skip
        assert rel_err(out.latents, ref.latents) > 1e-2
    finally:
        latent.cache_clear()


# ------------------------------------------------------- compute in proportion to own rows


@pytest.mark.parametrize(
    "model, hw, devices, weights, strategy, options",
    [
        ("tiny-dit", (256, 256), 3, (1, 2, 1), "distrifusion", ()),
        ("tiny-dit", (256, 256), 3, None, "pcpp", (("send", "band"),)),
        pytest.param("tiny-flux", (240, 256), 4, (1, 2, 1, 1), "pcpp", (), marks=SLOW),
        pytest.param("tiny-sd3", (256, 256), 3, (2, 1, 1), "distrifusion", (), marks=SLOW),
        # a link (extrapolated K/V, exact codec): its bases kept on the padded K/V
        ("tiny-dit", (256, 256), 3, (1, 2, 1), "distrifusion", (("extrapolate", 0.5),)),
    ],
)  # fmt: skip
def test_own_rows_compute_equals_the_padded_slabs(model, hw, devices, weights, strategy, options):
    """The steady phase of a stale DiT/MMDiT computes each device's own rows alone (a branch
    per patch size): the same image as padded slabs, every step stale."""
    args = (model, hw, strategy, devices, weights, (("warmup_steps", 0), *options))
    own, padded = latent(*args), latent(*args, compute="padded")
    assert rel_err(own, padded) <= 1e-5
    # every step stale: not the exact image (beyond the exact strategies' tolerance)
    assert rel_err(own, latent(model, hw, "sync_patch", devices, weights)) > 1e-4


def steady_hlo(model, plan, hw):
    import jax
    import jax.numpy as jnp

    from patchpar.models.presets import abstract_denoiser
    from patchpar.parallel.engine import abstract_inputs, make_step

    unet = abstract_denoiser(model, jnp.float32)
    params, (x, t, cond) = unet.abstract_params(), abstract_inputs(unet, hw, 1)
    mesh = plan.mesh()
    warm = make_step(unet, plan, "warmup", "row", 5.0, mesh)
    state = jax.eval_shape(warm, params, x, t, cond, None)[1]
    step = make_step(unet, plan, "steady", "row", 5.0, mesh)
    return jax.jit(step).lower(params, x, t, cond, state).as_text()


def test_own_rows_compute_branches_where_no_collective_runs_inside_the_call():
    """A branch per patch size in a DiT's packed steady phase; none in the warm-up (its K/V
    gather runs inside), none in a UNet's (its first conv's halo is exchanged fresh) and none
    with `uneven_compute=padded`; by default (`auto`) only where patch weights are given."""
    weights = (1, 2, 1)
    stale = make_strategy("distrifusion", warmup_steps=1)
    assert "case" in steady_hlo("tiny-dit", Plan(stale, 3, patch_weights=weights), (32, 32))
    padded = Plan(stale, 3, patch_weights=weights, uneven_compute="padded")
    assert "case" not in steady_hlo("tiny-dit", padded, (32, 32))
    # auto: own rows where weights say the devices differ, not on the most even split
    assert "case" not in steady_hlo("tiny-dit", Plan(stale, 3), (32, 32))
    assert "case" in steady_hlo("tiny-dit", Plan(stale, 3, uneven_compute="own"), (32, 32))
    assert "case" not in steady_hlo("tiny", Plan(stale, 3, patch_weights=weights), (32, 32))
    coded = make_strategy("distrifusion", warmup_steps=1, codec="int8")  # encoded in the branch
    assert "case" in steady_hlo("tiny-dit", Plan(coded, 3, patch_weights=weights), (32, 32))


def test_a_codec_that_mixes_tokens_codes_no_padding():
    """Low-rank K/V mixes every token of a payload: padded slabs code their K/V with the
    padding rows zeroed, as own-row compute pads them, so 8 steps of the two agree (2e-7
    measured; coded with the padding rows' own values, 1.5e-4)."""

    def run(compute):
        plan = Plan(make_strategy("distrifusion", warmup_steps=1, codec="kv=lowrank-1"), 3,
                    patch_weights=(1, 2, 1), uneven_compute=compute)  # fmt: skip
        out = pipeline("tiny-dit")(["a red bag"], height=256, width=256, steps=8,
                                   guidance_scale=5.0, plan=plan, seed=0)  # fmt: skip
        return np.asarray(out.latents)

    assert rel_err(run("own"), run("padded")) <= 1e-5


# ----------------------------------------------------------------------- bytes, padding


def test_hlo_bytes_equal_the_analytic_model_and_the_padding_is_counted_apart():
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser("tiny-dit", jnp.float32)
    plan = Plan(make_strategy("distrifusion", warmup_steps=1), 3)
    r = measure(unet, plan, (32, 32), batch=1, flops=False)
    rows = plan.row_split(32, unet)  # (12, 10, 10): slabs of 12 rows, 6 x 16 tokens
    assert rows == (12, 10, 10)
    # a UNet's halos, statistics and K/V on 12, 8, 8, 4 rows (4 devices: a ring all-reduce of 3
    # devices moves 4/3 of its bytes, which a packed exchange rounds once, the sites each)
    weighted = Plan(make_strategy("distrifusion", warmup_steps=1), 4, patch_weights=(3, 2, 2, 1))
    conv = measure(abstract_denoiser("tiny", jnp.float32), weighted, (32, 32), 1, flops=False)
    for phase in ("warmup", "steady"):
        p = conv["phases"][phase]
        assert p["analytic_matches_hlo"] and 0 < p["padding"]["all"]["max"] < p["hlo"]["kv"]["max"]
        assert set(p["padding"]) == {"all", "kv"}
    for phase in ("warmup", "steady"):
        p = r["phases"][phase]
        assert p["analytic_matches_hlo"]
        kv = p["hlo"]["kv"]["max"]  # every device receives the two other slabs
        # device 0 receives slabs 1 and 2, each 2 of its 12 rows padding (1/6 of the bytes);
        # devices 1 and 2 one such slab and device 0's, which has none (1/12)
        assert p["padding"]["kv"]["max"] == kv // 6
        assert p["padding"]["kv"]["total"] == kv // 6 + 2 * (kv // 12)
        assert p["padding"]["all"] == p["padding"]["kv"]  # halos and statistics are all image


@pytest.mark.parametrize(
    "strategy, share",
    [
        # Ulysses on 3: each all-to-all piece from a 10-row patch is 1/6 padding; device 0
        # receives two such pieces of Q, K and V (its own output's pieces have none): 1/8
        ("ulysses", 8),
        # Ring on 3: device 0's two blocks are the 10-row patches' (1/6 padding each)
        ("ring", 6),
    ],
)
def test_context_parallel_padding_is_counted_apart(strategy, share):
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser("tiny-dit", jnp.float32)
    r = measure(unet, Plan(make_strategy(strategy), 3), (32, 32), batch=1, flops=False)
    p = r["phases"]["steady"]
    assert p["analytic_matches_hlo"]
    kv = p["hlo"]["kv"]["max"]  # every device the same
    assert p["padding"]["kv"]["max"] == kv // share
    assert p["padding"]["kv"]["total"] == kv // 3  # 32 padding tokens of 96 per slab, 2 slabs


def test_comm_reports_the_padding_apart(capsys):
    args = ["comm", "--model.name", "tiny-dit", "--strategy", "distrifusion", "--devices", "3",
            "--resolution", "256", "--no-memory"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    import json

    rec = json.loads(capsys.readouterr().out)
    kv = rec["steady_by_site"]["kv"]["max"]  # 12, 10, 10 rows: device 0 receives two 1/6-padded
    assert rec["steady_padding"]["kv"]["max"] == kv // 6 > 0
    assert main(args) == 0
    assert "padding rows (most on one)" in capsys.readouterr().out


def test_pcpp_sends_padding_only_with_whole_neighbour_kv():
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser("tiny-dit", jnp.float32)
    for send, padded in (("full", True), ("band", False)):
        plan = Plan(make_strategy("pcpp", warmup_steps=1, send=send), 3)
        p = measure(unet, plan, (32, 32), batch=1, flops=False)["phases"]["steady"]
        assert p["analytic_matches_hlo"]
        if not padded:  # the bands are own tokens
            assert "kv" not in p["padding"]
            continue
        # device 1 receives its two neighbours' whole slabs (the most), the 10-row patch's
        # 1/6 padding; devices 0 and 2 one slab each, device 1's (1/6 padding)
        whole = p["hlo"]["kv"]["max"] // 2
        assert p["padding"]["kv"]["max"] == whole // 6
        assert p["padding"]["kv"]["total"] == 3 * (whole // 6)


@pytest.mark.slow
def test_naive_patches_of_uneven_rows_are_each_their_own_image():
    """naive_patch on 12, 12, 8 rows: each device denoises its own rows alone, as a whole
    image (nothing of the padding), so each slab equals one device's run on those rows."""
    pipe = pipeline("fmnist")
    x0 = pipe.initial_latents(1, 32, 32, 0)
    run = dict(steps=3, guidance_scale=2.0, latents=x0)
    plan = Plan(make_strategy("naive_patch"), 3, 1)
    got = np.asarray(pipe(["a bag"], height=32, width=32, plan=plan, **run).latents)
    at = 0
    for r in (12, 12, 8):
        one = dict(run, latents=x0[:, at : at + r])
        ref = np.asarray(pipe(["a bag"], height=r, width=32, **one).latents)
        assert rel_err(got[:, at : at + r], ref) <= 1e-4
        at += r


# ---------------------------------------------------------------------- compressed exchange


def test_compressed_exchange_on_uneven_patches_without_a_codec_is_sync_patch():
    """CompactFusion's exchange on 12, 12, 8 rows, its links' bases kept on padded payloads."""
    exact = latent("fmnist", (32, 32), "sync_patch", 3)
    plain = latent("fmnist", (32, 32), "compact", 3, None, (("codec", "kv=none,halo=none"),))
    assert rel_err(plain, exact) <= 1e-4


@SLOW
def test_compressed_exchange_on_uneven_patches_is_compressed_and_stays_close():
    """With a codec it is compressed (not exact) and stays close, its padding zero before it
    is coded."""
    exact = latent("fmnist", (32, 32), "sync_patch", 3)
    coded = latent("fmnist", (32, 32), "compact", 3, None, (("codec", "kv=int8,halo=int8"),))
    assert np.isfinite(coded).all()
    assert 1e-6 < rel_err(coded, exact) < 0.05


# --------------------------------------------------------------------------- refused


def test_naive_patches_of_uneven_rows_refuse_collectives_inside_the_call(tmp_path, capsys):
    args = ["generate", "--model", "fmnist", "--devices", "4", "--height", "36", "--width",
            "32", "--strategy", "naive_patch", "--fsdp", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "uneven patches (12, 8, 8, 8 latent rows) with strategy 'naive_patch': each" in err


def test_bad_weights_from_the_command_line(tmp_path, capsys):
    base = ["generate", "--model", "fmnist", "--devices", "3", "--strategy", "sync_patch",
            "--out", str(tmp_path)]  # fmt: skip
    for weights, message in [
        ("1,1", "patch_weights=1,1: 2 weight(s) for 3 patch devices"),
        ("1,x,1", "patch_weights='1,x,1': 'x' is not a number"),
        ("1,0,1", "0.0 is not a positive number"),
        ("20,20,1", "fewer than its minimum of 4"),
    ]:
        assert main([*base, "--patch-weights", weights]) == 2
        errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
        assert len(errors) == 1 and message in errors[0], errors
    run = ["run", "--model.name", "fmnist", "--mesh.devices", "3", "--strategy.name",
           "sync_patch", "--mesh.patch-weights", "1,1", "--results", str(tmp_path)]  # fmt: skip
    assert main(run) == 2
    assert "mesh.patch_weights=1,1: 2 weight(s)" in capsys.readouterr().err
    assert main([*base, "--uneven-compute", "some"]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert (
        len(errors) == 1 and "uneven_compute='some'; known: ['auto', 'own', 'padded']" in errors[0]
    )


def test_the_split_is_said_in_one_line(capsys):
    plan = Plan(make_strategy("sync_patch"), 3, 1)
    pipeline("fmnist")(["a bag"], height=32, width=32, steps=1, plan=plan, log=print)
    out = capsys.readouterr().out
    assert "latent rows=32 over 3 patch devices: 12, 12, 8 rows" in out


def test_weights_whose_shares_round_below_one_unit_in_floating_point():
    assert split_rows(52, 3, 4, (0.1, 1.1, 0.1)) == (4, 44, 4)  # shares 1, 11, 1 units exactly


def test_weights_where_no_rows_are_split_are_refused():
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser("tiny-dit")
    plan = Plan(make_strategy("asyncdiff", warmup_steps=1), 3, patch_weights=[3, 2, 1])
    assert plan.patch_weights == (3, 2, 1)  # hashable, as a static jit argument must be
    with pytest.raises(ValueError, match=r"patch_weights=3,2,1: strategy 'asyncdiff' on 3 patch"):
        plan.validate(unet, (32, 32), 4, 4.5)


@pytest.mark.slow
def test_bytes_of_a_cached_step_a_cfg_split_and_an_mmdits_joint_attention():
    """A cache's decision (its all-reduce of sums) has no padding; with cfg=2 the guided
    output's gather moves the padded slab; an MMDiT's image Q/K/V travel padded through
    Ulysses (its text heads do not)."""
    import jax.numpy as jnp

    from patchpar.measure.cost import measure
    from patchpar.models.presets import abstract_denoiser
    from patchpar.sampling.cache import make_cache

    dit = abstract_denoiser("tiny-dit", jnp.float32)
    cached = Plan(make_strategy("sync_patch"), 2, cache=make_cache("fbcache"))
    p = measure(dit, cached, (32, 32), batch=1, flops=False)["phases"]["warmup"]
    assert p["analytic_matches_hlo"] and p["padding"]["all"]["max"] == 0
    halves = Plan(make_strategy("sync_patch"), 6, cfg=2)  # 3 patches of 12, 10, 10 rows
    p = measure(dit, halves, (32, 32), batch=1, flops=False)["phases"]["warmup"]
    assert p["analytic_matches_hlo"] and p["hlo"]["cfg"]["max"] > 0
    flux = abstract_denoiser("tiny-flux", jnp.float32)
    p = measure(flux, Plan(make_strategy("ulysses"), 4), (30, 32), batch=1, flops=False)
    p = p["phases"]["warmup"]
    assert p["analytic_matches_hlo"] and 0 < p["padding"]["kv"]["max"] < p["hlo"]["kv"]["max"]
