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
    want = attend(XLA, *coded, heads)
    want = want if c[3] is None else rt(want, c[3], heads)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    assert float(jnp.abs(got - attend(XLA, q, k, v, heads)).max()) > 1e-3  # it is coded


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
        ("pixart", "sync_patch", 4, {"wire": "fp8"}),
        ("unet", "sync_patch", 2, {"wire": "kv=fp8-e5m2,halo=int8"}),
        ("pixart", "ulysses", 4, {"wire": "q=fp8,v=fp8,o=fp8"}),
        pytest.param(
            "unet", "ulysses", 4, {"ring_degree": 2, "wire": "fp8"}, marks=pytest.mark.slow
        ),
        ("pixart", "ring", 4, {"wire": "fp8"}),
    ],
)
def test_coded_strategies_count_their_bytes(family, name, devices, options):
    """On micro models: the output is near single (not equal: it is coded), the HLO bytes
    equal the analytic model's, and fewer than the exact strategy's."""
    from test_parallel_dit import max_diff
    from test_quant import _call, _micro

    from patchpar.measure.cost import measure
    from patchpar.parallel.engine import Plan

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
        ("ulysses", "fp16", r"ulysses: wire='fp16'.*unknown codec 'fp16'"),
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
