#!/usr/bin/env bash
# One end-to-end server measurement on a GPU machine (docs/PERFORMANCE.md): start
# `hypercorn orchestrator:app` with random 7B weights and fp8 KV, wait for /ready, run the load
# driver (full windows, worker processes), and leave under $OUT the summary, a gzipped
# load-result.json (when it fits), the lag plot, the server and driver logs, the GPU and
# /metrics before and after (metrics.txt), and the GPU's utilisation per second.  Usage (from the repository root):
#   OUT=/tmp/out bash tests/e2e/online_serving/h200_server_run.sh POLICY SESSIONS FRAMES [PROCESSES] [WAV]
# POLICY is PERSONAPLEX_TICK_POLICY (window | paced).  Wheels the machine lacks go in .whl/.
# The layout: ENGINE_HOST=process (default: an engine process, WORKERS front-end workers, default
# 1) or ENGINE_HOST=thread (the engine as a thread of the one server process, the old layout).
set -uo pipefail
policy=$1 sessions=$2 frames=$3 processes=${4:-8} wav=${5:-artifacts/input_assistant.wav}
out=${OUT:?set OUT}
load=$(mktemp -d /tmp/load-XXXX)/result  # a warm machine keeps /tmp: never reuse a directory
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv | tee /tmp/gpu.txt
export PERSONAPLEX_CHECKPOINT=random:personaplex-7b PERSONAPLEX_DEVICES=0 PERSONAPLEX_KV_CACHE=fp8 \
    PERSONAPLEX_MAX_SESSIONS=$sessions PERSONAPLEX_TICK_POLICY=$policy PERSONAPLEX_ENGINE_HOST=${ENGINE_HOST:-process} \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache PERSONAPLEX_CACHE_DIR=/tmp/personaplex-cache
started=$SECONDS
workers=${WORKERS:-1}
[ "${ENGINE_HOST:-process}" = thread ] && workers=1
python3 -m hypercorn orchestrator:app --bind 127.0.0.1:8000 --workers "$workers" > "$out/server.log" 2>&1 &
server=$!
until curl -sf 127.0.0.1:8000/ready >/dev/null; do
    kill -0 $server 2>/dev/null || { echo "server exited"; tail -20 "$out/server.log"; exit 1; }
    [ $((SECONDS - started)) -gt 400 ] && { echo "not ready in 400 s"; exit 1; }
    sleep 2
done
echo "ready after $((SECONDS - started)) s"
model=$(curl -s 127.0.0.1:8000/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
{ cat /tmp/gpu.txt; echo "# /metrics before the load"; curl -s 127.0.0.1:8000/metrics; } > "$out/metrics.txt"
nvidia-smi dmon -s u -d 1 > "$out/gpu-dmon.txt" 2>&1 &
dmon=$!
# Per-thread CPU every 20 s during the load (the busiest 20 threads of each sample).
(top -b -H -d 20 -w 250 -o %CPU | awk '/^top -/{n=0} {if (n++ < 27) print}' > "$out/top-threads.txt" 2>&1) &
topper=$!
tail_s=$(python3 -c "print(max(2.0, $frames * 0.08 - 38.0))")
python3 -m orchestrator.load_driver --model "$model" --input-wav "$wav" --sessions "$sessions" \
    --processes "$processes" --load-frames "$frames" --tail-s "$tail_s" --plot --progress-s 30 --start-spread-ms "${SPREAD_MS:-0}" \
    --server-revision "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
    --server-hardware "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), policy $policy, engine ${ENGINE_HOST:-process}, $workers worker(s)" \
    --output-dir "$load" > "$out/summary.txt" 2> "$out/driver.log"
echo "driver exit $?"
kill $dmon; pkill -P $topper; kill $topper 2>/dev/null
{ echo "# /metrics after the load"; curl -s 127.0.0.1:8000/metrics; } >> "$out/metrics.txt"
tail -4 "$out/summary.txt"
# THEN="N FRAMES": a second, lighter load on the same server once the first has ended.
if [ -n "${THEN:-}" ]; then
    set -- $THEN
    sleep 5
    python3 -m orchestrator.load_driver --model "$model" --input-wav "$wav" --sessions "$1" --processes 2 \
        --load-frames "$2" --tail-s "$(python3 -c "print(max(2.0, $2 * 0.08 - 38.0))")" --plot --progress-s 30 \
        --start-spread-ms "${SPREAD_MS:-0}" --server-revision "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" \
        --server-hardware "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), policy $policy, engine ${ENGINE_HOST:-process}, $workers worker(s)" \
        --output-dir "$load-then" > "$out/summary-then.txt" 2> "$out/driver-then.log"
    echo "second driver exit $?"
    tail -4 "$out/summary-then.txt"
    gzip -c "$load-then/load-result.json" > "$out/load-result-then.json.gz"
    cp "$load-then/load-timeline.png" "$out/load-timeline-then.png" 2>/dev/null
fi
gzip -c $load/load-result.json > /tmp/load-result.json.gz
[ "$(stat -c %s /tmp/load-result.json.gz)" -lt 16000000 ] && cp /tmp/load-result.json.gz "$out/load-result.json.gz"
cp $load/load-timeline.png "$out/" 2>/dev/null
kill $server; wait $server 2>/dev/null
sleep 3  # the engine host stops its engines once the server has gone
grep -E "^personaplex_(tick_duration_seconds|batch_size)_(sum|count)" "$out/metrics.txt"
ls -la "$out"
