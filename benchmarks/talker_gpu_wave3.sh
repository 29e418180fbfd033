#!/usr/bin/env bash
# The talker through the server on one GPU with serve's defaults (engine core, automatic gateway workers, headroom
# admission) for clients at their defaults: fixed levels and the capacity search with slots admission (what the
# engine carries), then the default admission at the offered levels given (default: twice the capacity found).
# Writes OUT/capacity.json, OUT/overload.json and the servers' log tails.
# Usage: benchmarks/talker_gpu_wave3.sh OUT [FIXED_LEVELS [OFFERED_LEVELS]]
set -euo pipefail
OUT=${1:?usage: talker_gpu_wave3.sh OUT [FIXED_LEVELS [OFFERED_LEVELS]]}
LEVELS=${2:-1,256,1000,1500}
OFFERED_LEVELS=${3:-}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
E=${TALKER_OPTIONS:-"-E device=cuda -E dtype=bfloat16 -E max_sessions=1536 -E max_batch=1536 -E max_context=1024 -E top_p=0.95 -E repetition_penalty=1.1"}
C="--model ${MODEL:-preset:csm-1b} --phases server --level-duration 10 --warmup 2 --ramp 3 --drain 6 --max-level 1536 --capacity-resolution 64 --engine-process auto --workers 0"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader || true
# shellcheck disable=SC2086
$PY benchmarks/talker_gpu.py --out "$WORK/capacity" $C $E --admission slots --levels "$LEVELS" \
    --capacity-start "${CAPACITY_START:-768}" \
    --deadline-s "${DEADLINE:-215}" || true
cp "$WORK/capacity/talker_gpu.json" "$OUT/capacity.json" || true
tail -n 40 "$WORK/capacity/server.log" > "$OUT/capacity_server_log_tail.txt" || true
CAPACITY=$($PY -c "import json,sys; d=json.load(open(sys.argv[1]))['server']; c=d.get('capacity') or {}; print(c.get('passed_max') or max([l['sessions'] for l in d['levels'] if l['passed']] or [512]))" "$OUT/capacity.json" || echo 512)
OFFERED=${OFFERED_LEVELS:-$((2 * CAPACITY))}
echo "capacity $CAPACITY: the default admission at $OFFERED offered"
# shellcheck disable=SC2086
$PY benchmarks/talker_gpu.py --out "$WORK/overload" $C $E --admission headroom --levels "$OFFERED" --deadline-s 1 || true
cp "$WORK/overload/talker_gpu.json" "$OUT/overload.json" || true
tail -n 40 "$WORK/overload/server.log" > "$OUT/overload_server_log_tail.txt" || true
$PY - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for name in ("capacity", "overload"):
    try:
        server = json.load(open(f"{out}/{name}.json"))["server"]
    except Exception as exc:
        print(name, "missing", exc)
        continue
    print(name, "ready_s", server.get("ready_s"), "capacity", server.get("capacity"), "workers", server.get("workers"))
    for lv in server["levels"]:
        s = lv.get("server_side") or {}
        t = lv.get("ttfa_ms") or {}
        stages = {k: round(v, 3) for k, v in (s.get("engine_stage_fraction") or {}).items()}
        print(f"  {lv['sessions']:>5} pass={lv['passed']} ttfa p50={t.get('p50')} p99={t.get('p99')} "
              f"under={lv.get('underruns')} utt={lv.get('utterances')} errors={lv.get('errors')} "
              f"reasons={lv.get('reasons')} step={s.get('engine_step_mean_ms')} "
              f"batch={s.get('engine_batch_mean')} busy={s.get('engine_busy_fraction')} stages={stages}")
PY
