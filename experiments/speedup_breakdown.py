"""Where the time of a multi-process run goes: each phase's measured step time split into
compute, communication and everything else, beside the ideal (single / N).

    .venv/bin/python experiments/speedup_breakdown.py [runs/speedup_cpu [runs/speedup_cpu_compute]]  # results/... : the published

Reads the sweep's records (runs.jsonl), the same points run with every collective replaced by
a local stand-in (`measure.compute_only`, experiments/sweeps/speedup_cpu_compute.yaml) and the
collective benchmark's fit (collectives_fit.json, experiments/bench_collectives.py), then for
every run in launched processes and each of its phases:
- compute = that phase's step time measured with stand-in collectives: each device's own work
  alone, in the same processes on the same cores (DistriFusion Table 2's "no communication");
  also, for comparison, FLOPs per device (cost analysis) / the FLOP rate of `single`;
- communication = sum over the collectives of the compiled step (as XLA runs them, after its
  combiners) of latency + operand bytes / bandwidth of that kind, from the gloo benchmark;
- other = measured - compute - communication (what the benchmark's collectives in a loop do
  not show: waiting on the other process, copies around each collective).
Writes breakdown.md and breakdown.json next to the records.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def step_cost(pipe, plan, phase: str, config: dict, batch: int) -> tuple[float, Counter, Counter]:
    """(FLOPs per device, {op: count}, {op: operand bytes}) of one compiled step."""
    from patchpar.measure.comm import parse_collectives
    from patchpar.measure.flops import program_flops
    from patchpar.parallel.engine import make_step

    s = config["sampler"]
    hw = (s["height"], s.get("width") or s["height"])
    cond = pipe.encode_prompt(["a"] * batch, None, s["guidance_scale"], *hw)
    f = pipe.latent_factor
    x = jnp.zeros((batch, hw[0] // f, hw[1] // f, pipe.unet.config.in_channels), jnp.float32)
    t = jnp.asarray(500.0)
    mesh = plan.mesh()
    axis = plan.strategy.patch_axis(0)
    params = pipe.unet_params
    state = None
    if phase == "steady":
        warm = make_step(pipe.unet, plan, "warmup", axis, s["guidance_scale"], mesh)
        _, state = jax.eval_shape(warm, params, x, t, cond, None)
    step = make_step(pipe.unet, plan, phase, axis, s["guidance_scale"], mesh)
    lowered = jax.jit(step).lower(params, x, t, cond, state)
    flops = program_flops(lowered)  # the chunked kernel's loops counted in full
    compiled = lowered.compile()
    counts, nbytes = Counter(), Counter()
    for c in parse_collectives(compiled.as_text(), plan.devices):
        counts[c.op] += 1
        nbytes[c.op] += c.operand_bytes()
    return flops, counts, nbytes


def main(folder: Path, alone_folder: Path) -> None:
    from patchpar.lab.config import build_plan
    from patchpar.lab.generation import get_pipeline
    from patchpar.lab.results import PHASE_STEPS, read_records

    fit = json.loads((folder / "collectives_fit.json").read_text())["fit"]
    records = [r for r in read_records(folder / "runs.jsonl", skip_bad=True) if r["status"] == "ok"]
    alone = {}  # (model, label, phase) -> step seconds with stand-in collectives
    if (alone_folder / "runs.jsonl").is_file():
        for r in read_records(alone_folder / "runs.jsonl", skip_bad=True):
            if r["status"] == "ok" and r["config"]["measure"].get("compute_only"):
                for phase in ("warmup", "steady"):
                    t = r["metrics"].get(f"{phase}_step_s_median")
                    if t:
                        alone[(r["config"]["model"]["name"], r["label"], phase)] = t
    rows = []
    for model in sorted({r["config"]["model"]["name"] for r in records}):
        mine = [r for r in records if r["config"]["model"]["name"] == model]
        single = [r for r in mine if r["config"]["mesh"].get("processes") == 1]
        if not single:
            continue
        single = single[-1]
        cfg = single["config"]
        pipe = get_pipeline(model, cfg["sampler"]["dtype"])
        batch = single["metrics"]["batch"]
        one = build_plan("sync_patch", {}, 1, 1)
        flops_single, _, _ = step_cost(pipe, one, "warmup", cfg, batch)
        t_single = single["metrics"]["step_s_median"]
        rate = flops_single / t_single
        latest = {}
        for r in mine:
            if r["config"]["mesh"].get("processes", 0) >= 2:
                latest[r["label"]] = r
        for label, r in latest.items():
            m, c = r["metrics"], r["config"]
            n = c["mesh"]["devices"]
            plan = build_plan(c["strategy"]["name"], _options(c["strategy"]), n, c["mesh"]["cfg"])
            for phase in ("warmup", "steady"):
                measured = m.get(f"{phase}_step_s_median")
                if not measured:
                    continue
                flops, counts, nbytes = step_cost(pipe, plan, phase, c, batch)
                comm = sum(
                    counts[op] * fit[op]["latency_s"]
                    + (nbytes[op] / fit[op]["bytes_per_s"] if fit[op]["bytes_per_s"] else 0.0)
                    for op in counts
                )
                flops_s = flops / rate
                compute = alone.get((model, label, phase))
                rows.append({
                    "model": model, "label": label, "devices": n, "phase": phase,
                    "steps": m[PHASE_STEPS[phase]], "measured_s": measured,
                    "ideal_s": t_single / n, "compute_s": compute, "compute_flops_s": flops_s,
                    "comm_s": comm,
                    "other_s": None if compute is None else measured - compute - comm,
                    "collectives": dict(counts), "collective_bytes": dict(nbytes),
                    "flops_per_device": flops, "single_step_s": t_single,
                    "speedup_vs_single": m.get("speedup_vs_single"),
                    "steady_speedup_vs_single": m.get("steady_speedup_vs_single"),
                })  # fmt: skip
                print(_line(rows[-1]), flush=True)
    tmp = folder / "breakdown.json.tmp"
    tmp.write_text(json.dumps({"fit": fit, "rows": rows}, indent=1))
    tmp.replace(folder / "breakdown.json")
    (folder / "breakdown.md").write_text(markdown(rows, fit))
    print(f"-> {folder / 'breakdown.md'}")


def _options(strategy: dict) -> dict:
    from patchpar.lab.options import STRATEGY_OPTIONS

    return {k: strategy[k] for k in STRATEGY_OPTIONS if strategy.get(k) is not None}


def _ms(v) -> str:
    return "—" if v is None else f"{v * 1e3:.1f}"


def _line(r: dict) -> str:
    return (
        f"{r['model']:6s} {r['label']:28s} {r['phase']:6s} measured {_ms(r['measured_s'])} ms"
        f" = compute {_ms(r['compute_s'])} + comm {_ms(r['comm_s'])}"
        f" ({sum(r['collectives'].values())} collectives) + other {_ms(r['other_s'])};"
        f" ideal {_ms(r['ideal_s'])}; FLOPs-based compute {_ms(r['compute_flops_s'])}"
    )


def markdown(rows: list[dict], fit: dict) -> str:
    head = (
        "Per-step time of each phase, measured in 2 launched processes (one core each), split "
        "into compute (the same phase timed with every collective replaced by a local stand-in, "
        "`measure.compute_only`), communication (each compiled collective priced by the gloo "
        "benchmark's fit) and other (the rest). Ideal = single's step / N. FLOPs-based = FLOPs "
        "per device / single's FLOP rate on one core, for comparison. Written by "
        "`experiments/speedup_breakdown.py` from `runs.jsonl`, `../speedup_cpu_compute/runs.jsonl` "
        "and `collectives_fit.json`.\n\n"
        "Gloo fit (seconds = latency + bytes / bandwidth): "
        + "; ".join(
            f"{op} {f['latency_s'] * 1e3:.2f} ms"
            + (f" + bytes at {f['bytes_per_s'] / 1e9:.2f} GB/s" if f["bytes_per_s"] else "")
            for op, f in fit.items()
        )
        + "\n\n"
        "| model | strategy | phase | measured ms | ideal ms | compute ms | collectives | comm ms "
        "| other ms | FLOPs-based compute ms | measured / ideal |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['model']} | {r['label']} | {r['phase']} | {_ms(r['measured_s'])} "
        f"| {_ms(r['ideal_s'])} | {_ms(r['compute_s'])} | {sum(r['collectives'].values())} "
        f"| {_ms(r['comm_s'])} | {_ms(r['other_s'])} | {_ms(r['compute_flops_s'])} "
        f"| {r['measured_s'] / r['ideal_s']:.2f} |\n"
        for r in rows
    )
    return head + body


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        Path(args[0] if args else "runs/speedup_cpu"),
        Path(args[1] if len(args) > 1 else "runs/speedup_cpu_compute"),
    )
