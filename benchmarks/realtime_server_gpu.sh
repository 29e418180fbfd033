#!/usr/bin/env bash
# Duplex sessions through the server on one GPU: `omnigate serve --engine duplex` (moshi-7b shapes, random weights)
# driven by the load-test CLI's realtime target (microphone audio appended in real time, replies played through the
# jitter-buffer player), one level per session count, server threads counted before and after each level.
# Usage: benchmarks/realtime_server_gpu.sh OUT_DIR "8 16 32 64" [DURATION_S]
set -uo pipefail
out="$1"; levels="$2"; duration="${3:-20}"
mkdir -p "$out"
port=8765
python3 -m omnigate.gateway.cli serve --engine duplex --model preset:moshi-7b -E device=cuda -E dtype=bfloat16 \
    -E max_sessions=64 --port "$port" --log-level warning >"$out/server.log" 2>&1 &
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
for n in $levels; do
    before=$(ls /proc/$server/task | wc -l)
    python3 -m omnigate.loadtest.cli run "ws://127.0.0.1:$port/v1/realtime#append_ms=40" --target realtime \
        --sessions "$n" --duration "$duration" --warmup 4 --ramp 4 --drain 10 --server-pid "$server" \
        --out "$out/realtime_$n.json" >"$out/realtime_$n.log" 2>&1
    echo "level $n: rc=$? server threads $before -> $(ls /proc/$server/task | wc -l)" | tee -a "$out/threads.txt"
done
