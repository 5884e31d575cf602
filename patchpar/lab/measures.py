"""What a run measures of one point, apart from running it (`lab.runner`): the denoising loop
timed (compile apart from the steady runs), the text encoding and the decode timed, and the
bytes and FLOPs of its programs counted (a cached run's per kind of step)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from patchpar.lab.config import RunConfig
from patchpar.lab.phases import compile_phases
from patchpar.lab.results import PHASE_STEPS

Log = Callable[[str], None]


def comm_metrics(pipe, plan, config: RunConfig, counted: dict) -> dict:
    """Bytes received per device per step (warm-up, steady, and the mean over the run's steps)
    and FLOPs per device of one step, from the timed phase programs themselves (`counted`:
    phase -> `measure.cost.count_lowered` of its loop, whose body is one step). With a step
    cache, `counted` holds each kind of step's programs apart (`computed`, `skipped`) and the
    computed steps of each phase (`cache`)."""
    from patchpar.parallel.engine import weight_bytes

    if "cache" in counted:
        return _cached_comm_metrics(pipe, plan, config, counted)
    wu = counted["warmup"]
    st = counted.get("steady", wu)  # an exact strategy's steps are all warm-up steps
    n = config.sampler.steps
    sync = plan.strategy.warmup_phase_steps(n)
    # loop iterations per phase (a pipeline's steady loop has one more, to drain)
    loops = plan.strategy.phase_iterations
    iw, i_s = loops("warmup", sync, plan.patch), loops("steady", n - sync, plan.patch)
    w_bytes, s_bytes = wu["hlo"]["all"]["max"], st["hlo"]["all"]["max"]
    rw, rs = wu["released"]["all"]["max"], st["released"]["all"]["max"]
    return {
        # analytic: the released DistriFusion / PCPP code's traffic pattern for the same run
        "released_bytes_per_device_per_step": (iw * rw + i_s * rs) / n,
        "warmup_bytes_per_device": w_bytes,
        "steady_bytes_per_device": s_bytes,
        "bytes_per_device_per_step": (iw * w_bytes + i_s * s_bytes) / n,
        "bytes_per_device_total": iw * w_bytes + i_s * s_bytes,
        "flops_per_device_per_step": st.get("flops_per_device"),
        "weight_bytes_per_device": weight_bytes(plan, pipe.unet, pipe.unet_params),
        "weight_rules": plan.rules_name,
        "analytic_matches_hlo": bool(wu["analytic_matches_hlo"] and st["analytic_matches_hlo"]),
    }


def _cached_comm_metrics(pipe, plan, config: RunConfig, counted: dict) -> dict:
    """comm_metrics of a cached run: a computed and a skipped step's bytes per phase (each from
    a program forced to that branch, checked against its analytic count), weighted by the
    steps of each kind the run took."""
    from patchpar.parallel.engine import weight_bytes

    n = config.sampler.steps
    sync = plan.strategy.warmup_phase_steps(n)
    spans = {"warmup": sync, "steady": n - sync}
    comp, skip, ran = counted["computed"], counted["skipped"], counted["cache"]
    out, total, released, match = {}, 0, 0, True
    for phase, steps in spans.items():
        if not steps:
            continue
        c, k = comp[phase]["hlo"]["all"]["max"], skip[phase]["hlo"]["all"]["max"]
        out[f"{phase}_bytes_per_device"] = c  # a computed step's
        out[f"{phase}_skipped_step_bytes_per_device"] = k
        total += ran[phase] * c + (steps - ran[phase]) * k
        released += ran[phase] * comp[phase]["released"]["all"]["max"]
        released += (steps - ran[phase]) * skip[phase]["released"]["all"]["max"]
        match = (
            match and comp[phase]["analytic_matches_hlo"] and skip[phase]["analytic_matches_hlo"]
        )
    st = comp.get("steady", comp["warmup"])
    return {
        "released_bytes_per_device_per_step": released / n,
        **out,
        "bytes_per_device_per_step": total / n,
        "bytes_per_device_total": total,
        "flops_per_device_per_step": st.get("flops_per_device"),  # a computed step's
        "weight_bytes_per_device": weight_bytes(plan, pipe.unet, pipe.unet_params),
        "weight_rules": plan.rules_name,
        "analytic_matches_hlo": bool(match),
    }


def timed_denoise(pipe, config: RunConfig, plan, cond, x0, log: Log):
    """Compile the denoising programs, one per phase (timed apart from running), run them
    `warmup_runs` times, then time `repeats` runs, each phase waited for on its own so that
    the warm-up (fresh exchange) and steady (stale exchange) step times are apart.
    Returns (final latent, timing metrics)."""
    import jax

    from patchpar import compile_cache
    from patchpar.measure.cost import check_fits, count_lowered, memory_per_device
    from patchpar.measure.timing import time_phases
    from patchpar.parallel.sites import record_sites
    from patchpar.parallel.split import guided_slab
    from patchpar.parallel.step import stale_bytes_per_device
    from patchpar.sampling.cache import Forced

    s, m = config.sampler, config.measure
    hits = compile_cache.hits()
    t0 = time.perf_counter()
    programs, args = pipe.denoise_phases(cond, x0, s.name, s.steps, s.guidance_scale, plan)
    compiled, lowered, entering = compile_phases(programs, args)  # at once, in threads
    memory = {}
    for phase, _, c in compiled:
        memory[phase] = memory_per_device(c)
        check_fits(memory[phase], f"the {phase} phase's program")  # before running it
    compile_s = time.perf_counter() - t0
    hits = compile_cache.hits() - hits  # programs read from the persistent cache meanwhile
    cached = f" ({hits} program(s) read from the compile cache)" if hits else ""
    log(f"  compiled in {compile_s:.1f} s{cached}; timing {m.repeats} run(s)")
    (final, (_, state)), t = time_phases(
        [(phase, c) for phase, _, c in compiled], args, m.warmup_runs, m.repeats
    )
    b = x0.shape[0]
    steps = {phase: n for phase, n, _ in compiled}
    out = {
        "compile_s": compile_s,
        "compile_cache_hits": hits,
        "batch": b,
        "denoise_s_median": t["median"],
        "denoise_s_min": t["min"],
        "denoise_s_max": t["max"],
        "denoise_s_all": t["all"],
        "step_s_median": t["median"] / s.steps,
        "images_per_s": b / t["median"],
        "stale_bytes_per_device": stale_bytes_per_device(state),
        # what a step cache did (none: every step ran every block)
        **(
            pipe.cache_report(plan, state, s.steps)
            or {"cache": "none", "cache_computed_steps": s.steps, "blocks_computed": 1.0}
        ),
    }
    out["memory_per_device"] = memory
    out["memory_per_device_bytes"] = max((v["total"] or 0 for v in memory.values()), default=None)
    for phase in ("warmup", "steady"):  # per-step medians of each phase (null: no such step)
        ph = t["phases"].get(phase)
        out[PHASE_STEPS[phase]] = steps.get(phase, 0)
        out[f"{phase}_step_s_median"] = ph["median"] / steps[phase] if ph else None
    counted = None
    if m.comm and not m.compute_only:
        local_out = guided_slab(
            plan, x0.shape, pipe.unet
        )  # one device's share of the guided output
        itemsize = jax.numpy.dtype(pipe.unet.module.dtype).itemsize
        count = lambda low, calls: count_lowered(  # noqa: E731
            low, calls, plan, local_out, itemsize, phase_loop=True
        )
        if plan.cache is None:  # the timed programs are the counted ones
            counted = {phase: count(low, calls) for phase, (low, calls) in lowered.items()}
        else:  # both branches are in the timed program: each kind of step counted apart
            counted = {"cache": _cache_steps(pipe, plan, state, s.steps)}
            for kind, compute in (("computed", True), ("skipped", False)):
                forced = dataclasses.replace(plan, cache=Forced(plan.cache, compute))
                fns, fargs = pipe.denoise_phases(cond, x0, s.name, s.steps, s.guidance_scale,
                                                 forced)  # fmt: skip
                counted[kind] = {}
                for phase, _, fn in fns:
                    with record_sites() as calls:
                        low = jax.jit(fn).lower(*fargs[:3], *entering[phase])
                    counted[kind][phase] = count(low, calls)
    return final, out, counted


def _cache_steps(pipe, plan, state, steps: int) -> dict:
    """{phase: steps that ran every block} of a cached run, from its final state."""
    from patchpar.parallel.mesh import to_local
    from patchpar.sampling.cache import CACHE, STEADY_COMPUTED

    first = lambda a: int(np.asarray(to_local(a)).reshape(-1)[0])  # noqa: E731
    total = first(state[CACHE]["computed"])
    steady = first(state[CACHE][STEADY_COMPUTED]) if STEADY_COMPUTED in state[CACHE] else 0
    return {"warmup": total - steady, "steady": steady}


def timed_encode(pipe, config: RunConfig, batch, hw) -> dict:
    """Text encoding of the timed call's prompts (the CFG pair included), seconds
    (`measure.timing.time_calls`)."""
    from patchpar.measure.timing import time_calls

    s = config.sampler
    prompts = [p for p, _ in batch]
    neg = [config.prompts.negative_prompt] * len(batch) if config.prompts.negative_prompt else None
    call = lambda: pipe.encode_prompt(prompts, neg, s.guidance_scale, *hw)  # noqa: E731
    return time_calls("encode_s", call, config.measure.repeats)[1]


def timed_decode(pipe, final, vae_plan, repeats: int) -> tuple[np.ndarray, dict]:
    """The VAE decode of the timed call's latent as `vae_plan` places it, to uint8 images on
    the host (rows gathered once): (images, seconds as `measure.timing.time_calls`)."""
    from patchpar.measure.timing import time_calls

    return time_calls("decode_s", lambda: pipe.decode(final, vae_plan), repeats)
