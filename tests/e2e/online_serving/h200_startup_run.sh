#!/usr/bin/env bash
# Start-up to /ready in the three cases operators meet (docs/PERFORMANCE.md, "Start-up budgets"),
# one server configuration, each start timed by h200_server_run.sh (no load) and stopped:
#   fresh      compile caches empty, no artifacts: compiles everything, writes the artifacts
#   restart    the same compile caches again (a restarted pod that kept its volume)
#   artifacts  compile caches empty, the artifact file only (a new replica given the file)
# Usage (repository root): OUT=/tmp/out [WEIGHTS=fp8] bash tests/e2e/online_serving/h200_startup_run.sh [CASE ...]
# (default: all three, in that order; each case's server log and startup.txt go in
# $OUT/CASE-server.tgz).  MAX_SESSIONS defaults to auto (the memory plan's wall).
# ROOT (a directory) keeps the caches and artifacts between calls.
# TORCH_LOGS=dynamo,recompiles puts torch.compile's per-graph timeline in the server logs.
set -uo pipefail
out=${OUT:?set OUT}
here=$(cd "$(dirname "$0")" && pwd)
root=${ROOT:-$(mktemp -d /tmp/startup-XXXX)}  # ROOT: a previous run's, for its caches and artifacts
export PERSONAPLEX_COMPILE_ARTIFACTS=$root/artifacts PERSONAPLEX_WEIGHTS=${WEIGHTS:-auto}
export MAX_SESSIONS=${MAX_SESSIONS:-auto} TORCH_LOGS=${TORCH_LOGS:-dynamo,recompiles}
cases=("$@")
[ ${#cases[@]} -eq 0 ] && cases=(fresh restart artifacts)
for case in "${cases[@]}"; do
    case $case in
        fresh) caches=$root/caches-1; rm -rf "$caches" "$PERSONAPLEX_COMPILE_ARTIFACTS" ;;
        restart) caches=$root/caches-1 ;;
        artifacts) caches=$root/caches-$case-$SECONDS; rm -rf "$caches" ;;
        *) echo "unknown case $case (fresh, restart, artifacts)"; exit 2 ;;
    esac
    mkdir -p "$out/$case"
    PERSONAPLEX_CACHE_DIR=$caches OUT=$out/$case bash "$here/h200_server_run.sh" paced || exit 1
    mv "$out/$case/paced-server.tgz" "$out/$case-server.tgz" && rmdir "$out/$case" 2>/dev/null
    ls -la "$PERSONAPLEX_COMPILE_ARTIFACTS" 2>/dev/null
done
for case in "${cases[@]}"; do
    echo "$case: $(tar -xzOf "$out/$case-server.tgz" startup.txt | grep 'ready after')"
done
