"""docs/design.md §4 items 1 and 4 at the level of single sites, and the corrected GroupNorm against
a NumPy transcription of DistriFusion's Eq. 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from patchpar.models.layers import Attention, Conv, Downsample2D, GroupNorm, Upsample2D
from patchpar.parallel.mesh import PATCH, make_mesh
from patchpar.parallel.sites import STALE, band_tokens, patch_ops

B, H, W, C = 2, 16, 6, 8


def rand(*shape, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randn(*shape), jnp.float32)


def init(module, x):
    params = module.init(jax.random.key(0), x)["params"]
    # non-trivial biases and scales
    return jax.tree.map(lambda p: p + 0.1 * rand(*p.shape, seed=p.size), params)


def sharded(module, params, x, n, state=None, token_axis=1, **kwargs):
    """Apply `module` (with patch ops; call keywords `kwargs`) to row patches of x on n
    devices; state in/out carries a leading device axis. Returns (output, new state)."""
    mesh = make_mesh(n, 1)
    spec = P(*([None] * token_axis + [PATCH]))
    state = state or {}

    def local(params, x, state):
        variables = {"params": params}
        if state:
            variables[STALE] = jax.tree.map(lambda a: a[0], state)
        out, mut = module.apply(variables, x, mutable=[STALE], **kwargs)
        return out, jax.tree.map(lambda a: a[None], mut.get(STALE, {}))

    fn = jax.shard_map(
        lambda p, x, s: local(p, x, s),
        mesh=mesh,
        in_specs=(P(), spec, jax.tree.map(lambda _: P(PATCH), state)),
        out_specs=(spec, P(PATCH)),
        check_vma=False,
    )
    return jax.jit(fn)(params, x, state)


CONVS = {
    "conv3x3": lambda ops: Conv(5, ops=ops),
    "down_pad1": lambda ops: Downsample2D(C, padding=1, ops=ops),
    "down_vae_asym": lambda ops: Downsample2D(C, padding=0, ops=ops),
    "upsample_conv": lambda ops: Upsample2D(C, ops=ops),
    "conv1x1": lambda ops: Conv(5, kernel_size=1, padding=0, ops=ops),
}


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_with_fresh_halo_equals_unsharded(name, n):
    x = rand(B, H, W, C)
    ref_mod = CONVS[name](patch_ops(1))
    params = init(ref_mod, x)
    out, state = sharded(CONVS[name](patch_ops(n, "warmup")), params, x, n)
    assert state == {}
    np.testing.assert_allclose(out, ref_mod.apply({"params": params}, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("gn", ["sync", "separate", "stale", "corrected"])
@pytest.mark.parametrize("n", [2, 8])
def test_groupnorm_sync_equals_unsharded(n, gn):
    """In the sync (warm-up) phase every GroupNorm mode is exact, `separate` included."""
    x = rand(B, H, W, C) * 3 + 1
    mod = GroupNorm(4, 1e-5, ops=patch_ops(n, "warmup", gn=gn))
    params = init(GroupNorm(4, 1e-5), x)
    out, _ = sharded(mod, params, x, n)
    np.testing.assert_allclose(
        out, GroupNorm(4, 1e-5).apply({"params": params}, x), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("n", [2, 4])
def test_self_attention_all_gather_equals_unsharded(n):
    x = rand(B, H * W, C)
    mod = Attention(2, 4, C, ops=patch_ops(n, "warmup", kv="all"))
    params = init(Attention(2, 4, C), x)
    out, _ = sharded(mod, params, x, n)
    np.testing.assert_allclose(
        out, Attention(2, 4, C).apply({"params": params}, x), atol=1e-5, rtol=0
    )


# ---------------------------------------------------------------------- GroupNorm formulas


def numpy_groupnorm(x, params, g_stale, l_stale, n, mode, groups=4, eps=1e-5):
    """docs/design.md §2 on each device's rows: corrected E = stale_global + (fresh_local - stale_local),
    stale E = stale_global + (fresh_local - stale_local) / n; var = E[x^2] - E[x]^2, the local
    variance where that is negative (corrected)."""
    x = np.asarray(x, np.float64)
    rows = x.shape[1] // n
    out = []
    for i in range(n):
        xi = x[:, i * rows : (i + 1) * rows].reshape(B, rows, W, groups, C // groups)
        fresh = np.stack([xi.mean(axis=(1, 2, 4)), (xi**2).mean(axis=(1, 2, 4))])
        delta = fresh - np.asarray(l_stale[i])
        est = np.asarray(g_stale[i]) + (delta if mode == "corrected" else delta / n)
        mean, var = est[0], est[1] - est[0] ** 2
        if mode == "corrected":
            var = np.where(var < 0, fresh[1] - fresh[0] ** 2, var)
        var = np.maximum(var, 0)
        y = (xi - mean[:, None, None, :, None]) / np.sqrt(var + eps)[:, None, None, :, None]
        out.append(
            y.reshape(B, rows, W, C) * np.asarray(params["scale"]) + np.asarray(params["bias"])
        )
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("mode", ["corrected", "stale"])
def test_stale_groupnorm_matches_numpy_formula(mode):
    n = 4
    x = rand(B, H, W, C, seed=1) * 2 + 0.5
    params = init(GroupNorm(4), x)
    g = rand(n, 2, B, 4, seed=2) * 0.3 + jnp.asarray([0.4, 1.5])[None, :, None, None]
    loc = rand(n, 2, B, 4, seed=3) * 0.3 + jnp.asarray([0.4, 1.5])[None, :, None, None]
    if mode == "corrected":  # device 0: stale local E[x^2] large -> negative estimated variance
        loc = loc.at[0, 1].add(6.0)
    mod = GroupNorm(4, 1e-5, ops=patch_ops(n, "steady", gn=mode))
    out, new = sharded(mod, params, x, n, {"gn_global": g, "gn_local": loc})
    ref = numpy_groupnorm(x, params, g, loc, n, mode)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    if mode == "corrected":  # the fallback was exercised
        est0 = np.asarray(g[0]) + (np.asarray(new["gn_local"][0]) - np.asarray(loc[0]))
        assert (est0[1] - est0[0] ** 2 < 0).any()


# ---------------------------------------------------------------------- staleness (§3 item 4)


def kv_of(mod_params, x):
    """Fresh keys/values of tokens x with the attention's own projections: (2, B, T, D)."""
    k = x @ mod_params["to_k"]["kernel"]
    v = x @ mod_params["to_v"]["kernel"]
    return jnp.stack([k, v])


def as_tokens(buf):
    """A K/V buffer as kept (the kernels' heads layout: (2, B, H, L, D), or the (n, ...) slots
    of a gathered one) -> (2, B, n*L, H*D), tokens in order."""
    if buf.ndim == 6:
        buf = jnp.concatenate(list(buf), axis=3)
    two, b, h, t, d = buf.shape
    return buf.transpose(0, 1, 3, 2, 4).reshape(two, b, t, h * d)


def test_stale_halo_reads_previous_step_and_refreshes():
    n, top = 4, 1
    x1, x2 = rand(B, H, W, C, seed=4), rand(B, H, W, C, seed=5)
    mod = Conv(5, ops=patch_ops(n, "steady", halo="stale"))
    params = init(Conv(5), x1)
    state0 = {"halo": rand(n, B, 2 * top, W, C, seed=6)}
    _, state1 = sharded(mod, params, x1, n, state0)
    rows = H // n
    for i in range(n):  # the buffer written at step t-1 holds the neighbours' fresh rows of x1
        above = x1[:, i * rows - 1 : i * rows] if i > 0 else jnp.zeros((B, 1, W, C))
        below = x1[:, (i + 1) * rows : (i + 1) * rows + 1] if i < n - 1 else jnp.zeros((B, 1, W, C))
        np.testing.assert_array_equal(state1["halo"][i], jnp.concatenate([above, below], axis=1))
    out2, _ = sharded(mod, params, x2, n, state1)
    for i in range(n):  # step t reads exactly that buffer around its own fresh rows
        padded = jnp.concatenate(
            [state1["halo"][i][:, :1], x2[:, i * rows : (i + 1) * rows], state1["halo"][i][:, 1:]],
            axis=1,
        )
        ref = Conv(5, padding=1).apply({"params": params}, padded)[:, 1:-1]
        np.testing.assert_allclose(out2[:, i * rows : (i + 1) * rows], ref, atol=1e-5, rtol=0)


def test_stale_groupnorm_buffers_hold_previous_step_statistics():
    n = 4
    x1 = rand(B, H, W, C, seed=7)
    mod = GroupNorm(4, ops=patch_ops(n, "steady", gn="corrected"))
    params = init(GroupNorm(4), x1)
    state0 = {"gn_global": rand(n, 2, B, 4, seed=8), "gn_local": rand(n, 2, B, 4, seed=9)}
    _, state1 = sharded(mod, params, x1, n, state0)
    rows = H // n
    xg = np.asarray(x1).reshape(B, n, rows, W, 4, C // 4)
    local = np.stack([xg.mean(axis=(2, 3, 5)), (xg**2).mean(axis=(2, 3, 5))])  # (2, B, n, G)
    np.testing.assert_allclose(state1["gn_local"], local.transpose(2, 0, 1, 3), atol=1e-5)
    for i in range(n):
        np.testing.assert_allclose(state1["gn_global"][i], local.mean(axis=2), atol=1e-5)


@pytest.mark.parametrize(
    "kv, send, align, n",
    [
        ("stale", "full", "tokens", 4),
        ("band", "full", "tokens", 4),
        ("band", "band", "tokens", 4),
        ("band", "full", "rows", 4),  # whole rows: 2 of each patch's 4 rows of W tokens, not 8
        ("band", "band", "rows", 4),
        ("band", "full", "tokens", 2),  # one neighbour each: its band alone, `kv_band`
        ("band", "band", "tokens", 2),
    ],
)
def test_stale_kv_reads_previous_step_and_refreshes(kv, send, align, n):
    portion = 0.3
    tokens = H * W
    x1, x2 = rand(B, tokens, C, seed=10), rand(B, tokens, C, seed=11)
    ops = patch_ops(n, "steady", kv=kv, portion=portion, send=send, align=align)
    mod = Attention(2, 4, C, ops=ops)
    params = init(Attention(2, 4, C), x1)
    length = tokens // n
    band = band_tokens(length, portion) if align == "tokens" else 2 * W
    heads = (2, 4)  # the buffers in the kernels' heads layout: 2 heads of 4
    if kv == "stale":
        state0 = {"kv": rand(n, n, 2, B, *heads[:1], length, heads[1], seed=12)}
    elif n == 2:
        state0 = {"kv_band": rand(n, 2, B, heads[0], band, heads[1], seed=12)}
    else:
        state0 = {
            "kv_above": rand(n, 2, B, heads[0], band, heads[1], seed=12),
            "kv_below": rand(n, 2, B, heads[0], band, heads[1], seed=13),
        }
    _, state1 = sharded(mod, params, x1, n, state0, row=W)  # row: tokens per image row
    fresh1 = kv_of(params, x1)  # (2, B, T, D)
    for i in range(n):
        if kv == "stale":
            np.testing.assert_allclose(as_tokens(state1["kv"][i]), fresh1, atol=1e-5)
        else:
            above = fresh1[:, :, i * length - band : i * length] if i > 0 else None
            below = fresh1[:, :, (i + 1) * length : (i + 1) * length + band] if i < n - 1 else None
            if n == 2:  # below for patch 0, above for patch 1
                want = below if i == 0 else above
                np.testing.assert_allclose(as_tokens(state1["kv_band"][i]), want, atol=1e-5)
                continue
            if above is not None:
                np.testing.assert_allclose(as_tokens(state1["kv_above"][i]), above, atol=1e-5)
            if below is not None:
                np.testing.assert_allclose(as_tokens(state1["kv_below"][i]), below, atol=1e-5)
    out2, _ = sharded(mod, params, x2, n, state1, row=W)
    fresh2 = kv_of(params, x2)
    q = x2 @ params["to_q"]["kernel"]
    for i in range(n):
        own = fresh2[:, :, i * length : (i + 1) * length]
        if kv == "stale":
            keys = as_tokens(state1["kv"][i]).at[:, :, i * length : (i + 1) * length].set(own)
        elif n == 2:
            band_i = as_tokens(state1["kv_band"][i])
            parts = [own, band_i] if i == 0 else [band_i, own]
            keys = jnp.concatenate(parts, axis=2)
        else:
            parts = (
                ([as_tokens(state1["kv_above"][i])] if i > 0 else [])
                + [own]
                + ([as_tokens(state1["kv_below"][i])] if i < n - 1 else [])
            )
            keys = jnp.concatenate(parts, axis=2)
        ref = attention_ref(q[:, i * length : (i + 1) * length], keys[0], keys[1], params)
        np.testing.assert_allclose(out2[:, i * length : (i + 1) * length], ref, atol=1e-5, rtol=0)


def attention_ref(q, k, v, params, heads=2):
    b, t, inner = q.shape
    d = inner // heads
    qh, kh, vh = (a.reshape(a.shape[0], a.shape[1], heads, d) for a in (q, k, v))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", qh, kh) / np.sqrt(d), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, vh).reshape(b, t, inner)
    return out @ params["to_out_0"]["kernel"] + params["to_out_0"]["bias"]


def test_no_sync_keeps_buffers_frozen():
    n = 4
    x = rand(B, H, W, C, seed=14)
    mod = Conv(5, ops=patch_ops(n, "steady", halo="stale", gn="separate", exchange=False))
    state0 = {"halo": rand(n, B, 2, W, C, seed=15)}
    _, state1 = sharded(mod, init(Conv(5), x), x, n, state0)
    np.testing.assert_array_equal(state1["halo"], state0["halo"])


def test_no_sync_needs_local_groupnorm():
    with pytest.raises(ValueError, match="gn must be 'separate'.*got gn='corrected'"):
        patch_ops(4, "steady", gn="corrected", exchange=False)


def test_input_layer_halo_is_fresh():
    """conv_in's ops: the stale halo becomes fresh (no buffer, exact); zero stays zero."""
    n = 4
    x = rand(B, H, W, C, seed=16)
    ops = patch_ops(n, "steady", halo="stale", gn="corrected", kv="stale").input_layer()
    assert ops.halo_op.mode == "fresh" and ops.halo_op.input and ops.gn_op.mode == "corrected"
    assert patch_ops(n, halo="zero").input_layer().halo_op.mode == "zero"
    params = init(Conv(5), x)
    out, state = sharded(Conv(5, ops=ops), params, x, n)
    assert state == {}
    np.testing.assert_allclose(out, Conv(5).apply({"params": params}, x), atol=1e-5, rtol=0)


def test_band_tokens():
    assert band_tokens(64, 0.3) == 20 and band_tokens(100, 0.3) == 30 and band_tokens(10, 1.0) == 10
    assert band_tokens(3, 0.01) == 1
    # whole rows: 0.3 of 4 rows of 6 tokens -> 2 rows; at least one row, at most all
    assert band_tokens(24, 0.3, 6) == 12 and band_tokens(24, 0.01, 6) == 6
    assert band_tokens(24, 1.0, 6) == 24


def test_row_aligned_band_needs_whole_rows():
    x = rand(B, H * W, C, seed=10)
    ops = patch_ops(4, "steady", kv="band", portion=0.3, align="rows")
    mod = Attention(2, 4, C, ops=ops)
    params = init(Attention(2, 4, C), x)
    state = {k: rand(4, 2, B, 2 * W, 8, seed=1) for k in ("kv_above", "kv_below")}
    with pytest.raises(
        ValueError, match=r"align=rows: .* 24 tokens do not come as whole image rows \(row=5\)"
    ):
        sharded(mod, params, x, 4, state, row=5)
    with pytest.raises(ValueError, match=r"align='diagonal'; known: \['tokens', 'rows'\]"):
        patch_ops(4, kv="band", align="diagonal")
