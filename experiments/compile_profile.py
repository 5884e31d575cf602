"""Where compile time goes: every point of a sweep file, each phase program traced, lowered and
compiled apart, with its program size.

    .venv/bin/python experiments/compile_profile.py [experiments/sweeps/quickstart.yaml] \
        [--out runs/compile_profile] [--label NAME] [--compile-cache DIR]

For each point (the same programs `patchpar run` times: `pipe.denoise_phases`) and each of its
phases, in this process, one after another:
- trace_s: Python tracing of the phase's loop to a jaxpr (`jax.jit(fn).trace`);
- lower_s: the jaxpr to StableHLO (`.lower()`);
- compile_s: XLA's passes and code generation (`.compile()`); with a warm persistent cache this
  is the cache read;
- stablehlo_ops: operations in the lowered module (before XLA's passes);
- hlo_instructions: instructions of the optimised HLO, every computation counted;
- hlo_opcodes: the same by opcode (where two programs' sizes differ).
A point's total is what its run waits for before timing starts. The programs a point shares
with an earlier one (same HLO) hit JAX's in-process caches only when they are the same
function; this profile makes every point's functions anew, as a fresh `patchpar run` does.
`--compile-cache DIR` turns on the persistent compilation cache in DIR (run twice: cold, warm).

`--full-size MODEL` (e.g. sdxl) instead lowers and compiles one model call per phase of MODEL
with abstract weights (nothing loaded) at `--resolution` (1024) on `--devices` (8) fake devices,
float32 (the CPU compiler has no bf16 dots), for `--strategies` (sync_patch distrifusion): the
step programs `patchpar comm` counts, without the denoising loop around them.
Writes profile.jsonl (one row per point and phase, appended, tagged with --label) and prints a
table.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

_INSTR = re.compile(r"^\s+(ROOT\s+)?%?[\w.\-]+ = ", re.M)
_OP = re.compile(r"^\s+(%[\w#:]+(, %[\w#:]+)* = )?\"?[a-z_]+\.[a-z_.]+", re.M)


def hlo_instructions(text: str) -> int:
    """Instructions of an HLO module's text, over all its computations."""
    return len(_INSTR.findall(text))


_OPCODE = re.compile(r"^\s+(?:ROOT\s+)?%?[\w.\-]+ = .*? ([a-z][a-z\-]*)\(", re.M)


def hlo_opcodes(text: str) -> dict[str, int]:
    """Instructions of an HLO module's text by opcode (fusion, add, parameter, ...), over all
    its computations (a fused computation's own instructions included), most first."""
    counts: dict[str, int] = {}
    for op in _OPCODE.findall(text):
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def stablehlo_ops(text: str) -> int:
    """Operations of a StableHLO/MLIR module's text (dialect.op lines)."""
    return len(_OP.findall(text))


def _row(label, devices, model, phase, steps, times, low, compiled, log) -> dict:
    """One phase's profile row (times: perf_counter before tracing, after it, after lowering,
    after compiling), said on `log` too."""
    t0, t1, t2, t3 = times
    r = {
        "label": label,
        "devices": devices,
        "model": model,
        "phase": phase,
        "steps": steps,
        "trace_s": t1 - t0,
        "lower_s": t2 - t1,
        "compile_s": t3 - t2,
        "stablehlo_ops": stablehlo_ops(low.as_text()),
        "hlo_instructions": hlo_instructions(compiled.as_text()),
        "hlo_opcodes": hlo_opcodes(compiled.as_text()),
    }
    log(
        f"  {model} {label} on {devices}: {phase} trace {r['trace_s']:.2f} s, lower "
        f"{r['lower_s']:.2f} s, compile {r['compile_s']:.2f} s; {r['stablehlo_ops']} ops -> "
        f"{r['hlo_instructions']} HLO instructions"
    )
    return r


def point_name(cfg) -> str:
    extra = (f" data={cfg.mesh.data}" if cfg.mesh.data > 1 else "") + (
        " fsdp" if cfg.mesh.fsdp else ""
    )
    return cfg.strategy.label() + extra


def profile_point(cfg, log) -> list[dict]:
    import jax

    from patchpar.lab.generation import batches, get_pipeline, inputs
    from patchpar.lab.runner import checked_plan
    from patchpar.pipelines.phased import outputs_abstract

    s = cfg.sampler
    pipe = get_pipeline(cfg.model.name, s.dtype, cfg.model.attention_spec())
    pipe = pipe.with_true_cfg(s.true_cfg_scale)
    plan, hw, pipe = checked_plan(cfg, pipe)
    cond, x0 = inputs(pipe, cfg, batches(cfg)[0], hw)
    programs, args = pipe.denoise_phases(cond, x0, s.name, s.steps, s.guidance_scale, plan)
    rows, x, loop = [], args[3], None
    for phase, n, fn in programs:
        t0 = time.perf_counter()
        traced = jax.jit(fn).trace(*args[:3], x, loop)
        t1 = time.perf_counter()
        low = traced.lower()
        t2 = time.perf_counter()
        c = low.compile()
        t3 = time.perf_counter()
        x, loop = outputs_abstract(c)
        rows.append(_row(point_name(cfg), cfg.mesh.devices, cfg.model.name, phase, n,
                         (t0, t1, t2, t3), low, c, log))  # fmt: skip
    return rows


def profile_full_size(model, strategy, resolution, devices, log) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from patchpar.lab.config import build_plan
    from patchpar.models.attention import AttentionSpec
    from patchpar.models.presets import abstract_denoiser
    from patchpar.parallel.engine import abstract_inputs, make_step

    unet = abstract_denoiser(model, jnp.float32, AttentionSpec("chunked"))
    plan = build_plan(strategy, {}, devices, 1)
    f = resolution // 8
    gs = 5.0 if unet.guidance_halves > 1 else 1.0
    plan.validate(unet, (f, f), 1_000_000, gs, 1)
    params = unet.abstract_params()
    x, t, cond = abstract_inputs(unet, (f, f), 1)
    mesh, axis = plan.mesh(), plan.strategy.patch_axis(0)
    phases = ["warmup"] + (["steady"] if plan.strategy.warmup_phase_steps(50) < 50 else [])
    state, rows = None, []
    for phase in phases:
        step = make_step(unet, plan, phase, axis, gs, mesh)
        t0 = time.perf_counter()
        traced = jax.jit(step).trace(params, x, t, cond, state if phase == "steady" else None)
        t1 = time.perf_counter()
        low = traced.lower()
        t2 = time.perf_counter()
        c = low.compile()
        t3 = time.perf_counter()
        if phase == "warmup":
            _, state = jax.eval_shape(step, params, x, t, cond, None)
        model_name = f"{model} {resolution}px (abstract, one model call)"
        rows.append(_row(strategy, devices, model_name, phase, 1, (t0, t1, t2, t3), low, c, log))
    return rows


def table(rows: list[dict]) -> str:
    points: dict = {}
    for r in rows:
        points.setdefault((r["label"], r["devices"]), []).append(r)
    out = [
        "| point | devices | phases | trace s | lower s | compile s | total s | StableHLO ops "
        "| HLO instructions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, dev), rs in points.items():
        tot = {k: sum(r[k] for r in rs) for k in ("trace_s", "lower_s", "compile_s")}
        out.append(
            f"| {label} | {dev} | {len(rs)} | {tot['trace_s']:.2f} | {tot['lower_s']:.2f} | "
            f"{tot['compile_s']:.2f} | {sum(tot.values()):.2f} | "
            f"{sum(r['stablehlo_ops'] for r in rs)} | {sum(r['hlo_instructions'] for r in rs)} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep", nargs="?", default="experiments/sweeps/quickstart.yaml")
    ap.add_argument("--out", default="runs/compile_profile")
    ap.add_argument("--label", default="", help="tag of this profile's rows (e.g. cold, warm)")
    ap.add_argument("--compile-cache", default=None, help="persistent compilation cache folder")
    ap.add_argument("--only", nargs="*", default=None, help="labels of the points to profile")
    ap.add_argument("--full-size", default=None, help="a preset profiled abstractly (e.g. sdxl)")
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--strategies", nargs="+", default=["sync_patch", "distrifusion"])
    a = ap.parse_args()

    from patchpar.lab.results import provenance
    from patchpar.lab.sweep import load_sweep

    if a.compile_cache:
        from patchpar.compile_cache import enable

        enable(Path(a.compile_cache))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.perf_counter()
    if a.full_size:
        for strategy in a.strategies:
            for r in profile_full_size(a.full_size, strategy, a.resolution, a.devices, print):
                r.update(
                    tag=a.label,
                    sweep=None,
                    commit=provenance().get("git_commit"),
                    dirty=provenance().get("git_dirty"),
                )
                rows.append(r)
        print(f"{len(a.strategies)} points in {time.perf_counter() - t0:.1f} s")
    else:
        points = load_sweep(a.sweep)
        if a.only:
            points = [p for p in points if point_name(p) in a.only]
        for cfg in points:
            for r in profile_point(cfg, print):
                r.update(
                    tag=a.label,
                    sweep=a.sweep,
                    commit=provenance().get("git_commit"),
                    dirty=provenance().get("git_dirty"),
                )
                rows.append(r)
        print(f"{len(points)} points in {time.perf_counter() - t0:.1f} s")
    with open(out / "profile.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
