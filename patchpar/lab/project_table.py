"""`patchpar project`'s table: one row per hardware profile of a projected point
(`lab.project.run_project`), with a step cache's rows where it has one."""

from __future__ import annotations


def format_project(rows: list[dict]) -> str:
    r0 = rows[0]
    size = f"{r0['resolution']}px"
    if "layout" in r0:  # a video's HxWxF
        h, w, f = r0["resolution"].split("x")
        size = f"{h}x{w} x {f} frames ({r0['layout']} layout)"
    head = (
        f"{r0['strategy']} | {r0['model']} {size} {r0['dtype']}, batch {r0['batch']}, "
        f"{r0['steps']} steps ({r0['warmup_phase_steps']} synchronous) | {r0['devices']} devices "
        f"(cfg={r0['cfg']})"
    )
    where = "row patches" if r0["vae"] == "rows" else "one device"
    if r0.get("quant", "none") != "none":
        emulated = [r["hardware"] for r in rows if r.get("quant_emulated")]
        head += (
            f" | quant {r0['quant']} (1 device: unquantized"
            + (f"; emulated on {', '.join(emulated)}" if emulated else "")
            + ")"
        )
    lines = [
        head + f" | VAE decode: {'none (pixel space)' if r0.get('pixel_space') else where}",
        "",
        "| hardware | latency s | 1 device s | speedup | compute s | exposed comm s | encode s "
        "| decode s: 1 device / rows | latency s: decode on rows / no decode | overlap | "
        "compute constants |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def s(v):  # seconds, or a dash where the decode does not split into row patches
        return "—" if v is None else f"{v:.3f}"

    for r in rows:
        lines.append(
            f"| {r['hardware']} | {r['latency_s']:.3f} | {r['single_latency_s']:.3f} | "
            f"{r['speedup']:.2f}x | {r['compute_s']:.3f} | {r['exposed_comm_s']:.3f} | "
            f"{r['encode_s']:.3f} | {r['decode_one_device_s']:.3f} / {s(r['decode_rows_s'])} | "
            f"{s(r['latency_decode_rows_s'])} / {r['latency_no_decode_s']:.3f} | "
            f"{r['overlap']} | {r['compute_source']} |"
        )
    if "cache" in r0:
        lines += [
            "",
            f"With {r0['cache']} ({r0['cache_computed_steps']} of {r0['steps']} steps run every "
            f"block; each kind of step's program projected, the rest as above):",
            "",
            "| hardware | latency s | speedup vs 1 device | 1 device with the cache s | "
            "speedup vs it |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['hardware']} | {r['latency_cached_s']:.3f} | {r['speedup_cached']:.2f}x | "
            f"{r['single_cached_latency_s']:.3f} | {r['speedup_vs_single_same_cache']:.2f}x |"
            for r in rows
        ]
    lines += [
        "",
        "compute: FLOPs per device priced by the profile (plus stale-buffer traffic); exposed "
        "comm: collectives the step waits for; encode: text encoding on one device; decode: the "
        "VAE on one device, or on row patches over the devices (its halos, GroupNorm and ring "
        "hops exposed). 1 device s decodes on one device. No decode: DistriFusion's and xDiT's "
        "published latencies leave it out (their benchmarks ask for latents).",
    ]
    return "\n".join(lines)
