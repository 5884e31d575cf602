"""Where the time of a multi-process run goes: each phase's measured step time split into
compute, communication and everything else, beside the ideal (single / N).

    .venv/bin/python experiments/speedup_breakdown.py [results/speedup_cpu]

Reads the sweep's records (runs.jsonl) and the collective benchmark's fit
(collectives_fit.json, from experiments/bench_collectives.py), then for every run in launched
processes and each of its phases:
- compute = FLOPs per device of one step (the compiled step's cost analysis) / the FLOP rate
  of `single` on one core (its FLOPs / its measured step time): the time the device's own
  arithmetic takes at the rate one core reaches on the whole image;
- communication = sum over the collectives of the compiled step (as XLA runs them, after its
  combiners) of latency + operand bytes / bandwidth of that kind, from the gloo benchmark;
- other = measured - compute - communication (dispatch, the smaller slabs' lower efficiency,
  waiting on the slower device).
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
        warm = make_step(pipe.unet, plan, "sync", axis, s["guidance_scale"], mesh)
        _, state = jax.eval_shape(warm, params, x, t, cond, None)
    step = make_step(pipe.unet, plan, phase, axis, s["guidance_scale"], mesh)
    lowered = jax.jit(step).lower(params, x, t, cond, state)
    flops = float(lowered.cost_analysis()["flops"])
    compiled = lowered.compile()
    counts, nbytes = Counter(), Counter()
    for c in parse_collectives(compiled.as_text(), plan.devices):
        counts[c.op] += 1
        nbytes[c.op] += c.operand_bytes()
    return flops, counts, nbytes


def main(folder: Path) -> None:
    from patchpar.lab.config import build_plan
    from patchpar.lab.generation import get_pipeline
    from patchpar.lab.results import read_records

    fit = json.loads((folder / "collectives_fit.json").read_text())["fit"]
    records = [r for r in read_records(folder / "runs.jsonl", skip_bad=True) if r["status"] == "ok"]
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
        flops_single, _, _ = step_cost(pipe, one, "sync", cfg, batch)
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
            for phase in ("sync", "steady"):
                measured = m.get(f"{phase}_step_s_median")
                if not measured:
                    continue
                flops, counts, nbytes = step_cost(pipe, plan, phase, c, batch)
                comm = sum(
                    counts[op] * fit[op]["latency_s"]
                    + (nbytes[op] / fit[op]["bytes_per_s"] if fit[op]["bytes_per_s"] else 0.0)
                    for op in counts
                )
                compute = flops / rate
                rows.append({
                    "model": model, "label": label, "devices": n, "phase": phase,
                    "steps": m[f"{phase}_steps"], "measured_s": measured,
                    "ideal_s": t_single / n, "compute_s": compute, "comm_s": comm,
                    "other_s": measured - compute - comm,
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
    from patchpar.lab.config import STRATEGY_OPTIONS

    return {k: strategy[k] for k in STRATEGY_OPTIONS if strategy.get(k) is not None}


def _line(r: dict) -> str:
    return (
        f"{r['model']:6s} {r['label']:28s} {r['phase']:6s} measured {r['measured_s'] * 1e3:8.1f} ms"
        f" = compute {r['compute_s'] * 1e3:8.1f} + comm {r['comm_s'] * 1e3:7.1f}"
        f" ({sum(r['collectives'].values())} collectives) + other {r['other_s'] * 1e3:7.1f};"
        f" ideal {r['ideal_s'] * 1e3:8.1f}"
    )


def markdown(rows: list[dict], fit: dict) -> str:
    head = (
        "Per-step time of each phase, measured in launched processes (one core each), split "
        "into compute (FLOPs per device / single's FLOP rate on one core), communication (each "
        "compiled collective priced by the gloo benchmark's fit) and other (the rest). Ideal = "
        "single's step / N. Written by `experiments/speedup_breakdown.py` from `runs.jsonl` and "
        "`collectives_fit.json`.\n\n"
        "Gloo fit (seconds = latency + bytes / bandwidth): "
        + "; ".join(
            f"{op} {f['latency_s'] * 1e3:.2f} ms"
            + (f" + bytes at {f['bytes_per_s'] / 1e9:.2f} GB/s" if f["bytes_per_s"] else "")
            for op, f in fit.items()
        )
        + "\n\n"
        "| model | strategy | phase | steps | measured ms | ideal ms | compute ms | collectives "
        "| comm ms | other ms | measured / ideal |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['model']} | {r['label']} | {r['phase']} | {r['steps']} | {r['measured_s'] * 1e3:.1f} "
        f"| {r['ideal_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
        f"{sum(r['collectives'].values())} | {r['comm_s'] * 1e3:.1f} | {r['other_s'] * 1e3:.1f} "
        f"| {r['measured_s'] / r['ideal_s']:.2f} |\n"
        for r in rows
    )
    return head + body


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/speedup_cpu"))
