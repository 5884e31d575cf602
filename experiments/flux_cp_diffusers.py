"""Time diffusers' own context parallelism (Ulysses / Ring) for FluxTransformer2DModel on CPU.

One transformer call (batch 1, float32, seeded random inputs) in three modes, on the same weights:

    single   one process, one thread
    ulysses  2 worker processes, one thread and one core each, torch.distributed gloo,
             transformer.enable_parallelism(ContextParallelConfig(ulysses_degree=2))
    ring     the same with ContextParallelConfig(ring_degree=2)

    .venv/bin/python experiments/flux_cp_diffusers.py \\
        --transformer ~/.cache/patchpar/models/tiny-flux-seed0/transformer \\
        --height 1024 --width 1024 --mode ring --repeats 3 --text-tokens 32 [--json OUT.json]

It prints one line `RESULT {json}` (mode, height, width, tokens, text_tokens, seconds = median of
the timed calls, times_s, first_call_s = the warm-up call, max_abs_diff = parallel output against
the plain one-process output computed in rank 0 before parallelism is enabled, torch, diffusers,
threads, ...) and writes the same object to --json. In parallel modes the script re-launches itself
as two workers (MASTER_ADDR=127.0.0.1, a free port) and kills them after --timeout seconds.

diffusers' context parallelism assumes accelerators; the CPU workarounds live in this file only,
each in `_cpu_patches()` with its reason. The numbers are meant to be compared with patchpar's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("single", "ulysses", "ring")
WORLD = 2  # parallel modes always use 2 processes (one per CPU core)
# attention backend per mode: the default SDPA ("native") wherever diffusers can use it; ring needs an
# op that also returns the log-sum-exp, which among the CPU-usable context-parallel backends only
# "_native_flash" has (with the CPU kernel patched in, see _cpu_patches)
BACKENDS = {"single": "native", "ulysses": "native", "ring": "_native_flash"}


# ---------------------------------------------------------------------------------------------
# command line


def _pixels(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0 or value % 16:
        raise argparse.ArgumentTypeError(
            f"{value} is not a positive multiple of 16 (VAE factor 8 x FLUX 2x2 packing)"
        )
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _transformer_folder(text: str) -> Path:
    folder = Path(text).expanduser()
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{folder} has no config.json (not a diffusers model folder)"
        )
    return folder.resolve()


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--transformer",
        type=_transformer_folder,
        required=True,
        help="diffusers FluxTransformer2DModel folder (config.json + safetensors)",
    )
    p.add_argument("--height", type=_pixels, default=1024, help="image height in pixels")
    p.add_argument("--width", type=_pixels, default=1024, help="image width in pixels")
    p.add_argument("--mode", choices=MODES, default="single")
    p.add_argument("--repeats", type=_positive, default=3, help="timed calls after one warm-up")
    p.add_argument("--text-tokens", type=_positive, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=_positive,
        default=1200,
        help="seconds before the parent kills the workers (parallel modes)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    # internal: set by the parent when it launches the workers
    p.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mode != "single":
        image_tokens = (args.height // 16) * (args.width // 16)
        if image_tokens % WORLD:
            p.error(
                f"--mode {args.mode}: {image_tokens} image tokens do not split over {WORLD} processes"
            )
        if args.text_tokens % WORLD:
            p.error(
                f"--mode {args.mode}: --text-tokens {args.text_tokens} does not split over {WORLD} processes"
            )
    return args


# ---------------------------------------------------------------------------------------------
# worker side (imports torch)


def _pin(rank: int, world: int) -> list[int]:
    """Pin this process to its own core (the rank-th of the cores it may use) and to one thread;
    returns the cores of all `world` ranks."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < world:
        raise SystemExit(f"{world} processes need {world} cores; this process may use {allowed}")
    cores = allowed[:world]
    os.sched_setaffinity(0, {cores[rank]})
    import torch

    torch.set_num_threads(1)
    return cores


def _cpu_patches(mode: str) -> list[str]:
    """Monkeypatches (beyond _OneAccelerator) that let diffusers' context parallelism run on
    CPU + gloo; returns one note per patch for the result. Only this worker process is touched."""
    import torch
    from diffusers.models import attention_dispatch as ad

    notes = []
    if mode == "ring":
        # Ring attention merges the per-chunk partial outputs with their log-sum-exp, so its
        # forward op is called with return_lse=True. The "native" (SDPA) backend refuses that;
        # "_native_flash" returns the LSE but calls torch.ops.aten._scaled_dot_product_flash_attention,
        # the CUDA-only kernel. Its CPU twin _scaled_dot_product_flash_attention_for_cpu returns
        # (out, logsumexp) in the same (B, H, S, D) / (B, H, S) layouts, accepts float32, and is what
        # replaces it here. `_native_flash_attention` looks the forward op up as a module global at
        # call time, so rebinding the module attribute is enough. Inference only: nothing is saved
        # for a backward pass.
        def cpu_flash_forward_op(
            ctx,
            query,
            key,
            value,
            attn_mask=None,
            dropout_p=0.0,
            is_causal=False,
            scale=None,
            enable_gqa=False,
            return_lse=False,
            _save_ctx=True,
            _parallel_config=None,
        ):
            if enable_gqa:
                raise ValueError("`enable_gqa` is not supported by the CPU flash op")
            # (B, S, H, D) -> (B, H, S, D)
            q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            out = out.transpose(1, 2).contiguous()  # (B, S, H, D)
            lse = lse.transpose(1, 2).contiguous()  # (B, S, H)
            return (out, lse) if return_lse else out

        ad._native_flash_attention_forward_op = cpu_flash_forward_op
        notes.append(
            "ring: _native_flash forward op -> aten._scaled_dot_product_flash_attention_for_cpu "
            "(the CUDA flash op is the only one that returns the LSE ring attention needs)"
        )
        # Guard: "_native_flash" also registers a bf16/fp16-only dtype check. diffusers runs the checks
        # only when DIFFUSERS_ATTN_CHECKS=1 (off by default); if it is set, this float32 run would be
        # refused although the CPU kernel takes float32, so the checks are turned off in this process.
        if ad._AttentionBackendRegistry._checks_enabled:
            ad._AttentionBackendRegistry._checks_enabled = False
            notes.append(
                "ring: DIFFUSERS_ATTN_CHECKS overridden (the _native_flash check wants bf16/fp16)"
            )
    return notes


class _OneAccelerator:
    """While `enable_parallelism` runs, `torch.accelerator.device_count()` answers 1.

    ModelMixin._resolve_parallel_config builds `torch.device(device_type, rank % device_count())`;
    with no accelerator device_count() is 0 and that is a ZeroDivisionError. The device type it uses
    (torch._C._get_accelerator()) is already "cpu" here, so the mesh it then builds is a CPU/gloo one,
    and the device it records ("cpu:0") is not used to place anything. Restored on exit."""

    def __enter__(self):
        import torch

        self._orig = torch.accelerator.device_count
        torch.accelerator.device_count = lambda *a, **k: 1
        return self

    def __exit__(self, *exc):
        import torch

        torch.accelerator.device_count = self._orig
        return False


def _inputs(config, height: int, width: int, text_tokens: int, seed: int):
    """FluxPipeline-shaped inputs: packed latents (1, (H/16)(W/16), in_channels), ids as
    FluxPipeline._prepare_latent_image_ids / encode_prompt build them, float32."""
    import torch

    lh, lw = height // 16, width // 16  # latent size H/8, then 2x2 packing
    g = torch.Generator().manual_seed(seed)
    hidden_states = torch.randn(1, lh * lw, config.in_channels, generator=g)
    encoder_hidden_states = torch.randn(1, text_tokens, config.joint_attention_dim, generator=g)
    pooled_projections = torch.randn(1, config.pooled_projection_dim, generator=g)
    img_ids = torch.zeros(lh, lw, 3)
    img_ids[..., 1] = img_ids[..., 1] + torch.arange(lh)[:, None]
    img_ids[..., 2] = img_ids[..., 2] + torch.arange(lw)[None, :]
    img_ids = img_ids.reshape(lh * lw, 3)
    txt_ids = torch.zeros(text_tokens, 3)
    kwargs = dict(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        pooled_projections=pooled_projections,
        timestep=torch.tensor([0.5]),
        img_ids=img_ids,
        txt_ids=txt_ids,
        return_dict=False,
    )
    if config.guidance_embeds:
        kwargs["guidance"] = torch.tensor([3.5])
    return kwargs


def _load(folder: Path):
    """The transformer in float32, and a list of notes on what had to be fixed to load it
    (none). A key diffusers does not know, or one it misses, is an error: diffusers would
    leave those weights random, not the ones patchpar runs. (patchpar's writer named FLUX's
    single-stream weights `single_transformer_blocks_0.*` until it learnt diffusers' list
    names; a preset folder written before that must be deleted and written again.)"""
    import torch
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as dlogging

    verbosity = dlogging.get_verbosity()
    dlogging.set_verbosity_error()  # the missing/unexpected-key warnings are handled below
    try:
        model, info = FluxTransformer2DModel.from_pretrained(
            folder, torch_dtype=torch.float32, output_loading_info=True
        )
    finally:
        dlogging.set_verbosity(verbosity)
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing or unexpected:
        raise SystemExit(
            f"{folder}: weights do not match FluxTransformer2DModel: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]} (a folder patchpar wrote before it named "
            f"single_transformer_blocks as diffusers does: delete it to have it written again)"
        )
    return model.eval(), []


def _time_calls(model, kwargs, repeats: int, barrier=None):
    import torch

    def call():
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        out = model(**kwargs)[0]
        # In parallel modes the output is the all-gather of proj_out's shards, returned by
        # torch's functional collectives as a lazy AsyncCollectiveTensor: wait for it inside the
        # timed region, else the final gather would be left out of the time (and left unwaited).
        if hasattr(out, "wait"):
            out = out.wait()
        return out, time.perf_counter() - t0

    with torch.inference_mode():
        out, first = call()  # warm-up
        times = []
        for _ in range(repeats):
            out, t = call()
            times.append(t)
    return out, first, times


def _versions() -> dict:
    import diffusers
    import torch

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "threads": torch.get_num_threads(),
    }


def _result(args, out, first, times) -> dict:
    return {
        "mode": args.mode,
        "height": args.height,
        "width": args.width,
        "tokens": (args.height // 16) * (args.width // 16),
        "text_tokens": args.text_tokens,
        "seconds": statistics.median(times),
        "times_s": times,
        "first_call_s": first,
        "out_shape": list(out.shape),
        "attention_backend": BACKENDS[args.mode],
        "transformer": str(args.transformer),
    }


def run_single(args) -> dict:
    cores = _pin(0, 1)
    import torch

    torch.manual_seed(args.seed)
    model, notes = _load(args.transformer)
    model.set_attention_backend(BACKENDS["single"])
    kwargs = _inputs(model.config, args.height, args.width, args.text_tokens, args.seed)
    out, first, times = _time_calls(model, kwargs, args.repeats)
    res = _result(args, out, first, times)
    res.update(world_size=1, cores=cores, patches=notes, **_versions())
    return res


def run_worker(args) -> None:
    rank = args.worker_rank
    cores = _pin(rank, WORLD)
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=args.timeout)
    )
    try:
        notes = _cpu_patches(args.mode)
        torch.manual_seed(args.seed)
        model, load_notes = _load(args.transformer)
        notes += load_notes
        heads = model.config.num_attention_heads
        if args.mode == "ulysses" and heads % WORLD:
            raise SystemExit(
                f"ulysses: {heads} attention heads do not split over {WORLD} processes"
            )
        kwargs = _inputs(model.config, args.height, args.width, args.text_tokens, args.seed)

        # reference: the plain one-process call on the same weights and inputs, before parallelism
        reference = None
        if rank == 0:
            model.set_attention_backend(BACKENDS["single"])
            with torch.inference_mode():
                reference = model(**kwargs)[0].clone()
        dist.barrier()

        model.set_attention_backend(BACKENDS[args.mode])
        cp = (
            ContextParallelConfig(ulysses_degree=WORLD)
            if args.mode == "ulysses"
            else ContextParallelConfig(ring_degree=WORLD)
        )
        with _OneAccelerator():
            model.enable_parallelism(config=cp)
        notes.insert(
            0,
            "torch.accelerator.device_count() -> 1 during enable_parallelism "
            "(diffusers computes rank % device_count(), 0 on CPU)",
        )

        out, first, times = _time_calls(model, kwargs, args.repeats, barrier=dist.barrier)
        dist.barrier()
        if rank == 0:
            res = _result(args, out, first, times)
            diff = (out - reference).abs().max().item()
            scale = reference.abs().max().item()
            res.update(
                max_abs_diff=diff,
                reference_max_abs=scale,
                max_rel_diff=diff / scale if scale else None,
                world_size=WORLD,
                cores=cores,
                patches=notes,
                **_versions(),
            )
            args.worker_result.write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# parent side (no torch import, so it stays light while the workers run)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parallel(args) -> dict:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
    )
    # gloo picks its network interface from the host name; keep it on loopback (one machine)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="flux_cp_") as tmp:
        result_file = Path(tmp) / "rank0.json"
        base = [
            sys.executable,
            os.path.abspath(__file__),
            "--transformer",
            str(args.transformer),
            "--height",
            str(args.height),
            "--width",
            str(args.width),
            "--mode",
            args.mode,
            "--repeats",
            str(args.repeats),
            "--text-tokens",
            str(args.text_tokens),
            "--seed",
            str(args.seed),
            "--timeout",
            str(args.timeout),
            "--worker-result",
            str(result_file),
        ]
        procs = [
            subprocess.Popen(
                base + ["--worker-rank", str(r)],
                env=dict(env, RANK=str(r)),
                stdout=sys.stderr,
                stderr=sys.stderr,
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + args.timeout
        failed = None
        try:
            while True:
                codes = [p.poll() for p in procs]
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failed = f"worker {bad[0][0]} exited with code {bad[0][1]}"
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    failed = f"workers still running after --timeout {args.timeout} s; killed"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:  # only the two workers this call started
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failed:
            raise SystemExit(f"{args.mode}: {failed}")
        return json.loads(result_file.read_text())


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker_rank is not None:
        run_worker(args)
        return
    res = run_single(args) if args.mode == "single" else run_parallel(args)
    line = json.dumps(res)
    print(f"RESULT {line}", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
