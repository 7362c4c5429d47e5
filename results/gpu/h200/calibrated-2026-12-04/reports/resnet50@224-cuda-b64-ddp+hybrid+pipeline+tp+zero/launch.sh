#!/usr/bin/env bash
# Train with the best plan of study 'resnet50@224-cuda-b64-ddp+hybrid+pipeline+tp+zero': ddp 64 on dev 0 bf16
# predicted 1326.7 samples/s, measured 1315.1 samples/s by the search
# Extra arguments go to hetsim.search.train (e.g. --data pkg.mod:fn --epochs 3 --checkpoint-dir ckpt).
set -euo pipefail
export PYTHONPATH="/work/main${PYTHONPATH:+:$PYTHONPATH}"
PATH="/opt/torch/.venv/bin:$PATH"
# Check the inputs first: bad input is one line and exit 2, before any rank starts.
/opt/torch/.venv/bin/python3 -m hetsim.search.train --check --plan /work/main/results/gpu/h200/calibrated-2026-12-04/reports/resnet50@224-cuda-b64-ddp+hybrid+pipeline+tp+zero/best_plan.json --model resnet50@224 "$@" >/dev/null
exec /opt/torch/.venv/bin/python3 -m hetsim.execution.launcher --nnodes 1 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 --rdzv-id hetsim-train --local-addr 127.0.0.1 --log-dir /work/main/results/gpu/h200/calibrated-2026-12-04/reports/resnet50@224-cuda-b64-ddp+hybrid+pipeline+tp+zero/torchelastic -m hetsim.search.train --plan /work/main/results/gpu/h200/calibrated-2026-12-04/reports/resnet50@224-cuda-b64-ddp+hybrid+pipeline+tp+zero/best_plan.json --model resnet50@224 --steps 30 "$@"
