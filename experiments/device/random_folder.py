"""A diffusers-format folder of any preset at its real size with deterministic random weights
(no download): what a whole-pipeline run on a lent machine loads where no model hub is
reachable (`patchpar generate --model <folder>`, `patchpar run --model.name <folder>`).

    python experiments/device/random_folder.py --model sdxl --out /tmp/sdxl-random \
        [--dtype bfloat16] [--seed 0]

Every component of the preset (denoiser, VAE, text encoders, their tokenizers, the scheduler)
is written by its family (`patchpar.models.presets.write_random_folder`: LeCun-normal kernels,
unit-normal embeddings, unit norm scales, zero biases, so activations stay finite through a
full-depth model). `--dtype bfloat16` stores the floating-point weights in bf16 (half the
bytes; a bf16 run computes in bf16 either way). The CLIP tokenizers' BPE comes from the
package open-clip-torch (its file only: `pip install --no-deps open-clip-torch`).
The folder appears whole or not at all (written beside it as `.<name>-*`, then renamed); an
--out that exists and is not empty is refused. A process killed mid-way (out of memory, say)
leaves that hidden folder behind: delete it. Not yet run at full size: SDXL's UNet alone is
10 GB in float32, drawn on the default device and held about twice on the host while its file
is written; the floats are written in float32 first, so the disk needs the float32 folder
(about 14 GB for SDXL) and the largest component's bf16 copy beside it, for a bf16 folder of
about 7 GB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DTYPES = ("float32", "bfloat16")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a preset name (e.g. sdxl, pixart-alpha)")
    p.add_argument("--out", type=Path, required=True, help="the folder to write (new or empty)")
    p.add_argument("--dtype", default="float32", help=f"stored weights: one of {list(DTYPES)}")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def check(a) -> None:
    """Every bad argument as a one-line error, before any work."""
    from patchpar.models.loading import CheckpointError
    from patchpar.models.presets import PRESETS
    from patchpar.models.tokenizer import open_clip_bpe_path

    if a.model not in PRESETS:
        sys.exit(f"random_folder: --model {a.model!r} is not a preset; presets: {sorted(PRESETS)}")
    if a.dtype not in DTYPES:
        sys.exit(f"random_folder: --dtype {a.dtype!r}; known: {list(DTYPES)}")
    out = a.out.resolve()
    if out == Path.cwd().resolve() or out in Path.cwd().resolve().parents:
        sys.exit(f"random_folder: --out {str(a.out)!r} is the working folder or holds it; "
                 "give a new folder")  # fmt: skip
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"random_folder: --out {str(a.out)!r} exists and is not an empty folder; "
                 "give a new one")  # fmt: skip
    clip = any(
        c.get("architectures", [""])[0].startswith("CLIPText")
        for c in PRESETS[a.model].values()
        if isinstance(c, dict)
    )
    if clip:  # its tokenizers' BPE file: missing, said now, not after the weights are written
        try:
            open_clip_bpe_path()
        except CheckpointError as e:
            sys.exit(f"random_folder: {a.model} has CLIP text encoders: {e}")


def to_bfloat16(folder: Path) -> None:
    """Every safetensors file under `folder` with its floating-point tensors in bf16, in place
    (each file written beside itself, then renamed)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import load_file, save_file

    for path in sorted(folder.rglob("*.safetensors")):
        state = load_file(str(path))
        for k, v in state.items():
            if np.issubdtype(v.dtype, np.floating):
                state[k] = v.astype(ml_dtypes.bfloat16)
        tmp = path.with_suffix(".safetensors.tmp")
        save_file(state, str(tmp), metadata={"format": "pt"})
        del state
        tmp.replace(path)


def main(argv=None) -> int:
    a = parse(argv)
    check(a)
    from patchpar.models.presets import PRESETS, write_random_folder

    start = time.perf_counter()
    out = a.out.resolve()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    except OSError as e:
        sys.exit(f"random_folder: cannot write beside --out {str(a.out)!r}: {e.strerror}")
    try:
        write_random_folder(tmp, PRESETS[a.model], a.seed)
        if a.dtype == "bfloat16":
            to_bfloat16(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> a folder as mkdir makes it
        os.replace(tmp, out)  # onto an empty --out too, in one step
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{a.model} ({a.dtype}, seed {a.seed}): {size / 2**30:.2f} GiB in "
          f"{time.perf_counter() - start:.0f} s -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
