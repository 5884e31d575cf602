#!/usr/bin/env bash
# The wheels a lent TPU machine needs beside what its own package index holds, into .whl-tpu/
# (ignored by git; `carry` it to the device). The index there has jax, flax, numpy, pyyaml
# (tpu_suite.sh installs them from it); it lacks tyro (patchpar's command line) with its needs,
# qwix (quantized inference) and open-clip-torch (installed without its needs: its CLIP BPE
# vocabulary file alone, for the tokenizers of a random full-size folder, random_folder.py).
# Versions are this checkout's .venv's, so the device runs what the tests here ran.
# Pure-Python wheels: one download, whatever the machine's glibc. Beside them the JAX peer of
# peer_unet.py: diffusers 0.35.2, the last with Flax models, as a zip put on PYTHONPATH (its
# needs come from the machine's index), without its pipelines' torch code: the device tool
# carries at most 64 MiB with the tree.
#
#   bash experiments/device/wheels_tpu.sh        then: device run ... carry [".whl-tpu"]
set -euo pipefail
DEST=${DEST:-.whl-tpu}
PY=${PY:-.venv/bin/python}
PACKAGES=(tyro docstring-parser typeguard qwix open-clip-torch)  # open-clip: its CLIP BPE file
pins=()
for name in "${PACKAGES[@]}"; do
  version=$($PY -c "from importlib.metadata import version; print(version('$name'))") || {
    echo "wheels_tpu.sh: $name is not installed in $PY's environment (run make setup first)" >&2
    exit 1
  }
  pins+=("$name==$version")
done
rm -rf "$DEST" && mkdir -p "$DEST"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${pins[@]}"
$PY -m pip download -q --no-deps --only-binary=:all: -d "$DEST/peer" diffusers==0.35.2
$PY - "$DEST" <<'PY'
import sys, zipfile
from pathlib import Path

dest = Path(sys.argv[1])
wheel = next((dest / "peer").glob("diffusers-*.whl"))
drop = ("diffusers/pipelines/", "diffusers/modular_pipelines/")  # their subpackages: torch
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(
    dest / "diffusers-0.35.2-flax.zip", "w", zipfile.ZIP_DEFLATED
) as out:
    for name in src.namelist():
        keep = name.startswith("diffusers/") and not (
            name.startswith(drop) and name.count("/") > 2
        )
        if keep:
            out.writestr(name, src.read(name))
PY
rm -rf "$DEST/peer"
ls "$DEST"
