"""Compressed and extrapolated exchange (docs/design.md §2b): the codecs' payloads and their
sizes, sender and receiver bases bit-identical at every step (error feedback), HLO bytes equal
the analytic model for every codec, packed equals per-site, the exact limits, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import GUIDANCE, inputs, micro_unet, rounding

from patchpar.measure.cost import measure
from patchpar.parallel.codecs import NAMES, pack, parse, unpack
from patchpar.parallel.engine import Plan, denoise, make_step, state_template
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

SLOW = pytest.mark.slow
CODECS = ("int8", "fp8", "fp8-e5m2", "int4", "int2", "sign1", "lowrank-2")

# ------------------------------------------------------------------------------- the codecs


def _activation(shape=(2, 3, 40, 16), seed=0):
    return jnp.asarray(np.random.RandomState(seed).laplace(size=shape), jnp.float32)


@pytest.mark.parametrize("name", CODECS)
def test_a_payload_is_uint8_of_the_size_the_model_counts(name):
    codec = parse(name)
    x = _activation()
    for lead in (1, 2):
        payload, _ = codec.encode(x, lead, codec.init_state(x.shape, lead))
        assert payload.dtype == jnp.uint8 and payload.ndim == 1
        assert payload.size == codec.payload_bytes(x.shape, 4, lead)
        assert codec.decode(payload, x.shape, jnp.float32, lead).shape == x.shape
    # against float32: 4.0x (int8 + scales) down to ~25x (sign1 + rank-1 scales) here
    assert codec.payload_bytes(x.shape, 4, 2) < x.size * 4 / 3.5


def test_codecs_lose_less_with_more_bits():
    x = _activation()
    err = {}
    for name in ("int8", "int4", "int2", "sign1"):
        codec = parse(name)
        y = codec.decode(codec.encode(x, 2)[0], x.shape, jnp.float32, 2)
        err[name] = float(jnp.linalg.norm(y - x) / jnp.linalg.norm(x))
    assert err["int8"] < 0.01 < err["int4"] < err["int2"] < err["sign1"] < 0.75, err


def test_lowrank_reproduces_a_matrix_of_its_rank():
    rng = np.random.RandomState(3)
    x = jnp.asarray(rng.randn(2, 1, 40, 2) @ rng.randn(2, 1, 2, 16), jnp.float32)  # rank 2
    codec = parse("lowrank-2")
    payload, q = codec.encode(x, 2, codec.init_state(x.shape, 2))
    y = codec.decode(payload, x.shape, jnp.float32, 2)
    np.testing.assert_allclose(y, x, atol=2e-2 * float(jnp.abs(x).max()))  # float16 factors
    assert q.shape == (2, 16, 2)  # the warm start for the next step


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_and_unpack_are_inverse(bits):
    codes = jnp.asarray(np.random.RandomState(bits).randint(0, 2**bits, size=(37,)), jnp.uint8)
    packed = pack(codes, bits)
    assert packed.size == -(-37 * bits // 8)
    np.testing.assert_array_equal(unpack(packed, bits, 37), codes)


@pytest.mark.parametrize("name", CODECS)
def test_a_zero_payload_decodes_to_zeros(name):
    """What an edge device receives from no neighbour is zeros: it must stay zero padding."""
    codec = parse(name)
    shape = (1, 4, 8, 16)
    zero = jnp.zeros(codec.payload_bytes(shape, 4, 1), jnp.uint8)
    np.testing.assert_array_equal(codec.decode(zero, shape, jnp.float32, 1), 0)


# ------------------------------------------------------- sender and receiver bases, every step


def _steps(strategy, options, patch, steps=4):
    """The stale state after every step of a run of the micro SD UNet (warm-up step 0, then
    steady steps; the latent moves by a fixed rule, the bases' bookkeeping does not care)."""
    unet, params = micro_unet("sd")
    x, t, cond = inputs("sd")
    plan = Plan(make_strategy(strategy, warmup_steps=0, **options), patch, 1)
    mesh = plan.mesh()
    warm = jax.jit(make_step(unet, plan, "warmup", "row", GUIDANCE, mesh))
    steady = jax.jit(make_step(unet, plan, "steady", "row", GUIDANCE, mesh))
    out, state = warm(params, x, t, cond, None)
    states = [state]
    for _ in range(steps - 1):
        x = x - 0.1 * out
        out, state = steady(params, x, t, cond, state)
        states.append(state)
    return [jax.tree.map(np.asarray, s) for s in states]


def _bases(state):
    """{(module path, link variable): value with the patch axis first}."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = path[-1].key
        if name.startswith("cx_"):
            out[(tuple(p.key for p in path[:-1]), name)] = leaf[0, 0, :, 0]  # (patch, ...)
    return out


def _assert_bases_identical(state, n):
    """Every device's base of device p's payload equals device p's own, bit for bit."""
    bases = _bases(state)
    checked = 0
    for (path, name), value in bases.items():
        kind_c, what = name.rsplit("_", 1)
        if what != "base":
            continue
        c = kind_c.split("_")[-1]
        sent = bases[(path, f"{kind_c}_sent")]
        if c == "gather":  # every device holds every patch's: all the same, own slot = sent
            for p in range(n):
                np.testing.assert_array_equal(value[p], value[0])
                np.testing.assert_array_equal(value[0][p], sent[p])
        elif c == "other":
            np.testing.assert_array_equal(value[1], sent[0])
            np.testing.assert_array_equal(value[0], sent[1])
        elif c == "down":  # device p + 1 holds what device p sent down
            for p in range(n - 1):
                np.testing.assert_array_equal(value[p + 1], sent[p])
        else:  # up: device p - 1 holds what device p sent up
            for p in range(1, n):
                np.testing.assert_array_equal(value[p - 1], sent[p])
        checked += 1
    return checked


@pytest.mark.parametrize(
    "strategy, options, patch",
    [
        pytest.param("distrifusion", {"codec": "kv=int2,halo=int8"}, 2, marks=SLOW),
        pytest.param(
            "pcpp", {"codec": "kv=sign1,halo=int4", "send": "band", "portion": 0.3}, 4, marks=SLOW
        ),
        # uneven patches (8, 4, 4 rows): the band below the above patch's own tokens
        ("pcpp", {"codec": "kv=int4,halo=int8", "send": "band", "portion": 0.3}, 3),
        pytest.param("distrifusion", {"codec": "kv=lowrank-2,halo=int2"}, 3, marks=SLOW),
        pytest.param("compact", {"codec": "kv=int4,halo=sign1"}, 4, marks=SLOW),
        pytest.param("distrifusion", {"codec": "kv=lowrank-2,halo=int2"}, 4, marks=SLOW),
        pytest.param("pcpp", {"codec": "kv=int8,halo=int2", "send": "full"}, 2, marks=SLOW),
        pytest.param("compact", {"codec": "kv=sign1,halo=lowrank-1"}, 2, marks=SLOW),
        pytest.param(
            "distrifusion",
            {"codec": "kv=sign1,halo=sign1", "comm_groups": "per_site"},
            8,
            marks=SLOW,
        ),
    ],
)
def test_sender_and_receiver_bases_are_bit_identical_at_every_step(strategy, options, patch):
    states = _steps(strategy, options, patch)
    sites = {_assert_bases_identical(s, patch) for s in states}
    assert len(sites) == 1 and sites.pop() > 10  # every halo and K/V site, every step
    # and the bases move: the compressed residuals are not all zero
    first, last = _bases(states[1]), _bases(states[-1])
    assert any(not np.array_equal(first[k], last[k]) for k in first if k[1].endswith("_base"))


@SLOW
def test_without_error_feedback_the_sender_does_not_follow_its_receivers():
    """residual='plain': receivers accumulate decoded residuals, the sender keeps its own
    activation, so the two drift apart (CompactFusion's 'no error feedback' curve)."""
    state = _steps("distrifusion", {"codec": "kv=sign1,halo=sign1", "residual": "plain"}, 2)[-1]
    with pytest.raises(AssertionError):
        _assert_bases_identical(state, 2)


# ------------------------------------------------------------------------- the whole run


@functools.cache
def _run(strategy, options, patch, steps=4, kind="sd"):
    unet, params = micro_unet(kind)
    x, _, cond = inputs(kind, batch=2)
    plan = Plan(make_strategy(strategy, **dict(options)), patch, 1)
    plan.validate(unet, x.shape[1:3], steps, GUIDANCE, batch=2)
    smp = get_sampler("dpmpp_2m")
    out, state = denoise(
        unet, plan, smp, params, cond, smp.schedule(SchedulerConfig(), steps), x, GUIDANCE
    )
    return np.asarray(out), jax.tree.map(np.asarray, state)


def _err(strategy, patch, **options):
    ref, _ = _run("sync_patch", (), patch)
    out, _ = _run(strategy, tuple(sorted({"warmup_steps": 0, **options}.items())), patch)
    return float(np.abs(out - ref).max())


@SLOW
def test_compact_without_a_codec_is_sync_patch():
    assert _err("compact", 4, codec="kv=none,halo=none") <= 1e-4


@SLOW
def test_compact_gets_closer_to_exact_with_more_bits_and_with_error_feedback():
    int8, sign1 = _err("compact", 4, codec="kv=int8,halo=int8"), _err("compact", 4, codec="sign1")
    no_residual = _err("compact", 4, codec="sign1", residual="none")
    assert int8 < 0.2 * sign1, (int8, sign1)
    assert sign1 < no_residual, (sign1, no_residual)
    assert int8 > 1e-6  # it is compressed


def test_codec_none_and_no_extrapolation_are_todays_distrifusion_bit_for_bit():
    plain, _ = _run("distrifusion", (("warmup_steps", 0),), 2)
    same, _ = _run(
        "distrifusion", (("codec", "none"), ("extrapolate", 0.0), ("warmup_steps", 0)), 2
    )
    np.testing.assert_array_equal(same, plain)


@SLOW
def test_extrapolation_changes_a_stale_run_and_an_exact_warm_up_leaves_it_exact():
    assert _err("distrifusion", 2, extrapolate=0.5) != _err("distrifusion", 2)
    ref, _ = _run("sync_patch", (), 2)
    out, _ = _run("distrifusion", (("extrapolate", 1.0), ("warmup_steps", 3)), 2)
    np.testing.assert_allclose(out, ref, atol=1e-4)


@pytest.mark.parametrize(
    "strategy, options, patch, groups",
    [
        pytest.param("pcpp", {"codec": "kv=sign1,halo=int4", "send": "band"}, 2, (1,), marks=SLOW),
        pytest.param("distrifusion", {"codec": "kv=int2,halo=int8"}, 4, (1, 2), marks=SLOW),
        pytest.param(
            "distrifusion", {"codec": "lowrank-1", "extrapolate": 0.5}, 2, (1, 2), marks=SLOW
        ),
    ],
)
def test_compressed_packed_equals_per_site(strategy, options, patch, groups):
    """The final latent within float32 rounding (`rounding`), as uncompressed packing's
    (test_parallel_exchange.py): the exchange only moves the codes, but the two programs'
    compute is compiled apart, and bit identity holds only where XLA compiles them alike (with
    XLA:CPU's older loop emitters at -O0, lowrank-1 with extrapolation lands 1.9e-5 from the
    per-site latent after 4 steps, 0.04 of the bound; bit for bit with XLA's default flags).
    The stale buffers' values are not compared (their shapes are): a coded one is a quantizer's
    output, and an ulp that crosses a level moves an element by a whole step (134 x `reordered` after 2 steps at
    int2). A packing off by one element fails that bound on the uncompressed exchange by
    orders of magnitude (test_parallel_exchange.py::test_a_packing_off_by_one_element_fails)."""
    opts = {"warmup_steps": 0, **options}
    per_site = tuple(sorted({**opts, "comm_groups": "per_site"}.items()))
    ref, ref_state = _run(strategy, per_site, patch)
    for g in groups:
        out, state = _run(strategy, tuple(sorted({**opts, "comm_groups": g}.items())), patch)
        assert np.abs(out - ref).max() <= rounding(ref)
        assert jax.tree.map(np.shape, state) == jax.tree.map(np.shape, ref_state)
    sync, _ = _run("sync_patch", (), patch)
    assert np.abs(ref - sync).max() > 100 * rounding(ref)  # coded and stale: far from exact


# ------------------------------------------------------------------ bytes: HLO == analytic


@pytest.mark.parametrize(
    "strategy, options, patch",
    [
        ("distrifusion", {"codec": "kv=int8,halo=int4"}, 4),
        pytest.param("distrifusion", {"codec": "kv=fp8,halo=fp8-e5m2"}, 2, marks=SLOW),
        pytest.param("pcpp", {"codec": "kv=sign1,halo=int2", "send": "band"}, 2, marks=SLOW),
        pytest.param("compact", {"codec": "kv=lowrank-2,halo=sign1"}, 4, marks=SLOW),
        ("compact", {"codec": "kv=int8,halo=int4"}, 3),  # uneven patches: 8, 4, 4 rows
        pytest.param("pcpp", {"codec": "kv=int2,halo=lowrank-1", "send": "full"}, 4, marks=SLOW),
        pytest.param("compact", {"codec": "kv=int4,halo=int8"}, 2, marks=SLOW),
        pytest.param("distrifusion", {"codec": "sign1", "extrapolate": 0.5}, 8, marks=SLOW),
    ],
)
def test_hlo_bytes_equal_the_analytic_model_for_every_codec(strategy, options, patch):
    unet, params = micro_unet("sd")
    r = measure(
        unet,
        Plan(make_strategy(strategy, **options), patch, 1),
        (16, 16),
        params=params,
        flops=False,
    )
    for phase in ("warmup", "steady"):
        entry = r["phases"][phase]
        assert entry["hlo"] == entry["analytic"], (phase, entry["hlo"], entry["analytic"])
    exact = make_strategy(strategy, codec="none")
    plain = measure(unet, Plan(exact, patch, 1), (16, 16), params=params, flops=False)
    steady, full = (x["phases"]["steady"]["hlo"]["kv"]["max"] for x in (r, plain))
    assert steady < full / 3  # compressed on the wire, as the compiled program sends it
    assert r["phases"]["warmup"]["hlo"] == plain["phases"]["warmup"]["hlo"]  # warm-up exact


def test_a_compressed_steady_step_sends_uint8_payloads():
    from patchpar.measure.comm import hlo_text_with_metadata

    unet, params = micro_unet("sd")
    x, t, cond = inputs("sd")
    plan = Plan(make_strategy("distrifusion", codec="kv=int2,halo=int2"), 4, 1)
    state = state_template(unet, plan, GUIDANCE, plan.mesh(), params, x, cond)
    step = make_step(unet, plan, "steady", "row", GUIDANCE, plan.mesh())
    text = hlo_text_with_metadata(jax.jit(step).lower(params, x, t, cond, state))
    lines = [ln for ln in text.splitlines() if "all-gather(" in ln or "collective-permute(" in ln]
    kv_halo = [ln for ln in lines if "pp_kv" in ln or "pp_halo" in ln]
    assert kv_halo and all(
        "u8[" in ln.split("=")[1].split("(")[0] for ln in kv_halo if "conv_in" not in ln
    )


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "options, match",
    [
        ({"codec": "int3"}, r"unknown codec 'int3'; known: \['none', 'int8', .*'lowrank-r'\]"),
        ({"codec": "lowrank-0"}, r"rank r of lowrank-r must be >= 1, got 0"),
        ({"codec": "lowrank--2"}, r"rank r of lowrank-r must be >= 1, got -2"),
        ({"codec": "gn=int8"}, r"GroupNorm statistics stay exact.*\['kv', 'halo'\]"),
        ({"codec": "kv=int8,attn=int2"}, r"unknown site kind 'attn'"),
        ({"extrapolate": 1.5}, r"extrapolate=1.5 must be in \[0.0, 1.0\]"),
        ({"extrapolate": -0.1}, r"extrapolate=-0.1 must be in"),
        ({"residual": "error"}, r"residual='error'; known: \['ef', 'plain', 'none'\]"),
        ({"codec": "int2", "no_sync": True, "gn": "separate"}, r"nothing to compress"),
    ],
)
def test_bad_compression_options_are_errors_naming_what_fits(options, match):
    with pytest.raises(ValueError, match=match):
        make_strategy("distrifusion", **options)


def test_compression_on_a_strategy_that_exchanges_nothing_says_why():
    with pytest.raises(ValueError, match=r"naive_patch .* exchange nothing"):
        make_strategy("naive_patch", codec="int2")
    with pytest.raises(ValueError, match=r"compact uses this step's"):
        make_strategy("compact", extrapolate=0.5)


def test_a_rank_larger_than_the_matrices_names_their_shape():
    unet, params = micro_unet("sd")
    plan = Plan(make_strategy("compact", codec="lowrank-64"), 2, 1)
    with pytest.raises(ValueError, match=r"compresses \d+ x \d+ matrices .* r <= \d+"):
        measure(unet, plan, (16, 16), params=params, flops=False)


def test_every_codec_name_parses():
    for name in NAMES:
        parse(name.replace("-r", "-3"))


# ------------------------------------------------------------------------------- on a DiT


@pytest.mark.parametrize(
    "name, options",
    [
        ("compact", {"codec": "int2"}),
        pytest.param("distrifusion", {"codec": "sign1", "extrapolate": 0.5}, marks=SLOW),
        pytest.param("pcpp", {"codec": "lowrank-2", "send": "band", "align": "rows"}, marks=SLOW),
    ],
)
def test_compressed_exchange_on_a_dit(name, options):
    """A DiT's one site (K/V) compressed: HLO bytes equal the analytic model, sent as uint8,
    and the run (1 exact step, then compressed ones) differs from sync_patch but not by much."""
    from test_parallel_dit import _sample, inputs, max_diff, micro_dit

    fn, params = micro_dit()
    x, _, _ = inputs()
    rec = measure(fn, Plan(make_strategy(name, **options), 4), x.shape[1:3], batch=2, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    steady, warm = (rec["phases"][p]["hlo"]["kv"]["max"] for p in ("steady", "warmup"))
    assert 0 < steady < warm / 3
    sync, _ = _sample("sync_patch", 4)
    out, state = _sample(name, 4, warmup_steps=0, **options)
    assert 1e-5 < max_diff(out, sync) < 0.5 * float(np.abs(sync).max())
    names = {p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert any(n.startswith("cx_kv_") for n in names), names
