#!/usr/bin/env bash
# End-to-end server measurements on a GPU machine (docs/PERFORMANCE.md): start
# `python -m orchestrator.serve orchestrator:app` (hypercorn's command line with our master,
# which hands each connection to the least busy worker) once with random 7B weights and fp8
# KV, time its start-up to /ready, then run each LOAD in turn against it with the load driver (full windows, worker
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
# MAX_SESSIONS (default: the
# largest load; auto when a load is "wall": see below), SPREAD_MS (default 80), WAV (default tests/data/input_assistant.wav), JOINER
# (EVERY_S:CHARS[:FRAMES]: during each load, a session joins every EVERY_S seconds with a new
# persona of CHARS characters, streams FRAMES frames and waits for as many back, and leaves, tests/e2e/online_serving/joiner.py; its open times go
# in joiner.json; give MAX_SESSIONS one more than the load), and for a
# dry run on CPU CHECKPOINT (a directory), DEVICES (cpu), KV_CACHE (auto); wheels the machine
# lacks go in .whl/, and a libopus.so.0 the machine lacks in .whl/lib/.
# Loads joined by '+' run at once, each with its own driver (a mixed run:
# 76:3000:5:realtime+76:3000:5:native); their files go under one run directory, one
# subdirectory per part.  Per load, also: the server processes' CPU seconds before and after
# (cpu.txt: per process, with the front-end workers and the engine named) and /metrics halfway
# through the window (metrics-mid.txt: the sessions per worker while they stream).
# SERVER=keep starts the server in a session of its own (setsid) and leaves it running when
# the script ends, and a later run with SERVER=keep uses the one already answering on port
# 8000 (a device call's processes end with it; a new session's do not), so that the loads of
# several calls share one start-up.
set -uo pipefail
policy=$1
shift
out=${OUT:?set OUT}
wav=${WAV:-tests/data/input_assistant.wav}
workers=${WORKERS:-4}
largest=0
for load in "$@"; do
    n=0
    for part in ${load//+/ }; do
        count=${part%%:*}
        case $count in wall*) largest=auto; continue ;; esac  # sized by the server's memory plan
        n=$((n + count))
    done
    [ "$largest" != auto ] && [ "$n" -gt "$largest" ] && largest=$n
done
mkdir -p "$out"
[ -e .whl/lib/libopus.so.0 ] && export LD_LIBRARY_PATH=$PWD/.whl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$PWD
fi
revision=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
keep=${SERVER:-}
export PERSONAPLEX_CHECKPOINT=${CHECKPOINT:-random:personaplex-7b} PERSONAPLEX_DEVICES=${DEVICES:-0} \
    PERSONAPLEX_KV_CACHE=${KV_CACHE:-fp8} PERSONAPLEX_MAX_SESSIONS=${MAX_SESSIONS:-$largest} \
    PERSONAPLEX_TICK_POLICY=$policy
started=$SECONDS
if [ "$keep" = keep ] && [ -s /tmp/pp-server ] && curl -sf 127.0.0.1:8000/ready >/dev/null; then
    read -r server server_dir < /tmp/pp-server
    echo "using the server already running (pid $server, $server_dir)"
else
    server_dir=$(mktemp -d /tmp/server-XXXX)  # a warm machine keeps /tmp: never reuse a directory
    if [ "$keep" = keep ]; then
        setsid python3 -m orchestrator.serve orchestrator:app --bind 127.0.0.1:8000 --workers "$workers" \
            > "$server_dir/server.log" 2>&1 < /dev/null &
    else
        python3 -m orchestrator.serve orchestrator:app --bind 127.0.0.1:8000 --workers "$workers" > "$server_dir/server.log" 2>&1 &
    fi
    server=$!
    echo "$server $server_dir" > /tmp/pp-server
fi
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
curl -s 127.0.0.1:8000/ready > "$server_dir/ready.json"  # the engine's memory plan among it
wall=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["max_sessions"])' "$server_dir/ready.json")
# The engine's measured plan: the most its items leave room for, and what is spare.
python3 - "$server_dir/ready.json" <<'PY' | tee -a "$server_dir/startup.txt"
import json, sys
for device in json.load(open(sys.argv[1]))["devices"]:
    plan = device.get("memory_plan")
    if plan:
        items = ", ".join(f"{name} {item['bytes'] / 2**30:.2f} GiB ({item['source']})"
                          for name, item in plan["items"].items())
        print(f"{device['device']}: memory plan {plan['sessions']} sessions, largest fit {plan['largest_fit']}, "
              f"spare {plan['spare_bytes'] / 2**30:.2f} GiB; {items}")
PY
echo "$policy: ready after $((SECONDS - started)) s (git $revision, $gpu, $workers worker(s), max_sessions $PERSONAPLEX_MAX_SESSIONS: $wall)" | tee -a "$server_dir/startup.txt"
model=$(curl -s 127.0.0.1:8000/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
# CPU seconds (user + system) of every process of the server (the hypercorn master and its
# descendants), one line each: pid, name, seconds; the workers are the master's children
# running hypercorn, the engine host and engines are named by their command.
server_cpu() {
    python3 - "$server" <<'PY'
import os, sys
root = int(sys.argv[1]); tick = os.sysconf("SC_CLK_TCK"); parent = {}; info = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read(); cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        continue
    fields = stat[stat.rindex(")") + 2:].split()
    parent[int(pid)] = int(fields[1]); info[int(pid)] = ((int(fields[11]) + int(fields[12])) / tick, cmd)
def under(pid):
    while pid in parent and pid != root:
        pid = parent[pid]
    return pid == root
for pid in sorted(p for p in info if under(p)):
    seconds, cmd = info[pid]
    name = ("master" if pid == root else "resource_tracker" if "resource_tracker" in cmd
            else "worker" if parent[pid] == root and "spawn_main" in cmd
            else "engine" if "engine" in cmd else cmd.split()[-1][:40] if cmd else "?")
    print(pid, name, f"{seconds:.2f}")
PY
}
# A load's SESSIONS may be "wall" or "wall-K": the server's max_sessions (its memory plan's,
# with MAX_SESSIONS unset or auto), less K.
resolved=()
for load in "$@"; do
    parts=""
    for part in ${load//+/ }; do
        count=${part%%:*}
        case $count in wall*) count=$((wall ${count#wall})) ;; esac
        parts="$parts${parts:++}$count:${part#*:}"
    done
    resolved+=("$parts")
done
set -- "${resolved[@]}"
for load in "$@"; do
    first=${load%%+*}
    IFS=: read -r sessions frames processes protocol <<< "$first"
    protocol=${protocol:-realtime}
    total=0; protocols=""
    for part in ${load//+/ }; do
        IFS=: read -r n _ _ p <<< "$part"; total=$((total + n)); protocols="$protocols${protocols:+-}${p:-realtime}"
    done
    run="$policy-n$total-$protocols"
    dir="$server_dir/$run"
    mkdir -p "$dir"
    { nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv
      echo "# /metrics before the load"; curl -s 127.0.0.1:8000/metrics; } > "$dir/metrics.txt"
    nvidia-smi dmon -s u -d 1 > "$dir/gpu-dmon.txt" 2>&1 &
    dmon=$!
    (top -b -H -d 20 -w 250 -o %CPU | awk '/^top -/{n=0} {if (n++ < 27) print}' > "$dir/top-threads.txt" 2>&1) &
    topper=$!
    tail_s=$(python3 -c "print(max(2.0, $frames * 0.08 - 38.0))")
    ( sleep "$(python3 -c "print($frames * 0.08 / 2)")"; curl -s 127.0.0.1:8000/metrics > "$dir/metrics-mid.txt" ) &
    mid=$!
    { echo "# before the load, at $(date +%s.%N)"; server_cpu; } > "$dir/cpu.txt"
    joiner=""
    if [ -n "${JOINER:-}" ]; then
        IFS=: read -r join_every join_chars join_frames <<< "$JOINER"
        # From when the sessions have opened (about 20 s at 128) to before the windows end.
        ( sleep 25; python3 -m tests.e2e.online_serving.joiner --url "ws://127.0.0.1:8000/v1/realtime?duplex=1" \
            --every-s "$join_every" --persona-chars "$join_chars" --first-index $((RANDOM * 1000)) \
            --stream-frames "${join_frames:-0}" \
            --duration-s "$(python3 -c "print(max(5.0, $frames * 0.08 - 20.0))")" \
            --output "$dir/joiner.json" > "$dir/joiner.txt" 2>&1 ) &
        joiner=$!
    fi
    drivers=(); parts=()
    for part in ${load//+/ }; do
        IFS=: read -r sessions frames processes protocol <<< "$part"
        protocol=${protocol:-realtime}
        processes=${processes:-$(( sessions / 16 > 2 ? sessions / 16 : 2 ))}
        sub="$dir"; [ "$part" != "$load" ] && sub="$dir/$protocol-n$sessions"
        mkdir -p "$sub"; parts+=("$sub")
        python3 -m orchestrator.load_driver --model "$model" --input-wav "$wav" --sessions "$sessions" \
            --protocol "$protocol" \
            --processes "$processes" --load-frames "$frames" --tail-s "$tail_s" --plot --progress-s 30 \
            --start-spread-ms "${SPREAD_MS:-80}" --server-revision "$revision" \
            --server-hardware "$gpu, policy $policy, $workers worker(s)" \
            --output-dir "$sub/result" > "$sub/summary.txt" 2> "$sub/driver.log" &
        drivers+=($!)
    done
    for i in "${!drivers[@]}"; do wait "${drivers[$i]}"; echo "$run: driver ${parts[$i]##*/} exit $?"; done
    { echo "# after the load, at $(date +%s.%N)"; server_cpu; } >> "$dir/cpu.txt"
    [ -n "$joiner" ] && { wait $joiner; cat "$dir/joiner.txt"; }
    kill $dmon $mid 2>/dev/null; pkill -P $topper; kill $topper 2>/dev/null
    { echo "# /metrics after the load"; curl -s 127.0.0.1:8000/metrics; } >> "$dir/metrics.txt"
    for sub in "${parts[@]}"; do
        python3 -m orchestrator.load_driver.reread --json "$sub/result/load-result.json" > "$sub/sessions.json"
        gzip -c "$sub/result/load-result.json" > "$sub/load-result.json.gz"
        # The device returns files of up to 16 MiB: a full-window result of many sessions is larger.
        [ "$(stat -c %s "$sub/load-result.json.gz")" -lt 12000000 ] || rm "$sub/load-result.json.gz"
        cp "$sub/result/load-timeline.png" "$sub/lag.png" 2>/dev/null
        rm -rf "$sub/result"
        tail -4 "$sub/summary.txt"
    done
    grep -E "^personaplex_(tick_duration_seconds|batch_size)_(sum|count)" "$dir/metrics.txt"
    grep -E "^personaplex_worker_sessions" "$dir/metrics-mid.txt"
    tar -czf "$out/$run.tgz" -C "$server_dir" "$run"
    sleep 5
done
if [ "$keep" = keep ]; then
    tar -czf "$out/$policy-server.tgz" -C "$server_dir" server.log startup.txt ready.json
    echo "the server goes on running (pid $server)"
    ls -la "$out"
    exit 0
fi
kill $server; wait $server 2>/dev/null
# The engine host stops its engines once the server has gone; a next server's memory plan
# would count what they still hold as another process's: wait until the GPU is given back.
for _ in $(seq 60); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-0}" -lt 2048 ] && break
    sleep 1
done
tar -czf "$out/$policy-server.tgz" -C "$server_dir" server.log startup.txt ready.json
ls -la "$out"
