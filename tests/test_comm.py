"""Communication accounting: the HLO parser on synthetic text, HLO bytes = analytic bytes for
every strategy, and `patchpar comm`."""

import json

import numpy as np
import pytest
from parallel_helpers import micro_unet

from patchpar.lab.cli import main
from patchpar.measure.comm import count_hlo, parse_collectives
from patchpar.measure.cost import measure
from patchpar.parallel.engine import Plan
from patchpar.parallel.strategies import make_strategy

# Compiled-HLO style: async pairs, bf16 operands, list and iota replica groups, a ROOT line.
SYNTHETIC = """
HloModule m
ENTRY %main {
  %cp-start = (bf16[2,8,16]{2,1,0}, bf16[2,8,16]{2,1,0}, u32[], u32[]) collective-permute-start(bf16[2,8,16]{2,1,0} %x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3}}, metadata={op_name="jit(step)/shard_map/pp_halo/ppermute"}
  %cp-done = bf16[2,8,16]{2,1,0} collective-permute-done(%cp-start), metadata={op_name="jit(step)/shard_map/pp_halo/ppermute"}
  %ag-start = (bf16[1,4,8]{2,1,0}, bf16[4,4,8]{2,1,0}) all-gather-start(%y), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/pp_kv/all_gather"}
  %ag-done = bf16[4,4,8]{2,1,0} all-gather-done(%ag-start)
  %ar-start = f32[2,3]{1,0} all-reduce-start(%z), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/pp_gn/psum"}
  %ar-done = f32[2,3]{1,0} all-reduce-done(%ar-start)
  %ag2 = f32[8,6]{1,0} all-gather(%w), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, metadata={op_name="jit(step)/pp_cfg/all_gather"}
  %rs = f32[2]{0} reduce-scatter(%u), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  ROOT %a2a = bf16[8,2]{1,0} all-to-all(%v), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
"""


def test_parser_on_synthetic_hlo_with_async_pairs_and_bf16():
    cs = parse_collectives(SYNTHETIC, 8)
    assert [c.op for c in cs] == [
        "collective-permute",
        "all-gather",
        "all-reduce",
        "all-gather",
        "reduce-scatter",
        "all-to-all",
    ]
    assert [c.site for c in cs] == ["halo", "kv", "gn", "cfg", "other", "other"]
    assert cs[2].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert cs[3].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    count = count_hlo(SYNTHETIC, 8)
    np.testing.assert_array_equal(
        count.by_site["halo"], [0, 512, 512, 512, 0, 0, 0, 0]
    )  # 2*8*16 bf16
    np.testing.assert_array_equal(count.by_site["kv"], [192] * 4 + [0] * 4)  # 3 x 64 bytes
    np.testing.assert_array_equal(count.by_site["gn"], [36] * 8)  # ring: 2 * 3/4 * 24 bytes
    np.testing.assert_array_equal(count.by_site["cfg"], [96] * 8)  # (2-1) x 8*6*4/2 bytes
    np.testing.assert_array_equal(count.by_site["other"], [56 + 28] * 8)  # 7/8 x 64 + 7/8 x 32
    s = count.summary()["all"]
    assert s["max"] == 512 + 192 + 36 + 96 + 84 and s["total"] == int(count.per_device.sum())
    assert s["mean"] == pytest.approx(s["total"] / 8)


# The edge cases: all devices as `replica_groups={}`, tuple collectives (sync and async, with
# the /*index=N*/ comments long tuples carry), async-wrapped reduce-scatter and all-to-all.
EDGES = """
HloModule m
ENTRY %main {
  %ag = f32[8,4]{1,0} all-gather(%a), channel_id=1, replica_groups={}, dimensions={0}
  %agt = (f32[8,4]{1,0}, bf16[8,2]{1,0}) all-gather(%b, %c), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %ags = ((f32[1,4]{1,0}, bf16[1,2]{1,0}), (f32[8,4]{1,0}, /*index=1*/bf16[8,2]{1,0})) all-gather-start(%b, %c), channel_id=3, replica_groups={}, dimensions={0}
  %agd = (f32[8,4]{1,0}, bf16[8,2]{1,0}) all-gather-done(%ags)
  %ar = (f32[4]{0}, f32[2]{0}) all-reduce(%d, %e), channel_id=4, replica_groups={}, to_apply=%add
  %rss = ((f32[16]{0}), f32[2]{0}) reduce-scatter-start(%f), channel_id=5, replica_groups={}, dimensions={0}, to_apply=%add
  %rsd = f32[2]{0} reduce-scatter-done(%rss)
  %a2as = ((f32[8,2]{1,0}), f32[8,2]{1,0}) all-to-all-start(%g), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  ROOT %a2ad = f32[8,2]{1,0} all-to-all-done(%a2as)
}
"""


def test_parser_edge_cases_all_devices_tuples_and_async_wrapped():
    cs = parse_collectives(EDGES, 8)
    assert [(c.op, c.is_async) for c in cs] == [
        ("all-gather", False),
        ("all-gather", False),
        ("all-gather", True),
        ("all-reduce", False),
        ("reduce-scatter", True),
        ("all-to-all", True),
    ]
    # {} is every device, not a group of one: 7 x (8*4*4 / 8) bytes, not 0
    assert cs[0].group_list(8) == (tuple(range(8)),)
    per = [int(c.received(8)[0]) for c in cs]
    assert per == [
        7 * 16,  # all-gather over 8: the others' 16-byte parts
        7 * (16 + 4),  # tuple: both operands (f32 4 + bf16 2 elements per device)
        7 * (16 + 4),  # the same, async, sized by its operand part
        2 * 7 * (16 + 8) // 8,  # ring all-reduce of both operands
        7 * 64 // 8,  # reduce-scatter of a 16-float operand
        3 * 64 // 4,  # all-to-all in groups of 4
    ]
    with pytest.raises(ValueError, match=r"replica_groups=\{\} \(all devices\)"):
        parse_collectives(EDGES)  # an all-gather over "all" devices needs their number


CASES = [
    ("sd", "naive_patch", {}, 4, 1),
    ("sd", "sync_patch", {}, 8, 1),
    ("sdxl", "sync_patch", {}, 4, 2),
    ("sd", "distrifusion", {"gn": "corrected"}, 4, 2),
    pytest.param("sdxl", "distrifusion", {"gn": "separate"}, 8, 1, marks=pytest.mark.slow),
    ("sd", "distrifusion", {"no_sync": True, "gn": "separate"}, 4, 1),
    pytest.param("sd", "distrifusion", {"gn": "separate"}, 4, 2, marks=pytest.mark.slow),
    ("sd", "pcpp", {"send": "full"}, 8, 1),
    pytest.param("sdxl", "pcpp", {"send": "band", "portion": 0.5}, 4, 2, marks=pytest.mark.slow),
]


def test_a_collective_in_a_loop_counts_as_often_as_the_loop_runs():
    """An all-gather inside a 3-step loop nested in a 2-step loop: received 6 times (a
    scanned stack of blocks), or 3 times with the outer loop counted once (a phase's loop over
    steps, `outer_once`)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from patchpar.measure.comm import hlo_text_with_metadata

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("patch",))

    def local(x):
        def inner(_, y):
            with jax.named_scope("pp_kv"):
                return y + lax.all_gather(y, "patch").sum(0)

        return lax.fori_loop(0, 2, lambda _, y: lax.fori_loop(0, 3, inner, y), x)

    f = jax.shard_map(local, mesh=mesh, in_specs=P("patch"), out_specs=P("patch"),
                      check_vma=False)  # fmt: skip
    text = hlo_text_with_metadata(jax.jit(f).lower(jnp.ones((4, 8), jnp.float32)))
    assert len(parse_collectives(text, 2)) == 6
    assert len(parse_collectives(text, 2, outer_once=True)) == 3
    assert count_hlo(text, 2).summary()["kv"]["max"] == 6 * 2 * 8 * 4  # 6 x the other's (2, 8)


@pytest.mark.parametrize("kind, strategy, options, devices, cfg", CASES)
def test_hlo_bytes_equal_analytic_bytes(kind, strategy, options, devices, cfg):
    unet, params = micro_unet(kind)
    r = measure(
        unet,
        Plan(make_strategy(strategy, **options), devices, cfg),
        (16, 16),
        params=params,
        flops=False,
    )
    for phase in ("warmup", "steady"):
        entry = r["phases"][phase]
        assert entry["analytic_matches_hlo"], (phase, entry["hlo"], entry["analytic"])
        assert entry["hlo"] == entry["analytic"]
    steady = r["phases"]["steady"]["hlo"]
    warmup = r["phases"]["warmup"]["hlo"]
    if strategy == "naive_patch":
        assert steady["all"]["max"] == 0
    if strategy != "naive_patch":  # every GroupNorm mode all-reduces during warm-up
        assert warmup["gn"]["max"] > 0
    if options.get("gn") == "separate":  # and `separate` is local in the steady phase
        assert "gn" not in steady
    if options.get("no_sync"):
        # Only conv_in's halo is exchanged, fresh: one row above and one below the patch of the
        # (B=2, 16, 16, 4) fp32 latent for an interior device.
        assert set(steady) == {"all", "halo"}
        assert steady["halo"]["max"] == 2 * (1 * 16 * 4 * 2 * 4)
    if strategy in ("distrifusion", "pcpp"):
        assert r["stale_bytes_per_device"] > 0


@pytest.mark.slow
def test_released_code_pattern_relations():
    """The analytic count of the released code's traffic, tied to patchpar's measured HLO
    counts by exact relations (fp32 micro UNet, 4 devices, CFG pair in the batch):
    K/V all-gathers are the same; statistics are all-gathered ((n-1) S, against the all-reduce's
    2(n-1)/n S: n/2 = 2 times); halos are all-gathered, 2 rows to all n-1 others, except
    conv_in's; the UNet output (B=2 x 4 rows x 16 x 4 fp32) is all-gathered every step."""
    unet, params = micro_unet("sd")
    n = 4

    def phases(strategy, **options):
        plan = Plan(make_strategy(strategy, **options), n, 1)
        return measure(unet, plan, (16, 16), params=params, flops=False)["phases"]

    d = phases("distrifusion", gn="corrected")
    hlo, rel = d["steady"]["hlo"], d["steady"]["released"]
    assert rel["kv"] == hlo["kv"]
    assert rel["gn"]["max"] == 2 * hlo["gn"]["max"]
    output = (n - 1) * (2 * 4 * 16 * 4 * 4)
    assert rel["output"] == {"max": output, "mean": float(output), "total": n * output}
    # halos: our interior device gets (top + bottom) rows from two neighbours; the released code
    # sends each conv's 2 boundary rows to all n-1 others (conv_in: nothing, sliced from the latent)
    conv_in = 2 * (1 * 16 * 4 * 2 * 4)  # fresh rows above and below, 4 channels, batch 2
    assert rel["halo"]["max"] == (n - 1) * (hlo["halo"]["max"] - conv_in)
    p_full = phases("pcpp", send="full")
    p_band = phases("pcpp", send="band")
    # PCPP's code sends whole neighbour K/V whatever patchpar's `send` is
    assert p_full["steady"]["released"]["kv"] == p_band["steady"]["released"]["kv"]
    assert p_full["steady"]["released"]["kv"] == p_full["steady"]["hlo"]["kv"]
    assert p_full["steady"]["released"]["all"]["max"] < rel["all"]["max"]
    # warm-up: every strategy's exchange as sync_patch's (K/V all-gathered) in the released code
    assert (
        d["warmup"]["released"]["kv"]
        == p_full["warmup"]["released"]["kv"]
        == d["warmup"]["hlo"]["kv"]
    )


@pytest.mark.slow
def test_pcpp_sends_less_than_distrifusion_and_band_less_than_full():
    unet, params = micro_unet("sd")
    steady = {}
    for name, opts in [
        ("distrifusion", {}),
        ("pcpp", {"send": "full"}),
        ("pcpp", {"send": "band"}),
    ]:
        r = measure(
            unet, Plan(make_strategy(name, **opts), 8, 1), (32, 16), params=params, flops=False
        )
        steady[name + opts.get("send", "")] = r["phases"]["steady"]["hlo"]["kv"]["max"]
    assert steady["pcppband"] < steady["pcppfull"] < steady["distrifusion"]


@pytest.mark.slow
def test_comm_cli_json_record(capsys):
    assert (
        main(
            [
                "comm",
                "--model",
                "tiny",
                "--resolution",
                "128",
                "--devices",
                "4",
                "--strategy",
                "pcpp",
                "--send",
                "band",
                "--dtype",
                "float32",
                "--json",
            ]
        )
        == 0
    )
    rec = json.loads(capsys.readouterr().out)
    for key in (
        "steady_bytes_per_device",
        "warmup_bytes_per_device",
        "flops_per_device",
        "stale_bytes_per_device",
    ):
        assert rec[key] > 0
    assert (
        rec["analytic_matches_hlo"]
        and rec["steady_bytes_per_device"] < rec["warmup_bytes_per_device"]
    )
    assert rec["steady_bytes_mean"] <= rec["steady_bytes_per_device"]
    assert rec["steady_bytes_total"] == pytest.approx(rec["steady_bytes_mean"] * 4)
    # memory per device of the compiled steady program; PCPP's stale buffers donated (aliased)
    mem = rec["memory_per_device"]
    assert rec["memory_per_device_bytes"] == mem["total"] > mem["arguments"] > 0
    assert mem["aliased"] == rec["stale_bytes_per_device"] > 0
    assert (rec["attention"], rec["memory_backend"]) == ("chunked", "cpu")


def test_comm_cli_bad_resolution(capsys):
    assert (
        main(
            [
                "comm",
                "--model",
                "tiny",
                "--resolution",
                "96",
                "--devices",
                "4",
                "--strategy",
                "sync_patch",
            ]
        )
        == 2
    )
    assert (
        "latent rows=12 are 3 unit(s) of 4 (2^2 UNet downsamplings): fewer than the 4 patch"
        in capsys.readouterr().err
    )
    assert main(["comm", "--model", "tiny", "--resolution", "100", "--strategy", "sync_patch"]) == 2
    assert "resolution=100: must be a positive multiple of 8" in capsys.readouterr().err


@pytest.mark.slow
def test_sdxl_steady_bytes_pcpp_vs_distrifusion_at_1024():
    """Issue 4's bound at one resolution (all resolutions: experiments/comm_table.py)."""
    from patchpar.models.presets import abstract_denoiser

    unet = abstract_denoiser("sdxl")
    params = unet.abstract_params()
    steady = {}
    for name, opts in [
        ("distrifusion", {}),
        ("full", {"send": "full"}),
        ("band", {"send": "band"}),
    ]:
        strat = make_strategy("pcpp" if opts else name, **opts)
        r = measure(unet, Plan(strat, 8, 1), (128, 128), params=params, flops=False)
        steady[name] = r["phases"]["steady"]["hlo"]["all"]["max"]
    assert steady["full"] <= 0.31 * steady["distrifusion"]
    assert steady["band"] <= 0.12 * steady["distrifusion"]


def test_the_published_grid_fills_distrifusion_table2():
    """The report finds its strategies by their options, whatever options later code adds to
    `describe()` (comm_groups); every published point's HLO count equals the analytic model."""
    from pathlib import Path

    from patchpar.lab.comm_report import distrifusion_table2_markdown
    from patchpar.lab.results import read_records

    records = read_records(Path(__file__).parents[1] / "results" / "comm" / "runs.jsonl")
    assert records and all(r["analytic_matches_hlo"] for r in records)
    table = distrifusion_table2_markdown(records)
    assert "not measured" not in table and "| 1024 | 0.42G | 0.43G | 0.750 |" in table
