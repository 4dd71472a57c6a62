#!/usr/bin/env bash
# parbench's device check: one run on one GPU (about 8 minutes) or on the CPU (CI, ~90 s).
#
#   scripts/device_check.sh [device=cpu|cuda] [out=DIR]
#
# device  cuda (default) or cpu
# out     results directory (default results/device-check-<timestamp>)
#
# Steps, each recorded in $OUT/steps.tsv (name, ok|fail|skipped, exit code, seconds, note)
# with its output in $OUT/logs/<step>.log:
#   preflight  the device is here (else one line and exit 2), the paths taken on it
#   single     the golden run and one single-rank case per family (data, tensor, context,
#              pipeline, expert, hybrid; every degree 1) plus a bf16 row:
#              parbench run suite=scripts/device_check/single.yaml device=$DEVICE
#   multi      two ranks: on CPU gloo; on >= 2 GPUs NCCL; on one GPU two ranks sharing it
#              over gloo with CUDA tensors (NCCL refuses two ranks on one device), a probe
#   calibrate  parbench calibrate device=$DEVICE (quick, the step model's shapes): on CUDA
#              one rank, the profile written to results/devices/<gpu>.json (links and
#              collectives from the GPU's datasheet preset); on CPU two gloo ranks, the
#              profile under $OUT only
#   step       a ~1B-parameter bf16 step on the GPU (on CPU a small model) measured with the
#              harness's instruments (CUDA events, the allocator's peak)
#   estimate-calibrated, estimate-preset
#              the same step predicted by parbench estimate with the calibrated profile and
#              with the datasheet preset (CPU: no preset)
#   summary    $OUT/summary.md and summary.json; the exit status is 1 when a required step
#              failed or a required case did not pass
set -euo pipefail

DEVICE=cuda
OUT=""
for arg in "$@"; do
    case "$arg" in
        device=*) DEVICE="${arg#device=}" ;;
        out=*) OUT="${arg#out=}" ;;
        *) echo "device_check.sh: error: argument '$arg' is not device=cpu|cuda or out=DIR" >&2
           exit 2 ;;
    esac
done
if [[ "$DEVICE" != cpu && "$DEVICE" != cuda ]]; then
    echo "device_check.sh: error: device='$DEVICE' must be cpu or cuda" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-results/device-check-$(date +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-python}"
PARBENCH=("$PY" -m parbench.cli)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
T_START=$EPOCHREALTIME

elapsed() {  # seconds since $1 (an EPOCHREALTIME reading), one decimal
    awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'
}

# the device first: one line and exit 2 before anything is spawned
t0=$EPOCHREALTIME
set +e
PREFLIGHT="$("$PY" -m parbench.devicecheck preflight device="$DEVICE" out="$OUT")"
rc=$?
set -e
if [[ $rc != 0 ]]; then
    exit 2  # preflight said why on stderr, in one line
fi
mkdir -p "$OUT/logs"
echo "$PREFLIGHT" | tee "$OUT/logs/preflight.log"
printf 'preflight\tok\t0\t%s\t%s\n' "$(elapsed "$t0")" "$PREFLIGHT" >"$OUT/steps.tsv"

# step NAME NOTE CMD...: run CMD, its output to the terminal and $OUT/logs/NAME.log; record it
step() {
    local name="$1" note="$2" rc t0 t1
    shift 2
    echo "== $name: $note"
    t0=$EPOCHREALTIME
    set +e
    "$@" 2>&1 | tee "$OUT/logs/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$([[ $rc == 0 ]] && echo ok || echo fail)" "$rc" \
        "$(elapsed "$t0")" "$note" >>"$OUT/steps.tsv"
    echo "== $name: exit $rc"
}
skip() {
    echo "== $1: skipped ($2)"
    printf '%s\tskipped\t0\t0.0\t%s\n' "$1" "$2" >>"$OUT/steps.tsv"
}
info() {  # a field of device.json
    "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))$1 or '')" "$OUT/device.json"
}

# (a) the golden run and the single-rank cases of every family
step single "one single-rank case per family and a bf16 row, each against the golden run" \
    "${PARBENCH[@]}" run suite=scripts/device_check/single.yaml device="$DEVICE" out="$OUT/single"

# (b) two ranks, by the path preflight chose (printed)
MULTI_SUITE="$(info "['multi_rank']['suite']")"
MULTI_BACKEND="$(info "['multi_rank']['backend']")"
echo "multi-rank path: $(info "['multi_rank']['why']")"
step multi "2 ranks, $MULTI_BACKEND: $(info "['multi_rank']['why']")" \
    env PARBENCH_BACKEND="$MULTI_BACKEND" "${PARBENCH[@]}" run \
    suite="scripts/device_check/$MULTI_SUITE.yaml" device="$DEVICE" out="$OUT/multi"

# (c) the device profile
PROFILE="$(info "['profile_path']")"
PRESET="$(info "['preset']")"
"$PY" -m parbench.devicecheck model-json device="$DEVICE" out="$OUT/step-model.json"
PROFILE_NAME="$(basename "$PROFILE" .json)-calibrated"
if [[ "$DEVICE" == cuda ]]; then
    CAL=(world_size=1 dtypes=bf16 reference=false)
    [[ -n "$PRESET" ]] && CAL+=(links_from="$PRESET")
else
    CAL=(world_size=2 dtypes=fp32 reference=true)
fi
step calibrate "quick, the step model's shapes, ${CAL[*]} -> $PROFILE" \
    env PARBENCH_PROFILE_DIR="$OUT/profile" "${PARBENCH[@]}" calibrate device="$DEVICE" \
    quick=true model="$OUT/step-model.json" micro_batch_sizes=2 tp=1 cp=1 "${CAL[@]}" \
    name="$PROFILE_NAME" out="$PROFILE"

# (d) the ~1B step: measured by the harness, predicted by the time model
step step "$("$PY" -m parbench.devicecheck keys device="$DEVICE"), zero.1 on one rank" \
    "$PY" -m parbench.devicecheck step device="$DEVICE" out="$OUT"
read -r -a KEYS <<<"$("$PY" -m parbench.devicecheck keys device="$DEVICE")"
estimate() {  # estimate WHICH PROFILE: parbench estimate --json into $OUT/estimate-WHICH.json
    "${PARBENCH[@]}" estimate "${KEYS[@]}" attention=flash device="$2" --json \
        >"$OUT/estimate-$1.json"
}
if [[ -f "$PROFILE" ]]; then
    step estimate-calibrated "parbench estimate device=$PROFILE" estimate calibrated "$PROFILE"
else
    skip estimate-calibrated "no calibrated profile (calibrate failed)"
fi
if [[ -n "$PRESET" ]]; then
    step estimate-preset "parbench estimate device=$PRESET (datasheet)" estimate preset "$PRESET"
else
    skip estimate-preset "no datasheet preset for this device"
fi

# (e) the summary
set +e
"$PY" -m parbench.devicecheck summary device="$DEVICE" out="$OUT"
RC=$?
set -e
echo "device check: $OUT (wall $(elapsed "$T_START") s, exit $RC)"
exit $RC
