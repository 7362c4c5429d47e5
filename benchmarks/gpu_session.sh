#!/usr/bin/env bash
# One prepared session on a machine with real GPUs: record the GPU's profiles, predict and run the
# fidelity suite's plans, then the user-facing search, all into results/gpu/NAME/.
#
#   bash benchmarks/gpu_session.sh NAME [DEST]
#
# DEST (optional) receives gpu.tgz of what was recorded and the logs.  Each stage has its own
# time limit so that a failure or hang in one still leaves the others' records.  The environment
# picks the workload: MODEL (resnet50), MODEL_ARGS (e.g. "--model-size small --seq-len 512"),
# GLOBAL_BATCH (64), PRECISIONS (fp32,bf16,fp16); SEARCH=0 skips stage 2.  Timing on an H200
# (2026-12-04, resnet50@224, three precisions): profiles 18 s, calibration 280 s (its runs repeated
# while no two agreed), then 15-35 s per plan's run; FIDELITY_BUDGET counts the runs only.
set -uo pipefail
NAME=${1:?usage: gpu_session.sh NAME [DEST]}
DEST=${2:-}
R=results/gpu/$NAME
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
LOGS=${DEST:-$R}
mkdir -p "$LOGS"

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv \
  | tee "$R/nvidia-smi.csv"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"

# 1. Profiles + the fidelity suite (predicted vs measured step time and peak memory per plan).
MODEL=${MODEL:-resnet50} GLOBAL_BATCH=${GLOBAL_BATCH:-64} PRECISIONS=${PRECISIONS:-fp32,bf16,fp16}
# shellcheck disable=SC2086  # MODEL_ARGS is a list of flags
timeout "${FIDELITY_TIMEOUT:-480}" $PY benchmarks/gpu_fidelity.py --out "$R" --model "$MODEL" ${MODEL_ARGS:-} \
  --global-batch "$GLOBAL_BATCH" --precisions "$PRECISIONS" --plans "${PLANS:-12}" --budget-s "${FIDELITY_BUDGET:-150}" 2>&1 | tee "$LOGS/fidelity.log"

# 2. The search as a user runs it (reuses the profiles just recorded: same batch, sizes, precisions).
# shellcheck disable=SC2086
[ "${SEARCH:-1}" = 0 ] || timeout "${SEARCH_TIMEOUT:-200}" $PY -m hetsim.search --model "$MODEL" ${MODEL_ARGS:-} --cluster cuda \
  --global-batch "$GLOBAL_BATCH" --precisions "$PRECISIONS" --trials 100 --top-k 3 --steps 10 --timeout 120 --out "$R" 2>&1 | tee "$LOGS/search.log"

if [ -n "$DEST" ]; then
  tar czf "$DEST/gpu.tgz" "$R" "$LOGS/fidelity.log" "$LOGS/search.log" 2>/dev/null || tar czf "$DEST/gpu.tgz" "$R"
fi
