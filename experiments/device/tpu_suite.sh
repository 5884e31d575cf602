#!/usr/bin/env bash
# The device suite on one TPU chip, in one call of at most 10 minutes (results/tpu_v5e/README.md
# holds what it measured):
#   here, once:  bash experiments/device/wheels_tpu.sh             (-> .whl-tpu/, git-ignored)
#   device run:  PATCHPAR_GIT_COMMIT=<commit> bash experiments/device/tpu_suite.sh [PART...]
#                (carry [".whl-tpu"]; the records name that commit: the copy's .git may be older)
#   here, in miniature (CPU, the same path in a minute): MINI=1 bash experiments/device/tpu_suite.sh
# Set-up: flax and pyyaml from the machine's own package index, the carried wheels, all into
# $SITE (default /tmp/site) behind the machine's JAX on PYTHONPATH; patchpar's compile cache in
# one folder for every program of the call. Parts (default: families), each a program of its own
# with its time limit; a part leaves every record it finished, also when it or a later part runs
# out of time:
#   families   family_timing.py: one call per family (PixArt-α, SD3.5-medium, FLUX.1-dev at two
#              reduced depths, SDXL) at 1024², xla and splash attention: ms, MFU, memory, compile
#   dits, unets  the same for the DiTs alone, the UNet alone
#   flops      family_timing.py --flops-only: each family's FLOPs per call at 1024² and 2048²
#              (lowered with abstract weights: seconds, nothing compiled)
#   blocks     family_timing.py: splash block sizes swept on the DiTs at 1024²
#   large      family_timing.py: 2048², splash
#   shards     shard_timing.py: one device's program of an N-way step (N = 1, 2, 4, 8; collectives
#              stood in by local copies) per strategy, PixArt-α at 1024²: the compute that bounds
#              every speedup (SHARD_MODELS=, SHARD_RESOLUTIONS=, SHARD_PATCHES=,
#              SHARD_STRATEGIES= choose; SHARD_OPTIONS="k=v ..." strategy options;
#              SHARD_STALE= stand_in, left_out, both (default) or dropped (left out, the
#              sends dropped: shard_timing.py's docstring) for a stale strategy's exchanges;
#              SHARD_LIMIT= the part's seconds (default 400); SHARD_SCAN=1 scans the blocks;
#              SHARD_PROFILE=1 traces two calls of each point into shards/trace/)
#   shards_base  the same points run from BASE=<folder>, an earlier commit's tree (its
#              patchpar and experiments/, e.g. `git archive <commit> patchpar experiments`;
#              BASE_COMMIT=<commit> names it in the records): before and after timed on one
#              chip in one call
#   attention_sources  attention_sources.py: one PixArt-α attention call, chunked over keys
#              formatted in the program, read in place, and an N-way stale step's sources
#   quant      quant_timing.py: PixArt-α (QUANT_MODELS= chooses) in bf16 against w8, int8 and
#              fp8 (int8 on the MXU; QUANT_MODES= chooses)
#   profile    family_timing.py --profile: SDXL and PixArt-α at 1024², splash 1024x1024, two calls
#              traced by jax.profiler into profile/trace/ (read here by profile_ops.py)
#   profile_mmdit  the same for SD3.5-medium and FLUX.1 (3+6 blocks), splash 512x1024
#   peer       peer_unet.py: SDXL's UNet, patchpar's beside diffusers 0.35's Flax UNet (the JAX
#              peer: .whl-tpu/diffusers-0.35.2-flax.zip, its needs from the machine's index)
#   video      family_timing.py: Wan 2.1 1.3B at 480p and 720p x 81 frames (32760 and 75600 tokens),
#              splash (VIDEO_MODELS=, VIDEO_SIZES= HxWxF choose)
#   video_shards  shard_timing.py: the per-device program of Wan 2.1 1.3B at 480p x 81 frames on
#              N = 1, 2, 4, 8 patches (frames layout), sync_patch, DistriFusion and PCPP
#   video_train  train_video_curve.py: the fmnist-video recipe trained to TRAIN_STEPS= (default
#              1000 2000 4000), each measured by eval_fmnist_video.py and probe_fmnist_video.py,
#              once per TRAIN_VARIANTS= noise law:motion profile (default uniform:constant; each
#              at most TRAIN_LIMIT= s; TRAIN_ARGS= more of train_video_curve's options,
#              TRAIN_CLASSIFIER= a fitted classifier/ to reuse); needs Debian's four
#              Fashion-MNIST files carried (PATCHPAR_FASHION_MNIST=) and EXTRA_PACKAGES="tqdm
#              matplotlib sentencepiece tokenizers"
#   pipeline   pipeline_timing.py: a whole image of SDXL and PixArt-α at 1024² (PIPELINE_MODELS=
#              chooses), random weights written on the machine (random_folder.py), 20 steps:
#              the stages warm per image, and a fresh process's first image with an empty and a
#              filled compile cache; needs EXTRA_PACKAGES="sentencepiece tokenizers" and
#              open-clip-torch's wheel in .whl-tpu (its CLIP BPE file; wheels_tpu.sh fetches it)
#   compile    compile_timing.py: sync_patch's and DistriFusion's phase programs compiled, the
#              blocks unrolled and scanned, the stale phases one after the other and in two
#              threads (PixArt-α at 1024²; COMPILE_MODELS= chooses)
# KERNELS= (families, dits, unets, large), BLOCK_MODELS= and BLOCKS= (blocks), OURS= and PEERS= (peer)
# replace the defaults; SCAN="off on" times the family_timing parts with the blocks unrolled and
# scanned (model.scan_blocks; default off).
# Results: $DEST/<part>/ (default results/tpu_v5e); with the device tool ($OUT set) they come
# back as $OUT/tpu_suite.tgz (unpack into results/tpu_v5e/).
set -uo pipefail
DEST=${DEST:-results/tpu_v5e}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-540}  # seconds for all the parts, inside the device tool's 600
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(families)
START=$(date +%s)
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PATCHPAR_COMPILE_CACHE=${PATCHPAR_COMPILE_CACHE:-/tmp/patchpar-compile-cache}

if [ -z "${MINI:-}" ] && ! $PY -c "import flax, yaml" 2>/dev/null; then
  pip_in() { PIP_CONFIG_FILE=/dev/null $PY -m pip install --isolated -q --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$@"; }
  # flax and pyyaml for patchpar; the rest for the peer part's diffusers (carried, no deps)
  pip_in --only-binary=:all: --index-url file:///opt/pypi/simple flax pyyaml huggingface-hub \
    safetensors regex requests filelock importlib-metadata pillow ${EXTRA_PACKAGES:-} \
    || echo "tpu_suite: flax/pyyaml/diffusers' needs did not install from the machine's index"
  if [ -d .whl-tpu ]; then
    pip_in --no-index --no-deps .whl-tpu/*.whl || echo "tpu_suite: the carried wheels failed"
  else
    echo "tpu_suite: no .whl-tpu/ here: run experiments/device/wheels_tpu.sh and carry it"
  fi
  export PYTHONPATH="$PYTHONPATH:$SITE"  # the machine's JAX stays first
fi
echo "set-up: $(($(date +%s) - START)) s"
$PY -c "import sys, jax, flax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', \
flax.__version__, jax.devices())" > "$DEST/machine.txt" 2>&1
cat "$DEST/machine.txt"

part() {  # part NAME SECONDS COMMAND...: at most SECONDS, and never past the budget
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 30 ]; then
    echo "== $name skipped: ${left} s of the budget left"
    return
  fi
  mkdir -p "$DEST/$name"
  echo "== $name (limit ${limit} s, $(($(date +%s) - START)) s in)"
  timeout --kill-after=10 "$limit" "$@" --out "$DEST/$name" --budget-s $((limit - 60)) \
    > "$DEST/$name/log.txt" 2>&1
  echo "   exit $?; $(tail -n 1 "$DEST/$name/log.txt")"
  [ -f "$DEST/$name/table.md" ] && cat "$DEST/$name/table.md"
}

FT=(experiments/device/family_timing.py)
if [ -n "${MINI:-}" ]; then  # small models on the CPU: the suite's path, not its numbers
  FT+=(--dtype float32 --repeats 1 --hardware cpu-gloo --resolutions 64)
  DITS=(tiny-dit tiny-sd3 tiny-flux:num_layers=1,num_single_layers=2)
  UNETS=(tiny)
  K=chunked  # splash needs a TPU
  PK=chunked:128x128
  PMK=chunked:128x128
  RES=(64 128)
  SHARD_PATCHES=${SHARD_PATCHES:-1 2}
  QT=(--dtype float32 --repeats 1 --resolution 64)
  CT=(--dtype float32 --resolution 64)
  PEER=(--model tiny:norm_num_groups=32 --resolution 64 --dtype float32 --repeats 1 --ours xla
        --peer default --hardware cpu-gloo)
  AT=(--tokens 256 --heads 2 --head-dim 8 --patches 2 --repeats 1 --dtype float32)
  PT=(--models tiny-xl --resolution 64 --steps 2 --dtype float32 --repeats 1 --hardware cpu-gloo)
  VMODELS=(tiny-wan)
  VSIZES=(64x64x5 64x64x9)
else
  FT+=(--repeats 5 --hardware tpu-v5e)
  DITS=(pixart-alpha sd3.5-medium flux-dev:num_layers=3,num_single_layers=6
        flux-dev:num_layers=6,num_single_layers=12)
  UNETS=(sdxl)
  K=splash
  PK=splash:1024x1024  # the best blocks of the committed sweeps (results/tpu_v5e/README.md)
  PMK=splash:512x1024
  RES=(1024 2048)
  QT=(--repeats 5)
  CT=()
  PEER=(--repeats 5 --ours ${OURS:-splash:1024x1024 xla} --peer ${PEERS:-default split_head_dim})
  AT=(--patches 2 4 8)
  PT=(--models ${PIPELINE_MODELS:-sdxl pixart-alpha} --hardware tpu-v5e)
  VMODELS=(wan2.1-1.3b)
  VSIZES=(480x832x81 720x1280x81)
fi
FTS=("${FT[@]}")  # the family_timing parts: with SCAN= too
[ -n "${SCAN:-}" ] && FTS+=(--scan $SCAN)
for p in "${PARTS[@]}"; do
  case $p in
    families) part families 540 $PY "${FTS[@]}" --models "${DITS[@]}" "${UNETS[@]}" \
                --attention ${KERNELS:-xla $K} ;;
    dits) part dits 400 $PY "${FTS[@]}" --models "${DITS[@]}" --attention ${KERNELS:-xla $K} ;;
    unets) part unets 400 $PY "${FTS[@]}" --models "${UNETS[@]}" --attention ${KERNELS:-xla $K} ;;
    flops) part flops 120 $PY "${FT[@]}" --models "${DITS[@]}" "${UNETS[@]}" --flops-only \
             --resolutions "${RES[@]}" ;;
    blocks) part blocks 400 $PY "${FTS[@]}" --models ${BLOCK_MODELS:-"${DITS[@]:0:2}"} \
              --attention ${BLOCKS:-$K:512x512 $K:512x1024 $K:1024x1024 $K:1024x2048 $K:2048x2048} ;;
    large) part large 400 $PY "${FTS[@]}" --models "${DITS[@]}" "${UNETS[@]}" \
             --resolutions 2048 --attention ${KERNELS:-$K} ;;
    shards) part shards ${SHARD_LIMIT:-400} $PY experiments/device/shard_timing.py "${FT[@]:1}" \
              --models ${SHARD_MODELS:-"${DITS[0]}"} --resolutions ${SHARD_RESOLUTIONS:-"${RES[0]}"} \
              --patches ${SHARD_PATCHES:-1 2 4 8} --strategies ${SHARD_STRATEGIES:-sync_patch distrifusion} \
              ${SHARD_PROFILE:+--profile "$DEST/shards/trace"} ${SHARD_SCAN:+--scan} \
              ${SHARD_STALE:+--stale-exchange $SHARD_STALE} \
              $(for o in ${SHARD_OPTIONS:-}; do echo --option "$o"; done) ;;
    shards_base) [ -d "${BASE:-}" ] || { echo "tpu_suite: shards_base needs BASE=<tree>"; exit 2; }
      part shards_base 400 env PATCHPAR_GIT_COMMIT="${BASE_COMMIT:-base}" \
        $PY "$BASE/experiments/device/shard_timing.py" "${FT[@]:1}" \
        --models ${SHARD_MODELS:-"${DITS[0]}"} --resolutions ${SHARD_RESOLUTIONS:-"${RES[0]}"} \
        --patches ${SHARD_PATCHES:-1 2 4 8} --strategies ${SHARD_STRATEGIES:-sync_patch distrifusion} \
        ${SHARD_BASE_OPTIONS:-} ${SHARD_SCAN:+--scan} ;;
    attention_sources) part attention_sources 150 $PY experiments/device/attention_sources.py \
                         "${AT[@]}" ;;
    quant) part quant 400 $PY experiments/device/quant_timing.py --models ${QUANT_MODELS:-"${DITS[0]}"} \
             ${QUANT_MODES:+--modes $QUANT_MODES} "${QT[@]}" ;;
    profile) part profile 300 $PY "${FTS[@]}" --models "${UNETS[@]}" "${DITS[0]}" --attention $PK \
               --profile "$DEST/profile/trace" ;;
    profile_mmdit) part profile_mmdit 240 $PY "${FTS[@]}" --models "${DITS[@]:1:2}" \
                     --attention $PMK --profile "$DEST/profile_mmdit/trace" ;;
    peer) part peer 540 env USE_TORCH=0 PYTHONPATH="$PYTHONPATH:$PWD/.whl-tpu/diffusers-0.35.2-flax.zip" \
            $PY experiments/device/peer_unet.py "${PEER[@]}" ;;
    video) part video 420 $PY "${FTS[@]}" --repeats ${VIDEO_REPEATS:-3} \
             --models ${VIDEO_MODELS:-"${VMODELS[@]}"} --resolutions ${VIDEO_SIZES:-"${VSIZES[@]}"} \
             --attention ${KERNELS:-$PK} ;;
    video_shards) part video_shards 540 $PY experiments/device/shard_timing.py "${FT[@]:1}" \
                    --repeats 3 --models ${VIDEO_MODELS:-"${VMODELS[0]}"} \
                    --resolutions ${VIDEO_SIZES:-"${VSIZES[0]}"} --patches ${SHARD_PATCHES:-1 2 4 8} \
                    --strategies ${SHARD_STRATEGIES:-sync_patch distrifusion pcpp} --attention $PK ;;
    video_train)  # one curve per TRAIN_VARIANTS noise law:motion profile; work in /tmp, shared
      first=
      for v in ${TRAIN_VARIANTS:-uniform:constant}; do
        nl=${v%%:*} mp=${v##*:}
        work=/tmp/video_train_work_${nl}_$mp
        mkdir -p "$work"
        [ -n "$first" ] && cp -r "$first"/clips-*.npz "$first"/classifier "$work"/ 2>/dev/null
        # a resumed work folder keeps the classifier it has (TRAIN_CLASSIFIER only seeds a new one)
        [ -n "${TRAIN_CLASSIFIER:-}" ] && [ ! -d "$work"/classifier ] \
          && cp -r "$TRAIN_CLASSIFIER" "$work"/classifier
        part video_train_${nl}_$mp ${TRAIN_LIMIT:-540} $PY experiments/device/train_video_curve.py \
          --work "$work" --noise-levels "$nl" --motion-profile "$mp" \
          --steps ${TRAIN_STEPS:-1000 2000 4000} ${TRAIN_ARGS:-}
        first=$work
      done ;;
    pipeline) part pipeline 540 $PY experiments/device/pipeline_timing.py "${PT[@]}" \
                --work /tmp/pipeline_timing ;;
    compile) part compile 400 $PY experiments/device/compile_timing.py \
               --models ${COMPILE_MODELS:-"${DITS[0]}"} "${CT[@]}" ;;
    *) echo "tpu_suite: unknown part $p; known: families dits unets flops blocks large shards shards_base attention_sources quant profile profile_mmdit peer video video_shards video_train pipeline compile"
       exit 2 ;;
  esac
done
echo "tpu_suite: $(($(date +%s) - START)) s -> $DEST"
if [ -n "${OUT:-}" ] && [ "$OUT" != "$DEST" ]; then
  tar czf "$OUT/tpu_suite.tgz" -C "$DEST" .
fi
