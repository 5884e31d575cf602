"""experiments/device/run_all.sh, the one command a lent GPU runs, in miniature on this CPU:
every part runs, writes its records, and the per-site comparison names its exchange."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_run_all_in_miniature(micro_folder, tmp_path):
    env = {
        **os.environ,
        "MINI": "1",
        "DEST": str(tmp_path / "device"),
        "MODEL": str(micro_folder),
        "RES": "64",
        "PY": sys.executable,
        "OUT": str(tmp_path),
    }
    env.pop("XLA_FLAGS", None)  # one device, as on the GPU machine
    done = subprocess.run(
        ["bash", "experiments/device/run_all.sh"], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    dest = tmp_path / "device"
    recs = {
        part: [json.loads(x) for x in (dest / part / "records.jsonl").read_text().splitlines()]
        for part in ("attention", "shard_packed", "shard_per_site", "quant")
    }
    assert all(r["status"] == "ok" for rs in recs.values() for r in rs), recs
    assert [r["attention"] for r in recs["attention"]] == ["xla", "chunked"]
    assert [r["patches"] for r in recs["shard_packed"]] == [1, 2]
    assert "comm_groups=1" in recs["shard_packed"][1]["strategy"]
    assert "comm_groups='per_site'" in recs["shard_per_site"][0]["strategy"]
    assert [r["mode"] for r in recs["quant"]] == ["none", "w8", "int8", "fp8"]
    assert recs["quant"][3]["emulated"]  # fp8 on a CPU
    assert (tmp_path / "run_all.tgz").stat().st_size > 0
    assert (dest / "machine.txt").read_text().count("jax") >= 1


# ------------------------------------------------------------- the TPU suite's pieces, on CPU


def test_weights_drawn_on_the_device_have_random_params_distributions():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax.traverse_util import flatten_dict

    from patchpar.models.components import random_params_on_device
    from patchpar.models.presets import abstract_denoiser

    abstract = abstract_denoiser("tiny-dit", jnp.bfloat16).abstract_params()
    drawn = flatten_dict(random_params_on_device(abstract, 0))
    again = flatten_dict(random_params_on_device(abstract, 0))
    other = flatten_dict(random_params_on_device(abstract, 1))
    flat = flatten_dict(abstract)
    assert drawn.keys() == flat.keys()
    for path, leaf in flat.items():
        got = drawn[path]
        assert (got.shape, got.dtype) == (leaf.shape, leaf.dtype), path
        assert bool(jnp.all(got == again[path])), path  # a seed draws the same weights
        value = np.asarray(got, np.float32)
        if path[-1] == "kernel" and value.size >= 4096:
            fan_in = int(np.prod(leaf.shape[:-1]))
            assert abs(value.std() * np.sqrt(fan_in) - 1) < 0.1, path  # LeCun normal
            assert not bool(jnp.all(got == other[path])), path
        elif path[-1] == "scale":
            assert (value == 1).all(), path
        elif path[-1] == "bias":
            assert (value == 0).all(), path
    # leaves of one shape are distinct draws, not one draw repeated
    kernels = [v for p, v in drawn.items() if p[-1] == "kernel"]
    shapes = [k.shape for k in kernels]
    twin = next(s for s in shapes if shapes.count(s) > 1)
    a, b = [k for k in kernels if k.shape == twin][:2]
    assert not bool(jnp.all(a == b))
    assert jax.tree.structure(random_params_on_device(abstract, 0)) == jax.tree.structure(abstract)


class _Chip:
    """A device as check_weights_fit sees one: a TPU with 1 GiB."""

    platform = "tpu"
    device_kind = "TPU v5 lite"

    def memory_stats(self):
        return {"bytes_limit": 2**30}


def test_weights_that_cannot_fit_a_chip_are_one_line_naming_what_would():
    import jax
    import jax.numpy as jnp

    from patchpar.measure.cost import check_weights_fit, param_bytes

    big = {"w": {"kernel": jax.ShapeDtypeStruct((32768, 24576), jnp.bfloat16)},
           "b": {"bias": jax.ShapeDtypeStruct((24576,), jnp.bfloat16)}}  # fmt: skip
    assert param_bytes(big) == 32768 * 24576 * 2 + 24576 * 2
    assert param_bytes(big, "w8") == 32768 * 24576 + 24576 * 2
    with pytest.raises(ValueError) as err:
        check_weights_fit(big, "big in bfloat16", _Chip())
    msg = str(err.value)
    assert "\n" not in msg
    assert "1.5 GiB" in msg and "1.0 GiB" in msg and "TPU v5 lite" in msg
    assert "w8 weights (0.8 GiB)" in msg and "FSDP over 2 or more chips" in msg
    small = {"w": {"kernel": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}}
    check_weights_fit(small, "small", _Chip())  # fits: nothing said
    check_weights_fit(big, "big", jax.devices("cpu")[0])  # CPUs are not checked


def test_a_pipeline_too_big_for_the_chip_is_refused_before_its_weights_are_read(
    micro_folder, monkeypatch
):
    import jax

    import patchpar.measure.cost as cost
    from patchpar.models import components
    from patchpar.pipelines import load_pipeline

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(jax, "local_devices", lambda *a, **k: [_Chip()])
    monkeypatch.setattr(cost, "device_memory_bytes", lambda device: 1000)
    read = []
    monkeypatch.setattr(components, "read_state_dict", lambda *a: read.append(a))
    with pytest.raises(ValueError, match="its weights alone are .* more than the 0.0 GiB"):
        load_pipeline(micro_folder)
    assert read == []


def test_a_preset_with_config_overrides():
    import jax.numpy as jnp

    from patchpar.measure.cost import param_bytes
    from patchpar.models.presets import abstract_denoiser

    full = abstract_denoiser("tiny-flux", jnp.float32)
    shallow = abstract_denoiser("tiny-flux", jnp.float32, overrides={"num_single_layers": 1})
    assert param_bytes(shallow.abstract_params()) < param_bytes(full.abstract_params())
    with pytest.raises(ValueError, match=r"\['num_layerz'\] are not keys of preset tiny-flux"):
        abstract_denoiser("tiny-flux", jnp.float32, overrides={"num_layerz": 1})


def test_flops_are_counted_where_the_backend_gives_no_count_before_compiling():
    import jax
    import jax.numpy as jnp

    from patchpar.measure.flops import program_flops

    def f(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, y: y @ w, x)

    low = jax.jit(f).lower(jnp.ones((8, 16)), jnp.ones((16, 16)))
    counted = program_flops(low)
    assert counted == pytest.approx(3 * 2 * 8 * 16 * 16, rel=0.05)
    assert program_flops(low, xla_flops=float("nan")) == counted  # a TPU's Lowered: NaN


def test_a_device_part_without_its_packages_names_them_and_the_wheel_script(monkeypatch):
    sys.path.insert(0, str(REPO / "experiments" / "device"))
    try:
        from calls import needs
    finally:
        sys.path.pop(0)
    needs("json")
    with pytest.raises(SystemExit) as err:
        needs("json", "yaml_is_not_here", "docstring_parser_nope")
    assert "yaml_is_not_here, docstring_parser_nope" in str(err.value)
    assert "experiments/device/wheels_tpu.sh" in str(err.value)


def test_a_copied_tree_names_its_commit(monkeypatch):
    from patchpar.lab import results

    results.git_commit.cache_clear()
    results.git_dirty.cache_clear()
    monkeypatch.setenv("PATCHPAR_GIT_COMMIT", "03ec213")
    try:
        assert results.git_commit() == "03ec213"
        assert results.git_dirty() is None
    finally:
        results.git_commit.cache_clear()
        results.git_dirty.cache_clear()


@pytest.mark.slow
def test_family_timing_records_time_flops_and_mfu(tmp_path):
    env = {**os.environ, "PATCHPAR_COMPILE_CACHE": "off"}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "experiments/device/family_timing.py", "--models",
         "tiny-dit:num_layers=1", "--resolutions", "32", "--attention", "xla", "chunked:64x64",
         "--dtype", "float32", "--repeats", "1", "--hardware", "cpu-gloo", "--out",
         str(tmp_path), "--profile", str(tmp_path / "trace")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    # every point's two traced calls in a folder of its own, named in its record
    assert [r["profile"] for r in recs] == [
        "tiny-dit_num_layers_1-32-xla", "tiny-dit_num_layers_1-32-chunked-64x64"
    ]  # fmt: skip
    for r in recs:
        assert list((tmp_path / "trace" / r["profile"]).rglob("*.xplane.pb")), r["profile"]
    assert [(r["attention"], r["block_q"], r["status"]) for r in recs] == [
        ("xla", 256, "ok"), ("chunked", 64, "ok")
    ]  # fmt: skip
    for r in recs:
        assert r["flops"] > 0 and r["batch"] == 2
        assert r["mfu"] == pytest.approx(r["flops"] / r["call_s_median"] / r["peak_flops"])
        assert r["memory_compiled"]["total"] > r["weight_bytes"] > 0
    assert "tiny-dit:num_layers=1 | 32 | 2 | chunked 64x64 |" in (tmp_path / "table.md").read_text()


@pytest.mark.slow
def test_the_tpu_suite_in_miniature(tmp_path):
    env = {**os.environ, "MINI": "1", "DEST": str(tmp_path / "tpu"), "PY": sys.executable,
           "OUT": str(tmp_path), "PATCHPAR_COMPILE_CACHE": str(tmp_path / "cc")}  # fmt: skip
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        ["bash", "experiments/device/tpu_suite.sh", "families", "flops", "blocks", "shards",
         "attention_sources", "quant", "compile", "pipeline"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    dest = tmp_path / "tpu"
    parts = ("families", "flops", "blocks", "shards", "attention_sources", "quant", "compile",
             "pipeline")  # fmt: skip
    for part in parts:
        recs = [json.loads(x) for x in (dest / part / "records.jsonl").read_text().splitlines()]
        assert recs and all(r["status"] == "ok" for r in recs), (part, recs)
    assert (tmp_path / "tpu_suite.tgz").stat().st_size > 0
    (whole,) = [
        json.loads(x) for x in (dest / "pipeline" / "records.jsonl").read_text().splitlines()
    ]
    assert whole["image_s_median"] > 0 and whole["cold_ready_s"] > 0  # a whole image, staged
    assert whole["warm_stages_s"]["compile_s"] < whole["cold_stages_s"]["compile_s"]  # the cache
    done = subprocess.run(
        [sys.executable, "experiments/device/tpu_tables.py", str(dest)], cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "| tiny-dit | 64 | 2 |" in (dest / "tables.md").read_text()


def test_tpu_tables_set_patchpar_beside_its_peer_and_each_strategy_beside_single(tmp_path):
    def write(part, recs):
        (tmp_path / part).mkdir()
        (tmp_path / part / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    point = {"model": "sdxl", "resolution": 1024, "status": "ok", "compile_s": 1.0,
             "memory_compiled": {"total": 2**30}, "batch": 2, "block_q": None, "block_kv": None}  # fmt: skip
    write("peer", [
        {**point, "implementation": "patchpar", "attention": "xla", "program_flops": 13.59e12,
         "call_s_median": 0.16},
        {**point, "implementation": "patchpar", "attention": "splash:1024x1024",
         "program_flops": 12e12, "call_s_median": 0.12},
        {**point, "implementation": "diffusers 0.35.2", "attention": "diffusers default",
         "program_flops": 13.5e12, "call_s_median": 0.15},
    ])  # fmt: skip
    shard = {"model": "pixart-alpha", "resolution": 1024, "status": "ok", "block_q": 256,
             "block_kv": 512}  # fmt: skip
    splash, chunked = {**shard, "attention": "splash"}, {**shard, "attention": "chunked"}
    write("shards", [
        {**splash, "patches": 1, "strategy": "single()", "unet_call_s_median": 0.2},
        {**splash, "patches": 4, "strategy": "sync_patch()", "unet_call_s_median": 0.06},
    ])  # fmt: skip
    write("shards_chunked", [
        {**chunked, "patches": 1, "strategy": "single()", "unet_call_s_median": 0.1},
        {**chunked, "patches": 4, "strategy": "distrifusion()", "unet_call_s_median": 0.03},
    ])  # fmt: skip
    # a later call without a single program of its own: the ratio is over the same kernel's
    write(
        "shards_more", [{**chunked, "patches": 2, "strategy": "pcpp()", "unet_call_s_median": 0.04}]
    )
    # a record from before the kernel was recorded, at a commit git does not know: not guessed
    write("shards_old", [{**shard, "patches": 1, "strategy": "single()", "git_commit": "0000000",
                          "unet_call_s_median": 0.3}])  # fmt: skip
    sys.path.insert(0, str(REPO / "experiments" / "device"))
    try:
        import tpu_tables
    finally:
        sys.path.pop(0)
    tpu_tables.main([str(tmp_path)])
    text = (tmp_path / "tables.md").read_text()
    # one FLOP count for every row (the xla program's), time over the peer's best
    assert "| sdxl | 1024 | patchpar | splash:1024x1024 | 120.0 | 57% | 0.80x | 1 |" in text
    assert "| sdxl | 1024 | patchpar | xla | 160.0 | 43% | 1.07x | 1 |" in text
    assert (
        "| sdxl | 1024 | diffusers 0.35.2 | diffusers default | 150.0 | 46% | 1.00x | 1 |" in text
    )
    # the peer's records stay out of the per-family table
    assert "| sdxl | 1024 | 2 |" not in text
    assert (
        "| pixart-alpha | 1024 | splash 256x512 | sync_patch | 4 | 60.0 | 1.20 | `shards/` |"
        in text
    )
    assert (
        "| pixart-alpha | 1024 | chunked 256x512 | distrifusion | 4 | 30.0 | 1.20 | `shards_chunked/` |"
        in text
    )
    assert (
        "| pixart-alpha | 1024 | chunked 256x512 | pcpp | 2 | 40.0 | 0.80 (single from "
        "`shards_chunked/`) | `shards_more/` |" in text
    )
    assert "| pixart-alpha | 1024 | auto | single | 1 | 300.0 | 1.00 | `shards_old/` |" in text


def test_profile_summary_splits_time_by_category_and_prices_the_kernel_by_subtraction():
    """profile_ops.py's table from xprof's per-op rows (made up here: xprof is not needed): ms
    per call over the calls traced, a Pallas kernel's calls as one row, and its TFLOP the
    program's count less what XLA counts in the other ops."""
    sys.path.insert(0, str(REPO / "experiments" / "device"))
    from profile_ops import summarize

    def op(name, cat, us, gflops_per_s=0.0, n=2):
        return {"hlo_op_name": name, "category": cat, "total_self_time": us, "occurrences": n,
                "model_flop_rate": gflops_per_s, "bound_by": "Compute", "hlo_op_expression": name}  # fmt: skip

    ops = [  # two calls traced: 60 ms of products at 150 TFLOP/s, 2 x 15 ms of a kernel, a copy
        op("fusion.1", "convolution fusion", 120_000, 150_000),
        op("splash.1", "custom-call", 30_000),
        op("splash.2", "custom-call", 30_000),
        op("copy.3", "data formatting", 20_000),
    ]
    text = "\n".join(summarize("point", ops, calls=2, top=5, flops=12e12))
    assert "Device busy 100.0 ms per call" in text
    assert "| convolution fusion | 60.0 | 60% | 9.00 | 150 |" in text
    assert "| custom-call | 30.0 | 30% | 3.00 | 100 |" in text  # 12 - 9 TFLOP in 30 ms
    assert "| splash.* | custom-call | 2 | 30.00 |" in text  # both kernel calls, one row
    assert "| data formatting | 10.0 | 10% | 0.00 | - |" in text


def test_profile_by_shape_sums_one_kind_of_op_over_an_unrolled_programs_layers():
    """`--by-shape`: ops of one category and one result type (each layer's own op in an
    unrolled program) as one row, their calls and time summed and their FLOP rate weighted by
    time; another type, another category, a custom call (a kernel: `by_kernel`'s) or an
    expression without a type stays a row of its own."""
    sys.path.insert(0, str(REPO / "experiments" / "device"))
    from profile_ops import summarize

    def op(name, cat, us, typ, rate=0.0, kind="fusion"):
        expr = f"%{name} = {typ} {kind}(bf16[8]{{0}} %p)" if typ else name
        return {"hlo_op_name": name, "category": cat, "total_self_time": us, "occurrences": 2,
                "model_flop_rate": rate, "bound_by": "HBM", "hlo_op_expression": expr}  # fmt: skip

    block = "(bf16[2,16,512,72]{2,3,1,0}, bf16[2,16,512,72]{2,3,1,0})"
    ops = [  # two calls traced: three layers' slices of one type, one of another, ...
        op("slice.1", "loop fusion", 2_000, block, rate=1000.0),
        op("slice.2", "loop fusion", 2_000, block, rate=4000.0),
        op("slice.3", "loop fusion", 4_000, block, rate=0.0),
        op("slice.4", "loop fusion", 4_000, "bf16[4,2]{1,0}"),
        op("copy.6", "data formatting", 6_000, block),  # the slices' type, another category
        op("kernel.7", "custom-call", 8_000, block, kind="custom-call"),
        op("other.8", "custom-call", 2_000, block, kind="custom-call"),  # another kernel
        op("copy.5", "data formatting", 10_000, ""),
    ]
    text = "\n".join(summarize("point", ops, calls=2, top=9, flops=None, shapes=True))
    # 4 ms a call of 19; (1 x 2 + 4 x 2 + 0 x 4) / 8 = 1.25 TFLOP/s
    assert "| slice.1 (+2 same shape) | loop fusion | 3 | 4.00 | 21.1% | 1 |" in text
    assert "| slice.4 | loop fusion | 1 | 2.00 |" in text
    assert "| copy.6 | data formatting | 1 | 3.00 |" in text
    assert "| kernel.* | custom-call | 1 | 4.00 |" in text
    assert "| other.* | custom-call | 1 | 1.00 |" in text  # two kernels: never one row
    assert "| copy.5 | data formatting | 1 | 5.00 |" in text
    plain = "\n".join(summarize("point", ops, calls=2, top=9, flops=None))
    assert "| slice.2 | loop fusion | 1 | 1.00 |" in plain  # without it: each op its own row


def _random_folder():
    sys.path.insert(0, str(REPO / "experiments" / "device"))
    from random_folder import main

    return main


def test_a_random_folder_of_a_preset_is_written_whole_in_bfloat16(tmp_path, capsys, monkeypatch):
    """random_folder.py: a preset's whole pipeline folder with random weights, its floats
    stored in bf16, nothing left beside it; bad arguments are one-line errors before any
    work."""
    from safetensors.numpy import load_file

    random_folder = _random_folder()
    out = tmp_path / "tiny-xl"
    assert random_folder(["--model", "tiny-xl", "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert "tiny-xl (bfloat16, seed 0)" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-xl"]  # nothing left beside it
    for part in ("unet", "vae"):
        state = load_file(str(out / part / "diffusion_pytorch_model.safetensors"))
        assert {str(v.dtype) for v in state.values()} == {"bfloat16"}
    assert (out / "tokenizer_2" / "vocab.json").is_file()
    assert (out / "model_index.json").is_file()

    empty = tmp_path / "empty"  # an empty --out: the folder written in its place
    empty.mkdir()
    assert random_folder(["--model", "tiny", "--out", str(empty)]) == 0
    assert (empty / "model_index.json").is_file()
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())

    for args, says in [
        (["--model", "sdxxl", "--out", str(tmp_path / "a")], "--model 'sdxxl' is not a preset"),
        (["--model", "tiny", "--out", str(out)], "exists and is not an empty folder"),
        (["--model", "tiny", "--out", str(tmp_path / "b"), "--dtype", "fp8"], "--dtype 'fp8'"),
        (["--model", "tiny", "--out", "."], "is the working folder or holds it"),
    ]:
        with pytest.raises(SystemExit) as e:
            random_folder(args)
        assert says in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    def no_bpe():
        raise CheckpointError("the CLIP BPE vocabulary comes from open-clip-torch, not installed")

    from patchpar.models import tokenizer
    from patchpar.models.loading import CheckpointError

    monkeypatch.setattr(tokenizer, "open_clip_bpe_path", no_bpe)  # said before any weights
    with pytest.raises(SystemExit, match="tiny-xl has CLIP text encoders: the CLIP BPE"):
        random_folder(["--model", "tiny-xl", "--out", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_a_random_bfloat16_folder_loads_and_generates(tmp_path):
    """The folder random_folder.py writes is a pipeline like any diffusers folder: loaded and
    run in bf16, it gives images (NaN or Inf would be an error)."""
    import jax.numpy as jnp
    import numpy as np

    from patchpar.pipelines import load_pipeline

    out = tmp_path / "tiny-xl"
    assert _random_folder()(["--model", "tiny-xl", "--out", str(out), "--dtype", "bfloat16"]) == 0
    images = load_pipeline(str(out), jnp.bfloat16)("a red bag", 64, 64, steps=2).images
    assert images.shape == (1, 64, 64, 3) and np.asarray(images, float).std() > 0
