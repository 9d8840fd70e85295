#!/usr/bin/env bash
# GPU check of the vLLM backend (not yet run on a GPU: docs/backends.md; run scripts/gpu-smoke.sh first).
# On a machine with one or two CUDA GPUs and no internet: a venv for vLLM (scripts/vllm-gpu-env.sh: a system vLLM,
# wheels carried in .whl/, or the index), a Qwen2.5-0.5B-sized model built locally (random weights), the vLLM-backed
# server on the GPU under the conformance suite, then weight updates (trainer on the same GPU over gloo, or on a
# second GPU over NCCL) while 64 streams generate; prints tokens/s while training, seconds paused per update and
# broadcast bytes/s. Target: < 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.cache/gpu-venv}"
PORT="${PORT:-8123}"
OUT="${OUT:-runs/gpu-check}"
mkdir -p "$OUT"

PY="$(scripts/vllm-gpu-env.sh "$VENV" | tail -1)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this tree's inflight, whatever the venv holds
"$PY" -c "import torch; print('GPU:', torch.cuda.get_device_name(0))"

# 1. a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 heads / 2 KV heads, vocabulary 151,936, untied head),
# random weights, built as scripts/gpu-smoke.sh builds it: Llama modules and `inflight make-model`'s tokenizer (a
# qwen2-type folder would make AutoTokenizer swap Qwen2's own tokenizer class in over ours)
MODEL="$("$PY" -c 'import sys; sys.path.insert(0, "scripts"); from pathlib import Path; from gpu_smoke import build_models
print(build_models(Path(sys.argv[1]), tiny=False, dtype="bfloat16")["untied"])' "$OUT" | tail -1)"
echo "model ready: $MODEL"

# 2. the server (vLLM on the GPU), in a session of its own: the trap ends the whole process group, vLLM's
# engine-core process included (killing the API process alone leaves it holding the GPU)
CUDA_VISIBLE_DEVICES="${SERVER_GPU:-0}" setsid "$PY" -m inflight.engine.vllm_backend --model "$MODEL" --port "$PORT" \
    --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.5 > "$OUT/server.log" 2>&1 &
SERVER=$!
stop_server() {
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 -- "-$SERVER" 2>/dev/null || return 0; sleep 1; done
    kill -KILL -- "-$SERVER" 2>/dev/null || true
}
trap stop_server EXIT
for i in $(seq 1 300); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
curl -sf "localhost:$PORT/health" || { tail -50 "$OUT/server.log"; exit 1; }

# 3. conformance suite
"$PY" -m pytest -q -p no:cacheprovider tests/conformance --server-url "http://127.0.0.1:$PORT" | tail -3

# 4. updates over NCCL while 64 streams generate; the "trainer" shares the GPU
"$PY" - "$MODEL" "$PORT" <<'EOF'
import sys, time, threading, torch, httpx
from transformers import AutoModelForCausalLM
from inflight.trainer.weight_sync.inflight import WeightSyncClient
model_dir, port = sys.argv[1], sys.argv[2]
url = f"http://127.0.0.1:{port}"
name = model_dir.rstrip("/").split("/")[-1]
# NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): with one GPU the trainer side uses gloo
# (CUDA tensors staged through host memory), with two the trainer sits on cuda:1 and the broadcast is NCCL.
two = torch.cuda.device_count() >= 2
backend = "nccl" if two else "gloo"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda:1" if two else "cuda:0")
client = WeightSyncClient([url], backend=backend, transport="process_group", device=model.device)
client.init_process_group()
tokens, stop = [0], threading.Event()
def worker():
    with httpx.Client(timeout=300) as h:
        while not stop.is_set():
            r = h.post(url + "/v1/chat/completions", json={"model": name, "max_tokens": 256, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "count to 100"}], "temperature": 1.0})
            tokens[0] += r.json()["usage"]["completion_tokens"]
threads = [threading.Thread(target=worker, daemon=True) for _ in range(64)]
[t.start() for t in threads]
time.sleep(10)
t0, tok0, pauses, rates = time.time(), tokens[0], [], []
for v in range(1, 6):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=1e-3)  # stands in for an optimizer step (a bf16 x1.0001 is a no-op)
    torch.cuda.synchronize()
    st = client.push(model.named_parameters(), version=v)
    pauses.append(st["pause_s"][url]); rates.append(st["bytes"] / st["seconds"])
    time.sleep(3)
elapsed, gen = time.time() - t0, tokens[0] - tok0
stop.set()
print("\n| metric | value |\n|---|---|")
print(f"| tokens/s while training (64 streams, 5 updates) | {gen / elapsed:,.0f} |")
print(f"| seconds paused per update (median of 5) | {sorted(pauses)[2]:.3f} |")
print(f"| {backend} broadcast bytes/s (median, {st['bytes']/1e9:.2f} GB per update) | {sorted(rates)[2]/1e9:.2f} GB/s |")
client.close()
EOF
