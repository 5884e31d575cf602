"""The packed stale exchange (docs/design.md §2): packed equals per-site (the exchange moves
bytes; the two programs' compute may round apart by a few ulps where XLA compiles them
differently), a steady step issues exactly the collectives its grouping implies, HLO bytes equal
the analytic model per site whatever the grouping, and bad `comm_groups` are errors naming what
fits."""

import functools

import jax
import numpy as np
import pytest
from parallel_helpers import GUIDANCE, inputs, micro_unet, reordered, rounding

from patchpar.lab.config import RunConfig
from patchpar.lab.configio import with_overrides
from patchpar.measure.comm import hlo_text_with_metadata, parse_collectives
from patchpar.measure.cost import measure
from patchpar.parallel.engine import Plan, denoise, make_step, stale_sites, state_template
from patchpar.parallel.exchange import pending_sends
from patchpar.parallel.strategies import make_strategy
from patchpar.sampling.schedulers import SchedulerConfig, get_sampler

SLOW = pytest.mark.slow


@functools.cache
def _run(strategy, options, patch, cfg, data, fsdp, kind="sd"):
    unet, params = micro_unet(kind)
    x, _, cond = inputs(kind, batch=2)
    plan = Plan(
        make_strategy(strategy, **dict(options)), data * cfg * patch, cfg, data=data, fsdp=fsdp
    )
    plan.validate(unet, x.shape[1:3], 4, GUIDANCE, batch=2)
    smp = get_sampler("dpmpp_2m")
    sched = smp.schedule(SchedulerConfig(), 4)
    out, state = denoise(unet, plan, smp, params, cond, sched, x, GUIDANCE)
    return np.asarray(out), jax.tree.map(np.asarray, state)


# (strategy, options, patch, cfg, data, fsdp); 4 steps, 1 warm-up step + 3 steady ones
CASES = [
    ("distrifusion", {"gn": "corrected"}, 2, 1, 1, False),
    # pcpp's packed sends: here in the slow tier, and over 2 processes (slow); the
    # default tier has pcpp's whole band equal to distrifusion (test_parallel_unet.py)
    pytest.param("pcpp", {"send": "band", "portion": 0.3}, 2, 1, 1, False, marks=SLOW),
    pytest.param("pcpp", {"send": "band", "portion": 0.3}, 4, 2, 1, False, marks=SLOW),
    pytest.param("distrifusion", {"gn": "stale"}, 4, 2, 1, False, marks=SLOW),
    pytest.param("pcpp", {"send": "band", "portion": 0.3}, 8, 1, 1, False, marks=SLOW),
    pytest.param("pcpp", {"send": "full", "portion": 0.5}, 2, 1, 2, False, marks=SLOW),
    pytest.param("distrifusion", {"gn": "separate"}, 8, 1, 1, False, marks=SLOW),
    pytest.param("distrifusion", {"gn": "sync"}, 2, 2, 1, False, marks=SLOW),
    pytest.param("distrifusion", {"gn": "separate", "no_sync": True}, 4, 1, 1, False, marks=SLOW),
    pytest.param("distrifusion", {"gn": "corrected"}, 2, 1, 2, True, marks=SLOW),
    pytest.param("pcpp", {"send": "band", "portion": 0.7}, 4, 2, 1, False, marks=SLOW),
    pytest.param("pcpp", {"send": "band", "portion": 1.0}, 2, 1, 1, True, marks=SLOW),
    pytest.param("pcpp", {"send": "full", "gn": "stale"}, 4, 1, 2, False, marks=SLOW),
]


@pytest.mark.parametrize("strategy, options, patch, cfg, data, fsdp", CASES)
def test_packed_equals_per_site(strategy, options, patch, cfg, data, fsdp):
    """The final latent within float32 rounding (`rounding`, the suite's bound for the same
    arithmetic in another order) and every stale buffer within 10 x `reordered` (1e-5 of its
    scale, at least of 1): the exchange only moves bytes, but the two programs' compute is
    compiled apart, and bit identity holds only where XLA compiles them alike (with XLA:CPU's
    older loop emitters the packed program lands 1 ulp from the per-site one in 2 of 65 buffers
    after 2 steps, 18 ulps, 1.1e-6 of the scale, after 4). A packing off by one element fails
    it by orders of magnitude (test_a_packing_off_by_one_element_fails)."""
    opts = {"warmup_steps": 0, **options}
    ref_out, ref_state = _run(
        strategy, tuple(sorted({**opts, "comm_groups": "per_site"}.items())), patch, cfg, data, fsdp
    )
    assert jax.tree.leaves(ref_state)
    for groups in (1,) if options.get("no_sync") else (1, 3):  # no_sync sends nothing
        out, state = _run(
            strategy, tuple(sorted({**opts, "comm_groups": groups}.items())), patch, cfg, data, fsdp
        )
        assert np.abs(out - ref_out).max() <= rounding(ref_out)
        assert jax.tree.structure(state) == jax.tree.structure(ref_state)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
            assert np.abs(a - b).max() <= 10 * reordered(b)
    if not options.get("no_sync") and options.get("gn") != "sync":  # the steady phase is stale
        sync, _ = _run("sync_patch", (), patch, cfg, data, False)
        assert np.abs(ref_out - sync).max() > 1e-4


@pytest.mark.slow
def test_a_packing_off_by_one_element_fails(monkeypatch):
    """The bound above catches a packing bug: every packed buffer shifted by one element lands
    1.06 from the per-site latent, 2,200 times the bound (4.8e-4)."""
    from patchpar.parallel.sites import common

    def shifted(parts):  # only where sites are packed together: per-site sends stay right
        return common_pack(parts) if len(parts) == 1 else jax.numpy.roll(common_pack(parts), 1)

    common_pack = common._pack
    strategy, options = "distrifusion", {"gn": "corrected", "warmup_steps": 0}
    per_site, _ = _run(
        strategy, tuple(sorted({**options, "comm_groups": "per_site"}.items())), 2, 1, 1, False
    )
    # the same static arguments as the other test's: JAX's trace caches would hand back the
    # correct program (and keep the planted one for the next test) without this
    jax.clear_caches()
    try:
        monkeypatch.setattr(common, "_pack", shifted)
        planted, _ = _run.__wrapped__(
            strategy, tuple(sorted({**options, "comm_groups": 1}.items())), 2, 1, 1, False
        )
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert np.abs(planted - per_site).max() > 100 * rounding(per_site)


def _steady_collectives(strategy, patch, cfg=1, kind="sd", **options):
    """(op, site) -> how many, in the pre-optimisation HLO of one steady step."""
    unet, params = micro_unet(kind)
    x, t, cond = inputs(kind)
    plan = Plan(make_strategy(strategy, **options), patch * cfg, cfg)
    mesh = plan.mesh()
    state = state_template(unet, plan, GUIDANCE, mesh, params, x, cond)
    step = make_step(unet, plan, "steady", "row", GUIDANCE, mesh)
    lowered = jax.jit(step).lower(params, x, t, cond, state)
    counts: dict = {}
    for c in parse_collectives(hlo_text_with_metadata(lowered), plan.devices):
        counts[(c.op, c.site)] = counts.get((c.op, c.site), 0) + 1
    return counts


@pytest.mark.parametrize(
    "strategy, options, patch",
    [
        pytest.param("distrifusion", {}, 2, marks=SLOW),  # 2 devices: test_two_devices_...
        ("pcpp", {"send": "band"}, 4),
        pytest.param("distrifusion", {}, 4, marks=SLOW),
        pytest.param("pcpp", {"send": "band"}, 2, marks=SLOW),
    ],
)
def test_steady_step_has_the_collectives_its_grouping_implies(strategy, options, patch):
    """Per group: one collective per site kind and collective (halos and PCPP's bands: one
    permute per direction; K/V: one all-gather; GroupNorm: one all-reduce; on 2 devices each
    is one swap), plus conv_in's fresh halo. Per site: one per site and collective."""
    unet, _ = micro_unet("sd")
    plan = Plan(make_strategy(strategy, **options), patch, 1)
    sites = stale_sites(unet, plan, (16, 16))
    perm = "collective-permute"
    directions = 1 if patch == 2 else 2  # one halo or band exchange: a swap, or down and up
    if strategy == "distrifusion":
        kv, kv_count = (perm if patch == 2 else "all-gather", "kv"), 1
    else:
        kv, kv_count = (perm, "kv"), directions
    gn = (perm if patch == 2 else "all-reduce", "gn")
    one = _steady_collectives(strategy, patch, **options, comm_groups=1)
    assert one == {(perm, "halo"): 2 * directions, kv: kv_count, gn: 1}  # + conv_in's halo
    two = _steady_collectives(strategy, patch, **options, comm_groups=2)
    assert two == {k: 2 * v - (directions if k[1] == "halo" else 0) for k, v in one.items()}
    # as many groups as sites: each site's collectives apart, as per_site issues them
    per_site = _steady_collectives(strategy, patch, **options, comm_groups="per_site")
    assert _steady_collectives(strategy, patch, **options, comm_groups=sites) == per_site
    assert sum(per_site.values()) > 3 * sum(one.values())
    halos, norms, attns = (per_site[k] for k in ((perm, "halo"), gn, kv))
    assert (halos // directions - 1) + norms + attns // kv_count == sites


def test_two_devices_exchange_by_swaps_only():
    """On a patch axis of 2 every collective of every phase is one collective-permute 0 <-> 1
    (halo, K/V and GroupNorm alike; over gloo a permute costs a fraction of the others)."""
    unet, params = micro_unet("sd")
    x, t, cond = inputs("sd")
    plan = Plan(make_strategy("distrifusion"), 2, 1)
    for phase in ("warmup", "steady"):
        state = state_template(unet, plan, GUIDANCE, plan.mesh(), params, x, cond)
        step = make_step(unet, plan, phase, "row", GUIDANCE, plan.mesh())
        lowered = jax.jit(step).lower(params, x, t, cond, state if phase == "steady" else None)
        cs = parse_collectives(hlo_text_with_metadata(lowered), 2)
        assert cs and {(c.op, c.pairs) for c in cs} == {("collective-permute", ((0, 1), (1, 0)))}


@pytest.mark.parametrize(
    "kind, strategy, options, devices, cfg",
    [
        ("sd", "distrifusion", {"comm_groups": 3}, 4, 2),
        pytest.param("sdxl", "pcpp", {"comm_groups": 2, "send": "band"}, 2, 1, marks=SLOW),
        pytest.param("sd", "pcpp", {"comm_groups": "per_site"}, 8, 1, marks=SLOW),
    ],
)
def test_hlo_bytes_equal_the_analytic_model_whatever_the_grouping(
    kind, strategy, options, devices, cfg
):
    unet, params = micro_unet(kind)
    plan = Plan(make_strategy(strategy, **options), devices, cfg)
    r = measure(unet, plan, (16, 16), params=params, flops=False)
    for phase in ("warmup", "steady"):
        entry = r["phases"][phase]
        assert entry["hlo"] == entry["analytic"], (phase, entry["hlo"], entry["analytic"])
    per_site = Plan(make_strategy(strategy, **{**options, "comm_groups": "per_site"}), devices, cfg)
    ref = measure(unet, per_site, (16, 16), params=params, flops=False)
    assert r["phases"]["steady"]["hlo"] == ref["phases"]["steady"]["hlo"]  # the same bytes


def test_pending_sends_keep_the_order_the_sites_ran():
    a = np.zeros(1)
    tree = {
        "up_blocks_0": {"resnets_10": {"halo": {"down": a}}, "resnets_2": {"gn": {"mean": a}}},
        "down_blocks_0": {"attn": {"kv": {"gather": a}}},
    }
    assert [(p, k) for p, k, _ in pending_sends(tree)] == [
        (("up_blocks_0", "resnets_10"), "halo"),
        (("up_blocks_0", "resnets_2"), "gn"),
        (("down_blocks_0", "attn"), "kv"),
    ]


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [0, -2, True, "four", 1.5])
def test_comm_groups_must_be_a_positive_integer_or_per_site(bad):
    with pytest.raises(
        ValueError, match=rf"comm_groups={bad!r} must be a positive integer .* or 'per_site'"
    ):
        make_strategy("distrifusion", comm_groups=bad)


def test_comm_groups_larger_than_the_stale_sites_names_how_many():
    unet, _ = micro_unet("sd")
    x, _, _ = inputs("sd")
    plan = Plan(make_strategy("pcpp", comm_groups=10_000), 2, 1)
    sites = stale_sites(unet, plan, (16, 16))
    assert 10 < sites < 10_000
    with pytest.raises(
        ValueError, match=f"comm_groups=10000 is larger than the {sites} stale site"
    ):
        plan.validate(unet, x.shape[1:3], 10, GUIDANCE)
    Plan(make_strategy("pcpp", comm_groups=sites), 2, 1).validate(unet, x.shape[1:3], 10, GUIDANCE)


def test_comm_groups_on_a_strategy_without_stale_exchange_names_those_with_it():
    with pytest.raises(
        ValueError, match=r"no option\(s\) \['comm_groups'\].*only distrifusion and pcpp have"
    ):
        make_strategy("sync_patch", comm_groups=2)
    cfg = with_overrides(RunConfig(), {"strategy.name": "ring", "strategy.comm_groups": 2})
    with pytest.raises(ValueError, match="only distrifusion and pcpp"):
        cfg.validate()


def test_comm_groups_from_a_config_file_and_the_command_line():
    base = {"strategy.name": "distrifusion", "mesh.devices": 2}
    assert (
        with_overrides(RunConfig(), {**base, "strategy.comm_groups": 4}).plan().strategy.comm_groups
        == 4
    )
    cfg = with_overrides(RunConfig(), {**base, "strategy.comm_groups": "per_site"})
    assert cfg.plan().strategy.packed_groups() is None
    with pytest.raises(ValueError, match=r"strategy.comm_groups=2.5: expected int or str"):
        with_overrides(RunConfig(), {**base, "strategy.comm_groups": 2.5})


def test_accelerator_exchange_issues_each_payload_apart(monkeypatch):
    """On a TPU or GPU (`packs_flat` false) a packed group's payloads go as collectives of
    their own, issued together (no flat buffer: a relayout copy at both ends there): the same
    bytes as the flat packing, more collectives."""
    from patchpar.parallel.sites import common

    unet, params = micro_unet("sd")
    plan = Plan(make_strategy("distrifusion", comm_groups=1), 4, 1)
    flat = measure(unet, plan, (16, 16), params=params, flops=False)
    one = _steady_collectives("distrifusion", 4, comm_groups=1)
    try:
        monkeypatch.setattr(common, "packs_flat", lambda: False)
        apart = measure(unet, plan, (16, 16), params=params, flops=False)
        each = _steady_collectives("distrifusion", 4, comm_groups=1)
    finally:  # no program traced without flat packing is left for a later test
        monkeypatch.undo()
        jax.clear_caches()
    for phase in ("warmup", "steady"):
        assert apart["phases"][phase]["hlo"] == flat["phases"][phase]["hlo"]
        assert apart["phases"][phase]["hlo"] == apart["phases"][phase]["analytic"]
    sites = stale_sites(unet, plan, (16, 16))
    assert sum(each.values()) > sum(one.values()) and each[("all-gather", "kv")] > 1
    assert sum(each.values()) >= sites


@pytest.mark.slow
def test_accelerator_exchange_equals_the_flat_one(monkeypatch):
    """The payloads exchanged apart (`packs_flat` false) give the flat packing's latent and
    stale buffers, within the rounding bound of another program."""
    from patchpar.parallel.sites import common

    key = ("distrifusion", (("comm_groups", 1), ("warmup_steps", 0)), 4, 1, 1, False)
    out, state = _run(*key)
    jax.clear_caches()
    try:
        monkeypatch.setattr(common, "packs_flat", lambda: False)
        out2, state2 = _run.__wrapped__(*key)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert np.abs(out2 - out).max() <= rounding(out)
    for a, b in zip(jax.tree.leaves(state2), jax.tree.leaves(state), strict=True):
        assert np.abs(a - b).max() <= 10 * reordered(b)
