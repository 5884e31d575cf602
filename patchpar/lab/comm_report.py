"""Markdown tables from communication records."""

from __future__ import annotations

from patchpar.models.presets import abstract_denoiser

GB = 1e9


def comm_markdown(records: list[dict]) -> str:
    """One table per model: steady / warm-up bytes received per device per model call (the
    most any device receives), FLOPs per device and stale-buffer memory."""
    ok = [r for r in records if r.get("status") == "ok"]
    lines = [
        "# Communication per model call (bytes received by the busiest device)",
        "",
        "Made by `experiments/comm_table.py` from `runs.jsonl`; bf16, CFG pair in the model's "
        "batch (batch 2), 77 text tokens (UNets; PixArt's T5: 120); pre-optimisation HLO, "
        "checked against the analytic model. A DiT (pixart-alpha) has one site, "
        "self-attention K/V: no halos, no GroupNorm. An MMDiT (flux-dev) has one too, each "
        "joint attention's image K/V (the text K/V stays on every device); its guidance scale "
        "is an input, so its model batch is 1, with 512 T5 tokens.",
        "",
        '"steady GB" and "warm-up GB" are patchpar\'s traffic, counted in the compiled program '
        "(halos to neighbours only, GroupNorm statistics all-reduced, the latent kept sharded). "
        '"released GB" is the analytic count of what the released DistriFusion / PCPP code\'s '
        "pattern would move for the same steady step (halos and statistics all-gathered from "
        "every device, PCPP's whole neighbour K/V, the UNet output all-gathered every step); "
        "it is not measured.",
        "",
    ]
    for model in sorted({r["model"] for r in ok}):
        lines += [
            f"## {model}",
            "",
            "| px | devices | strategy | steady GB | warm-up GB | steady / distrifusion | "
            "released GB | released / distrifusion released | "
            "TFLOP per device | stale GB per device | HLO = analytic |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = sorted(
            (r for r in ok if r["model"] == model),
            key=lambda r: (r["resolution"], r["devices"], r["strategy"]),
        )
        for r in rows:
            base = next(
                (
                    b
                    for b in rows
                    if b["resolution"] == r["resolution"]
                    and b["devices"] == r["devices"]
                    and b["strategy"].startswith("distrifusion")
                ),
                None,
            )
            ratio = (
                f"{r['steady_bytes_per_device'] / base['steady_bytes_per_device']:.1%}"
                if base and base["steady_bytes_per_device"]
                else "–"
            )
            rel, rel_base = (
                r.get("released_steady_bytes_per_device"),
                (base or {}).get("released_steady_bytes_per_device"),
            )
            rel_gb = f"{rel / GB:.3f}" if rel is not None else "–"
            rel_ratio = f"{rel / rel_base:.1%}" if rel is not None and rel_base else "–"
            flops = r.get("flops_per_device")
            lines.append(
                f"| {r['resolution']} | {r['devices']} | `{r['strategy']}` | {r['steady_bytes_per_device'] / GB:.3f} | "
                f"{r['warmup_bytes_per_device'] / GB:.3f} | {ratio} | {rel_gb} | {rel_ratio} | "
                f"{flops / 1e12 if flops else float('nan'):.2f} | "
                f"{r['stale_bytes_per_device'] / GB:.3f} | {'yes' if r['analytic_matches_hlo'] else 'NO'} |"
            )
        lines.append("")
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        lines += ["## Failed points", ""] + [
            f"- {r['model']} {r['resolution']} {r['devices']} {r['strategy']}: {r.get('error')}"
            for r in failed
        ]
    return "\n".join(lines) + "\n"


PAPER_TABLE2 = {
    1024: 0.42,
    2048: 1.48,
    3840: 5.38,
}  # DistriFusion Table 2, "Comm." (unit "G", undefined)
PAPER_TABLE2_TP = {1024: 1.33, 2048: 5.33, 3840: 18.7}  # its "sync tensor parallel" row
# xDiT's cost table (PipeFusion arXiv 2405.14430): communication per layer in units of
# O(p x hs) (p tokens, hidden size hs), N devices; PipeFusion's 2 O(p x hs) is per step, not per
# layer: 2/L per layer for L blocks
XDIT_COST = {"tensor": "4", "ring": "2", "ulysses": "4/N", "distrifusion": "2", "pipefusion": "2/L"}


def distrifusion_table2_markdown(records: list[dict], devices: int = 8) -> str:
    """SDXL on `devices` devices beside DistriFusion's Table 2 communication column."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok" and r["model"] == "sdxl" and r["devices"] == devices
    ]

    def pick(res, name, *options):
        """The record of strategy `name` with every option in `options` (as `describe()`
        writes them, e.g. "send='full'") and no row-aligned band: records keep the options of
        the code that made them (`comm_groups` came later), so no whole string is matched."""
        return next(
            (
                r
                for r in ok
                if r["resolution"] == res
                and r["strategy"].startswith(name + "(")
                and all(o in r["strategy"] for o in options)
                and "align='rows'" not in r["strategy"]
            ),
            None,
        )

    lines = [
        "| px | paper Comm. | our full stale set (G elements) | distrifusion steady GB/device | "
        "pcpp full | pcpp band | pcpp full / distrifusion | pcpp band / distrifusion | "
        "released code: distrifusion GB | released: pcpp / distrifusion |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res, paper in PAPER_TABLE2.items():
        d = pick(res, "distrifusion", "warmup_steps=4", "gn='corrected'", "no_sync=False")
        full = pick(res, "pcpp", "gn='corrected'", "portion=0.3", "send='full'")
        band = pick(res, "pcpp", "gn='corrected'", "portion=0.3", "send='band'")
        if not (d and full and band):
            lines.append(f"| {res} | {paper}G | (not measured yet) | | | | | | | |")
            continue
        db, fb, bb = (
            d["steady_bytes_per_device"],
            full["steady_bytes_per_device"],
            band["steady_bytes_per_device"],
        )
        rd, rf = (
            d.get("released_steady_bytes_per_device"),
            full.get("released_steady_bytes_per_device"),
        )
        released = f"{rd / GB:.3f} | {rf / rd:.1%}" if rd and rf is not None else "– | –"
        lines.append(
            f"| {res} | {paper}G | {d['stale_bytes_per_device'] / 2 / 1e9:.2f}G | {db / GB:.3f} | {fb / GB:.3f} | "
            f"{bb / GB:.3f} | {fb / db:.1%} | {bb / db:.1%} | {released} |"
        )
    return "\n".join(lines) + "\n"


def _pick(records, model, res, devices, prefix):
    return next(
        (
            r
            for r in records
            if r.get("status") == "ok"
            and r["model"] == model
            and r["resolution"] == res
            and r["devices"] == devices
            and r["strategy"].startswith(prefix)
        ),
        None,
    )


def tensor_parallel_markdown(records: list[dict], devices: int = 8) -> str:
    """SDXL tensor parallelism on `devices` devices beside DistriFusion Table 2's "sync tensor
    parallel" row, with each one's ratio to DistriFusion's own traffic."""
    lines = [
        "| px | paper TP Comm. | paper TP / DistriFusion | tensor steady GB/device | "
        "tensor / distrifusion (ours) | tp site GB | weights GB/device (tensor; replicated) |",
        "|---|---|---|---|---|---|---|",
    ]
    for res, paper in PAPER_TABLE2_TP.items():
        t = _pick(records, "sdxl", res, devices, "tensor")
        d = _pick(records, "sdxl", res, devices, "distrifusion")
        ratio = paper / PAPER_TABLE2[res]
        if not (t and d):
            lines.append(f"| {res} | {paper}G | {ratio:.2f}x | (not measured yet) | | | |")
            continue
        tb, db = t["steady_bytes_per_device"], d["steady_bytes_per_device"]
        w = t.get("weight_bytes_per_device")
        whole = _pick(records, "sdxl", res, devices, "ring")  # replicated weights, same model
        wd = (whole or {}).get("weight_bytes_per_device")
        weights = f"{w / GB:.2f}; {wd / GB:.2f}" if w and wd else "–"
        lines.append(
            f"| {res} | {paper}G | {ratio:.2f}x | {tb / GB:.3f} | {tb / db:.2f}x | "
            f"{t['steady_by_site'].get('tp', 0) / GB:.3f} | {weights} |"
        )
    return "\n".join(lines) + "\n"


XDIT_POINTS = (
    ("pixart-alpha", 1024),
    ("pixart-alpha", 2048),
    ("sdxl", 1024),
    ("flux-dev", 1024),
    ("flux-dev", 2048),
)


def xdit_cost_markdown(records: list[dict], points=XDIT_POINTS) -> str:
    """Tensor, Ring, Ulysses and DistriFusion side by side with xDiT's cost table, one section
    per (model, px) of `points` measured: steady bytes per device per model call at 2/4/8
    devices, and each one's ratio to DistriFusion's beside the ratio the table's formulas
    give. The formulas are a DiT's (one exchange per block); a UNet adds halos and GroupNorm."""
    out = []
    for model, res in points:
        if any(r.get("model") == model and r.get("resolution") == res for r in records):
            out += [f"## {model} {res}px", "", _xdit_cost_rows(records, model, res), ""]
    return "\n".join(out) if out else "(no xDiT comparison points measured yet)\n"


def _layers(model: str) -> int:
    """A DiT preset's block count (PipeFusion's formula per layer)."""
    return abstract_denoiser(model).stack.num_layers


def _xdit_cost_rows(records: list[dict], model: str, res: int) -> str:
    lines = [
        "| devices | strategy | xDiT cost per layer | steady GB/device | self-attention (kv) GB "
        "| / distrifusion (all) | xDiT formula / distrifusion |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in (2, 4, 8):
        d = _pick(records, model, res, n, "distrifusion")
        for name, cost in XDIT_COST.items():
            if name == "pipefusion" and abstract_denoiser(model).stack is None:
                continue  # a stack of identical blocks only
            r = _pick(records, model, res, n, name)
            if r is None or d is None:
                lines.append(f"| {n} | {name} | {cost}·O(p·hs) | (not measured yet) | | | |")
                continue
            formula = (
                1.0 / _layers(model)
                if cost == "2/L"
                else {"4": 2.0, "2": 1.0, "4/N": 2.0 / n}[cost]
            )
            b = r["steady_bytes_per_device"]
            lines.append(
                f"| {n} | {name} | {cost}·O(p·hs) | {b / GB:.3f} | "
                f"{r['steady_by_site'].get('kv', 0) / GB:.3f} | "
                f"{b / d['steady_bytes_per_device']:.2f}x | {formula:.2f}x |"
            )
    return "\n".join(lines) + "\n"
