# shellcheck shell=bash
# Sourced by scripts/install_jetson.sh (its variables and helpers: say, note, warn, die, run).
# The engines the daemon opens: TensorRT plans, the ahead-of-time compiled torch step, the
# look-ahead calibration, and the health check on them.
# shellcheck disable=SC2154  # set by scripts/install_jetson.sh

# engines_match: exit 0 when <engine_dir>/trt/<precision>/manifest.json matches this board, its
# TensorRT version, the checkpoint and the configured limits (appliance.engines.manifest.check).
engines_match() {
    "$VENV/bin/python" - "$CONFIG" "$PRECISION" <<'EOF'
import sys
from appliance.config import load_config
from appliance.errors import ApplianceError
from appliance.engines import manifest as mf
try:
    import tensorrt
except ImportError:
    sys.exit("TensorRT Python bindings are not importable (apt: python3-libnvinfer)")
cfg = load_config(sys.argv[1])
precision = sys.argv[2]
d = cfg.resolve(cfg.model.engine_dir) / "trt" / precision
try:
    m = mf.read(d)
    dev = mf.device_facts()
    ck = mf.checkpoint_identity(cfg.resolve(cfg.model.path), m.get("checkpoint"))
    mf.check(m, {"kind": "tensorrt", "precision": precision, "runtime": {"version": tensorrt.__version__},
                 "device": {"board": dev["board"], "l4t": dev["l4t"]}, "checkpoint_sha256": ck["sha256"],
                 "limits": {"max_batch": cfg.model.max_batch, "max_seq_len": cfg.model.max_seq_len}},
             "rebuild")
except ApplianceError as e:
    sys.exit(str(e))
print(f"engines in {d} match this board and checkpoint")
EOF
}

# replace_files SRC DEST: the files of directory SRC into DEST, each copied beside it first (a
# staging directory on DEST's file system) and renamed over its old version, manifest.json last: a
# daemon reading DEST meanwhile sees each file whole, old or new, never half of one.
replace_files() {
    local src=$1 dest=$2 stage f
    stage="$(dirname "$dest")/.$(basename "$dest").incoming"
    run rm -rf "$stage"
    run mkdir -p "$stage" "$dest"
    run cp -a "$src/." "$stage/"
    if [ "$DRY_RUN" -eq 1 ]; then
        printf '+ mv -f %q/* %q/   # one rename per file, manifest.json last\n' "$stage" "$dest"
        return
    fi
    for f in "$stage"/* "$stage"/.[!.]*; do
        if [ -e "$f" ] && [ "${f##*/}" != manifest.json ]; then run mv -f "$f" "$dest/"; fi
    done
    [ ! -e "$stage/manifest.json" ] || run mv -f "$stage/manifest.json" "$dest/"
    run rm -rf "$stage"
}

# Checks: the TensorRT plans' manifest matches this board, its TensorRT, the checkpoint and the limits
# (then they are kept); else the ONNX graphs (from --onnx-dir, the cache, or an export with torch >= 2.10)
# and engines build.
step_engines() {
    say "TensorRT engines ($PRECISION) in $ENGINE_DIR"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines)"
        return
    fi
    if [ "$DRY_RUN" -eq 0 ] && engines_match; then
        note "reusing the cached engines"
        return
    fi
    [ "$DRY_RUN" -eq 1 ] && note "(the engines are rebuilt only if their manifest does not match)"
    local onnx="$ENGINE_DIR/onnx/fp16"
    if [ -n "$ONNX_DIR" ]; then
        local src="$ONNX_DIR"
        [ -d "$ONNX_DIR/onnx/fp16" ] && src="$ONNX_DIR/onnx/fp16"
        [ -f "$src/manifest.json" ] || die "$EXIT_USAGE" "--onnx-dir: no manifest.json in $src (export with --precision fp16)"
        replace_files "$src" "$onnx"
    elif [ -f "$onnx/manifest.json" ]; then
        note "ONNX graphs present in $onnx"
    elif [ "$DRY_RUN" -eq 1 ] || "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
        # the export needs a torch its graphs are tested with (2.10+; JetPack 6's NVIDIA wheels are 2.3-2.5):
        # say so and what to do before a long export fails (appliance/build/cli.py torch_problem)
        local why=""
        [ "$DRY_RUN" -eq 1 ] || why=$("$VENV/bin/python" -c 'from appliance.build.cli import torch_problem as p; print(p() or "")')
        [ -z "$why" ] || die "$EXIT_FAIL" "$why"
        run "$CLI" engines export --config "$CONFIG" --precision fp16
    else
        die "$EXIT_FAIL" "no ONNX graphs in $onnx and no torch in $VENV to export them: run 'chattts-appliance engines export --precision fp16 --out DIR' on a machine with torch and pass --onnx-dir DIR"
    fi
    # engines build then measures the vocoder look-ahead these plans and this checkpoint need
    # (chattts-appliance calibrate) and records it beside them: the daemon's first audio depends on it
    run "$CLI" engines build --config "$CONFIG" --precision "$PRECISION"
}

# step_aot: the torch CUDA path's decode step compiled ahead of time (chattts-appliance engines
# compile: AOTInductor packages in <engine_dir>/aot, loaded at start by model.compile: auto). It
# needs a PyTorch with Triton to build; JetPack's has none, so on a stock Jetson this is skipped
# and the torch fallback captures plain CUDA graphs (the TensorRT plans above are the fast path).
# Exit 1 from it means the packages were built but fail their load check in a child process (torch
# 2.11's loader crashed on them on an H200): recorded beside them, the daemon runs plain CUDA graphs,
# so the install goes on with a warning; any other failure stops it.
step_aot() {
    say "ahead-of-time compiled torch step in $ENGINE_DIR/aot"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines)"
        return
    fi
    if [ "$DRY_RUN" -eq 1 ]; then
        note "(only where PyTorch has CUDA and Triton: not JetPack's)"
    elif ! "$VENV/bin/python" -c 'import sys, torch; from appliance.engines.torch.step_modes import has_triton; sys.exit(0 if torch.cuda.is_available() and has_triton() else 1)' >/dev/null 2>&1; then
        note "skipped: no PyTorch with CUDA and Triton in $VENV; the torch fallback runs plain CUDA graphs"
        return
    fi
    printf '+ %q engines compile --config %q\n' "$CLI" "$CONFIG"
    [ "$DRY_RUN" -eq 1 ] && return
    local rc=0
    "$CLI" engines compile --config "$CONFIG" || rc=$?
    case "$rc" in
        0) ;;
        1) warn "the compiled step's packages cannot be loaded by this PyTorch (see above): the daemon runs plain CUDA graphs" ;;
        *) die "$EXIT_FAIL" "command failed ($rc): $CLI engines compile --config $CONFIG" ;;
    esac
}

# step_calibrate: the vocoder look-ahead of the backend the daemon will open, where none is
# recorded for it (engines build calibrated the TensorRT plans; this covers the torch CUDA path and
# a CPU box's ONNX graphs exported elsewhere). The daemon would otherwise measure it at its first
# start, before it serves (stream.calibrate_at_start).
# Checks: a look-ahead is recorded for the engines the daemon opens (calibrate --if-missing).
step_calibrate() {
    say "look-ahead calibration of the engines the daemon opens"
    if [ "$SKIP_ENGINES" -eq 1 ]; then
        note "skipped (--skip-engines): the daemon calibrates at its first start"
        return
    fi
    run "$CLI" calibrate --config "$CONFIG" --if-missing
}

# Checks: chattts-appliance health as the service user (UNHEALTHY warns, an error stops).
step_health() {
    say "health check"
    if [ "$SKIP_HEALTH" -eq 1 ]; then
        note "skipped (--skip-health)"
        return
    fi
    printf '+ runuser -u %s -- %q health --config %q\n' "$SERVICE_USER" "$CLI" "$CONFIG"
    [ "$DRY_RUN" -eq 1 ] && return
    local rc=0
    runuser -u "$SERVICE_USER" -- "$CLI" health --config "$CONFIG" || rc=$?
    case "$rc" in
        0) note "healthy" ;;
        1) warn "the health check reports UNHEALTHY (see the table above); the service is installed anyway, tune health.* in $CONFIG" ;;
        *) die "$EXIT_FAIL" "the health check could not run (exit $rc); fix the error above and run this script again" ;;
    esac
}

# step_path: which backend the box will run each network on, and its expected all-in footprint
# (the daemon's own estimate before the load: docs/jetson-memory.md gives the figures per path).
# Checks: the backend model.backend auto picks here, and the memory fit's estimate (a warning when
# the engines are not there yet).
step_path() {
    say "the path this box will run"
    if [ "$DRY_RUN" -eq 1 ]; then
        note "(would print the backend model.backend auto picks here and its expected memory)"
        return
    fi
    "$VENV/bin/python" - "$CONFIG" <<'PY' || warn "could not tell the path yet (export the engines first): docs/jetson-memory.md"
import sys
from appliance.config import load_config
from appliance.daemon.memory import plan_before_load
from appliance.engines.select import choose_backend
from appliance.engines.sizes import plan_sizes
from appliance.ops.footprint import memory_kind
cfg = load_config(sys.argv[1])
backend, why = choose_backend(cfg)
print(f"    backend {backend}: {why}")
try:
    s = plan_sizes(cfg)
    fit = plan_before_load(cfg, s, memory_kind(s.device), 100.0)
    print(f"    expected: about {fit.footprint_mib:.0f} MiB all-in at {fit.max_batch} x {fit.max_seq_len} positions ({fit.action}); {fit.text}")
except Exception as e:   # sizes unknown until the engines exist
    print(f"    expected footprint unknown until the engines are exported ({e}); docs/jetson-memory.md")
PY
}
