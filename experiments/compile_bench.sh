#!/usr/bin/env bash
# Compile time, cold and warm, in one run on this machine (results/compile/README.md):
#   bash experiments/compile_bench.sh [OUT]        # default runs/compile; ~15 minutes on 2 cores
# 1. every quick-start point's programs traced, lowered and compiled (experiments/compile_profile.py)
#    with an empty persistent cache, then again with it warm;
# 2. SDXL at 1024² on 8 fake devices, one model call per phase with abstract weights, sync_patch
#    and distrifusion, cold then warm;
# 3. `make run` cold (empty cache) then warm, wall time.
set -euo pipefail
OUT=${1:-runs/compile}
mkdir -p "$OUT"
CACHE=$(mktemp -d /tmp/patchpar-compile-bench-XXXX)
PY=.venv/bin/python
export XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
for tag in cold warm; do
  $PY experiments/compile_profile.py --out "$OUT" --label "quickstart-$tag" --compile-cache "$CACHE/q"
done
for tag in cold warm; do
  $PY experiments/compile_profile.py --full-size sdxl --out "$OUT" --label "sdxl-$tag" --compile-cache "$CACHE/s"
done
for tag in cold warm; do  # make run with its own PATCHPAR_HOME: cold is an empty compile cache
  start=$(date +%s.%N)
  PATCHPAR_HOME="$CACHE/home" make run > "$OUT/make_run_$tag.log" 2>&1
  end=$(date +%s.%N)
  echo "{\"make_run\": \"$tag\", \"seconds\": $(echo "$end - $start" | bc), \"commit\": \"$(git rev-parse HEAD)\", \"nproc\": $(nproc)}" >> "$OUT/make_run.jsonl"
done
rm -rf "$CACHE"
