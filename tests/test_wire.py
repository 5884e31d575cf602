"""fp8 (and int8) on the wire of the exact strategies (`wire`: `codecs.to_rows`, one scale per
token): the codes round as the format does and never overflow; a coded all-to-all or ring
equals the exact one on the coded tensors; on micro models every strategy's HLO bytes equal the
analytic model, and bad input is a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from patchpar.models.attention import AttentionSpec, attend
from patchpar.parallel.codecs import FP8, from_rows, parse, rows_bytes, to_rows
from patchpar.parallel.engine import Plan
from patchpar.parallel.mesh import PATCH, make_mesh
from patchpar.parallel.sites.context import context_attention
from patchpar.parallel.strategies import make_strategy

XLA = AttentionSpec("xla")


def rt(x, codec, heads=None):
    """x coded and decoded (per row of the last axis; with `heads`, per head of (.., H*D))."""
    if heads is None:
        return from_rows(to_rows(x, codec), codec, x.dtype)
    y = x.reshape(x.shape[:-1] + (heads, -1))
    return from_rows(to_rows(y, codec), codec, x.dtype).reshape(x.shape)


@pytest.mark.parametrize("name, mantissa", [("fp8", 3), ("fp8-e5m2", 2), ("int8", None)])
def test_rows_round_as_the_format_and_never_overflow(name, mantissa):
    codec = parse(name)
    x = jax.random.normal(jax.random.key(0), (3, 7, 64)) * jnp.logspace(-3, 3, 64)
    x = x.at[0, 0, 0].set(3e37)  # beyond float16 (and e4m3 x float16) by far
    w = to_rows(x, codec)
    assert w.dtype == jnp.uint8 and w.shape == (3, 7, 66)
    assert rows_bytes(x.shape, 4, codec) == w.size
    y = from_rows(w, codec, jnp.float32)
    assert bool(jnp.isfinite(y).all())
    top = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    err = jnp.abs(y - x)
    if mantissa is None:  # int8: half a step of the row's scale (max / 127, rounded up)
        assert bool((err <= top / 127 * (0.5 + 2**-6)).all())
    else:  # floats: half an ulp of the value, where it is a normal number of the format
        tiny = float(jnp.finfo(FP8[name]).tiny) / float(jnp.finfo(FP8[name]).max)
        normal = jnp.abs(x) >= 2 * tiny * top
        assert bool(normal.sum() > 0.5 * x.size)
        bound = jnp.abs(x) * 2.0 ** -(mantissa + 1) * (1 + 2**-6)
        assert bool(jnp.where(normal, err <= bound, True).all())
    # the link codec (stale strategies' codec layer) carries the same codes
    payload, _ = codec.encode(x, 2)
    if name != "int8":
        assert payload.size == codec.payload_bytes(x.shape, 4, 2)
        np.testing.assert_array_equal(codec.decode(payload, x.shape, jnp.float32, 2), y)


def _sharded(fn, n, *xs):
    mesh = make_mesh(n)
    spec = P(None, PATCH, None)
    return jax.jit(
        jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(xs), out_specs=spec, check_vma=False)
    )(*xs)


def _qkv(n=4, heads=4, d=8, per=6):
    keys = jax.random.split(jax.random.key(3), 3)
    return [jax.random.normal(k, (2, n * per, heads * d)) * 3 for k in keys], heads


@pytest.mark.parametrize("wire", ["fp8", "q=fp8,v=fp8,o=fp8", "k=fp8-e5m2,o=int8"])
def test_coded_ulysses_equals_exact_attention_of_the_coded_tensors(wire):
    """Ulysses codes Q, K, V per token and head before its all-to-all and the output after
    attention: the result is exact attention over the coded Q, K, V, coded itself."""
    (q, k, v), heads = _qkv()
    codecs = make_strategy("ulysses", wire=wire).codecs()
    c = tuple(codecs.get(t) for t in "qkvo")
    got = _sharded(
        lambda q, k, v: context_attention(q, k, v, heads, XLA, 4, 4, codecs=c), 4, q, k, v
    )
    coded = [x if cc is None else rt(x, cc, heads) for x, cc in zip((q, k, v), c, strict=False)]
    exact = attend(XLA, *coded, heads)
    want = exact if c[3] is None else rt(exact, c[3], heads)
    near = np.abs(np.asarray(got - want)) <= 1e-5 * (np.abs(np.asarray(want)) + 1)
    if c[3] is None:
        assert near.all()
    else:  # the output coded after attention: a value that float rounding (the heads apart
        # on 4 devices) moves across a code's edge takes the neighbouring code, one step away
        step = _code_step(exact, c[3], heads)
        assert near.mean() >= 0.99 and bool((jnp.abs(got - want) <= step).all())
    assert float(jnp.abs(got - attend(XLA, q, k, v, heads)).max()) > 1e-3  # it is coded


def _code_step(x, codec, heads):
    """The distance from each value of (B, L, H*D) `x` to the neighbouring code of `codec`
    (per token and head), an upper bound: int8 a step of the row's scale, fp8 an ulp of the
    format at the value, or its smallest normal's."""
    y = x.reshape(x.shape[:-1] + (heads, -1))
    top = jnp.max(jnp.abs(y), axis=-1, keepdims=True) * (1 + 2**-6)  # the scale, rounded up
    if codec.name == "int8":
        return jnp.broadcast_to(top / 127, y.shape).reshape(x.shape)
    fmt = jnp.finfo(FP8[codec.name])
    scale = top / float(fmt.max)
    ulp = jnp.maximum(jnp.abs(y) * 2.0 ** -(fmt.nmant - 1), float(fmt.tiny) * scale)
    return (ulp * (1 + 2**-6)).reshape(x.shape)


def test_coded_ring_attends_its_own_block_exactly_and_the_others_coded():
    (q, k, v), heads = _qkv()
    codec = parse("fp8")
    c = (None, codec, codec, None)
    got = _sharded(
        lambda q, k, v: context_attention(q, k, v, heads, XLA, 4, 1, codecs=c), 4, q, k, v
    )
    per = q.shape[1] // 4
    want = []
    for p in range(4):  # device p: its own K/V exact, the others' coded
        own = np.zeros(q.shape[1], bool)
        own[p * per : (p + 1) * per] = True
        kk, vv = (jnp.where(own[None, :, None], x, rt(x, codec, heads)) for x in (k, v))
        want.append(attend(XLA, q[:, p * per : (p + 1) * per], kk, vv, heads))
    np.testing.assert_allclose(got, jnp.concatenate(want, axis=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "family, name, devices, options",
    [
        pytest.param("pixart", "sync_patch", 4, {"wire": "fp8"}, marks=pytest.mark.slow),
        pytest.param(
            "unet", "sync_patch", 2, {"wire": "kv=fp8-e5m2,halo=int8"}, marks=pytest.mark.slow
        ),
        ("pixart", "ulysses", 4, {"wire": "q=fp8,v=fp8,o=fp8"}),
        pytest.param(
            "unet", "ulysses", 4, {"ring_degree": 2, "wire": "fp8"}, marks=pytest.mark.slow
        ),
        pytest.param("pixart", "ring", 4, {"wire": "fp8"}, marks=pytest.mark.slow),
    ],
)
def test_coded_strategies_count_their_bytes(family, name, devices, options):
    """On micro models: the output is near single (not equal: it is coded), the HLO bytes
    equal the analytic model's, and fewer than the exact strategy's."""
    from test_parallel_dit import max_diff
    from test_quant import _call, _micro

    from patchpar.measure.cost import measure

    fn, params, x, t, cond, scale = _micro(family)
    one = _call(fn, params, x, t, cond, scale)
    got = _call(fn, params, x, t, cond, scale, name, devices, **options)
    rel = max_diff(got, one) / float(np.abs(one).max())
    assert 1e-5 < rel < 0.15, rel
    received = {}
    for opts in ({k: v for k, v in options.items() if k != "wire"}, options):
        plan = Plan(make_strategy(name, **opts), devices)
        rec = measure(fn, plan, x.shape[1:3], batch=2, params=params, flops=False)
        assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
        received["wire" in opts] = rec["phases"]["warmup"]["hlo"]["all"]["max"]
    assert received[True] < 0.8 * received[False], received


@pytest.mark.parametrize(
    "name, wire, message",
    [
        (
            "ulysses",
            "fp16",
            r"ulysses: wire='fp16': unknown codec 'fp16'; the wire takes "
            r"\['none', 'int8', 'fp8', 'fp8-e5m2'\]$",
        ),
        ("sync_patch", "kv=lowrank-0", r"unknown codec 'lowrank-0'; the wire takes \['none', "),
        (
            "ulysses",
            "int2",
            r"ulysses: wire='int2': codec 'int2' keeps state .* \['none', 'int8', 'fp8', 'fp8-e5m2'\]",
        ),
        (
            "ring",
            "x=fp8",
            r"ring: wire='x=fp8': unknown 'x'; ring sends \['q', 'k', 'v', 'o', 'halo'\]",
        ),
        ("sync_patch", "kv=fp8,kv=int8", r"sync_patch: wire='kv=fp8,kv=int8': named twice"),
        ("sync_patch", "q=fp8", r"unknown 'q'; sync_patch sends \['halo', 'kv'\]"),
        ("sync_patch", "", r"wire='': give a codec name"),
    ],
)
def test_bad_wire_is_one_line(name, wire, message):
    with pytest.raises(ValueError, match=message):
        make_strategy(name, wire=wire)


def test_a_pure_ring_sends_no_queries_or_outputs():
    with pytest.raises(ValueError, match=r"ring: wire='q=fp8,v=fp8' codes \['q'\], which only"):
        make_strategy("ring", wire="q=fp8,v=fp8").validate(10, 4, 1)
    make_strategy("ring", ulysses_degree=2, wire="q=fp8,v=fp8").validate(10, 4, 1)


def _family(family):
    """A micro denoiser of `family` (no weights: these checks read shapes) and a latent size
    its patches split."""
    from test_parallel_dit import MICRO as PIXART
    from test_parallel_flux import MICRO as FLUX
    from test_parallel_sd3 import KINDS
    from torch_refs import MICRO_UNETS

    from patchpar.models.family import named

    config = {"flux": FLUX, "sd3": KINDS["dual"], "pixart": PIXART, "unet": MICRO_UNETS["sd"]}
    fn = named(family).denoiser(config[family], "micro", jnp.float32, XLA)
    return fn, (16, 16) if family == "unet" else (16, 12)


@pytest.mark.parametrize(
    "family, name, options, message",
    [
        ("flux", "sync_patch", {"wire": "halo=fp8"}, "sync_patch: wire='halo=fp8': a flux"),
        ("sd3", "ulysses", {"wire": "q=fp8,halo=int8"}, "ulysses: wire='q=fp8,halo=int8': a sd3"),
        ("pixart", "distrifusion", {"codec": "halo=int8"}, "distrifusion: codec='halo=int8': a"),
        ("flux", "compact", {"codec": "kv=int2,halo=int8"}, "compact: codec='kv=int2,halo=int8'"),
    ],
)
def test_a_wire_or_codec_names_only_sites_the_model_has(family, name, options, message):
    """DiTs and MMDiTs exchange attention K/V only: a halo named on the wire or in a codec
    would change nothing, so it is refused, naming the family and what it exchanges; one
    codec for all, or the kinds it has, run."""
    fn, hw = _family(family)
    with pytest.raises(ValueError, match=rf"^{message}.* has no halo site \(it exchanges kv\)"):
        Plan(make_strategy(name, **options), 2).validate(fn, hw, 8, 1.0)
    key = "k" if name == "ulysses" else "kv"
    fits = [{"wire": "fp8"}, {"wire": f"{key}=fp8"}] if "wire" in options else [{"codec": "int2"}]
    for ok in fits:
        Plan(make_strategy(name, **ok), 2).validate(fn, hw, 8, 1.0)


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "unet"])
def test_site_kinds_are_what_the_model_exchanges(family):
    """A UNet's convolutions exchange halos and its attention K/V; a DiT's and an MMDiT's
    attention K/V only (their patch embedding cuts whole tokens)."""
    from patchpar.parallel.checks import site_kinds

    fn, _ = _family(family)
    assert site_kinds(fn) == ({"halo", "kv"} if family == "unet" else {"kv"})


def test_a_unet_takes_halos_and_kv_on_the_wire_or_in_a_codec():
    fn, hw = _family("unet")
    for name, options in (("sync_patch", {"wire": "halo=fp8"}), ("ring", {"wire": "halo=int8"}),
                          ("pcpp", {"codec": "halo=int8"}), ("distrifusion", {"codec": "int2"})):  # fmt: skip
        Plan(make_strategy(name, **options), 2).validate(fn, hw, 8, 7.5)


def test_comm_refuses_a_halo_on_the_wire_of_a_flux_transformer(capsys):
    from patchpar.lab.cli import main

    args = ["comm", "--model", "tiny-flux", "--resolution", "128", "--strategy", "sync_patch",
            "--devices", "2", "--wire", "halo=fp8"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "patchpar: error: sync_patch: wire='halo=fp8': a flux denoiser has no halo site (it "
        "exchanges kv); name only kinds it has: kv"
    )


def test_help_lists_the_codecs_each_option_takes():
    """`wire` offers only what the wire takes (`codecs.WIRE`), `codec` every codec."""
    import re
    from dataclasses import fields

    from patchpar.parallel.codecs import NAMES, WIRE
    from patchpar.parallel.strategies import STRATEGIES

    seen = set()
    for cls in STRATEGIES.values():
        for f in fields(cls):
            if f.name in ("wire", "codec"):
                words = set(re.findall(r"[\w-]+", f.metadata["help"])) & set(NAMES)
                assert words == set(WIRE if f.name == "wire" else NAMES), (cls.name, f.name)
                seen.add(f.name)
    assert seen == {"wire", "codec"}
