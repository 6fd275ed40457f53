#!/usr/bin/env bash
# Clean retrain of the shipped drafter on one GPU machine: regenerate the data with the runner
# backend, train, evaluate on spec_bench_dev (evaluation only), pack the weights for the trip back.
#
# Prepare on the CPU machine first (sizes every call, splits the GGUF, writes the exact calls):
#     python -m ops.distill.prep_device_run            # -> .carry/clean/call1..N, COMMANDS.txt
# Then, on one warm device machine, each call right after the previous one returns:
#     bash ops/distill/gpu_clean_retrain.sh stash 1     carry .carry/clean/call1   (+ a rehearsal, see below)
#     bash ops/distill/gpu_clean_retrain.sh stash 2     carry .carry/clean/call2   ...
#     bash ops/distill/gpu_clean_retrain.sh main        carry .carry/clean/callN
#
# stash I:  copies GGUF part I to $STASH_DIR (/tmp stays while the machine stays warm) and checks its sha256.
#           Call 1 also rehearses (REHEARSE=0 skips it): a random-weight target of the demo's shape through
#           the runner backend (static step checked against the eager runner, a throughput probe), which
#           also fills torch.compile's cache for the main call.
# stash-data DIR: copies an earlier heads call's data.tar.xz.part* from DIR (a carried folder) to $STASH/data_in;
#           main with TRAINER=ops.distill.gpu_heads then trains on those answers instead of generating (it looks in
#           $REUSE_DIR, $STASH/data_in and the main call's folder, in that order).
# concurrent: reassembles the GGUF as main does, then runs `python -m ops.gpu_bench --part concurrent` for each of
#           CONC_TOKENS (default "128 512") answer lengths (extra arguments go to ops.gpu_bench).
# main:     reassembles and checks the GGUF, installs the carried gguf wheel, unpacks the prompts, and runs
#           `python -m ops.distill.gpu_train` within WALL_TOTAL seconds of this script's start (default 555), then
#           packs the drafter into $OUT. Extra arguments are passed to ops.distill.gpu_train (later flags
#           win).
# Environment: OUT (the device tool sets it), STASH_DIR (/tmp/ss), CLEAN_DIR (.carry/clean), WALL_TOTAL,
# TRAIN_S (200), GEN_ROWS (512), TARGET (a model folder: skips the GGUF, for dry runs), PY (python3),
# TRAINER (the module main runs, default ops.distill.gpu_train; ops.distill.gpu_heads trains the feature heads,
# reusing the answers of an earlier call where the main call carries its data.tar.xz.partNN).
set -uo pipefail
START=$(date +%s)
MODE=${1:?usage: gpu_clean_retrain.sh stash I | main [ops.distill.gpu_train flags...]}
shift
STASH=${STASH_DIR:-/tmp/ss}
CLEAN=${CLEAN_DIR:-.carry/clean}
OUT=${OUT:-/tmp/ss-out}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$STASH" "$OUT"

manifest() {  # manifest.json value at a python expression over `m`
    local f
    f=$(ls "$CLEAN"/call*/manifest.json 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "no manifest.json under $CLEAN/call*" >&2; return 1; }
    "$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print($1)" "$f"
}
elapsed() { echo $(( $(date +%s) - START )); }

if [ "$MODE" = stash ]; then
    I=${1:?stash needs the part number}
    src="$CLEAN/call$I/gguf.part$I"
    [ -f "$src" ] || { echo "missing $src (carry $CLEAN/call$I)"; exit 2; }
    cp "$src" "$STASH/" || exit 2
    want=$(manifest "[p['sha256'] for p in m['gguf']['parts'] if p['name']=='gguf.part$I'][0]")
    got=$(sha256sum "$STASH/gguf.part$I" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "gguf.part$I sha256 $got != manifest $want"; exit 3; }
    echo "stashed gguf.part$I ($(stat -c %s "$STASH/gguf.part$I") bytes, sha256 ok) in $STASH; $(ls "$STASH" | tr '\n' ' ')"
    nvidia-smi -L 2>/dev/null; df -h /tmp | tail -1
    if [ "$I" = 1 ] && [ "${REHEARSE:-1}" = 1 ] && [ -f "$CLEAN/call$I/target_config.json" ]; then
        timeout -s INT "${REHEARSE_S:-100}" "$PY" -m ops.distill.gpu_rehearse --config "$CLEAN/call$I/target_config.json" \
            --rows "${GEN_ROWS:-512}" --seconds "${PROBE_S:-30}" --folder "$STASH/rehearse_target" --out "$OUT" 2>&1 \
            | tee "$OUT/rehearsal.log"
    fi
    echo "stash $I done in $(elapsed) s"
    exit 0
fi

if [ "$MODE" = stash-data ]; then  # an earlier heads call's answers, for main to train on (REUSE below)
    SRC=${1:?stash-data needs the folder holding data.tar.xz.part*}
    ls "$SRC"/data.tar.xz.part* >/dev/null 2>&1 || { echo "no data.tar.xz.part* in $SRC"; exit 2; }
    mkdir -p "$STASH/data_in" && cp "$SRC"/data.tar.xz.part* "$STASH/data_in/" || exit 2
    echo "stashed $(ls "$STASH/data_in" | tr '\n' ' ')in $STASH/data_in ($(du -sh "$STASH/data_in" | cut -f1))"
    exit 0
fi

[ "$MODE" = main ] || [ "$MODE" = concurrent ] || { echo "unknown mode $MODE"; exit 2; }
LAST=$(ls -d "$CLEAN"/call* | sort -V | tail -1)
if [ -n "${TARGET:-}" ]; then
    echo "target folder $TARGET (no GGUF)"
else
    N=$(manifest "m['calls']") || exit 2
    NAME=$(manifest "m['gguf']['name']")
    parts=()
    for ((i = 1; i <= N; i++)); do
        p="$STASH/gguf.part$i"
        [ -f "$p" ] || p="$CLEAN/call$i/gguf.part$i"  # the last part, or an ignored path kept from an earlier call
        if [ ! -f "$p" ]; then
            echo "gguf.part$i is missing: this machine is not the one the stash calls used (it went back between"
            echo "calls). Run the stash calls again, each right after the previous one, then this."
            exit 3
        fi
        parts+=("$p")
    done
    cat "${parts[@]}" > "$STASH/$NAME"
    want=$(manifest "m['gguf']['sha256']")
    got=$(sha256sum "$STASH/$NAME" | cut -d' ' -f1)
    [ "$want" = "$got" ] || { echo "reassembled $NAME sha256 $got != manifest $want"; exit 4; }
    echo "reassembled $NAME from ${#parts[@]} parts, sha256 ok ($(elapsed) s)"
    TARGET="$STASH/$NAME"
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$LAST"/gguf-*.whl || exit 5
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
if [ "$MODE" = concurrent ]; then  # the 32-stream benchmark on the real demo target, per answer length
    export SPECSERVE_CACHE=$STASH/cache
    for n in ${CONC_TOKENS:-128 512}; do
        "$PY" -m ops.gpu_bench --part concurrent --gguf "$TARGET" --max-tokens "$n" --out "$OUT/c$n" "$@" 2>&1 \
            | tee "$OUT/c$n.log" | tail -9
    done
    exit 0
fi
"$PY" - "$LAST/prompts.npz.xz" "$STASH/prompts.npz" "$(manifest "m['prompts']['npz_sha256']")" <<'EOF' || exit 6
import hashlib, lzma, sys
raw = lzma.decompress(open(sys.argv[1], "rb").read())
if hashlib.sha256(raw).hexdigest() != sys.argv[3]:
    sys.exit("prompts sha256 differs from the manifest")
open(sys.argv[2], "wb").write(raw)
print(f"prompts: {len(raw)} bytes, sha256 ok")
EOF
EXTRA=()
if [ "${TRAINER:-ops.distill.gpu_train}" = ops.distill.gpu_heads ]; then
    # $OUT returns at most 8 files: the heads' run keeps the manifest in its metrics, not beside them
    for d in ${REUSE_DIR:-} "$STASH/data_in" "$LAST"; do  # an earlier call's answers: train on them
        if ls "$d"/data.tar.xz.part* >/dev/null 2>&1; then
            EXTRA=(--reuse-data "$d")
            echo "reusing the answers of an earlier call: $(ls "$d"/data.tar.xz.part* | tr '\n' ' ')"
            break
        fi
    done
else
    cp "$LAST/manifest.json" "$OUT/manifest.json"
fi
export SPECSERVE_CACHE=$STASH/cache
WALL=$(( ${WALL_TOTAL:-555} - $(elapsed) ))
echo "starting ${TRAINER:-ops.distill.gpu_train} at $(elapsed) s, wall budget $WALL s"
"$PY" -m "${TRAINER:-ops.distill.gpu_train}" --pack-to "$OUT" --target "$TARGET" --out "$STASH/run" \
    --prompts "$STASH/prompts.npz" --eval-prompts "$LAST/spec_bench_dev.npz" \
    --layers 2 --draft-vocab 8192 --max-new-tokens 256 --sample-fraction 0.3 --chunk-prompts 4096 \
    --gen-tokens 1000000000 --gen-rows "${GEN_ROWS:-512}" --train-seconds "${TRAIN_S:-200}" --lr 1e-3 \
    --eval-every 250 --seed 0 --wall-seconds "$WALL" --wall-reserve 45 "${EXTRA[@]}" "$@" 2>&1 \
    | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
echo "${TRAINER:-ops.distill.gpu_train} exit $rc; total $(elapsed) s" | tee -a "$OUT/train.log"
ls -la "$OUT"
exit "$rc"
