#!/usr/bin/env bash
# Issue 13 on a machine with more cores: experiments/sweeps/speedup_cpu_cores.yaml (single on
# one core; sync_patch and distrifusion on 4 and 8 launched processes, one core each) and the
# gloo collective benchmark at 8 processes, on the CPUs of the lent device machine (the GPU is
# not used: JAX_PLATFORMS=cpu). Records land in $OUT (default results/speedup_cpu_cores).
#
# Here, once: pip download --no-deps the tyro, docstring-parser, typeguard, qwix and open-clip-torch
# (its BPE vocabulary builds the `tiny` preset there) wheels into .whl/; then
#   device run: bash experiments/device/speedup_cores.sh   (carry .whl)
# (or copy the `tiny` preset folder into .devcarry/home/models/ and carry that as well)
# In miniature on this machine: MINI=1 bash experiments/device/speedup_cores.sh
set -euo pipefail
OUT=${OUT:-results/speedup_cpu_cores}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import tyro" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1
[ -d .devcarry/home ] && export PATCHPAR_HOME="$PWD/.devcarry/home"
PY=${PY:-python3}
(lscpu || nproc) > "$OUT/lscpu.txt" 2>&1
$PY -c "import jax, sys; print(sys.version.split()[0], 'jax', jax.__version__)" >> "$OUT/lscpu.txt"
SWEEP=experiments/sweeps/speedup_cpu_cores.yaml
EXTRA=()
if [ -n "${MINI:-}" ]; then  # a few seconds' version of the same path, for the tests here
  SWEEP=$(mktemp --suffix=.yaml)
  sed -e 's/height: 512/height: 64/; s/width: 512/width: 64/; s/steps: 8/steps: 2/' \
      -e 's/repeats: 2/repeats: 1/; s/mesh: \[{devices: 4, processes: 4}, {devices: 8, processes: 8}\]/mesh: [{devices: 2, processes: 2}]/' \
      -e 's/{name: distrifusion}/{name: distrifusion, warmup_steps: 0}/' \
      -e "s#base: ../configs/tiny.yaml#base: $PWD/experiments/configs/tiny.yaml#" \
      experiments/sweeps/speedup_cpu_cores.yaml > "$SWEEP"
  EXTRA=(--sizes 64 4096 --chain 4 --repeats 2 --processes 2)
fi
RES=$(mktemp -d)
# copy the records out as they come, so a run stopped at its time limit keeps its finished points
(while sleep 15; do cp "$RES"/speedup_cpu_cores/runs.jsonl "$OUT/runs.jsonl" 2>/dev/null || true; done) &
$PY -m patchpar.lab.cli sweep "$SWEEP" --results "$RES" 2>&1 | grep -v Gloo | tee "$OUT/sweep.log" || true
cp "$RES"/speedup_cpu_cores/runs.jsonl "$OUT/runs.jsonl" || true
$PY experiments/bench_collectives.py --processes 8 --out "$RES/bench" "${EXTRA[@]}" 2>&1 \
  | grep -v Gloo | tail -n 30 || true
cp "$RES"/bench/collectives.jsonl "$RES"/bench/collectives_fit.json "$OUT/" || true
ls -l "$OUT"
