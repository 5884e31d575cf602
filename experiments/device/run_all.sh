#!/usr/bin/env bash
# Every device check in one command, for whoever has a GPU (one H200: under 10 minutes):
#   1. attention_sdxl.py   one SDXL UNet call at 1024² per attention kernel: time and memory
#   2. shard_timing.py     one device's program of an N-way distrifusion step (N = 1, 2, 4, 8 at
#                          1024², collectives stood in), the stale sends packed (one group, the
#                          default) and per site: what packing costs a device's compute
#   3. quant_timing.py     one PixArt-α call at 1024² in bf16 against w8, int8 and fp8 (Qwix):
#                          time, memory, difference; whether the GPU runs fp8 natively
#   4. speedup_cores.sh    the CPU side of the machine: single vs sync_patch / distrifusion on 4
#                          and 8 launched processes, and the gloo collective benchmark
# Each part has a time budget; a part that fails or runs out of time leaves what it finished and
# the next part runs. Results go to $DEST/<part>/ (default results/device/); when the device tool
# runs it ($OUT set), they also come back as $OUT/run_all.tgz (unpack into results/device/).
#
#   device run: bash experiments/device/run_all.sh      (carry .whl, as speedup_cores.sh
#                                                        says)
#   here, in miniature: MINI=1 DEST=/tmp/device bash experiments/device/run_all.sh
#   (MODEL= and RES= choose the miniature's model and resolution: default tiny, 128)
set -uo pipefail
DEST=${DEST:-results/device}
PY=${PY:-python3}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
START=$(date +%s)
{ nvidia-smi || true; $PY -c "import jax; print('jax', jax.__version__, jax.devices())"; } \
  > "$DEST/machine.txt" 2>&1

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log kept beside its results
  local name=$1 limit=$2
  shift 2
  mkdir -p "$DEST/$name"
  echo "== $name (limit ${limit} s, $(($(date +%s) - START)) s in)"
  timeout --kill-after=10 "$limit" "$@" > "$DEST/$name/log.txt" 2>&1
  local rc=$?
  echo "   exit $rc; $(tail -n 1 "$DEST/$name/log.txt")"
}

if [ -n "${MINI:-}" ]; then  # the same path in seconds, on a CPU
  M=(--model "${MODEL:-tiny}" --dtype float32 --repeats 1)
  part attention 120 $PY experiments/device/attention_sdxl.py "${M[@]}" \
    --resolution "${RES:-128}" --attention xla chunked --out "$DEST/attention"
  part shard_packed 120 $PY experiments/device/shard_timing.py "${M[@]}" \
    --resolutions "${RES:-128}" --patches 1 2 --hardware cpu-gloo --out "$DEST/shard_packed"
  part shard_per_site 120 $PY experiments/device/shard_timing.py "${M[@]}" \
    --resolutions "${RES:-128}" --patches 2 --hardware cpu-gloo \
    --option comm_groups=per_site --out "$DEST/shard_per_site"
  part quant 120 $PY experiments/device/quant_timing.py --model "${MODEL:-tiny}" \
    --resolution "${RES:-128}" --dtype float32 --repeats 1 --out "$DEST/quant"
else
  part attention 150 $PY experiments/device/attention_sdxl.py --repeats 5 --out "$DEST/attention"
  part shard_packed 150 $PY experiments/device/shard_timing.py --resolutions 1024 \
    --patches 1 2 4 8 --budget-s 120 --out "$DEST/shard_packed"
  part shard_per_site 90 $PY experiments/device/shard_timing.py --resolutions 1024 \
    --patches 2 8 --budget-s 60 --option comm_groups=per_site --out "$DEST/shard_per_site"
  part quant 120 $PY experiments/device/quant_timing.py --repeats 5 --out "$DEST/quant"
  left=$((570 - ($(date +%s) - START)))
  if [ "$left" -gt 60 ]; then
    part cpu_cores "$left" env OUT="$DEST/cpu_cores" bash experiments/device/speedup_cores.sh
  else
    echo "== cpu_cores skipped: ${left} s left"
  fi
fi
echo "run_all: $(($(date +%s) - START)) s -> $DEST"
if [ -n "${OUT:-}" ] && [ "$OUT" != "$DEST" ]; then
  tar czf "$OUT/run_all.tgz" -C "$DEST" .
fi
