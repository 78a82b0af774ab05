#!/usr/bin/env bash
# Everything a session checks on a lent GPU, in one call (the device tool: one H200, torch as
# installed there, gradsync from this source tree, no pip). Writes its logs under $OUT (default
# out/gpu) and prints their summaries; each part has its own time limit, so a slow part costs
# only itself. Try it here first: `DEVICE=cpu bash benchmarks/gpu_session.sh` (tiny shapes).
#
#   1. benchmarks/gpu_check.py --quick (A: NCCL at world size 1; B: two ranks as processes)
#   2. host profile of a step, gradsync against torch's DDP (benchmarks/host_profile.py)
#   3. gradsync bench --device cuda, the eager models (GPT-2-small shape, many-tensor GPT)
#   4. gradsync bench --device cuda, the torch.compile model
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
TINY=()
[ "$DEVICE" = cpu ] && TINY=(--tiny)
quiet() { grep -v "find_unused_parameters=True was specified\|FutureWarning\|ddp = cls(\|^  warnings.warn\|UserWarning"; }
step() { echo; echo "=== $1 ($(date +%T))"; }

step "device"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"

step "1. gpu_check --quick"
timeout "${T_CHECK:-200}" $PY benchmarks/gpu_check.py --device "$DEVICE" --quick --out "$OUT/gpu_check.json" 2>&1 | quiet \
    >"$OUT/gpu_check.log"
echo "rc=${PIPESTATUS[0]}"; cut -c1-700 "$OUT/gpu_check.log" | grep -v "^\s*$" | tail -40

step "2. host profile"
timeout "${T_PROFILE:-90}" $PY benchmarks/host_profile.py --device "$DEVICE" "${TINY[@]}" --model gpt_many \
    --steps 10 --top 14 >"$OUT/host_profile.txt" 2>&1
echo "rc=$?"; grep -A1 "^=== " "$OUT/host_profile.txt" | cut -c1-900

step "3. bench, eager models"
timeout "${T_BENCH:-200}" $PY -m gradsync.tools.cli bench --device "$DEVICE" --nproc 1 "${TINY[@]}" \
    --models gpt2_small,gpt_many --rounds "${ROUNDS:-8}" --out "$OUT/bench-eager" 2>&1 | quiet >"$OUT/bench-eager.log"
echo "rc=${PIPESTATUS[0]}"; grep -A6 "^| model" "$OUT/bench-eager.log"; grep "same parameters\|done in\|Error\|error" "$OUT/bench-eager.log" | head -20

step "4. bench, torch.compile"
timeout "${T_COMPILED:-150}" $PY -m gradsync.tools.cli bench --device "$DEVICE" --nproc 1 "${TINY[@]}" \
    --models gpt_compiled --rounds "${ROUNDS:-8}" --out "$OUT/bench-compiled" 2>&1 | quiet >"$OUT/bench-compiled.log"
echo "rc=${PIPESTATUS[0]}"; grep -A4 "^| model" "$OUT/bench-compiled.log"; grep "same parameters\|done in\|Error\|error" "$OUT/bench-compiled.log" | head -10
step "end"
