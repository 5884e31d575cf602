#!/bin/bash
# The breakdown of results/uneven_dit_cpu: the per-device steady-phase programs of tiny-dit
# DistriFusion (experiments/device/shard_timing.py: collectives stood in, one thread, pinned to a
# core) timed alone, and side by side as the launched run places them (two on core 0, one on
# core 1). About 2 minutes; prints each program's ms per denoiser call.
#   bash experiments/uneven_breakdown.sh [OUT]
set -e
export XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
T="${PYTHON:-.venv/bin/python} experiments/device/shard_timing.py --models tiny-dit --strategies distrifusion --dtype float32 --hardware cpu-gloo"
O=${1:-/tmp/breakdown}
taskset -c 1 $T --resolutions 1024 --patches 2 4 --repeats 5 --out $O/alone > /dev/null 2>&1
taskset -c 1 $T --resolutions 1056 --patches 3 --repeats 5 --out $O/alone44 > /dev/null 2>&1
taskset -c 1 $T --resolutions 1024 --patches 2 --repeats 15 --out $O/busy64 > /dev/null 2>&1 &
taskset -c 0 $T --resolutions 1024 --patches 4 --repeats 30 --out $O/busy32a > /dev/null 2>&1 &
taskset -c 0 $T --resolutions 1024 --patches 4 --repeats 30 --out $O/busy32b > /dev/null 2>&1
wait
taskset -c 0 $T --resolutions 1056 --patches 3 --repeats 20 --out $O/busy44a > /dev/null 2>&1 &
taskset -c 0 $T --resolutions 1056 --patches 3 --repeats 20 --out $O/busy44b > /dev/null 2>&1
wait
for d in alone alone44 busy64 busy32a busy32b busy44a busy44b; do echo "$d"; tail -n +5 $O/$d/table.md | cut -d'|' -f2-6; done
