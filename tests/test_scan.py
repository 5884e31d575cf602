"""Scanned blocks (`patchpar.models.scan`, `model.scan_blocks`): each run of identical blocks
as one `lax.scan` loop. On every family the scanned model equals the unrolled one within float
rounding (relative 1e-6), under every patch strategy too, and the compiled program's bytes equal
the unrolled program's and the analytic model (a collective inside the loop counts as often as
the loop runs)."""

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_parallel_dit as dit
import test_parallel_flux as flux
import test_parallel_sd3 as sd3
from parallel_helpers import inputs as unet_inputs
from parallel_helpers import micro_unet

from patchpar.lab.config import build_plan
from patchpar.measure.cost import measure
from patchpar.models import scan
from patchpar.parallel.engine import Plan, denoise
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler


def close(a, b) -> bool:
    """Equal within float32 rounding of a reordered sum: relative 1e-6 of the larger value."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max()) <= 1e-6 * max(1.0, float(np.abs(b).max()))


@cache
def micro_flux3():
    """A micro FLUX.1 with 3 double and 3 single blocks: both stacks scan a run (the singles'
    last block, whose text tokens nothing reads, stays unrolled after the loop)."""
    from patchpar.models.flux import FluxConfig, FluxFn, FluxTransformer2DModel

    cfg = {**flux.MICRO, "num_layers": 3, "num_single_layers": 3}
    fn = FluxFn(FluxTransformer2DModel(FluxConfig.from_diffusers(cfg)))
    rng = np.random.RandomState(0)
    params = jax.tree.map(lambda p: np.asarray(p + 0.1 * rng.randn(*p.shape), np.float32),
                          fn.init(seed=3))  # fmt: skip
    return fn, params


MODELS = {  # name -> (fn, params, inputs, guidance scale)
    "pixart": lambda: (*dit.micro_dit(), dit.inputs(), dit.GUIDANCE),
    "flux": lambda: (*micro_flux3(), flux.inputs(), flux.GUIDANCE),
    "sd3": lambda: (*sd3.micro_sd3("dual2"), sd3.inputs(), sd3.GUIDANCE),
    "unet": lambda: (*micro_unet("sdxl"), unet_inputs("sdxl"), 5.0),
}


def _one_call(fn, params, x, t, cond):
    from patchpar.pipelines.single import unet_on_stack

    return jax.jit(lambda p: unet_on_stack(fn, p, x, t, cond))(params)


@pytest.mark.parametrize("family", list(MODELS))
def test_a_scanned_model_equals_the_unrolled_one(family):
    """One model call, the blocks scanned against unrolled, given the parameters stacked (once)
    or as loaded (stacked inside the call); a stacked leaf is its blocks' leaves in order."""
    fn, params, (x, t, cond), _ = MODELS[family]()
    ref = _one_call(fn, params, x, t, cond)
    scanned = fn.with_scan()
    assert scanned.scanned and not fn.scanned
    stacked = scanned.prepare(params)
    loops = {p for p in _paths(stacked) if scan.SCANNED in p}
    assert loops, "no scanned run in the micro model"
    assert close(_one_call(scanned, stacked, x, t, cond), ref)
    assert close(_one_call(scanned, params, x, t, cond), ref)
    flat, leaves = dict(_leaves(params)), dict(_leaves(stacked))
    for path in loops:  # '<stack>_scan_<lo>/scan/layer/<rest>' holds blocks lo, lo + 1, ...
        prefix, lo, rest = _block_of(scan.first_layer_path(path))
        got = leaves[path]
        want = [flat[f"{prefix}_{lo + i}/{rest}"] for i in range(got.shape[0])]
        assert np.array_equal(got, np.stack(want)), path
    assert len(leaves) < len(flat)


def _leaves(tree):
    return [("/".join(str(getattr(k, "key", k)) for k in p), v)
            for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]]  # fmt: skip


def _block_of(path: str) -> tuple[str, int, str]:
    """('.../transformer_blocks', 3, 'attn1/to_q/kernel') of a path through block 3."""
    import re

    m = re.search(r"^(.*?transformer_blocks)_(\d+)/(.*)$", path)
    return m.group(1), int(m.group(2)), m.group(3)


def _paths(tree) -> list[str]:
    return [p for p, _ in _leaves(tree)]


@cache
def _sample(family: str, name: str, patch: int, scanned: bool, **options):
    fn, params, (x, _, cond), g = MODELS[family]()
    fn = fn.with_scan(scanned)
    smp = get_sampler("euler")
    sched = smp.schedule(SchedulerConfig(), 3)
    plan = _plan(name, patch, options)
    plan.validate(fn, x.shape[1:3], 3, g)
    placed = plan.program.place(plan, fn, params)
    out, _ = denoise(fn, plan, smp, placed, cond, sched, x * sched.init_noise_sigma, g)
    return np.asarray(out)


def _plan(name: str, devices: int, options: dict) -> Plan:
    """`options` are the strategy's, but `fsdp` (the weights sharded at rest over the mesh)."""
    options = dict(options)
    fsdp = options.pop("fsdp", False)
    return Plan(make_strategy(name, **options), devices, fsdp=fsdp)


STRATEGIES = [
    pytest.param("pixart", "sync_patch", 2, {}, marks=pytest.mark.slow),
    ("pixart", "distrifusion", 2, {"warmup_steps": 1}),
    pytest.param("pixart", "pcpp", 4, {"warmup_steps": 1, "send": "band"}, marks=pytest.mark.slow),
    pytest.param("pixart", "ring", 4, {}, marks=pytest.mark.slow),
    pytest.param("pixart", "ulysses", 4, {}, marks=pytest.mark.slow),
    pytest.param(
        "flux", "distrifusion", 2, {"warmup_steps": 1, "text": "mean"}, marks=pytest.mark.slow
    ),
    ("pixart", "tensor", 2, {}),  # 3 heads padded to 4 over model=2: the local shapes stacked
    pytest.param("flux", "tensor", 3, {}, marks=pytest.mark.slow),  # proj_out's 5 parts
    pytest.param(
        "pixart", "sync_patch", 4, {"fsdp": True}, marks=pytest.mark.slow
    ),  # every block's shares gathered in the loop
    pytest.param(
        "sd3", "distrifusion", 2, {"warmup_steps": 1, "text": "first"}, marks=pytest.mark.slow
    ),  # fmt: skip
    pytest.param("unet", "distrifusion", 2, {"warmup_steps": 1}, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family, name, devices, options", STRATEGIES)
def test_scanned_strategies_equal_unrolled_and_move_the_same_bytes(family, name, devices, options):
    """A sampling run with scanned blocks equals the unrolled one (stale buffers, packed sends
    and the text stream's site inside the loop); each phase's program moves the same bytes,
    which equal the analytic model, and counts the same FLOPs."""
    opts = tuple(sorted(options.items()))
    got = _sample(family, name, devices, True, **dict(opts))
    assert close(got, _sample(family, name, devices, False, **dict(opts)))
    fn, _, (x, _, _), _ = MODELS[family]()
    recs = [measure(f, _plan(name, devices, options), x.shape[1:3], batch=2)
            for f in (fn, fn.with_scan())]  # fmt: skip
    for phase, unrolled in recs[0]["phases"].items():
        scanned = recs[1]["phases"][phase]
        assert scanned["analytic_matches_hlo"] and unrolled["analytic_matches_hlo"], phase
        assert scanned["hlo"] == unrolled["hlo"], phase
        assert scanned["hlo"]["all"]["max"] > 0, phase
        # the loop's own index arithmetic (a few FLOPs per layer) on top of the same model's
        assert scanned["flops_per_device"] == pytest.approx(unrolled["flops_per_device"], rel=1e-5)


def test_a_scanned_program_is_smaller():
    """What makes the compile shorter: the scanned program holds one block where the unrolled
    one holds every block (HLO instructions after lowering, PixArt with 6 blocks)."""
    from patchpar.models.pixart import PixArtConfig, PixArtFn, PixArtTransformer2DModel

    fn = PixArtFn(PixArtTransformer2DModel(PixArtConfig.from_diffusers({**dit.MICRO,
                                                                          "num_layers": 6})))  # fmt: skip
    x, t, cond = dit.inputs()
    params = jax.eval_shape(fn.init)
    sizes = []
    for f in (fn, fn.with_scan()):
        p = jax.eval_shape(f.prepare, params)
        low = jax.jit(lambda p, f=f: _stack_call(f, p, x, t, cond)).lower(p)
        sizes.append(low.as_text().count("\n"))
    assert sizes[1] < 0.5 * sizes[0], sizes


def _stack_call(fn, p, x, t, cond):
    from patchpar.pipelines.single import unet_on_stack

    return unet_on_stack(fn, p, x, t, cond)


def test_scanned_blocks_refuse_what_runs_them_apart():
    """A quantized model, a layer-splitting strategy, a DiT's step cache that runs its first
    block apart, or a part of a scanned run: one line each, naming what to turn off."""
    from patchpar.lab.checks import check_scan
    from patchpar.quant import quantize

    with pytest.raises(ValueError, match="scan_blocks with quant='w8'.*turn one of them off"):
        check_scan(True, "w8", "single")
    with pytest.raises(ValueError, match="scan_blocks with strategy 'pipefusion'"):
        check_scan(True, "none", "pipefusion")
    check_scan(False, "w8", "pipefusion")  # off: nothing to refuse
    fn, params = dit.micro_dit()
    x, t, cond = dit.inputs()
    scanned = fn.with_scan()
    with pytest.raises(ValueError, match="quant='w8' with scanned blocks"):
        quantize(scanned, params, "w8")
    for name, step_cache, what in (
        ("pipefusion", "none", "strategy 'pipefusion'"),
        ("asyncdiff", "none", "strategy 'asyncdiff'"),
        ("single", "fbcache", "cache 'fbcache'"),
    ):
        plan = build_plan(name, {}, 1 if name == "single" else 2, 1, cache=step_cache)
        with pytest.raises(ValueError, match=f"scan_blocks with {what}"):
            plan.validate(scanned, x.shape[1:3], 10, dit.GUIDANCE)
    build_plan("single", {}, 1, 1, cache="taylorseer").validate(scanned, x.shape[1:3], 10, 4.5)
    module = scanned.module
    variables = {"params": scanned.prepare(params)}
    extras = {k: v[0] for k, v in cond.extras.items()}
    args = (x, jnp.full((2,), t), cond.context[0], extras["encoder_attention_mask"],
            extras["resolution"], extras["aspect_ratio"])  # fmt: skip
    hs, aux = module.apply(variables, *args, method="prologue")
    with pytest.raises(ValueError, match=r"transformer_blocks \[0, 1\) cuts the scanned run "
                                         r"of blocks \[0, 2\)"):  # fmt: skip
        module.apply(variables, hs, aux, method=lambda m, hs, aux: m.blocks(0, 1, hs, aux))
    with pytest.raises(ValueError, match="transformer_blocks_0 runs inside a scanned run"):
        module.apply(variables, hs, aux, method="modulated")  # TeaCache's first-block input


def test_stacking_names_what_is_missing():
    params = {
        "transformer_blocks_0": {"w": jnp.ones(2)},
        "transformer_blocks_2": {"w": jnp.ones(2)},
    }
    with pytest.raises(ValueError, match="transformer_blocks_1 is missing"):
        scan.stack(params, "transformer_blocks", [0, 0, 0])
    assert scan.runs([1, 1, 2, 1, 1, 1]) == [(0, 2), (2, 3), (3, 6)]
    assert scan.scanned_runs([(True, 0), (True, 1), (False, 1), (False, 1)]) == [(2, 4)]
