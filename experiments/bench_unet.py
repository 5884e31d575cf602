"""One device of patchpar against diffusers' PyTorch UNet, on the same random diffusers folder.

    .venv/bin/python experiments/bench_unet.py                          # all rows, both cores
    .venv/bin/python experiments/bench_unet.py --rows sd:32 --repeats 5 --profile

For each row (config x latent size) the script writes a random diffusers UNet folder (seeded,
under --work), then times, each in a fresh child process so that neither framework's thread
pool disturbs the other: diffusers (`torch.inference_mode`, `torch.set_num_threads(threads)`)
and patchpar (`jax.jit` of the loaded UNet; XLA:CPU uses the same cores), batch 2, float32,
median of --repeats calls after a warm-up call. Torch runs first, then patchpar, in one run of
this script: the ratio patchpar / diffusers is measured on the same machine state.

Records go to <out>/records.jsonl, one per row, and the table to <out>/table.md. --profile adds
<out>/profile_<row>.md: patchpar's time per XLA op kind (JAX profiler) for that row.
Target (issue 14): ratio <= 1.0 on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# SD-like: SD 1.x's layout with small widths; heads as diffusers' attention_head_dim (= count).
SD = dict(
    block_out_channels=(64, 128, 256, 256),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
)
# SDXL-like: SDXL's layout (no attention at the first level, linear projections, deeper
# transformers lower down, text_time conditioning) with head dim 64 as SDXL.
SDXL = dict(
    block_out_channels=(64, 128, 256),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=2,
    attention_head_dim=(1, 2, 4),
    transformer_layers_per_block=(1, 2, 2),
    use_linear_projection=True,
    cross_attention_dim=2048,
    addition_embed_type="text_time",
    addition_time_embed_dim=32,
    projection_class_embeddings_input_dim=128 + 6 * 32,
)
CONFIGS = {"sd": SD, "sdxl": SDXL}
POOLED = {"sdxl": 128}
ROWS = ("sd:32", "sd:64", "sdxl:32", "sdxl:64")
BATCH = 2


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(ROWS), help="config:latent, e.g. sd:32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--attention", default="auto", help="patchpar's model.attention")
    p.add_argument("--block-q", type=int, default=None, help="default: AttentionSpec's")
    p.add_argument("--block-kv", type=int, default=None, help="default: AttentionSpec's")
    p.add_argument("--out", type=Path, default=Path("runs/bench_unet"))
    p.add_argument("--work", type=Path, default=Path(".bench_unet"))
    p.add_argument("--profile", action="store_true")
    p.add_argument("--child", choices=("torch", "jax"), help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for row in args.rows:
        kind, _, size = row.partition(":")
        if kind not in CONFIGS or not size.isdigit() or int(size) % 8:
            p.error(
                f"row {row!r}: expected config:latent with config in {list(CONFIGS)} and a "
                f"latent size that is a multiple of 8 (e.g. sd:32)"
            )
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    return args


def write_folder(kind: str, work: Path) -> Path:
    """The random diffusers UNet folder of a config (seed 0), written once."""
    folder = work / f"{kind}_unet"
    if not (folder / "config.json").is_file():
        import torch
        from diffusers import UNet2DConditionModel

        torch.manual_seed(0)
        UNet2DConditionModel(sample_size=64, **CONFIGS[kind]).save_pretrained(folder)
    return folder


def inputs(kind: str, size: int):
    import numpy as np

    rng = np.random.RandomState(0)
    x = rng.randn(BATCH, 4, size, size).astype(np.float32)
    ctx = rng.randn(BATCH, 77, CONFIGS[kind]["cross_attention_dim"]).astype(np.float32)
    t = np.full((BATCH,), 500.0, np.float32)
    added = {}
    if kind in POOLED:
        added = {
            "text_embeds": rng.randn(BATCH, POOLED[kind]).astype(np.float32),
            "time_ids": np.tile(
                np.array([[8 * size, 8 * size, 0, 0, 8 * size, 8 * size]], np.float32), (BATCH, 1)
            ),
        }
    return x, t, ctx, added


def _median_time(fn, repeats: int) -> tuple[float, float, list[float]]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first, times


def child_torch(args, kind: str, size: int) -> dict:
    import torch
    from diffusers import UNet2DConditionModel

    torch.set_num_threads(args.threads)
    model = UNet2DConditionModel.from_pretrained(write_folder(kind, args.work)).eval()
    x, t, ctx, added = inputs(kind, size)
    kw = {}
    if added:
        kw["added_cond_kwargs"] = {k: torch.tensor(v) for k, v in added.items()}
    xt, tt, ct = torch.tensor(x), torch.tensor(t), torch.tensor(ctx)
    with torch.inference_mode():
        med, first, times = _median_time(lambda: model(xt, tt, ct, **kw).sample, args.repeats)
    return {
        "seconds": med,
        "first_call_s": first,
        "times_s": times,
        "threads": torch.get_num_threads(),
        "version": torch.__version__,
    }


def child_jax(args, kind: str, size: int) -> dict:
    import jax  # importing jax does not start a backend
    import jax.numpy as jnp

    import patchpar  # noqa: F401  (XLA:CPU defaults before the backend starts)
    from patchpar.models.api import load_unet
    from patchpar.models.attention import AttentionSpec, resolve
    from patchpar.xla_flags import in_effect

    blocks = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv)) if v}
    spec = AttentionSpec(args.attention, **blocks)
    fn, params = load_unet(write_folder(kind, args.work), jnp.float32, spec)
    x, t, ctx, added = inputs(kind, size)
    xs = jnp.asarray(x.transpose(0, 2, 3, 1))
    ts, cs = jnp.asarray(t), jnp.asarray(ctx)
    kw = {k: jnp.asarray(v) for k, v in added.items()}
    f = jax.jit(fn)
    run = lambda: jax.block_until_ready(f(params, xs, ts, cs, **kw))  # noqa: E731
    med, first, times = _median_time(run, args.repeats)
    out = {
        "seconds": med,
        "first_call_s": first,
        "times_s": times,
        "attention": resolve(spec, jnp.float32).impl,
        "xla_flags": in_effect(),
        "version": jax.__version__,
        "devices": jax.device_count(),
    }
    if args.profile:
        out["profile"] = profile(run, f.lower(params, xs, ts, cs, **kw).compile().as_text())
    return out


def profile(run, hlo: str, calls: int = 3) -> list[tuple[str, float, float]]:
    """(op kind, ms per call, count per call) from a JAX profiler trace of `calls` calls."""
    import collections
    import gzip
    import re
    import tempfile

    import jax

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(calls):
            run()
        jax.profiler.stop_trace()
        trace = sorted(Path(tmp).rglob("*.trace.json.gz"))[-1]
        with gzip.open(trace) as fh:
            events = json.load(fh)["traceEvents"]
    # a fusion's kind: what its body computes (convolution, dot) or its XLA name without number
    bodies = dict(re.findall(r"^%(\S+) [^\n]*?\{\n(.*?)\n\}", hlo, re.M | re.S))
    calls_of = dict(re.findall(r"%(\S+) = \S+ fusion\(.*?calls=%([\w.\-]+)", hlo))
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or any(s in name for s in ("Thunk", "$", "Pjit", "Slinky", "end:")):
            continue
        body = bodies.get(calls_of.get(name, ""), "")
        kind = (
            "convolution"
            if "convolution(" in body
            else "dot"
            if " dot(" in body
            else re.sub(r"\.\d+$", "", name)
        )
        total[kind] += e["dur"] / 1000 / calls
        count[kind] += 1 / calls
    return [(k, round(v, 2), round(count[k])) for k, v in total.most_common(15)]


def run_child(args, framework: str, row: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        framework,
        "--row",
        row,
        "--repeats",
        str(args.repeats),
        "--threads",
        str(args.threads),
        "--attention",
        args.attention,
        "--work",
        str(args.work),
    ]
    if args.profile:
        cmd.append("--profile")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"{framework} child for {row} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> None:
    args = parse(argv)
    if args.child:
        kind, size = args.row.split(":")
        fn = child_torch if args.child == "torch" else child_jax
        print("RESULT " + json.dumps(fn(args, kind, int(size))), flush=True)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from patchpar.lab.results import append_record, provenance

    args.out.mkdir(parents=True, exist_ok=True)
    for kind in {r.split(":")[0] for r in args.rows}:
        write_folder(kind, args.work)
    rows = []
    for row in args.rows:
        torch_r = run_child(args, "torch", row)
        jax_r = run_child(args, "jax", row)
        kind, size = row.split(":")
        rec = {
            "row": row,
            "config": kind,
            "latent": int(size),
            "batch": BATCH,
            "dtype": "float32",
            "threads": args.threads,
            "repeats": args.repeats,
            "diffusers_s": torch_r["seconds"],
            "patchpar_s": jax_r["seconds"],
            "ratio": jax_r["seconds"] / torch_r["seconds"],
            "attention": jax_r["attention"],
            "xla_flags": jax_r["xla_flags"],
            "patchpar_compile_s": jax_r["first_call_s"],
            "diffusers_times_s": torch_r["times_s"],
            "patchpar_times_s": jax_r["times_s"],
            "torch": torch_r["version"],
            "jax": jax_r["version"],
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            **provenance(),
        }
        append_record(args.out / "records.jsonl", rec)
        rows.append(rec)
        print(
            f"{row:8s} diffusers {rec['diffusers_s'] * 1e3:8.1f} ms  patchpar "
            f"{rec['patchpar_s'] * 1e3:8.1f} ms  ratio {rec['ratio']:.2f} "
            f"({rec['attention']})",
            flush=True,
        )
        if args.profile and "profile" in jax_r:
            lines = [
                f"# patchpar time per XLA op kind, {row} (ms per call)",
                "",
                "| op kind | ms | count |",
                "|---|---|---|",
            ]
            lines += [f"| {k} | {ms} | {n} |" for k, ms, n in jax_r["profile"]]
            (args.out / f"profile_{kind}_{size}.md").write_text("\n".join(lines) + "\n")
    table = ["| row | diffusers ms | patchpar ms | ratio | attention |", "|---|---|---|---|---|"]
    table += [
        f"| {r['row']} | {r['diffusers_s'] * 1e3:.1f} | {r['patchpar_s'] * 1e3:.1f} | "
        f"{r['ratio']:.2f} | {r['attention']} |"
        for r in rows
    ]
    cmd = "python experiments/bench_unet.py " + " ".join(argv or sys.argv[1:])
    (args.out / "table.md").write_text(
        f"`{cmd.strip()}` (commit {rows[0].get('git_commit')}, {rows[0]['cores']} cores, "
        f"medians of {args.repeats})\n\n" + "\n".join(table) + "\n"
    )


if __name__ == "__main__":
    main()
