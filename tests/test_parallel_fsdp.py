"""Parameters sharded at rest and gathered per layer (FSDP rules, `Plan(fsdp=True)`), on 8 fake
CPU devices: images equal the same plan without it (and so `single` for the exact strategies),
one all-gather per parameterised layer whose bytes equal the analytic model, weights per
device / the degree, the gathers issued layer by layer (not all at the start), and bad degrees
or rules are errors."""

import re

import jax
import numpy as np
import pytest
from parallel_helpers import GUIDANCE, inputs, micro_unet, reordered, single_guided

from patchpar.measure.comm import hlo_text_with_metadata, parse_collectives
from patchpar.measure.cost import measure, memory_per_device
from patchpar.models.unet import LOGICAL
from patchpar.parallel.engine import Plan, denoise, make_step
from patchpar.parallel.rules import RULES, _leaves, check_rules, logical_axes
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

SLOW = pytest.mark.slow


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def plan(name, devices, cfg=1, data=1, fsdp=True, **options):
    return Plan(make_strategy(name, **options), devices, cfg, data=data, fsdp=fsdp)


# (kind, strategy, devices, cfg, data, options)
FORWARD_CASES = [
    ("sd", "sync_patch", 8, 1, 1, {}),
    pytest.param("sdxl", "sync_patch", 8, 2, 2, {}, marks=SLOW),  # over data x cfg x patch
    # 2-D: heads over model, embed over patch
    pytest.param("sd", "tensor", 8, 1, 1, {"tp_degree": 2}, marks=SLOW),
    pytest.param("sdxl", "ulysses", 4, 1, 1, {}, marks=SLOW),
]


@pytest.mark.parametrize("kind, name, devices, cfg, data, options", FORWARD_CASES)
def test_fsdp_forward_equals_single_and_the_same_plan_without_it(
    kind, name, devices, cfg, data, options
):
    unet, params = micro_unet(kind)
    x, t, cond = inputs(kind, batch=2 * data)
    outs = []
    for fsdp in (False, True):
        p = plan(name, devices, cfg, data, fsdp, **options)
        p.validate(unet, x.shape[1:3], 10, GUIDANCE, x.shape[0])
        step = jax.jit(make_step(unet, p, "warmup", "row", GUIDANCE, p.mesh()))
        outs.append(step(params, x, t, cond, None)[0])
    assert max_diff(outs[1], single_guided(unet, params, x, t, cond)) <= 1e-4
    # the same weights, only gathered: the same arithmetic (bit for bit where XLA lays the
    # gathered weights out as the whole ones; float rounding apart is the contract)
    assert max_diff(outs[1], outs[0]) <= reordered(outs[0])


@pytest.mark.parametrize(
    "kind, name, devices, cfg, options",
    [
        pytest.param("sd", "distrifusion", 8, 2, {"warmup_steps": 1}, marks=SLOW),
        pytest.param("sdxl", "pcpp", 4, 1, {"warmup_steps": 1}, marks=SLOW),
    ],
)
def test_fsdp_sampling_runs_equal_the_same_plan_without_it(kind, name, devices, cfg, options):
    """Stale strategies too: a warm-up and a steady phase (stale state inside gathering
    layers), final latent and stale buffers the same."""
    unet, params = micro_unet(kind)
    x, _, cond = inputs(kind)
    smp = get_sampler("dpmpp_2m")
    sched = smp.schedule(SchedulerConfig(), 4)
    x0 = x * sched.init_noise_sigma
    runs = []
    for fsdp in (False, True):
        p = plan(name, devices, cfg, fsdp=fsdp, **options)
        runs.append(denoise(unet, p, smp, params, cond, sched, x0, GUIDANCE))
    assert max_diff(runs[1][0], runs[0][0]) <= reordered(runs[0][0])
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1]), strict=True):
        assert max_diff(a, b) <= reordered(b)


def _layers(params) -> int:
    """Parameterised layers that gather (ResNet and transformer blocks, the projections and
    norms of each transformer, samplers, embeddings, conv_in / conv_norm_out / conv_out)."""
    prefixes = set()
    for path in _leaves(params):
        m = re.match(r"(.*?(resnets_\d+|transformer_blocks_\d+|attentions_\d+/(norm|proj_in|proj_out)"
                     r"|(down|up)samplers_0|time_embedding|add_embedding|conv_in|conv_norm_out"
                     r"|conv_out))/", path)  # fmt: skip
        prefixes.add(m.group(1))
    return len(prefixes)


@pytest.mark.parametrize(
    "kind, name, devices, cfg, data, options",
    [
        pytest.param("sdxl", "sync_patch", 8, 1, 2, {}, marks=pytest.mark.slow),
        ("sd", "distrifusion", 4, 2, 1, {"warmup_steps": 1}),
    ],  # fmt: skip
)
def test_one_gather_per_layer_and_hlo_bytes_equal_the_analytic_model(
    kind, name, devices, cfg, data, options
):
    unet, params = micro_unet(kind)
    p = plan(name, devices, cfg, data, **options)
    r = measure(unet, p, (16, 16), batch=2 * data, params=params, flops=False)
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    unsharded = sum(
        x.size * x.dtype.itemsize
        for path, x in _leaves(params).items()
        if "embed" not in logical_axes(path, x.ndim, LOGICAL)
    )
    k = devices  # every device runs the same weights (no model axis)
    assert r["weight_bytes_per_device"] == (whole - unsharded) // k + unsharded
    for phase in r["phases"].values():
        assert phase["analytic_matches_hlo"], phase
        # each device receives the other k-1 shares of every sharded weight once per call
        assert phase["hlo"]["fsdp"]["max"] == (k - 1) * (whole - unsharded) // k
    x, t, cond = inputs(kind, batch=2 * data)
    step = make_step(unet, p, "warmup", "row", GUIDANCE, p.mesh())
    text = hlo_text_with_metadata(jax.jit(step).lower(params, x, t, cond, None))
    gathers = [c for c in parse_collectives(text, devices) if c.site == "fsdp"]
    assert {c.op for c in gathers} == {"all-gather"}
    assert {len(g) for c in gathers for g in c.groups} == {k}
    assert len(gathers) == _layers(params)


def test_gathers_run_layer_by_layer_not_all_at_the_start():
    """The compiled program holds the shares plus about one layer whole: its temporaries grow
    by far less than the whole weights (XLA:CPU would otherwise issue every gather first)."""
    unet, params = micro_unet("sd")
    x, t, cond = inputs("sd")
    whole = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    mem = {}
    for fsdp in (False, True):
        p = plan("sync_patch", 8, fsdp=fsdp)
        step = make_step(unet, p, "warmup", "row", GUIDANCE, p.mesh())
        mem[fsdp] = memory_per_device(jax.jit(step).lower(params, x, t, cond, None).compile())
    assert mem[True]["arguments"] < mem[False]["arguments"] - 0.8 * whole
    assert mem[True]["temporaries"] - mem[False]["temporaries"] < 0.5 * whole, mem


def test_bad_fsdp_degrees_and_rules_are_errors():
    unet, _ = micro_unet("sd")  # embed widths 16, 32, 48, 64
    with pytest.raises(ValueError, match=r"fsdp over patch = 3 devices: \d+ parameter\(s\) do not "
                       r"shard evenly, e.g. .* \(embed = \d+\).* must be one of \[1, 2, 4, 8, 16\]"):  # fmt: skip
        plan("sync_patch", 3).validate(unet, (48, 48), 10, GUIDANCE)
    with pytest.raises(ValueError, match=r"unknown mesh axes \['pod'\]"):
        check_rules({"embed": ("data", "pod")}, LOGICAL)
    with pytest.raises(ValueError, match=r"mesh axis 'patch' on both 'embed' and 'heads'"):
        check_rules({"embed": ("data", "patch"), "heads": "patch"}, LOGICAL)
    with pytest.raises(ValueError, match=r"'data' on both 'conv_in' and 'embed'.*any other kernel"):
        check_rules({"embed": "data", "conv_in": "data"}, LOGICAL)
    p = plan("tensor", 8, tp_degree=2)
    assert p.rules_name == "tensor+fsdp" and p.fsdp_degree == 4
    assert p.rules() == {**RULES["tensor"], "embed": ("patch",)}  # axes of degree 1 dropped
    assert plan("tensor", 8).rules_name == "tensor"  # all devices on model: nothing to shard
    assert plan("sync_patch", 1).fsdp_degree == 1


def test_every_unet_parameter_has_at_most_one_embed_dimension():
    for kind in ("sd", "sdxl"):
        _, params = micro_unet(kind)
        for path, x in _leaves(params).items():
            names = logical_axes(path, x.ndim, LOGICAL)
            assert len(names) == x.ndim and names.count("embed") <= 1, (path, names)
    assert logical_axes("conv_out/kernel", 4, LOGICAL) == (None, None, "embed", "conv_out")
    assert logical_axes("down_blocks_0/resnets_0/conv_shortcut/kernel", 4, LOGICAL) == (
        None, None, "conv_in", "embed")  # fmt: skip
