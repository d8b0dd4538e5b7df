#!/usr/bin/env bash
# End-to-end server measurements on a GPU machine (docs/PERFORMANCE.md): start
# `hypercorn orchestrator:app` once with random 7B weights and fp8 KV, time its start-up to
# /ready, then run each LOAD in turn against it with the load driver (full windows, worker
# processes, starts spread over the frame period), and stop it.  Usage (repository root):
#   OUT=/tmp/out bash tests/e2e/online_serving/h200_server_run.sh POLICY LOAD [LOAD ...]
# POLICY is PERSONAPLEX_TICK_POLICY (window | paced); a LOAD is SESSIONS:FRAMES[:PROCESSES[:PROTOCOL]]
# (driver processes: default one per 16 sessions, at least 2; PROTOCOL the driver's --protocol,
# realtime by default or native: /api/chat with Ogg/Opus).  Under $OUT, per load,
# POLICY-nSESSIONS.tgz: the driver's summary and log, per-session lag figures (sessions.json),
# load-result.json.gz (when under 12 MB), the lag plot,
# /metrics before and after (metrics.txt), the GPU's utilisation per second (gpu-dmon.txt)
# and the busiest threads every 20 s (top-threads.txt); per server, POLICY-server.tgz: its log
# and start-up time (startup.txt).  Settings: WORKERS (front-end workers, default 4),
# ENGINE_HOST (process | thread: the old one-process layout), MAX_SESSIONS (default: the
# largest load), SPREAD_MS (default 80), WAV (default tests/data/input_assistant.wav), JOINER
# (EVERY_S:CHARS: during each load, a session joins every EVERY_S seconds with a new persona of
# CHARS characters and leaves once open, tests/e2e/online_serving/joiner.py; its open times go
# in joiner.json; give MAX_SESSIONS one more than the load), and for a
# dry run on CPU CHECKPOINT (a directory), DEVICES (cpu), KV_CACHE (auto); wheels the machine
# lacks go in .whl/.
set -uo pipefail
policy=$1
shift
out=${OUT:?set OUT}
wav=${WAV:-tests/data/input_assistant.wav}
engine_host=${ENGINE_HOST:-process}
workers=${WORKERS:-4}
[ "$engine_host" = thread ] && workers=1
largest=0
for load in "$@"; do n=${load%%:*}; [ "$n" -gt "$largest" ] && largest=$n; done
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$PWD
fi
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
server_dir=$(mktemp -d /tmp/server-XXXX)  # a warm machine keeps /tmp: never reuse a directory
export PERSONAPLEX_CHECKPOINT=${CHECKPOINT:-random:personaplex-7b} PERSONAPLEX_DEVICES=${DEVICES:-0} \
    PERSONAPLEX_KV_CACHE=${KV_CACHE:-fp8} PERSONAPLEX_MAX_SESSIONS=${MAX_SESSIONS:-$largest} \
    PERSONAPLEX_TICK_POLICY=$policy PERSONAPLEX_ENGINE_HOST=$engine_host
started=$SECONDS
python3 -m hypercorn orchestrator:app --bind 127.0.0.1:8000 --workers "$workers" > "$server_dir/server.log" 2>&1 &
server=$!
phase=""
until curl -sf 127.0.0.1:8000/ready >/dev/null; do
    kill -0 $server 2>/dev/null || { echo "server exited"; tail -20 "$server_dir/server.log"; exit 1; }
    ready=$(curl -s 127.0.0.1:8000/ready)
    if echo "$ready" | grep -q '"reason": *"unavailable"'; then  # the engine failed to load
        echo "server not ready: the engine failed to load"; tail -20 "$server_dir/server.log"; kill $server; exit 1
    fi
    # Where the load is (/ready's "loading"), each time it moves on.
    now=$(echo "$ready" | python3 -c 'import json,sys
try: print(json.dumps(json.load(sys.stdin)["devices"][0].get("loading", {}).get("phase", "")))
except Exception: print("")' 2>/dev/null)
    if [ -n "$now" ] && [ "$now" != "$phase" ]; then
        phase=$now; echo "$((SECONDS - started)) s: $(echo "$ready" | python3 -c 'import json,sys; print(json.load(sys.stdin)["devices"][0].get("loading"))')" | tee -a "$server_dir/startup.txt"
    fi
    [ $((SECONDS - started)) -gt 600 ] && { echo "not ready in 600 s"; kill $server; exit 1; }
    sleep 1
done
echo "$policy: ready after $((SECONDS - started)) s (git $revision, $gpu, engine $engine_host, $workers worker(s), max_sessions $PERSONAPLEX_MAX_SESSIONS)" | tee -a "$server_dir/startup.txt"
model=$(curl -s 127.0.0.1:8000/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
for load in "$@"; do
    IFS=: read -r sessions frames processes protocol <<< "$load"
    protocol=${protocol:-realtime}
    processes=${processes:-$(( sessions / 16 > 2 ? sessions / 16 : 2 ))}
    run="$policy-n$sessions-$protocol"
    dir="$server_dir/$run"
    mkdir -p "$dir"
    { nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
      echo "# /metrics before the load"; curl -s 127.0.0.1:8000/metrics; } > "$dir/metrics.txt"
    nvidia-smi dmon -s u -d 1 > "$dir/gpu-dmon.txt" 2>&1 &
    dmon=$!
    (top -b -H -d 20 -w 250 -o %CPU | awk '/^top -/{n=0} {if (n++ < 27) print}' > "$dir/top-threads.txt" 2>&1) &
    topper=$!
    tail_s=$(python3 -c "print(max(2.0, $frames * 0.08 - 38.0))")
    joiner=""
    if [ -n "${JOINER:-}" ]; then
        IFS=: read -r join_every join_chars <<< "$JOINER"
        # From when the sessions have opened (about 20 s at 128) to before the windows end.
        ( sleep 25; python3 -m tests.e2e.online_serving.joiner --url "ws://127.0.0.1:8000/v1/realtime?duplex=1" \
            --every-s "$join_every" --persona-chars "$join_chars" --first-index $((RANDOM * 1000)) \
            --duration-s "$(python3 -c "print(max(5.0, $frames * 0.08 - 20.0))")" \
            --output "$dir/joiner.json" > "$dir/joiner.txt" 2>&1 ) &
        joiner=$!
    fi
    python3 -m orchestrator.load_driver --model "$model" --input-wav "$wav" --sessions "$sessions" \
        --protocol "$protocol" \
        --processes "$processes" --load-frames "$frames" --tail-s "$tail_s" --plot --progress-s 30 \
        --start-spread-ms "${SPREAD_MS:-80}" --server-revision "$revision" \
        --server-hardware "$gpu, policy $policy, engine $engine_host, $workers worker(s)" \
        --output-dir "$dir/result" > "$dir/summary.txt" 2> "$dir/driver.log"
    echo "$run: driver exit $?"
    [ -n "$joiner" ] && { wait $joiner; cat "$dir/joiner.txt"; }
    kill $dmon; pkill -P $topper; kill $topper 2>/dev/null
    { echo "# /metrics after the load"; curl -s 127.0.0.1:8000/metrics; } >> "$dir/metrics.txt"
    python3 -m orchestrator.load_driver.reread --json "$dir/result/load-result.json" > "$dir/sessions.json"
    gzip -c "$dir/result/load-result.json" > "$dir/load-result.json.gz"
    # The device returns files of up to 16 MiB: a full-window result of many sessions is larger.
    [ "$(stat -c %s "$dir/load-result.json.gz")" -lt 12000000 ] || rm "$dir/load-result.json.gz"
    cp "$dir/result/load-timeline.png" "$dir/lag.png" 2>/dev/null
    rm -rf "$dir/result"
    tail -4 "$dir/summary.txt"
    grep -E "^personaplex_(tick_duration_seconds|batch_size)_(sum|count)" "$dir/metrics.txt"
    tar -czf "$out/$run.tgz" -C "$server_dir" "$run"
    sleep 5
done
kill $server; wait $server 2>/dev/null
sleep 3  # the engine host stops its engines once the server has gone
tar -czf "$out/$policy-server.tgz" -C "$server_dir" server.log startup.txt
ls -la "$out"
