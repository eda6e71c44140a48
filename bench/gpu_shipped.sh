#!/usr/bin/env bash
# The shipped config.yaml on a GPU machine, as a new user meets it: the full-size random checkpoint,
# no settings changed beyond paths (backend auto, model.dtype auto, model.compile auto, the 1500 MiB
# budget). Starts the daemon, times READY, sends 10 requests, reads `status` (memory_kind,
# memory_mib, host_rss_mib) before and after, and stops it. Results (log, status JSON) under $OUT.
# Usage: bench/gpu_shipped.sh [KEY=VALUE ...]   model: settings to change, e.g. compile=off max_seq_len=512
#        (ENG=DIR: an engine directory built before; COMPILE_FIRST=1: run engines compile first, timed)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_shipped}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
export PYTHONPATH=${PYTHONPATH:-}:$PWD
D=/tmp/shipped
mkdir -p $D
ENG=${ENG:-$D/engines}
mkdir -p "$ENG"
sed -e "s#^  path: models/chattts #  path: $CKPT #" -e "s#^  engine_dir: engines/build #  engine_dir: $ENG #" \
    -e "s#^  socket: /run/chattts-appliance/appliance.sock#  socket: $D/appliance.sock#" \
    -e "s#^  spool_dir: spool #  spool_dir: $D/spool #" -e "s#^  wav_dir: out#  wav_dir: $D/out#" config.yaml > $D/config.yaml
for kv in "$@"; do   # KEY=VALUE settings of the model: section replace the shipped lines (e.g. compile=off)
  k=${kv%%=*} v=${kv#*=}
  sed -i "s#^  $k: [^#]*#  $k: $v   #" $D/config.yaml
done
grep -n "path:\|engine_dir:\|socket:\|dtype:\|compile:\|memory_budget_mb:" $D/config.yaml | head -8
if [ -n "${COMPILE_FIRST:-}" ]; then   # the installer's cold path: the step compiled ahead of time
  c0=$(date +%s)
  timeout "${COMPILE_TIMEOUT:-400}" python3 -m appliance engines compile --config $D/config.yaml > "$OUT/compile.log" 2>&1
  echo "engines compile: rc=$? in $(( $(date +%s) - c0 )) s"; grep -i "compiling\|wrote\|error\|load check" "$OUT/compile.log" | tail -8
fi
t0=$(date +%s.%N)
python3 -m appliance serve --config $D/config.yaml > "$OUT/daemon.log" 2>&1 &
pid=$!
while [ ! -S $D/appliance.sock ] && kill -0 $pid 2>/dev/null; do sleep 0.2; done
t1=$(date +%s.%N)
if ! kill -0 $pid 2>/dev/null; then
  echo "daemon exited before READY"; tail -5 "$OUT/daemon.log"; exit 1
fi
python3 - "$t0" "$t1" <<'PY'
import sys
print(f"socket up after {float(sys.argv[2]) - float(sys.argv[1]):.1f} s (the daemon binds it after the load and warm-up)")
PY
C=(python3 -m appliance)
"${C[@]}" status --config $D/config.yaml --json > "$OUT/status_ready.json" 2>&1
for i in $(seq 1 10); do
  "${C[@]}" say --config $D/config.yaml --max-new-tokens 120 --seed "$i" "今天天气很好，我们去公园散步吧。Hello there, number $i." > "$OUT/say_$i.log" 2>&1 || echo "say $i failed"
done
"${C[@]}" status --config $D/config.yaml --json > "$OUT/status_10.json" 2>&1
python3 - "$OUT" <<'PY'
import json, sys
for f in ("status_ready", "status_10"):
    s = json.load(open(f"{sys.argv[1]}/{f}.json"))
    print(f, {k: s.get(k) for k in ("backend", "memory_kind", "memory_mib", "memory_budget_mib", "host_rss_mib",
                                    "host_rss_limit_mib", "memory_note")})
PY
grep -h "memory\|backend\|compile\|ready\|dtype\|load check\|decode step" "$OUT/daemon.log" | grep -v DEBUG | head -12
kill -TERM $pid; wait $pid; echo "daemon rc=$?"
