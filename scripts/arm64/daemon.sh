# shellcheck shell=bash
# Sourced by scripts/arm64_emulated.sh (its variables and helpers: say, note, stage, in_root, host_py).
# The daemon in the root: its config, the checkpoint and export, serve, say, stop, health, the record.
# shellcheck disable=SC2154,SC2034  # read and set for scripts/arm64_emulated.sh

# Checks: the installed config loads with the run's changes (WAV output, the tiny checkpoint's paths).
run_config() {
    # the installed config with WAV output and a socket inside the prefix; the model and engine
    # paths point at the tiny checkpoint. A twin with host paths drives the export on the host.
    host_py - "$ROOT" "$CONFIG" "$RUN_CFG" "$CKPT" "$ENGINES" "$SOCK" <<'EOF' || return 1
import sys, yaml
root, config, run_cfg, ckpt, engines, sock = sys.argv[1:]
cfg = yaml.safe_load(open(root + config))
cfg["model"].update(path=ckpt, engine_dir=engines)
cfg["audio"]["output"] = "wav"
cfg["service"]["socket"] = sock
head = "# scripts/arm64_emulated.sh: the installed config.yaml with a tiny checkpoint, WAV output, socket in the prefix\n"
open(root + run_cfg, "w").write(head + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
cfg["model"].update(path=root + ckpt, engine_dir=root + engines)
open(root + run_cfg + ".host", "w").write(head + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
EOF
    mkdir -p "$ROOT$(dirname "$SOCK")"
    DETAIL="$RUN_CFG: model.backend $(grep -A20 '^model:' "$ROOT$RUN_CFG" | grep -m1 ' backend:' | awk '{print $2}'), audio.output wav"
}

# Checks: the tiny checkpoint and its export (GGUF + ONNX vocoder, or int8 ONNX) are written on the host.
checkpoint_export() {
    if [ ! -f "$ROOT$CKPT/asset/gpt/config.json" ]; then
        host_py -m appliance model random --size tiny "$ROOT$CKPT" || return 1
    fi
    # fresh graphs every run: the export format follows the copied tree
    rm -rf "$ROOT$ENGINES/onnx" "$ROOT$ENGINES/llama"
    local p=q8_0 kind=llama
    [ "$LLAMA_MODE" = off ] && p=int8 kind=onnx
    host_py -m appliance engines export --config "$ROOT$RUN_CFG.host" --precision "$p" || return 1
    DETAIL="tiny random checkpoint, $kind/$p $(du -sh "$ROOT$ENGINES/$kind/$p" | cut -f1) (exported on the host by $HOST_PY)"
}

READY_S=""
# Checks: the daemon's socket appears within the time limit (READY), emulated, with model.backend auto.
serve() {
    local t0 log="$ROOT$SERVE_LOG" i
    rm -f "$ROOT$SOCK"
    t0=$(now)
    timeout --kill-after=30 "$LIMIT" chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/bin:/bin \
        QEMU_CPU="$QEMU_CPU_MODEL" "$CLI" serve --config "$RUN_CFG" >"$log" 2>&1 &
    DAEMON_PID=$!
    for ((i = 0; i < LIMIT; i++)); do
        grep -q "ready: channels" "$log" && break
        kill -0 "$DAEMON_PID" 2>/dev/null || { tail -30 "$log"; echo "the daemon exited" >&2; return 1; }
        sleep 1
    done
    grep -q "ready: channels" "$log" || { tail -30 "$log"; echo "the daemon was not ready in $LIMIT s" >&2; return 1; }
    READY_S=$(since "$t0")
    grep -E "inference backend|audio output|pipeline loaded|warm-up took|ready:" "$log" | sed 's/^/    /'
    local want=llama.cpp
    [ "$LLAMA_MODE" = off ] && want=onnxruntime
    grep -q "inference backend: $want" "$log" || { echo "the daemon did not pick $want" >&2; return 1; }
    DETAIL="ready after $READY_S s; $(grep -o 'inference backend: .*' "$log" | head -1)"
}

# Checks: one sentence through chattts-appliance say ends with done and a non-empty WAV file.
speak() {
    local events="$WORK/events.jsonl"
    in_root "$CLI" say --config "$RUN_CFG" --json --timeout "$LIMIT" --max-new-tokens "$MAX_NEW" "$TEXT" >"$events" || { cat "$events"; return 1; }
    python3 - "$events" "$ROOT" "$DONE_JSON" >"$WORK/speak.txt" <<'EOF' || { cat "$WORK/speak.txt"; return 1; }
import json, sys, wave
events, root, out = sys.argv[1:]
done = [e for e in map(json.loads, open(events)) if e.get("type") == "done"]
if not done:
    sys.exit("no done event: " + open(events).read()[-2000:])
d = done[-1]
path = root + str(d.get("output", ""))
with wave.open(path) as w:
    d["wav_frames"], d["wav_rate"], d["wav_path"] = w.getnframes(), w.getframerate(), path[len(root):]
if d["wav_frames"] <= 0:
    sys.exit(f"{path} holds no audio")
json.dump(d, open(out, "w"))
print(f"WAV {d['wav_path']}: {d['wav_frames'] / d['wav_rate']:.2f} s at {d['wav_rate']} Hz; ttfb {d.get('ttfb_ms')} ms, "
      f"rtf {d.get('rtf')}, {d.get('steps')} steps at {d.get('steps_per_s')}/s")
EOF
    DETAIL=$(tail -n 1 "$WORK/speak.txt")
}

PEAK_RSS=""
# Checks: SIGTERM stops the daemon with exit 0 within its stop timeout.
stop_daemon() {
    local i
    # $DAEMON_PID is timeout(1); its child is the emulated daemon (chroot and env exec into it)
    local child
    child=$(cat "/proc/$DAEMON_PID/task/$DAEMON_PID/children" 2>/dev/null || true)
    PEAK_RSS=$(awk '/^VmHWM/ { printf "%.0f", $2 / 1024 }' "/proc/${child%% *}/status" 2>/dev/null || true)
    kill -TERM "$DAEMON_PID" || return 1
    for ((i = 0; i < 300; i++)); do kill -0 "$DAEMON_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$DAEMON_PID" 2>/dev/null; then echo "the daemon did not stop within 300 s of SIGTERM" >&2; return 1; fi
    wait "$DAEMON_PID" 2>/dev/null || true
    DAEMON_PID=""
    grep -q "stopped" "$ROOT$SERVE_LOG" || { echo "no 'stopped' line in the daemon's log" >&2; return 1; }
    DETAIL="SIGTERM: stopped after ${i} s; peak RSS of the emulated process ${PEAK_RSS:-?} MiB"
}

# health_json OUT CMD...: run CMD (a `health --json`), keep its health line in OUT. Exit 1 means
# unhealthy (emulated, RTF > 1 is expected) and still carries the numbers; anything else fails.
health_json() {
    local out=$1 rc=0
    shift
    "$@" >"$WORK/h.txt" 2>/dev/null || rc=$?
    grep '"type": *"health"' "$WORK/h.txt" | tail -n 1 >"$out" || true
    if [ "$rc" -gt 1 ] || [ ! -s "$out" ]; then
        cat "$WORK/h.txt"
        echo "health failed (exit $rc): $*" >&2
        return 1
    fi
}

# Checks: chattts-appliance health --json runs emulated and natively; their steps/s give the slowdown.
health_both() {
    health_json "$HEALTH_EMU" in_root "$CLI" health --config "$RUN_CFG" --json || return 1
    health_json "$HEALTH_NATIVE" host_py -m appliance health --config "$ROOT$RUN_CFG.host" --json || return 1
    DETAIL=$(python3 - "$HEALTH_EMU" "$HEALTH_NATIVE" <<'EOF'
import json, sys
e, n = (json.load(open(f)) for f in sys.argv[1:])
print(f"emulated {e['steps_per_s']} steps/s, RTF {e['rtf']}, TTFB {e['ttfb_ms']} ms; natively on the host "
      f"{n['steps_per_s']} steps/s, RTF {n['rtf']}, TTFB {n['ttfb_ms']} ms: emulation {n['steps_per_s'] / e['steps_per_s']:.1f}x slower")
EOF
)
}

# Checks: nothing: appends the run's record (bench: arm64_emulated, bench/harness.py's shared fields
# first) to <results>/arm64_emulated.jsonl, then shows the daemon's log.
write_record() {
    python3 - "$STAGES" "$DONE_JSON" "$RECORD" "$READY_S" "$PEAK_RSS" "$(git -C "$REPO" rev-parse --short HEAD)" \
        "$SUITE" "$N_STAGES" "$QEMU_CPU_MODEL" "$(dpkg-query -W -f='${Version}' qemu-user-static 2>/dev/null)" \
        "$HEALTH_EMU" "$HEALTH_NATIVE" "$LOG" "$LLAMA_MODE" <<'EOF'
import datetime, json, os, sys
stages_f, done_f, record_f, ready_s, peak, commit, suite, n_stages, qemu_cpu, qemu, health_emu, health_native, log_f, llama = sys.argv[1:]
stages = [dict(zip(("name", "result", "seconds", "detail"), l.rstrip("\n").split("\t"))) for l in open(stages_f) if l.strip()]
for s in stages:
    s["seconds"] = float(s["seconds"])
d = json.load(open(done_f)) if os.path.exists(done_f) else {}
health = {k: json.load(open(f)) if os.path.exists(f) else None for k, f in (("emulated", health_emu), ("native", health_native))}
for h in health.values():
    if h:
        h.pop("limits", None), h.pop("type", None)
slowdown = (round(health["native"]["steps_per_s"] / health["emulated"]["steps_per_s"], 2)
            if health["native"] and health["emulated"] else None)
ok = len(stages) == int(n_stages) and all(s["result"] == "ok" for s in stages)
sps = d.get("steps_per_s")
rec = {
    "bench": "arm64_emulated", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    "machine": "arm64-qemu", "commit": commit, "checkpoint": "tiny",
    "backend": "onnxruntime" if llama == "off" else "llama.cpp",
    "notes": (f"Debian {suite} arm64 root under qemu-user on the 2-core x86-64 host: scripts/install_jetson.sh --prefix, "
              "the CPU runtime from PyPI aarch64 wheels, the daemon on a tiny random checkpoint (exported on the host), "
              "one sentence to a WAV file. Emulated: the times and RSS (qemu's included) say nothing about an Orin's speed."),
    "precision": "int8" if llama == "off" else "q8_0", "llama_build": llama, "batch": 1,
    "ms_per_step": round(1000 / sps, 2) if sps else None, "steps_per_s": sps, "rtf": d.get("rtf"),
    "ttfb_ms": d.get("ttfb_ms"), "peak_mem_mib": int(peak) if peak else None, "all_ok": ok,
    "ready_s": float(ready_s) if ready_s else None, "audio_s": d.get("audio_s"), "steps": d.get("steps"),
    "output": d.get("wav_path"), "spoken": d.get("spoken"), "unspeakable": d.get("unspeakable"), "qemu_cpu": qemu_cpu,
    "qemu": qemu, "health_emulated": health["emulated"], "health_native_x86": health["native"],
    "emulation_slowdown": slowdown, "log": os.path.basename(log_f), "stages": stages,
}
with open(record_f, "a", encoding="utf-8") as f:
    f.write(json.dumps(rec, ensure_ascii=False) + "\n")
print(f"record: {record_f} (all_ok={ok})")
EOF
    if [ -f "$ROOT$SERVE_LOG" ]; then
        say "the daemon's log"
        sed 's/^/    | /' "$ROOT$SERVE_LOG"
    fi
}
