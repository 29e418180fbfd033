#!/usr/bin/env bash
# Where a loaded server's time goes: `omnigate serve` with the given options under SESSIONS speech-stream sessions
# (the load-test CLI at its defaults, spread over 8 client processes), sampled by py-spy in every process of the
# server (the gateway and, with --engine-process core, the engine core): once over all running threads, once over
# the threads holding the GIL. Writes collapsed stacks (py-spy's raw format) and the load-test reports to OUT.
# Usage: benchmarks/server_profile_gpu.sh OUT SESSIONS serve-option...
# e.g.   benchmarks/server_profile_gpu.sh out/core 442 --engine talker --model preset:csm-1b -E device=cuda ... \
#            --engine-process core --admission slots
set -uo pipefail
out="$1"; sessions="$2"; shift 2
mkdir -p "$out"
port=8766
python3 -m omnigate.gateway.cli serve "$@" --port "$port" --log-level warning >"$out/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server' EXIT
python3 - "$port" <<'PY'
import sys, time, urllib.request
for _ in range(600):
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit("server not ready")
PY
clients=8
pids=()
for i in $(seq 0 $((clients - 1))); do
    n=$(( sessions / clients + (i < sessions % clients ? 1 : 0) ))
    python3 -m omnigate.loadtest.cli run "http://127.0.0.1:$port" --target ws-speech --sessions "$n" --duration 24 \
        --warmup 2 --ramp 4 --drain 8 --seed $((i + 1)) --out "$out/loadtest_$i.json" --quiet --no-metrics \
        >"$out/loadtest_$i.log" 2>&1 &
    pids+=($!)
done
sleep 8  # past the ramp: the level is at its full count of sessions
py-spy record --subprocesses --threads --rate 200 --duration 8 --format raw --output "$out/all_threads.txt" --pid "$server" \
    >"$out/py-spy.log" 2>&1
py-spy record --subprocesses --threads --gil --rate 200 --duration 8 --format raw --output "$out/gil.txt" --pid "$server" \
    >>"$out/py-spy.log" 2>&1
wait "${pids[@]}"
