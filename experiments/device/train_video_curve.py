"""The `fmnist-video` recipe's learning curve on one accelerator: experiments/train_fmnist_video.py
trained to each of --steps in turn (each a resume of the last), exported, and measured by
experiments/eval_fmnist_video.py (class and motion accuracy on held-out seeds) and probed by
experiments/probe_fmnist_video.py (which parts of the caption the loss reads). A TPU chip runs
the recipe in minutes where 2 CPU cores take hours: it says how many updates the recipe needs
and what each stage has learned (results/fmnist_video_recipe).

    PATCHPAR_FASHION_MNIST=runs/fmnist-data \\
        python experiments/device/train_video_curve.py --steps 1000 2000 4000 --out DIR

Writes DIR/records.jsonl (eval_fmnist_video's records, each with trained_steps) and
DIR/curve.jsonl (seconds of training to each milestone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import eval_fmnist_video as evaluate  # noqa: E402
import probe_fmnist_video as probe  # noqa: E402
import train_fmnist_video as train  # noqa: E402

from patchpar.lab.results import append_record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--per-caption", type=int, default=2)
    ap.add_argument("--batch", type=int, default=train.TrainConfig.batch)
    ap.add_argument("--lr", type=float, default=train.TrainConfig.lr)
    ap.add_argument("--noise-levels", default=train.TrainConfig.noise_levels)
    ap.add_argument("--motion-profile", default=train.TrainConfig.motion_profile)
    ap.add_argument("--clips", type=int, default=0, help="train on N clips (0: all; checks)")
    ap.add_argument("--out", type=Path, default=Path("runs/train_video_curve"))
    ap.add_argument("--work", type=Path, help="checkpoint, clips, classifier (default: out/work)")
    ap.add_argument("--budget-s", type=float, default=3600.0)
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    for steps in sorted(args.steps):
        left = deadline - time.monotonic()
        if left < 60:
            print(f"stopping before {steps} steps: {left:.0f} s of the budget left")
            break
        cfg = train.TrainConfig(max_steps=steps, batch=args.batch, lr=args.lr, clips=args.clips,
                                noise_levels=args.noise_levels,
                                motion_profile=args.motion_profile,
                                minutes=(left - 60) / 60, work=args.work or args.out / "work",
                                out=args.out / "weights", plots=args.out / "plots")  # fmt: skip
        t0 = time.perf_counter()
        train.main(cfg)
        done = json.loads((cfg.out / "training.json").read_text())["trained_steps"]
        append_record(args.out / "curve.jsonl", {"trained_steps": done, "batch": args.batch,
                                                 "lr": args.lr,
                                                 "noise_levels": args.noise_levels,
                                                 "motion_profile": args.motion_profile,
                                                 "train_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
        evaluate.main(["--model", str(cfg.out), "--per-caption", str(args.per_caption),
                       "--out", str(args.out)])  # fmt: skip
        probe.main(["--checkpoint", str(cfg.work / "checkpoint.msgpack"),
                    "--out", str(args.out / "probe")])  # fmt: skip
        if done < steps:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
