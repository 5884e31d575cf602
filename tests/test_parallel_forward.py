"""docs/design.md §4 item 2: one sync_patch UNet call equals the single device, per layout
(a file of its own, so that pytest-xdist's workers share the parallel-engine tests)."""

import jax
import numpy as np
import pytest
from parallel_helpers import GUIDANCE, inputs, micro_unet, single_guided

from patchpar.parallel.engine import Plan, make_step
from patchpar.parallel.strategies import make_strategy

# every (patch, cfg) that fits on 8 devices
LAYOUTS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2)]


def max_diff(a, b):
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# The default tier: two layouts of each UNet (patch 1, 2, 4, 8 and both cfg values among them;
# test_parallel_unet's sampling runs add more); `make test-slow` runs the other ten.
DEFAULT_LAYOUTS = {"sd": ((2, 1), (4, 2)), "sdxl": ((1, 2), (8, 1))}
FORWARD_CASES = [
    (kind, p, c) if (p, c) in DEFAULT_LAYOUTS[kind] else
    pytest.param(kind, p, c, marks=pytest.mark.slow)
    for kind in ("sd", "sdxl") for p, c in LAYOUTS
]  # fmt: skip


@pytest.mark.parametrize("kind, patch, cfg", FORWARD_CASES)
def test_sync_patch_forward_equals_single(kind, patch, cfg):
    unet, params = micro_unet(kind)
    x, t, cond = inputs(kind)
    plan = Plan(make_strategy("sync_patch"), patch * cfg, cfg)
    plan.validate(unet, x.shape[1:3], 10, GUIDANCE)
    step = jax.jit(make_step(unet, plan, "warmup", "row", GUIDANCE, plan.mesh()))
    out, state = step(params, x, t, cond, None)
    assert state == {}
    assert max_diff(out, single_guided(unet, params, x, t, cond)) <= 1e-4
