"""What one UNet call costs under a plan, per phase, from the program XLA is given: bytes each
device receives (by site kind, from HLO, and from the analytic model), FLOPs per device and
stale-buffer memory. Works on abstract parameters (`jax.ShapeDtypeStruct`), so full-size
presets need no weights and little memory."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import jax
import numpy as np

from patchpar.measure.comm import (
    CommCount,
    collective_groups,
    count_collectives,
    hlo_text_with_metadata,
    parse_collectives,
)
from patchpar.measure.flops import program_flops, quantized_flops
from patchpar.models.family import Denoiser
from patchpar.parallel.engine import (
    Plan,
    abstract_inputs,
    denoise_phase,
    make_step,
    phase_steps,
    placed_params,
    weight_bytes,
)
from patchpar.parallel.sites import PHASES, record_sites
from patchpar.parallel.split import guided_slab
from patchpar.parallel.step import stale_bytes_per_device

__all__ = [
    "abstract_inputs",
    "analytic_count",
    "count_lowered",
    "measure",
    "memory_per_device",
    "released_count",
]


def _site_count(plan: Plan, log, rule: str) -> CommCount:
    """Bytes per device from the recorded site calls by one of the site ops' byte models
    (`received_bytes`: patchpar's own; `released_bytes`: the released code's pattern)."""
    count = CommCount(plan.devices)
    for op, info in log:
        per_patch = np.array([getattr(op, rule)(info, p) for p in range(plan.patch)], np.int64)
        # device id = ((data_index * cfg + cfg_index) * patch + patch_index) * model + model_index
        count.add(op.kind, np.tile(np.repeat(per_patch, plan.model), plan.data * plan.cfg))
    return count


def analytic_count(plan: Plan, log, out_shape, out_itemsize: int) -> CommCount:
    """Bytes per device from the recorded site calls and the strategy's rules."""
    count = _site_count(plan, log, "received_bytes")
    if plan.cfg == 2:  # the guided output: each device gathers the other half's (B, h, W, C)
        count.add("cfg", np.full(plan.devices, int(np.prod(out_shape)) * out_itemsize, np.int64))
    return count


def released_count(plan: Plan, log, out_shape, out_itemsize: int) -> CommCount:
    """Bytes per device that the released DistriFusion / PCPP code's pattern would move for the
    same UNet call (analytic, from the recorded site calls; each op's `released_bytes`), plus
    the all-gather of the UNet output over all devices that it runs every step to hand the
    full latent to the scheduler (patchpar keeps the latent sharded instead)."""
    count = _site_count(plan, log, "released_bytes")
    if plan.devices > 1 and plan.program.gathers_output:
        # out_shape: one device's slab of the guided output (its CFG part); PipeFusion's
        # released code (xDiT) returns each latent patch to the first stage, as patchpar does
        slab = int(np.prod(out_shape)) * out_itemsize * (2 if plan.cfg == 1 else 1)
        count.add("output", np.full(plan.devices, (plan.devices - 1) * slab, np.int64))
    return count


def measure(
    unet: Denoiser,
    plan: Plan,
    latent_hw: tuple[int, int],
    batch: int = 1,
    params=None,
    guidance_scale: float = 5.0,
    flops: bool = True,
    memory: bool = False,
    log=None,
) -> dict:
    """One UNet call per phase under `plan`: HLO-counted and analytic bytes per device, FLOPs per
    device (pre-optimisation HLO cost analysis, loops counted in full), stale-buffer bytes per
    device, and with `memory` the compiled steady-phase program's memory per device (compiles
    it; the warm-up program is the same one without stale buffers coming in). `log` hears a
    line as each program is lowered and compiled (a full-size model takes tens of seconds)."""
    log = log or (lambda msg: None)
    if unet.guidance_halves == 1:  # the scale is a model input (FLUX.1): one half, no CFG
        guidance_scale = 1.0
    plan.validate(unet, latent_hw, 1_000_000, guidance_scale, batch)
    params = unet.abstract_params() if params is None else params
    if not plan.program.per_call:  # its phases lowered whole (PipeFusion's pipeline)
        return _measure_phases(
            unet, plan, latent_hw, batch, params, guidance_scale, flops, memory, log
        )
    mesh = plan.mesh()
    x, t, cond = abstract_inputs(unet, latent_hw, batch)
    axis = plan.strategy.patch_axis(0)
    warm = make_step(unet, plan, "warmup", axis, guidance_scale, mesh)
    state = None
    if plan.cache is not None:  # a cached step reads every buffer (a skip keeps them)
        plain = make_step(unet, replace(plan, cache=None), "warmup", axis, guidance_scale, mesh)
        state = jax.eval_shape(plain, params, x, t, cond, None)[1]
    out_shape, state = jax.eval_shape(warm, params, x, t, cond, state)
    reads = plan.cache is not None  # the warm-up reads the buffers too
    # one device's slab of the guided output (uneven patches: the largest patch's rows)
    local_out = guided_slab(plan, (batch, *latent_hw, out_shape.shape[-1]), unet)
    record = {
        "stale_bytes_per_device": stale_bytes_per_device(state),
        "weight_bytes_per_device": weight_bytes(plan, unet, params),
        "mesh": plan.degrees(),
        "phases": {},
    }
    for phase in PHASES:
        t0 = time.perf_counter()
        log(f"lowering the {phase.replace('warmup', 'warm-up')} phase's model call")
        with record_sites() as sites:
            # the stale buffers are donated: inside the denoising loop they are a loop carry,
            # updated in place, so their new values alias the old ones as they do there
            donate = (4,) if memory and phase == "steady" and jax.tree.leaves(state) else ()
            step = make_step(unet, plan, phase, axis, guidance_scale, mesh)
            lowered = jax.jit(step, donate_argnums=donate).lower(
                params, x, t, cond, state if phase == "steady" or reads else None
            )
        entry = count_lowered(lowered, sites, plan, local_out, out_shape.dtype.itemsize, flops)
        entry["lower_s"] = round(time.perf_counter() - t0, 2)
        if memory and phase == "steady":  # the steady program holds the stale buffers in and out
            log("compiling the steady phase's model call (memory per device)")
            t0 = time.perf_counter()
            entry["memory"] = memory_per_device(lowered.compile())
            entry["compile_s"] = round(time.perf_counter() - t0, 2)
        record["phases"][phase] = entry
    return record


def _measure_phases(
    unet, plan, latent_hw, batch, params, guidance_scale, flops, memory, log
) -> dict:
    """`measure` for a program whose step is not one model call (PipeFusion's): each phase's compiled loop
    on a two-step schedule, one step per phase (the loop body is one step, counted once)."""
    from dataclasses import replace

    from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

    plan = replace(plan, strategy=replace(plan.strategy, warmup_steps=1))
    sampler = get_sampler("ddim")
    schedule = sampler.schedule(SchedulerConfig(), 2)
    x, _, cond = abstract_inputs(unet, latent_hw, batch)
    local_out = guided_slab(plan, x.shape, unet)
    record = {
        "weight_bytes_per_device": weight_bytes(plan, unet, params),
        "mesh": plan.degrees(),
        "phases": {},
    }
    loop, params = None, placed_params(plan, unet, params)
    for phase in phase_steps(plan, 2):
        t0 = time.perf_counter()
        log(f"lowering the {phase.replace('warmup', 'warm-up')} phase's program")
        with record_sites() as sites:
            lowered = denoise_phase.lower(
                unet, plan, sampler, phase, params, cond, schedule, x, loop, guidance_scale
            )
        entry = count_lowered(
            lowered, sites, plan, local_out, x.dtype.itemsize, flops, phase_loop=True
        )
        entry["lower_s"] = round(time.perf_counter() - t0, 2)
        if memory and phase == "steady":
            log("compiling the steady phase's program (memory per device)")
            t0 = time.perf_counter()
            entry["memory"] = memory_per_device(lowered.compile())
            entry["compile_s"] = round(time.perf_counter() - t0, 2)
        record["phases"][phase] = entry
        _, loop = lowered.out_info
        record.setdefault("stale_bytes_per_device", stale_bytes_per_device(loop[1]))
    return record


def count_lowered(
    lowered,
    log,
    plan: Plan,
    local_out,
    out_itemsize: int,
    flops: bool = True,
    phase_loop: bool = False,
):
    """What a lowered program of one model step (or, `phase_loop`, a phase's loop, whose body
    is one step: its collectives appear once in the program) costs each device: bytes received
    by site from the pre-optimisation HLO (`hlo`), the same from the site calls recorded while
    tracing it (`analytic`, and `analytic_matches_hlo`), the released code's pattern
    (`released`), the collectives grouped (op, group size, bytes) and `flops_per_device` of one
    step, every inner loop (a blockwise attention kernel's) counted as often as it runs
    (`measure.flops`; XLA's own count takes a loop's body once). `local_out`: one device's slab
    of the guided output (for the CFG gather and the released code's output gather)."""
    text = hlo_text_with_metadata(lowered)
    collectives = parse_collectives(text, plan.devices, outer_once=phase_loop)
    hlo = count_collectives(collectives, plan.devices)
    model = analytic_count(plan, log, local_out, out_itemsize)
    entry = {
        "hlo": hlo.summary(),
        "analytic": model.summary(),
        "analytic_matches_hlo": _same(hlo, model),
        "collectives": collective_groups(collectives, plan.devices),
        "released": released_count(plan, log, local_out, out_itemsize).summary(),
        # of the received bytes, those of padding (uneven patches: `parallel.split`)
        "padding": _site_count(plan, log, "padding_bytes").summary(),
        # whether the program branches (`lax.cond`/`switch`): a cache's decision, or uneven
        # patches' own rows (a branch per patch size, `parallel.step`; the FLOPs are then
        # the largest branch's)
        "branches": "conditional(" in text,
    }
    if flops:
        entry["flops_per_device"] = program_flops(lowered, outer_once=phase_loop, text=text)
        # of them, a quantized model's int8/fp8 products (priced at those units' peak)
        q, kinds = quantized_flops(text, outer_once=phase_loop)
        entry["quantized_flops_per_device"], entry["quantized_types"] = q, kinds
    return entry


def memory_per_device(compiled) -> dict:
    """Bytes one device holds for a compiled program (XLA's buffer assignment for the backend
    it was compiled for): arguments (weights, inputs, stale buffers in), outputs, temporaries
    (activations, attention blocks), minus outputs aliased onto arguments; `total` is their sum,
    the peak the program needs resident."""
    ma = compiled.memory_analysis()
    if ma is None:  # a backend without buffer statistics
        return {"total": None}
    parts = {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
    }
    parts["total"] = parts["arguments"] + parts["outputs"] + parts["temporaries"] - parts["aliased"]
    return parts


def device_memory_bytes(device) -> int | None:
    """What one device can hold: its allocator's limit (GPUs, TPUs), or on CPU the machine's
    available memory shared by this process's CPU devices; None where neither is known."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
        return avail // max(1, len(jax.local_devices(backend="cpu")))
    return None


def check_fits(memory: dict, what: str = "this program") -> None:
    """ValueError, before running it, when a compiled program's `memory_per_device` (XLA's
    buffer assignment) is more than a device here has."""
    need = memory["total"]
    have = device_memory_bytes(jax.local_devices()[0])
    if need and have and need > have:
        raise ValueError(
            f"{what} needs {need / 2**30:.2f} GiB per device (XLA's buffer assignment of the "
            f"compiled program), more than the {have / 2**30:.2f} GiB a device has here: use a "
            "smaller image, more devices, bfloat16 or the chunked attention kernel"
        )


def param_bytes(abstract_params, quant: str = "none") -> int:
    """Bytes of a parameter tree (arrays or abstract shapes); `quant="w8"`: as Qwix's int8
    weights would hold it (one byte per element of every matrix kernel, the rest as they are;
    the per-channel scales, under 1%, left out)."""
    from flax.traverse_util import flatten_dict

    total = 0
    for path, leaf in flatten_dict(abstract_params).items():
        size = int(np.prod(leaf.shape))
        low = quant != "none" and path[-1] == "kernel" and len(leaf.shape) >= 2
        total += size * (1 if low else np.dtype(leaf.dtype).itemsize)
    return total


def check_weights_fit(abstract_params, what: str, device=None) -> None:
    """ValueError before anything is compiled, drawn or read, when a model's weights alone are
    more than one accelerator holds (CPUs are not checked: their devices share the machine's
    memory): names the figure, and what would fit (w8 weights, FSDP over more chips)."""
    device = device or jax.local_devices()[0]
    if device.platform == "cpu":
        return
    have = device_memory_bytes(device)
    need = param_bytes(abstract_params)
    if not have or need <= have:
        return
    w8 = param_bytes(abstract_params, "w8")
    chips = -(-need // int(0.8 * have))  # a fifth of each chip left for activations
    fits = f"w8 weights ({w8 / 2**30:.1f} GiB" + (
        ")" if w8 < have else ", which does not fit either)"
    )
    raise ValueError(
        f"{what}: its weights alone are {need / 2**30:.1f} GiB, more than the "
        f"{have / 2**30:.1f} GiB one {device.device_kind} holds; would fit: {fits}, or FSDP over "
        f"{chips} or more chips (a smaller image does not shrink the weights)"
    )


def _same(a: CommCount, b: CommCount) -> bool:
    keys = set(a.by_site) | set(b.by_site)
    zero = np.zeros(a.num_devices, np.int64)
    return all(np.array_equal(a.by_site.get(k, zero), b.by_site.get(k, zero)) for k in keys)
