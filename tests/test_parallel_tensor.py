"""Tensor parallelism and parameters placed by logical-axis rules, on 8 fake CPU devices: the
`tensor` strategy (alone, padded heads, and on hybrid (data, cfg, patch, model) meshes) equals
the single device, its bytes from the compiled program equal the analytic model, and the rules
place, lay out and count weights as they say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parallel_helpers import GUIDANCE, inputs, micro_unet, single_guided

from patchpar.measure.comm import hlo_text_with_metadata, parse_collectives
from patchpar.measure.cost import measure
from patchpar.models.unet import LOGICAL
from patchpar.parallel.engine import Plan, denoise, make_step
from patchpar.parallel.rules import (
    RULES,
    check_rules,
    logical_axes,
    placed,
    unplaced,
    weight_bytes_per_device,
)
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

SLOW = pytest.mark.slow


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def plan(devices, cfg=1, data=1, **options):
    return Plan(make_strategy("tensor", **options), devices, cfg, data=data)


# (kind, devices, cfg, data, tp_degree): the micro SDXL UNet has 2 and 4 heads, so tp 4 pads
FORWARD_CASES = [
    pytest.param("sd", 2, 1, 1, None, marks=SLOW),
    ("sdxl", 4, 1, 1, None),  # 2 heads padded to 4 at the first attention level
    ("sd", 8, 2, 2, None),  # data 2 x cfg 2 x model 2
    pytest.param(
        "sdxl", 8, 1, 1, 2, marks=SLOW
    ),  # patch 4 x model 2: sync_patch's sites on the patch axis
    pytest.param("sdxl", 8, 2, 1, 2, marks=SLOW),
    pytest.param("sd", 4, 2, 1, None, marks=SLOW),
]


@pytest.mark.parametrize("kind, devices, cfg, data, tp", FORWARD_CASES)
def test_tensor_forward_equals_single(kind, devices, cfg, data, tp):
    unet, params = micro_unet(kind)
    x, t, cond = inputs(kind)
    p = plan(devices, cfg, data, tp_degree=tp)
    p.validate(unet, x.shape[1:3], 10, GUIDANCE, x.shape[0])
    out, state = jax.jit(make_step(unet, p, "warmup", "row", GUIDANCE, p.mesh()))(
        params, x, t, cond, None
    )
    assert state == {}
    assert max_diff(out, single_guided(unet, params, x, t, cond)) <= 1e-4


@pytest.mark.parametrize(
    "kind, devices, tp", [("sd", 4, 2), pytest.param("sdxl", 2, None, marks=SLOW)]
)
def test_tensor_sampling_run_equals_single(kind, devices, tp):
    unet, params = micro_unet(kind)
    x, _, cond = inputs(kind)
    smp = get_sampler("dpmpp_2m")
    sched = smp.schedule(SchedulerConfig(), 3)
    x0 = x * sched.init_noise_sigma
    ref, _ = denoise(unet, Plan(make_strategy("single")), smp, params, cond, sched, x0, GUIDANCE)
    out, _ = denoise(unet, plan(devices, tp_degree=tp), smp, params, cond, sched, x0, GUIDANCE)
    assert max_diff(out, ref) <= 1e-4


@pytest.mark.parametrize(
    "kind, devices, cfg, data, tp",
    [
        pytest.param("sdxl", 4, 1, 1, None, marks=SLOW),
        ("sd", 8, 1, 2, 2),
        pytest.param("sd", 8, 2, 1, 2, marks=SLOW),
    ],  # fmt: skip
)
def test_hlo_bytes_equal_the_analytic_model_and_only_the_model_axis_reduces(
    kind, devices, cfg, data, tp
):
    unet, params = micro_unet(kind)
    p = plan(devices, cfg, data, tp_degree=tp)
    r = measure(unet, p, (16, 16), batch=2 * data, params=params, flops=False)
    for phase in r["phases"].values():
        assert phase["analytic_matches_hlo"], phase
        assert phase["hlo"]["tp"]["max"] > 0
    x, t, cond = inputs(kind, batch=2 * data)
    step = make_step(unet, p, "warmup", "row", GUIDANCE, p.mesh())
    text = hlo_text_with_metadata(jax.jit(step).lower(params, x, t, cond, None))
    tp_ops = [c for c in parse_collectives(text, devices) if c.site == "tp"]
    assert {c.op for c in tp_ops} == {"all-reduce"}
    model = p.degrees()["model"]
    assert {len(g) for c in tp_ops for g in c.groups} == {model}  # within a model group only


def test_weights_per_device_follow_the_rules():
    unet, params = micro_unet("sd")
    whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert weight_bytes_per_device(params, RULES["replicated"], {"model": 2}, LOGICAL) == whole
    split = weight_bytes_per_device(params, RULES["tensor"], {"model": 2}, LOGICAL)
    assert whole / 2 < split < whole  # split layers halve, the rest stay whole
    r = measure(unet, plan(2), (16, 16), params=params, flops=False)
    assert r["weight_bytes_per_device"] == split
    assert r["mesh"] == {"data": 1, "cfg": 1, "patch": 1, "model": 2}


def test_gated_projection_is_laid_out_per_device_and_back():
    """GEGLU's [h | gate] kernel: device i's share holds h_i and gate_i, and `unplaced` gives
    the module its local (C, 2 x mlp / m) kernel."""
    c, mlp, m = 3, 8, 2
    kernel = jnp.arange(c * 2 * mlp, dtype=jnp.float32).reshape(c, 2 * mlp)
    params = {"ff": {"net_0": {"proj": {"kernel": kernel}}}}
    assert logical_axes("x/ff/net_0/proj/kernel", 2, LOGICAL) == ("embed", "mlp_gated")
    laid, specs = placed(params, RULES["tensor"], LOGICAL)
    assert laid["ff"]["net_0"]["proj"]["kernel"].shape == (c, 2, mlp)
    assert tuple(specs["ff"]["net_0"]["proj"]["kernel"]) == (None, None, "model")
    share = laid["ff"]["net_0"]["proj"]["kernel"][:, :, mlp // m :]  # device 1's share
    local = unplaced({"ff": {"net_0": {"proj": {"kernel": share}}}}, LOGICAL)["ff"]["net_0"]["proj"]
    h, gate = jnp.split(local["kernel"], 2, axis=-1)
    np.testing.assert_array_equal(h, kernel[:, mlp // m : mlp])
    np.testing.assert_array_equal(gate, kernel[:, mlp + mlp // m :])


def test_bad_rules_and_widths_are_errors():
    with pytest.raises(ValueError, match=r"unknown logical axes \['vocab'\]; known: \['heads'"):
        check_rules({"vocab": "model"}, LOGICAL)
    with pytest.raises(ValueError, match=r"unknown mesh axes \['tensor'\]; mesh axes: \['data'"):
        check_rules({"heads": "tensor"}, LOGICAL)
    with pytest.raises(ValueError, match=r"mesh axis 'model' on both 'embed' and 'heads'"):
        check_rules({"heads": "model", "embed": "model"}, LOGICAL)
    with pytest.raises(ValueError, match=r"no option\(s\) \['tp_degree'\].*combines with exact "
                       r"row patches only"):  # fmt: skip
        make_strategy("distrifusion", tp_degree=2)
    unet, _ = micro_unet("sd")  # widths 16, 32; 4 GroupNorm groups
    with pytest.raises(ValueError, match=r"norm_num_groups \[4\] are not all divisible by 8.* "
                       r"degrees that divide every split width: \[1, 2, 4\]"):  # fmt: skip
        plan(8).validate(unet, (16, 16), 10, GUIDANCE)
    with pytest.raises(ValueError, match=r"tensor: tp_degree=3 must divide the 8 devices"):
        plan(8, tp_degree=3).validate(unet, (16, 16), 10, GUIDANCE)
