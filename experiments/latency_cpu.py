"""The projection checked against real runs on this CPU (issue 15): the cpu-gloo profile and
each device's compute timed alone predict the measured 2-process speedups of issue 13.

    .venv/bin/python experiments/latency_cpu.py                 # check (and fit cpu-gloo)
    taskset -c 0 .venv/bin/python experiments/latency_cpu.py --measure-peak   # one core's peak

Measured (records): <measured>/runs.jsonl (default runs/speedup_cpu, a user's own sweep;
`--measured results/speedup_cpu --compute results/speedup_cpu_compute` reads the published; every strategy in 2 launched processes,
`single` on one core; tiny at 512x512 and fmnist at 32x32, 20 DDIM steps, warm-up 4) and
<compute>/runs.jsonl (the same points with every collective replaced by a
local stand-in: each device's compute alone, per phase).
Projected: per phase, the timed compute plus the step's collectives priced by the cpu-gloo
profile (latency + bytes / rate per op, patchpar/hardware/cpu-gloo.yaml, measured by bench_collectives.py), all
exposed (XLA's CPU runtime runs collectives synchronously); speedup = single's measured step
over the projected mean step. The collectives are read from the lowered programs of the same
points (workloads cached in <out>/workloads_cpu.jsonl).
Also the fully modelled variant: compute from FLOPs with cpu-gloo's fitted constants (fitted
on the two `single` rows only and written into patchpar/hardware/cpu-gloo.yaml).
Output: <out>/cpu.jsonl and <out>/cpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "latency")
    p.add_argument("--measured", type=Path, default=REPO / "runs" / "speedup_cpu")
    p.add_argument("--compute", type=Path, default=REPO / "runs" / "speedup_cpu_compute")
    p.add_argument("--measure-peak", action="store_true", help="time one core's matmul and copy")
    p.add_argument("--no-write-profile", action="store_true")
    return p.parse_args(argv)


def measure_peak(out: Path) -> dict:
    """One core's float32 matmul rate (XLA, 2048^3) and copy bandwidth (numpy, 64 MiB)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jnp.ones((2048, 2048), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        ts.append(time.perf_counter() - t)
    x = np.ones(8 * 2**20)
    y = np.empty_like(x)
    cs = []
    for _ in range(7):
        t = time.perf_counter()
        np.copyto(y, x)
        cs.append(time.perf_counter() - t)
    rec = {
        "matmul_flops_per_s": 2 * 2048**3 / float(np.median(ts)),
        "copy_bytes_per_s": 2 * x.nbytes / float(np.median(cs)),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_peak.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def label_of(rec: dict) -> str:
    return rec.get("label") or rec["config"]["strategy"]["name"]


def load(folder: Path, experiment_ok) -> dict:
    from patchpar.lab.results import read_records

    out = {}
    for r in read_records(folder / "runs.jsonl", skip_bad=True):
        if r.get("status") == "ok" and experiment_ok(r):
            out[(r["config"]["model"]["name"], label_of(r))] = r
    return out


def main(argv=None) -> None:
    args = parse(argv)
    if args.measure_peak:
        print(json.dumps(measure_peak(args.out), indent=2))
        return
    import numpy as np

    from patchpar import hardware
    from patchpar.lab.config import RunConfig
    from patchpar.lab.configio import from_dict
    from patchpar.lab.results import provenance
    from patchpar.measure.projection import fit_compute, project
    from patchpar.measure.workload import WorkloadCache

    prov = provenance()  # before the fit rewrites a profile: the commit is what ran
    measured = load(args.measured, lambda r: not r["config"]["measure"].get("compute_only"))
    alone = load(args.compute, lambda r: r["config"]["measure"].get("compute_only"))
    cache = WorkloadCache(args.out / "workloads_cpu.jsonl")
    hw = hardware.load("cpu-gloo")

    def workload(rec):  # the run's own plan, size and batch (float32, as issue 13 ran)
        c = from_dict(RunConfig, rec["config"])
        batch = len(c.prompts.prompts) * len(c.prompts.seeds)
        return cache.get(c.model.name, c.sampler.height, c.plan(), batch, "float32")

    # fit cpu-gloo's compute constants on the single rows (declared points)
    singles = {m: r for (m, lbl), r in measured.items() if lbl == "single"}
    pts = []
    for _, r in sorted(singles.items()):
        w = workload(r)
        pts.append((w.phases["warmup"]["flops_per_device"], 1, r["metrics"]["step_s_median"]))
    eff, call = fit_compute(pts, hw.peak_flops)
    fitted_on = (
        f"the one-core single-device step of tiny 512x512 and fmnist 32x32 ({args.measured})"
    )
    if not args.no_write_profile:
        hardware.write_fit("cpu-gloo", eff, call, fitted_on, "python experiments/latency_cpu.py")
    fitted = dataclasses.replace(hw, flop_efficiency=eff, call_overhead_s=call)
    print(f"cpu-gloo fit: flop_efficiency {eff:.4f}, call_overhead_s {call * 1e3:.2f} ms")

    rows = []
    for (model, lbl), rec in sorted(measured.items()):
        if lbl == "single":
            continue
        single_rec = singles[model]
        w, ws = workload(rec), workload(single_rec)
        steps = rec["config"]["sampler"]["steps"]
        single_step = single_rec["metrics"]["step_s_median"]
        row = {
            "model": model,
            "strategy": lbl,
            "devices": rec["config"]["mesh"]["devices"],
            "measured_step_s": rec["metrics"]["step_s_median"],
            "measured_speedup": rec["metrics"]["speedup_vs_single"],
            "provenance": prov,
            "measured_run_id": rec.get("run_id"),
        }
        a = alone.get((model, lbl))
        if a is not None:
            m = a["metrics"]
            timed = {
                "warmup": m["warmup_step_s_median"],
                "steady": m["steady_step_s_median"] or m["warmup_step_s_median"],
                "single": single_step,
            }
            p = project(w, ws, hw, steps, overlap="none", measured=timed)
            step = _mean_step(p, steps)
            row.update(
                {
                    "compute_alone_run_id": a.get("run_id"),
                    "projected_step_s": step,
                    "projected_speedup": single_step / step,
                    "comm_s_per_step": {ph: p.phases[ph]["comm_s"] for ph in p.phases},
                    "collectives_per_step": {ph: p.phases[ph]["collectives"] for ph in p.phases},
                }
            )
            row["error"] = row["projected_speedup"] / row["measured_speedup"] - 1
        pf = project(w, ws, fitted, steps, overlap="none")
        single_fitted = fitted.compute_s(ws.phases["warmup"]["flops_per_device"])
        row["modelled_speedup"] = single_fitted / _mean_step(pf, steps)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "cpu.jsonl.tmp"
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    tmp.replace(args.out / "cpu.jsonl")
    errs = [abs(r["error"]) for r in rows if "error" in r]
    median = float(np.median(errs)) if errs else None
    text = cpu_md(rows, eff, call, median, max(errs or [0]), args.compute)
    (args.out / "cpu.md").write_text(text)
    print(text)


def _mean_step(p, steps: int) -> float:
    ph = p.phases
    return (
        p.warmup_phase_steps * ph["warmup"]["step_s"] + p.steady_steps * ph["steady"]["step_s"]
    ) / steps


def cpu_md(rows, eff, call, median, largest, compute_dir) -> str:
    lines = [
        "# Measured 2-process speedups on this CPU against the projection (cpu-gloo)",
        "",
        "`python experiments/latency_cpu.py`: projected = each device's compute timed alone "
        f"({compute_dir}) + the step's collectives priced by cpu-gloo, all "
        "exposed; modelled = compute from FLOPs too (cpu-gloo fit: flop_efficiency "
        f"{eff:.4f}, call_overhead_s {call * 1e3:.2f} ms, on the two single rows).",
        "",
        "| model | strategy | measured ms/step | measured speedup | projected ms/step | projected speedup | error | collectives (warm-up/steady) | comm ms/step (warm-up/steady) | modelled speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            c, t = r["collectives_per_step"], r["comm_s_per_step"]
            proj = (
                f"{r['projected_step_s'] * 1e3:.1f} | {r['projected_speedup']:.2f}x | "
                f"{r['error'] * 100:+.1f}% | {c['warmup']}/{c['steady']} | "
                f"{t['warmup'] * 1e3:.1f}/{t['steady'] * 1e3:.1f}"
            )
        else:
            proj = "no compute-alone run | | | |"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['measured_step_s'] * 1e3:.1f} | "
            f"{r['measured_speedup']:.2f}x | {proj} | {r['modelled_speedup']:.2f}x |"
        )
    if median is not None:
        lines += [
            "",
            f"Projected against measured speedup: median absolute error {median * 100:.1f}%, "
            f"largest {largest * 100:.1f}% (target: within 15%).",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
