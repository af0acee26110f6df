#!/usr/bin/env bash
# The whole GPU check of pdserve in one go, for the day a CUDA machine is available (issue 16):
#   1. the attention kernel tests, compiled on the GPU (TRITON_INTERPRET unset),
#   2. `pdserve serve --device cuda` answering a request in unified and in disaggregated mode
#      (KV over an NCCL pair channel; the transferred bytes are read back from /metrics). NCCL
#      refuses two ranks on one GPU, so disaggregated mode needs 2 GPUs (one per worker actor);
#      with one GPU that step is reported as skipped,
#   3. bench/attention.py (kernels vs torch_ref, timings and bandwidth vs the copy bandwidth).
# Every step has its own timeout; the whole output goes to the results file (and the terminal).
#
# Usage (from the repository root, after `make setup`):
#   bench/gpu_smoke.sh [results-file]          # default gpu_smoke_results.txt; about 10 minutes
# Environment: PY / PDSERVE (interpreter and CLI, default .venv/bin/...), MODEL (default smollm2).
set -u
OUT=${1:-gpu_smoke_results.txt}
PY=${PY:-.venv/bin/python}
PDSERVE=${PDSERVE:-.venv/bin/pdserve}
MODEL=${MODEL:-smollm2}
PORT=${PORT:-18000}
GRPC_PORT=${GRPC_PORT:-18051}
unset TRITON_INTERPRET
exec > >(tee "$OUT") 2>&1
failures=0
step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || fail "nvidia-smi"
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "gpus", torch.cuda.device_count())' || fail "torch/triton import"

step "attention kernel tests on the GPU"
timeout 600 "$PY" -m pytest -q tests/attention || fail "tests/attention"

serve_request() {  # $1 = mode
    local mode=$1 log="gpu_smoke_serve_$1.log" pid ok=0
    "$PDSERVE" serve --device cuda --mode "$mode" --model "$MODEL" --host 127.0.0.1 \
        --port "$PORT" --grpc-port "$GRPC_PORT" --served-model-name smoke >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 180); do
        if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then ok=1; break; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if [ "$ok" = 1 ]; then
        grep -m1 "ready:" "$log"
        timeout 120 curl -sf "http://127.0.0.1:$PORT/v1/completions" \
            -H 'content-type: application/json' \
            -d '{"model": "smoke", "prompt": "The capital of France is", "max_tokens": 16,
                 "temperature": 0}' || fail "$mode: completion request"
        echo
        curl -sf "http://127.0.0.1:$PORT/metrics" | grep -E '^pdserve_kv_transfer_bytes' \
            || echo "(no KV transfer metric: expected in unified mode)"
    else
        fail "$mode: server did not become healthy"; tail -30 "$log"
    fi
    kill -INT "$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
}

step "pdserve serve --device cuda --mode unified"
serve_request unified
step "pdserve serve --device cuda --mode disaggregated (KV over NCCL)"
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then
    serve_request disaggregated
    grep -i -m3 "nccl" gpu_smoke_serve_disaggregated.log || echo "(the log does not name NCCL)"
else
    echo "SKIPPED: $gpus GPU(s); NCCL needs the prefill and decode workers on different GPUs"
fi

step "bench/attention.py"
timeout 600 "$PY" bench/attention.py --json gpu_smoke_attention.json || fail "bench/attention.py"

step "done: $failures failure(s); results in $OUT"
exit $((failures > 0))
