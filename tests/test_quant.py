"""Quantized inference with Qwix (`patchpar.quant`), on micro models of every family: the
weights are stored quantized; a quantized model runs inside the strategies' programs, and an
exact strategy equals one device: weight-only modes <= 1e-4 of the latent's scale; modes that
quantize activations closer than the quantization itself moved the model (mean absolute
difference: `test_sync_patch_equals_one_device` says why that holds on any machine and still
fails on a parallelism bug); bad input is a one-line error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel_dit import GUIDANCE, inputs, max_diff
from test_pipefusion import micro_dit

from patchpar.parallel.engine import Plan, make_step
from patchpar.parallel.strategies import make_strategy
from patchpar.quant import MODES, check_mode, mode_of, quantize, quantize_abstract, weight_dtypes


def _micro(family):
    if family == "pixart":
        fn, params = micro_dit()
        x, t, cond = inputs()
        return fn, params, x, t, cond, GUIDANCE
    from parallel_helpers import GUIDANCE as scale
    from parallel_helpers import inputs as unet_inputs
    from parallel_helpers import micro_unet

    fn, params = micro_unet("sd")
    x, t, cond = unet_inputs("sd")
    return fn, params, x, t, cond, scale


def _call(fn, params, x, t, cond, scale, name="single", devices=1, **options):
    plan = Plan(make_strategy(name, **options), devices)
    step = jax.jit(make_step(fn, plan, "warmup", "row", scale, plan.mesh()))
    out, _ = step(params, x, t, cond, None)
    return np.asarray(out)


@pytest.mark.parametrize("mode", MODES)
def test_weights_are_stored_quantized(mode):
    fn, params = micro_dit()
    qf, qp = quantize(fn, params, mode)
    assert mode_of(qf) == mode and mode_of(fn) is None
    want = {"w8": "int8", "w4": "int4", "int8": "int8", "fp8": "float8_e4m3fn"}[mode]
    kinds = weight_dtypes(qp)
    assert kinds[want] > 0.5 * sum(kinds.values()), kinds  # most bytes are the weights'
    # the abstract quantization (full-size memory tables) lays out the same tree
    _, shapes = quantize_abstract(fn, jax.eval_shape(lambda: params), mode)
    same = jax.tree.map(lambda a, b: (a.shape, a.dtype) == (b.shape, b.dtype), shapes, qp)
    assert all(jax.tree.leaves(same))
    if mode == "w4":  # half a byte per int4 value: half of w8's bytes of values
        values = sum(x.size for x in jax.tree.leaves(qp) if x.dtype == jnp.int4)
        assert values > 0 and kinds["int4"] == values // 2
        assert weight_dtypes(quantize(fn, params, "w8")[1])["int8"] == values


SLOW = pytest.mark.slow


def _mean_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).mean())


@pytest.mark.parametrize(
    "family, mode",
    [
        ("pixart", "w8"),
        ("pixart", "int8"),
        pytest.param("pixart", "fp8", marks=SLOW),  # fp8: the UNet's; the DiT's int8
        pytest.param("unet", "w8", marks=SLOW),
        pytest.param("unet", "int8", marks=SLOW),
        pytest.param("unet", "fp8", marks=SLOW),
    ],
)
def test_sync_patch_equals_one_device(family, mode):
    """Weight-only: equal within float rounding. Quantized activations round each value to a
    bucket, so an ulp of difference between two programs (a GroupNorm statistic all-reduced,
    a softmax over gathered keys) can put a value in the next bucket: one quantum more, in a
    few values, where quantizing moved every value by up to half a quantum. How many buckets
    flip depends on the machine's code generation, so the contract is not "within the noise
    of one run" but: sync_patch moves the quantized model's output less, on average, than
    quantizing moved the float model's. Measured on the micro models: even 1e-4 relative
    noise on the input (which flips every value near an edge, far more than ulps do) moves
    the output by 0.5-0.67 of the quantization's mean change; a parallelism bug (two
    patches' K/V crossed, `test_a_parallelism_bug_fails_the_quantized_contract`) by 3-17x."""
    fn, params, x, t, cond, scale = _micro(family)
    qf, qp = quantize(fn, params, mode)
    one = _call(qf, qp, x, t, cond, scale)
    got = _call(qf, qp, x, t, cond, scale, "sync_patch", 2)
    quant_error = max_diff(one, _call(fn, params, x, t, cond, scale))
    assert quant_error > 1e-3  # the model is quantized
    if mode == "w8":
        assert max_diff(got, one) <= 1e-4 * max(1.0, float(np.abs(one).max()))
        return
    _assert_within_quantization(got, one, _call(fn, params, x, t, cond, scale))


def _assert_within_quantization(got, one, float_one):
    moved, quantization = _mean_diff(got, one), _mean_diff(one, float_one)
    assert moved < quantization, (moved, quantization)


@pytest.mark.parametrize(
    "family, mode",
    [
        ("pixart", "int8"),
        pytest.param("pixart", "fp8", marks=SLOW),
        pytest.param("unet", "fp8", marks=SLOW),
    ],
)
def test_a_parallelism_bug_fails_the_quantized_contract(family, mode, monkeypatch):
    """The contract above is not too loose to see a bug: sync_patch on 2 devices with the
    two patches' K/V crossed (each patch's keys with the other's values) fails it."""
    import patchpar.parallel.sites.kv as kv

    sources = kv.KV.sources

    def crossed(self, *args, **kwargs):  # on 2 devices: the own slot, then the other's
        own, other = (s.kv for s in sources(self, *args, **kwargs))  # (1, 2, B, H, L, D) each
        return [
            kv.Keys(jnp.concatenate([own[:, :1], other[:, 1:]], axis=1)),  # the other's values
            kv.Keys(jnp.concatenate([other[:, :1], own[:, 1:]], axis=1)),
        ]

    fn, params, x, t, cond, scale = _micro(family)
    qf, qp = quantize(fn, params, mode)
    one = _call(qf, qp, x, t, cond, scale)
    monkeypatch.setattr(kv.KV, "sources", crossed)
    got = _call(qf, qp, x, t, cond, scale, "sync_patch", 2)
    with pytest.raises(AssertionError):
        _assert_within_quantization(got, one, _call(fn, params, x, t, cond, scale))


def test_bad_input_is_one_line():
    fn, params = micro_dit()
    with pytest.raises(
        ValueError, match=r"quant='int3': unknown; modes: none, w8 \(.*\), w4 .* fp8"
    ):
        check_mode("int3")
    with pytest.raises(ValueError, match=r"quant='int4': int4 activations are not offered"):
        check_mode("int4")
    qf, qp = quantize(fn, params, "w8")
    with pytest.raises(ValueError, match=r"already quantized \('w8'\)"):
        quantize(qf, qp, "fp8")
    # tensor parallelism splits a row-parallel layer's inputs: no per-token activation scale
    qa, _ = quantize(fn, params, "int8")
    with pytest.raises(ValueError, match=r"tensor parallelism over 2 devices .*\(quant='int8'\)"):
        Plan(make_strategy("tensor"), 2).validate(qa, (8, 8), 4, GUIDANCE)
    # fp8 (and int8) products on a CPU: emulated, said in a warning
    with pytest.warns(UserWarning, match=r"quant='fp8': emulated: cpu .* no fp8 matrix units"):
        quantize(fn, params, "fp8")
    assert jnp.dtype(jnp.int4).name == "int4"


@pytest.mark.parametrize(
    "name, devices, options, fsdp, mode",
    [
        pytest.param("tensor", 2, {}, False, "w8", marks=SLOW),  # tensor-4 below
        ("tensor", 4, {"tp_degree": 2}, True, "w8"),
        pytest.param("sync_patch", 4, {}, True, "w8", marks=SLOW),  # FSDP: tensor-4 above
        pytest.param("tensor", 2, {}, False, "w4", marks=SLOW),
        pytest.param("tensor", 4, {"tp_degree": 2}, True, "w4", marks=SLOW),
        pytest.param("sync_patch", 4, {}, True, "w4", marks=SLOW),
    ],
)
def test_quantized_weights_are_placed_by_the_rules(name, devices, options, fsdp, mode):
    """Tensor parallelism splits a quantized weight's values and per-channel scales over
    `model` as the float weight; FSDP shards them at rest and each layer gathers them: the
    output equals the quantized model on one device, the HLO bytes the analytic model (the
    gathers carry the stored int8/int4 values), and a device holds its share of the
    quantized bytes."""
    from patchpar.measure.cost import measure
    from patchpar.parallel.rules import weight_bytes_per_device

    fn, params, x, t, cond, scale = _micro("pixart")
    qf, qp = quantize(fn, params, mode)
    plan = Plan(make_strategy(name, **options), devices, fsdp=fsdp)
    plan.validate(qf, x.shape[1:3], 10, scale)
    step = jax.jit(make_step(qf, plan, "warmup", "row", scale, plan.mesh()))
    got, _ = step(qp, x, t, cond, None)
    one = _call(qf, qp, x, t, cond, scale)
    assert max_diff(got, one) <= 1e-4 * max(1.0, float(np.abs(one).max()))
    rec = measure(qf, plan, x.shape[1:3], batch=2, params=qp, flops=False)
    assert all(ph["analytic_matches_hlo"] for ph in rec["phases"].values()), rec
    whole = weight_bytes_per_device(qp, {}, {}, qf.logical)
    assert whole < weight_bytes_per_device(params, {}, {}, fn.logical) / 3
    assert rec["weight_bytes_per_device"] < 0.75 * whole


def test_a_run_records_its_quant_mode_against_the_unquantized_baseline(micro_folder, tmp_path):
    """`model.quant` in a run: the pipeline's denoiser is quantized (its weights held as int8),
    the record says so, its label carries the mode, and its quality is measured against the
    unquantized single-device images (the quantization's own cost: not infinite PSNR)."""
    from test_runner import micro_base

    from patchpar.lab.cli import main
    from patchpar.lab.results import read_records

    base = micro_base(micro_folder, tmp_path)
    args = ["--model.name", base["model"]["name"], "--results", str(tmp_path)]
    args += ["--sampler.steps", "3", "--sampler.height", "32", "--sampler.width", "32"]
    args += ["--prompts.prompts", "a red bag", "--prompts.seeds", "0", "--experiment", "q"]
    args += ["--measure.warmup-runs", "0", "--measure.repeats", "1"]
    assert main(["run", *args, "--measure.quality", "psnr"]) == 0
    assert main(["run", *args, "--measure.quality", "psnr", "--model.quant", "w8"]) == 0
    plain, quant = read_records(tmp_path / "q" / "runs.jsonl")
    assert plain["metrics"]["psnr"] is None and plain["metrics"]["quant"] == "none"  # identical
    assert quant["label"] == "single + w8" and quant["metrics"]["quant"] == "w8"
    assert 15 < quant["metrics"]["psnr"] < float("inf")
    # the micro UNet's weights are mostly convolutions, which stay in floats
    w = [r["metrics"]["weight_bytes_per_device"] for r in (plain, quant)]
    assert w[1] < 0.9 * w[0], w


@pytest.mark.device
def test_fp8_on_a_gpu(tmp_path):
    """On a lent GPU: PixArt-α at 512² in bf16, w8, int8 and fp8 all run, fp8 natively where
    the GPU has fp8 matrix units (compute capability >= 8.9), and stay near bf16. Their times
    are the record's (experiments/device/quant_timing.py), not a test's target."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments" / "device"))
    import quant_timing

    quant_timing.main(["--resolution", "512", "--repeats", "3", "--out", str(tmp_path)])
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["status"] for r in recs] == ["ok"] * 4, recs
    dev = jax.devices()[0]
    cc = tuple(int(v) for v in str(getattr(dev, "compute_capability", "0.0")).split("."))
    assert (recs[3]["emulated"] is None) == (dev.platform == "gpu" and cc >= (8, 9))
    assert all(r["rel_diff_vs_first"] < 0.2 for r in recs), recs


def _mmdit(family):
    import test_parallel_flux as flux
    import test_parallel_sd3 as sd3

    m = flux if family == "flux" else sd3
    return m, *(m.micro_flux() if family == "flux" else m.micro_sd3())


@pytest.mark.parametrize("family", ["flux", pytest.param("sd3", marks=SLOW)])
def test_a_quantized_mmdit_runs_exact_strategies(family):
    """FLUX.1 and SD3 quantized: w8 under sync_patch equals the quantized model on one device."""
    m, fn, params = _mmdit(family)
    x, t, cond = m.inputs()
    qf, qp = quantize(fn, params, "w8")
    one = _call(qf, qp, x, t, cond, m.GUIDANCE)
    assert max_diff(one, _call(fn, params, x, t, cond, m.GUIDANCE)) > 1e-4  # quantized
    got = _call(qf, qp, x, t, cond, m.GUIDANCE, "sync_patch", 2)
    assert max_diff(got, one) <= 1e-4 * max(1.0, float(np.abs(one).max()))


def test_sd3s_layer_split_refuses_a_quantized_module():
    """SD3's layer-splitting stack (PipeFusion, AsyncDiff) runs blocks outside the quantized
    module: a one-line error."""
    m, fn, params = _mmdit("sd3")
    x, _, _ = m.inputs()
    qf, _ = quantize(fn, params, "w8")
    with pytest.raises(ValueError, match=r"quant='w8': SD3's layer-splitting stack"):
        Plan(make_strategy("pipefusion"), 2).validate(qf, x.shape[1:3], 10, m.GUIDANCE)


@pytest.mark.slow
def test_a_quantized_checkpoint_loads_without_the_floats(micro_folder, tmp_path, monkeypatch):
    """`save_quantized` writes a quantized denoiser beside its float checkpoint; loading the
    folder with that mode reads it (no float weights read) and gives the same parameters; a
    checkpoint of another config or compute dtype is a one-line error."""
    import json
    import shutil

    from patchpar.models.presets import model_family
    from patchpar.pipelines import load_pipeline

    folder = tmp_path / "model"
    shutil.copytree(micro_folder, folder)
    pipe = load_pipeline(folder, quant="w8")
    path = pipe.save_quantized()
    assert path.is_file()
    fam = type(model_family(folder))
    monkeypatch.setattr(fam, "load_denoiser", lambda *a, **k: pytest.fail("floats read"))
    again = load_pipeline(folder, quant="w8")
    assert again.quant == "w8"
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                        again.unet_params, pipe.unet_params)  # fmt: skip
    assert all(jax.tree.leaves(same))
    with pytest.raises(ValueError, match=r"holds float32, the model takes bfloat16"):
        load_pipeline(folder, jnp.bfloat16, quant="w8")
    meta = path.with_suffix(".json")
    info = json.loads(meta.read_text())
    info["config"]["cross_attention_dim"] = 64
    meta.write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"made from a denoiser of another config \(differs in "
                       r"\['cross_attention_dim'\]\); quantize the float model again"):  # fmt: skip
        load_pipeline(folder, quant="w8")
    with pytest.raises(ValueError, match=r"save_quantized: 'fmnist-dit' is not a local model"):
        load_pipeline("fmnist-dit", quant="w8").save_quantized()


@pytest.mark.slow
def test_a_quantized_checkpoint_is_bound_to_its_float_weights(micro_folder, tmp_path):
    """A quantized checkpoint keeps the digest of the float weights it was made from: after
    the floats change it is an error naming both (never a run on stale weights); its scales
    are checked for NaN/Inf at load; a damaged or half-written checkpoint names its file."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from patchpar.models import loading
    from patchpar.models.loading import CheckpointError
    from patchpar.pipelines import load_pipeline

    folder = tmp_path / "model"
    shutil.copytree(micro_folder, folder)
    pipe = load_pipeline(folder, quant="w8")
    (floats,) = (folder / "unet").glob("*.safetensors")
    floats.write_bytes(floats.read_bytes())  # rewritten after the pipeline read it
    with pytest.raises(ValueError, match=r"save_quantized: this denoiser's float weights changed "
                       r"since they were read"):  # fmt: skip
        pipe.save_quantized()
    path = load_pipeline(folder, quant="w8").save_quantized()
    meta = path.with_suffix(".json")
    with pytest.MonkeyPatch.context() as m:  # the floats' stamp unchanged: not read again
        m.setattr(loading, "_digest", lambda *a: pytest.fail("the float files were hashed"))
        assert load_pipeline(folder, quant="w8").quant_checkpoint == path
    assert load_pipeline(folder).quant_checkpoint is None
    moved = tmp_path / "moved"  # a copy: other stamps, the same digest
    shutil.copytree(folder, moved)
    assert load_pipeline(moved, quant="w8").quant == "w8"
    # the float weights change (halved): the checkpoint no longer is theirs
    kept = floats.read_bytes()
    save_file({k: v * 0.5 for k, v in load_file(floats).items()}, floats)
    with pytest.raises(CheckpointError, match=r"quantized checkpoint .*quantized-w8.npz' was made "
                       r"from other float weights than .* \(sha256 [0-9a-f]{16} then, "
                       r"[0-9a-f]{16} now\); quantize the float model again"):  # fmt: skip
        load_pipeline(folder, quant="w8")
    floats.write_bytes(kept)
    assert load_pipeline(folder, quant="w8").quant == "w8"
    # a NaN in a quantized scale: named at load, before anything is compiled
    arrays = dict(np.load(path))
    key = next(k for k in arrays if k.endswith("['scale']") and arrays[k].dtype == np.float32)
    arrays[key] = arrays[key].copy()
    arrays[key].flat[0] = np.nan
    np.savez(path, **arrays)
    with pytest.raises(CheckpointError, match=r"quantized checkpoint .*quantized-w8.npz'.*"
                       r"holds 1 NaN and 0 Inf"):  # fmt: skip
        load_pipeline(folder, quant="w8")
    # metadata that does not read, and arrays that are missing: both files named
    info = meta.read_text()
    meta.write_text(info[:20] + "\x01" + info[20:])
    with pytest.raises(CheckpointError, match=r"metadata .*quantized-w8.json' does not read"):
        load_pipeline(folder, quant="w8")
    meta.write_text(info)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint .*quantized-w8.npz' does not read "
                       r"\(FileNotFoundError.* though its metadata .*quantized-w8.json' is there"):  # fmt: skip
        load_pipeline(folder, quant="w8")
    # a checkpoint written before the binding (no digest): made again, not trusted
    meta.write_text(json.dumps({k: v for k, v in json.loads(info).items()
                                if k != "float_weights_sha256"}))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"\(sha256 not recorded then"):
        load_pipeline(folder, quant="w8")


def test_quantized_products_are_counted_apart_and_priced_at_their_peak():
    """`quantized_flops` counts the int8/fp8 dots of a quantized program (2 x out x k each,
    a loop's as often as it runs), and the projection prices them at the chip's int8/fp8 peak
    (H100: 2x bf16), or at its bf16 peak where it has no such units (A100's fp8: emulated)."""
    import flax.linen as nn
    import qwix

    from patchpar import hardware
    from patchpar.measure.comm import hlo_text_with_metadata
    from patchpar.measure.flops import quantized_flops

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(32, use_bias=False)(x)  # 2 x (4 x 16) x 32 quantized
            w = self.param("w", nn.initializers.normal(), (3, 32, 32))

            def body(h, wi):  # a loop of 3: never quantized by the rule (no Dense), float
                return h @ wi, None

            x, _ = jax.lax.scan(body, x, w)
            return nn.Dense(8, use_bias=False)(x)  # 2 x (4 x 32) x 8 quantized

    net, x = Net(), jnp.ones((4, 16))
    rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn,
                       act_qtype=jnp.float8_e4m3fn, op_names=("dot_general",))  # fmt: skip
    q = qwix.quantize_model(net, qwix.PtqProvider([rule]))
    params = qwix.quantize_params(net.init(jax.random.key(0), x)["params"],
                                  jax.eval_shape(q.init, jax.random.key(0), x)["params"])  # fmt: skip
    low = jax.jit(lambda p: q.apply({"params": p}, x)).lower(params)
    flops, kinds = quantized_flops(hlo_text_with_metadata(low))
    assert (flops, kinds) == (2 * 4 * 16 * 32 + 2 * 4 * 32 * 8, ["fp8"])
    low = jax.jit(lambda p: net.apply({"params": p}, x)).lower(
        net.init(jax.random.key(0), x)["params"]
    )
    assert quantized_flops(hlo_text_with_metadata(low)) == (0.0, [])
    # an int8 product inside a loop of 3 (fori_loop: a while with a constant bound) counts 3x

    def looped(x, w):
        def body(_, h):
            y = jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())),
                                    preferred_element_type=jnp.int32)  # fmt: skip
            return y.astype(jnp.int8)

        return jax.lax.fori_loop(0, 3, body, x)

    xi, wi = jnp.ones((4, 16), jnp.int8), jnp.ones((16, 16), jnp.int8)
    low = jax.jit(looped).lower(xi, wi)
    assert quantized_flops(hlo_text_with_metadata(low)) == (3 * 2 * 4 * 16 * 16, ["int8"])

    h100, a100 = hardware.load("h100-sxm"), hardware.load("a100-sxm")
    f, qf = 1e12, 6e11
    for hw, kind, peak in ((h100, "fp8", 1979e12), (a100, "int8", 624e12), (a100, "fp8", 312e12)):
        e, c = hw.flop_efficiency, hw.call_overhead_s
        want = (f - qf) / (hw.peak_flops * e) + qf / (peak * e) + c
        assert hw.compute_s(f, qf, kind) == pytest.approx(want)
        assert hw.emulates(kind) == (peak == hw.peak_flops)
    assert h100.compute_s(f) == h100.compute_s(f, 0.0, None)
