"""One self-attention call of a patch-parallel layer, timed per way of reading its keys: the
`chunked` kernel over keys formatted in the program (`Keys.of`, the heads layout made inside the
timed call, as `single` reads them; up to e4c0904 laid out in blocks with the values' column of
ones in that copy), over the same keys as a source that arrived formatted (read block by block
where it lies: a gathered buffer), and over
one device's N-way sources (its own fresh queries' keys plus a stale buffer of N slots with its
own skipped, as DistriFusion's steady step reads them; or all N slots gathered, as sync_patch
reads them), beside the `xla` kernel. Default: a PixArt-α layer at 1024² (CFG pair, 4096
tokens, 16 heads of 72), bf16.

    device run: python experiments/device/attention_sources.py --out $OUT/attention_sources
    here, in miniature: python experiments/device/attention_sources.py --tokens 256 --heads 2 \
        --head-dim 8 --patches 2 --repeats 1 --dtype float32 --out /tmp/attention_sources

Records: <out>/records.jsonl (one per way, ms per call median of `--repeats`); <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=72)
    p.add_argument("--patches", type=int, nargs="+", default=[4], help="N of the N-way rows")
    p.add_argument("--blocks", default="256x512", help="chunked's QxKV blocks")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no way after this")
    p.add_argument("--out", type=Path, default=Path("runs/attention_sources"))
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse(argv)
    import jax
    import jax.numpy as jnp

    from patchpar.lab.results import append_record, provenance
    from patchpar.models.attention import AttentionSpec, Keys, attend, attend_keys, heads_kv

    bq, bk = (int(x) for x in a.blocks.split("x"))
    dtype = getattr(jnp, a.dtype)
    b, t, h, d = a.batch, a.tokens, a.heads, a.head_dim
    q, k, v = (
        jax.random.normal(key, (b, t, h * d), dtype)
        for key in jax.random.split(jax.random.key(0), 3)
    )
    chunked, xla = AttentionSpec("chunked", bq, bk), AttentionSpec("xla")
    ways = {
        "chunked, keys formatted here": (lambda q, k, v: attend(chunked, q, k, v, h), (q, k, v)),
        "chunked, keys read in place": (
            lambda q, kv: attend_keys(chunked, q, h, [Keys(kv[None])]),
            (q, heads_kv(k, v, h)),
        ),
        "xla": (lambda q, k, v: attend(xla, q, k, v, h), (q, k, v)),
    }
    for n in a.patches:  # one device's queries, its own K/V fresh, the others' from a buffer
        own = t // n
        buffer = jnp.stack([heads_kv(k[:, i * own : (i + 1) * own], v[:, i * own : (i + 1) * own], h)
                            for i in range(n)])  # fmt: skip

        def stale(q, k_own, v_own, buf, skip):
            return attend_keys(chunked, q, h, [Keys.of(k_own, v_own, h), Keys(buf, skip=skip)])

        args = (q[:, :own], k[:, :own], v[:, :own], buffer, jnp.asarray(0, jnp.int32))
        ways[f"chunked, N = {n}: own fresh + stale buffer"] = (stale, args)
        ways[f"chunked, N = {n}: gathered buffer (sync_patch)"] = (
            lambda q, buf: attend_keys(chunked, q, h, [Keys(buf)]),
            (q[:, :own], buffer),
        )
    a.out.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    rows = []
    start = time.perf_counter()
    for name, (fn, args) in ways.items():
        if time.perf_counter() - start > a.budget_s:
            print(f"{name}: skipped, the time budget of {a.budget_s:.0f} s is spent", flush=True)
            continue
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        rec = {"way": name, "device_kind": dev.device_kind, "batch": b, "tokens": t, "heads": h,
               "head_dim": d, "blocks": a.blocks, "dtype": a.dtype,
               "status": "ok", "call_s_median": statistics.median(times),
               "call_s_all": times}  # fmt: skip
        append_record(a.out / "records.jsonl", {**rec, **provenance()})
        rows.append(rec)
        print(json.dumps({k: v for k, v in rec.items() if k != "call_s_all"}), flush=True)
    lines = [
        f"One attention call, {b} x {t} tokens, {h} heads of {d}, {a.dtype}, {dev.device_kind}, "
        f"chunked {a.blocks}",
        "",
        "| way | ms per call |",
        "|---|---|",
        *(f"| {r['way']} | {r['call_s_median'] * 1e3:.3f} |" for r in rows),
    ]
    (a.out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
