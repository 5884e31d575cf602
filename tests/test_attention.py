"""Attention kernels: every implementation equals the whole-logits reference (`xla`), alone and
inside the micro UNets, and the bad-input cases name what would fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import inputs, micro_unet, single_guided

from patchpar.models.attention import (
    AttentionSpec,
    Keys,
    attend,
    attend_keys,
    available,
    chunked_attention,
    heads_kv,
    resolve,
    xla_attention,
)

SHAPES = [  # (batch, queries, keys, heads, head dim, block_q, block_kv, masked)
    (2, 100, 77, 2, 8, 32, 32, False),  # cross-attention: 77 keys, blocks do not divide
    (2, 300, 300, 4, 8, 64, 128, True),  # PCPP-like key mask, padded last key block
    (1, 64, 200, 1, 16, 512, 1024, True),  # blocks larger than the sequences
    (2, 256, 256, 2, 40, 64, 64, False),  # SD's head dim 40, blocks divide
]


def _qkv(b, tq, tk, h, d, seed=0):
    rng = np.random.RandomState(seed)
    return [jnp.asarray(rng.randn(b, n, h * d), jnp.float32) for n in (tq, tk, tk)]


def _mask(tk, seed=1):
    keep = np.random.RandomState(seed).rand(tk) > 0.3
    keep[:40] = False  # a whole missing neighbour band (an edge device's top slots)
    return jnp.asarray(keep)


def _rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[1]}x{s[2]}h{s[3]}d{s[4]}")
def test_chunked_equals_xla(shape):
    b, tq, tk, h, d, bq, bk, masked = shape
    q, k, v = _qkv(b, tq, tk, h, d)
    mask = _mask(tk) if masked else None
    ref = xla_attention(q, k, v, h, mask)
    out = jax.jit(lambda q, k, v: chunked_attention(q, k, v, h, mask, bq, bk))(q, k, v)
    assert out.shape == ref.shape
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("shape", [*SHAPES[:2], SHAPES[3]], ids=lambda s: f"{s[1]}x{s[2]}")
def test_splash_interpreted_equals_xla(shape):
    """The Pallas TPU kernel, run in interpret mode on CPU: padding and masks via segment ids;
    keys that fill whole blocks, none masked, without them."""
    b, tq, tk, h, d, _, _, masked = shape
    q, k, v = _qkv(b, tq, tk, h, d)
    mask = _mask(tk) if masked else None
    out = attend(AttentionSpec("splash", 128, 128, interpret=True), q, k, v, h, mask)
    assert _rel(out, xla_attention(q, k, v, h, mask)) <= 1e-5


@pytest.mark.parametrize("impl", ["chunked", "xla", "splash"])
@pytest.mark.parametrize("skip", [0, 2, 3], ids=lambda s: f"skip{s}")
def test_sources_equal_their_keys_in_one_sequence(impl, skip):
    """Keys read where they lie (a stale buffer's slots but the skipped own one, a fresh own
    slot, a masked band) give the softmax over those keys joined in one sequence: slots of 70
    keys in blocks of 32 (the last block of each starts early, its keys read before masked)."""
    b, tq, h, d, t, slots = 2, 50, 2, 8, 70, 4
    rng = np.random.RandomState(3)
    q = jnp.asarray(rng.randn(b, tq, h * d), jnp.float32)
    kv = [jnp.asarray(rng.randn(b, t, h * d), jnp.float32) for _ in range(2 * slots + 4)]
    buffer = jnp.stack([heads_kv(kv[2 * i], kv[2 * i + 1], h) for i in range(slots)])
    own_k, own_v, band_k, band_v = kv[-4:]
    band_keep = _mask(t)
    sources = [
        Keys(buffer, skip=jnp.asarray(skip, jnp.int32)),
        Keys.of(own_k, own_v, h),
        Keys.of(band_k, band_v, h, band_keep),
    ]
    others = [i for i in range(slots) if i != skip]
    keys = jnp.concatenate([kv[2 * i] for i in others] + [own_k, band_k], 1)
    values = jnp.concatenate([kv[2 * i + 1] for i in others] + [own_v, band_v], 1)
    mask = jnp.concatenate([jnp.ones(((slots - 1) * t + t,), bool), band_keep])
    ref = xla_attention(q, keys, values, h, mask)
    spec = AttentionSpec(impl, 128, 128, True) if impl == "splash" else AttentionSpec(impl, 16, 32)
    out = jax.jit(lambda q, s: attend_keys(spec, q, h, s))(q, sources)
    assert _rel(out, ref) <= 1e-5


def test_chunked_bfloat16_close_to_float32():
    q, k, v = _qkv(2, 256, 256, 2, 40)
    ref = xla_attention(q, k, v, 2)
    low = [t.astype(jnp.bfloat16) for t in (q, k, v)]
    out = chunked_attention(*low, 2, None, 64, 64)
    assert out.dtype == jnp.bfloat16
    assert _rel(out.astype(jnp.float32), ref) <= 2e-2  # bf16 inputs: 8 mantissa bits


@pytest.mark.parametrize(
    "kind, impl",
    [
        ("sd", "chunked"),
        ("sdxl", "splash"),
        pytest.param("sdxl", "chunked", marks=pytest.mark.slow),
        pytest.param("sd", "splash", marks=pytest.mark.slow),
    ],
)
def test_micro_unet_with_each_kernel_equals_xla(kind, impl):
    """The whole (guided) micro UNet: self-, cross-attention and the rest, 1e-5 relative."""
    unet, params = micro_unet(kind)
    x, t, cond = inputs(kind)
    spec = (
        AttentionSpec(impl, 128, 128, interpret=True)
        if impl == "splash"
        else AttentionSpec(impl, 64, 32)
    )
    ref = single_guided(unet.with_attention(AttentionSpec("xla")), params, x, t, cond)
    out = single_guided(unet.with_attention(spec), params, x, t, cond)
    assert _rel(out, ref) <= 1e-5


def test_auto_resolves_per_backend():
    assert resolve(AttentionSpec("auto"), jnp.float32, "cpu").impl == "chunked"
    assert resolve(AttentionSpec("auto"), jnp.bfloat16, "gpu").impl == "cudnn"
    assert resolve(AttentionSpec("auto"), jnp.float32, "gpu").impl == "chunked"
    tpu = resolve(AttentionSpec("auto", 200, 300), jnp.bfloat16, "tpu")
    assert (tpu.impl, tpu.block_q, tpu.block_kv) == ("chunked", 200, 300)
    assert available("cpu") == ["auto", "xla", "chunked"]


def test_bad_attention_input():
    with pytest.raises(ValueError, match=r"'cudnn' needs a GPU backend; this one is 'cpu', "
                       r"which has \['auto', 'xla', 'chunked'\]"):  # fmt: skip
        resolve(AttentionSpec("cudnn"), jnp.bfloat16, "cpu")
    with pytest.raises(ValueError, match="'splash' needs a TPU backend"):
        resolve(AttentionSpec("splash"), jnp.bfloat16, "cpu")
    with pytest.raises(ValueError, match="needs bfloat16 or float16 compute; the dtype is float32"):
        resolve(AttentionSpec("cudnn"), jnp.float32, "gpu")
    with pytest.raises(ValueError, match=r"'flash' is not an attention implementation; known: "):
        AttentionSpec("flash")
    with pytest.raises(ValueError, match="block_q=0: must be a positive int"):
        AttentionSpec("chunked", block_q=0)
    with pytest.raises(ValueError, match="must be multiples of 128.*nearest: 256, 128"):
        AttentionSpec("splash", block_q=300, block_kv=100)


def test_run_config_names_bad_attention():
    from patchpar.lab.config import ModelConfig, RunConfig

    with pytest.raises(ValueError, match=r"model.attention='flash': must be one of \['auto'"):
        RunConfig(model=ModelConfig(attention="flash")).validate()
    with pytest.raises(ValueError, match=r"model.block_kv=-1: must be a positive integer"):
        RunConfig(model=ModelConfig(block_kv=-1)).validate()


@pytest.mark.slow  # ~40 s; test_comm's CLI record checks the memory fields on every run
def test_memory_per_device_chunked_below_xla(micro_folder):
    """Compiled memory per device: the chunked kernel does not hold the whole logits."""
    from patchpar.lab.costs import CommConfig, run_comm

    recs = {
        a: run_comm(CommConfig.from_flags(model=str(micro_folder), resolution=64, attention=a))
        for a in ("xla", "chunked")
    }
    for rec in recs.values():
        phase = rec["memory_per_device"]
        assert rec["memory_per_device_bytes"] == phase["total"]
        assert phase["total"] == (
            phase["arguments"] + phase["outputs"] + phase["temporaries"] - phase["aliased"]
        )
    # the micro model at 64 px: 32x32 latent, 1024 tokens, 2 (CFG) x 2 heads: 16 MiB of logits
    logits = 2 * 2 * 1024 * 1024 * 4
    temps = {a: r["memory_per_device"]["temporaries"] for a, r in recs.items()}
    assert temps["xla"] >= logits
    assert temps["xla"] - temps["chunked"] >= logits  # at least the whole logits not held
    assert recs["chunked"]["attention"] == "chunked"


def test_device_script_in_miniature(micro_folder, tmp_path):
    """experiments/device/attention_sdxl.py, as a lent GPU would run it, on the micro model."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "experiments/device/attention_sdxl.py"
    spec = importlib.util.spec_from_file_location("attention_sdxl", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(
        [
            "--model", str(micro_folder), "--resolution", "64", "--repeats", "1",
            "--dtype", "float32", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["attention"] for r in recs] == ["chunked", "xla"]  # auto = chunked here: once
    assert all(r["status"] == "ok" and r["step_s_median"] > 0 for r in recs)
    assert recs[1]["max_abs_diff_vs_first"] <= 1e-4
    assert recs[1]["memory_compiled"]["total"] > 0
    assert "| chunked |" in (tmp_path / "table.md").read_text()


def test_sources_script_in_miniature(tmp_path):
    """experiments/device/attention_sources.py, as the TPU suite runs it, at a toy size."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "experiments/device/attention_sources.py"
    spec = importlib.util.spec_from_file_location("attention_sources", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(
        [
            "--tokens", "128", "--heads", "2", "--head-dim", "8", "--patches", "2", "--repeats",
            "1", "--dtype", "float32", "--blocks", "32x32", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    recs = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["way"] for r in recs][-2:] == [
        "chunked, N = 2: own fresh + stale buffer",
        "chunked, N = 2: gathered buffer (sync_patch)",
    ]
    assert len(recs) == 5 and all(r["status"] == "ok" and r["call_s_median"] > 0 for r in recs)
