"""FLUX.1 on this CPU beside diffusers: one core, and 2 launched processes.

    .venv/bin/python experiments/bench_flux.py                 # both parts, ~25 min
    .venv/bin/python experiments/bench_flux.py --part core --rows mid:512 --repeats 3

Part `core` (one core, one thread each): patchpar's FLUX transformer call (`jax.jit` of the
loaded `FluxFn`) against diffusers' `FluxTransformer2DModel` (`torch.inference_mode`,
`torch.set_num_threads(1)`) on the same diffusers folder, batch 1 (FLUX.1-dev's guidance is an
input: one call per step), float32, median of --repeats calls after a warm-up call, each
framework in a fresh child process pinned to core 0. Rows (config:resolution in pixels):
- `mid`: FLUX.1's block layout at a width this CPU runs in seconds: 4 heads of 128 (RoPE on
  16/56/56 head dims, as FLUX.1), 2 double- and 4 single-stream blocks, T5 width 4096, 512
  text tokens, guidance embedding; random weights written by diffusers (seed 0);
- `tiny`: the `tiny-flux` preset's transformer (2 heads of 16, 32 text tokens), the model of
  part `processes`.
The two outputs are compared (max abs difference, printed and recorded).

Part `processes` (2 launched processes, one core each, against one process on one core), on
`tiny-flux` at 1024x1024 (4,096 image tokens + 32 text tokens: attention dominates):
- patchpar: `patchpar sweep experiments/sweeps/speedup_cpu_flux.yaml` (every strategy that
  runs on FLUX, 20 flow-matching Euler steps; ms per step, steady phase apart);
- diffusers: its own context parallelism (`ContextParallelConfig`: Ulysses, Ring) on 2 gloo
  processes, and its plain call on one core, timed per transformer call by
  `experiments/flux_cp_diffusers.py` (the CPU patches diffusers needs live there).

Records: <out>/core.jsonl, <out>/processes.jsonl (one per point), the patchpar sweep's
runs/speedup_cpu_flux/runs.jsonl; table: <out>/table.md. Targets: on one core patchpar at most
0.8x diffusers' time; on 2 processes patchpar's exact strategies at most diffusers' time per
step at the same degree, its stale ones faster.
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

ROOT = Path(__file__).resolve().parent.parent
MID = dict(
    patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
    num_attention_heads=4, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
TEXT_TOKENS = {"mid": 512, "tiny": 32}
ROWS = ("mid:512", "mid:1024", "tiny:1024")
SWEEP = ROOT / "experiments/sweeps/speedup_cpu_flux.yaml"
SWEEP_RUNS = Path("runs/speedup_cpu_flux")
CP_MODES = ("single", "ulysses", "ring")
CP_RESOLUTION = 1024


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("core", "processes", "both"), default="both")
    p.add_argument("--rows", nargs="+", default=list(ROWS), help="config:pixels, e.g. mid:512")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/bench_flux"))
    p.add_argument("--work", type=Path, default=Path(".bench_flux"))
    p.add_argument("--attention", default="auto", help="patchpar's model.attention")
    p.add_argument("--profile", action="store_true", help="patchpar's time per XLA op kind")
    p.add_argument("--child", choices=("torch", "jax"), help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for row in args.rows:
        kind, _, size = row.partition(":")
        if kind not in TEXT_TOKENS or not size.isdigit() or int(size) % 16:
            p.error(
                f"row {row!r}: expected config:pixels with config in {list(TEXT_TOKENS)} and a "
                f"size that is a multiple of 16 (VAE factor 8 x 2 x 2 packing), e.g. mid:512"
            )
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    return args


def tiny_folder() -> Path:
    """The tiny-flux preset's pipeline folder (written on first use, seed 0)."""
    sys.path.insert(0, str(ROOT))
    from patchpar.models.presets import preset_folder

    return Path(preset_folder("tiny-flux"))


def transformer_folder(kind: str, work: Path) -> Path:
    if kind == "tiny":
        return tiny_folder() / "transformer"
    folder = work / f"{kind}_transformer"
    if not (folder / "config.json").is_file():
        import torch
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        FluxTransformer2DModel(**MID).save_pretrained(folder)
    return folder


def inputs(config: dict, kind: str, size: int):
    """Seeded inputs: the latent NCHW (1, C, H/8, W/8), T5 states, pooled, t, guidance."""
    import numpy as np

    rng = np.random.RandomState(0)
    c, h = config["in_channels"] // 4, size // 8
    latent = rng.randn(1, c, h, h).astype(np.float32)
    ctx = rng.randn(1, TEXT_TOKENS[kind], config["joint_attention_dim"]).astype(np.float32)
    pooled = rng.randn(1, config["pooled_projection_dim"]).astype(np.float32)
    return latent, ctx, pooled, np.full((1,), 0.5, np.float32), np.full((1,), 3.5, np.float32)


def _median_time(fn, repeats: int):
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first, times, out


def child_torch(args, kind: str, size: int) -> dict:
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    torch.set_num_threads(1)
    folder = transformer_folder(kind, args.work)
    model = FluxTransformer2DModel.from_pretrained(folder).eval()
    latent, ctx, pooled, t, g = inputs(dict(model.config), kind, size)
    b, c, h, w = latent.shape  # diffusers' packing: (B, h/2 * w/2, C * 4)
    packed = latent.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    packed = packed.reshape(b, (h // 2) * (w // 2), c * 4)
    ids = np.zeros((h // 2, w // 2, 3), np.float32)
    ids[..., 1], ids[..., 2] = np.arange(h // 2)[:, None], np.arange(w // 2)[None, :]
    kw = dict(
        hidden_states=torch.tensor(packed), encoder_hidden_states=torch.tensor(ctx),
        pooled_projections=torch.tensor(pooled), timestep=torch.tensor(t),
        img_ids=torch.tensor(ids.reshape(-1, 3)), txt_ids=torch.zeros(ctx.shape[1], 3),
        guidance=torch.tensor(g) if model.config.guidance_embeds else None,
    )  # fmt: skip
    with torch.inference_mode():
        med, first, times, out = _median_time(lambda: model(**kw).sample, args.repeats)
    out = out.numpy().reshape(b, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    np.save(args.work / f"out_torch_{kind}_{size}.npy", out.reshape(b, h, w, c))
    return {"seconds": med, "first_call_s": first, "times_s": times,
            "threads": torch.get_num_threads(), "version": torch.__version__}  # fmt: skip


def child_jax(args, kind: str, size: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import patchpar  # noqa: F401  (XLA:CPU defaults before the backend starts)
    from patchpar.models.attention import AttentionSpec, resolve
    from patchpar.models.flux import load_flux
    from patchpar.xla_flags import in_effect

    folder = transformer_folder(kind, args.work)
    spec = AttentionSpec(args.attention)
    fn, params = load_flux(folder, jnp.float32, spec)
    config = json.loads((folder / "config.json").read_text())
    latent, ctx, pooled, t, g = inputs(config, kind, size)
    xs = jnp.asarray(latent.transpose(0, 2, 3, 1))
    kw = {"pooled_projections": jnp.asarray(pooled)}
    if config.get("guidance_embeds"):
        kw["guidance"] = jnp.asarray(g)
    f = jax.jit(fn)
    run = lambda: jax.block_until_ready(f(params, xs, jnp.asarray(t), jnp.asarray(ctx), **kw))  # noqa: E731
    med, first, times, out = _median_time(run, args.repeats)
    np.save(args.work / f"out_jax_{kind}_{size}.npy", np.asarray(out))
    res = {"seconds": med, "first_call_s": first, "times_s": times,
           "attention": resolve(spec, jnp.float32).impl, "xla_flags": in_effect(),
           "version": jax.__version__}  # fmt: skip
    if args.profile:
        from bench_unet import profile

        hlo = f.lower(params, xs, jnp.asarray(t), jnp.asarray(ctx), **kw).compile().as_text()
        res["profile"] = profile(run, hlo)
    return res


def run_child(args, framework: str, row: str) -> dict:
    cmd = [sys.executable, __file__, "--child", framework, "--row", row,
           "--repeats", str(args.repeats), "--work", str(args.work),
           "--attention", args.attention] + ["--profile"] * args.profile  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}  # fmt: skip
    proc = subprocess.run(["taskset", "-c", "0", *cmd], capture_output=True, text=True, env=env,
                          timeout=3600)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"{framework} child for {row} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def part_core(args, prov: dict) -> list[dict]:
    import numpy as np

    from patchpar.lab.results import append_record

    rows = []
    for row in args.rows:
        kind, size = row.split(":")
        transformer_folder(kind, args.work)
        torch_r, jax_r = run_child(args, "torch", row), run_child(args, "jax", row)
        a, b = (np.load(args.work / f"out_{f}_{kind}_{size}.npy") for f in ("torch", "jax"))
        rec = {
            "row": row, "config": kind, "pixels": int(size), "tokens": (int(size) // 16) ** 2,
            "text_tokens": TEXT_TOKENS[kind], "batch": 1, "dtype": "float32", "threads": 1,
            "repeats": args.repeats, "diffusers_s": torch_r["seconds"],
            "patchpar_s": jax_r["seconds"], "ratio": jax_r["seconds"] / torch_r["seconds"],
            "max_abs_diff": float(np.abs(a - b).max()), "output_max_abs": float(np.abs(a).max()),
            "attention": jax_r["attention"], "xla_flags": jax_r["xla_flags"],
            "patchpar_compile_s": jax_r["first_call_s"], "diffusers_times_s": torch_r["times_s"],
            "patchpar_times_s": jax_r["times_s"], "torch": torch_r["version"],
            "jax": jax_r["version"], "cpu": platform.processor() or platform.machine(), **prov,
        }  # fmt: skip
        if "profile" in jax_r:
            lines = [f"# patchpar time per XLA op kind, {row} (ms per call, one core)", "",
                     "| op kind | ms | count |", "|---|---|---|"]  # fmt: skip
            lines += [f"| {k} | {ms} | {n} |" for k, ms, n in jax_r.pop("profile")]
            (args.out / f"profile_{kind}_{size}.md").write_text("\n".join(lines) + "\n")
        append_record(args.out / "core.jsonl", rec)
        rows.append(rec)
        print(f"{row:10s} diffusers {rec['diffusers_s'] * 1e3:9.1f} ms  patchpar "
              f"{rec['patchpar_s'] * 1e3:9.1f} ms  ratio {rec['ratio']:.2f}  "
              f"max |diff| {rec['max_abs_diff']:.1e}", flush=True)  # fmt: skip
    return rows


def part_processes(args, prov: dict) -> list[dict]:
    from patchpar.lab.results import append_record

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    patchpar = [sys.executable, "-m", "patchpar.lab.cli"]
    subprocess.run([*patchpar, "sweep", str(SWEEP)], check=True, env=env, timeout=7200)
    folder = tiny_folder() / "transformer"
    rows = []
    for mode in CP_MODES:
        cmd = [sys.executable, str(ROOT / "experiments/flux_cp_diffusers.py"),
               "--transformer", str(folder), "--height", str(CP_RESOLUTION), "--width",
               str(CP_RESOLUTION), "--mode", mode, "--repeats", str(args.repeats),
               "--text-tokens", str(TEXT_TOKENS["tiny"])]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"diffusers {mode} failed (exit {proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")  # fmt: skip
        rec = {**json.loads(lines[-1][len("RESULT ") :]), "framework": "diffusers", **prov}
        append_record(args.out / "processes.jsonl", rec)
        rows.append(rec)
        print(f"diffusers {mode:8s} {rec['seconds'] * 1e3:9.1f} ms/call", flush=True)
    return rows


def write_table(args, core: list[dict], procs: list[dict]) -> None:
    lines = [f"`python experiments/bench_flux.py --part {args.part}` (commit "
             f"{(core or procs or [{}])[0].get('git_commit')}, medians of {args.repeats})", ""]  # fmt: skip
    if core:
        lines += ["One core: FLUX transformer call, batch 1, float32.", "",
                  "| row | tokens (image + text) | diffusers ms | patchpar ms | ratio | max abs diff |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['row']} | {r['tokens']} + {r['text_tokens']} | {r['diffusers_s'] * 1e3:.1f} | "
            f"{r['patchpar_s'] * 1e3:.1f} | {r['ratio']:.2f} | {r['max_abs_diff']:.1e} |"
            for r in core
        ]
    if procs:
        from patchpar.lab.results import read_records

        sweep = [r for r in read_records(SWEEP_RUNS / "runs.jsonl", skip_bad=True)
                 if r.get("status") == "ok"]  # fmt: skip
        lines += ["", f"2 processes, `tiny-flux` at {CP_RESOLUTION}²: ms per step (patchpar, "
                  "20 steps; steady phase in brackets) and per transformer call (diffusers).", "",
                  "| method | patchpar ms/step | diffusers ms/call |", "|---|---|---|"]  # fmt: skip
        dif = {r["mode"]: r["seconds"] * 1e3 for r in procs}
        for r in sweep:
            m = r["metrics"]
            name = r["label"]
            steady = m.get("steady_step_s_median")
            cell = f"{m['step_s_median'] * 1e3:.1f}" + (f" ({steady * 1e3:.1f})" if steady else "")
            other = {"single": "single", "ulysses": "ulysses", "ring": "ring"}.get(name)
            lines.append(f"| {name} | {cell} | {dif[other]:.1f} |" if other in dif
                         else f"| {name} | {cell} | |")  # fmt: skip
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'table.md'}")


def main(argv=None) -> None:
    args = parse(argv)
    if args.child:
        os.sched_setaffinity(0, {0})
        kind, size = args.row.split(":")
        fn = child_torch if args.child == "torch" else child_jax
        print("RESULT " + json.dumps(fn(args, kind, int(size))), flush=True)
        return
    sys.path.insert(0, str(ROOT))
    from patchpar.lab.results import provenance

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    prov = provenance()
    core = part_core(args, prov) if args.part in ("core", "both") else []
    procs = part_processes(args, prov) if args.part in ("processes", "both") else []
    write_table(args, core, procs)


if __name__ == "__main__":
    main()
