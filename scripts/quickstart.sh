#!/usr/bin/env bash
# Command 1 of README.md: set up this machine and run the main job end to end.
#
#   1. installs the system packages (PortAudio for sounddevice) when run as root and missing,
#   2. creates .venv and installs chattts-appliance with the [torch] and [llama] extras (llama.cpp is
#      built from its sdist with this machine's C/C++ compiler for THIS CPU: ~5 min on two cores the
#      first time; LLAMA_CPU=portable builds for every CPU of the architecture, for an image to flash
#      onto other boxes: up to an hour; without a compiler it says so once and the CPU backend is
#      ONNX Runtime),
#   3. uses the real checkpoint in models/chattts if it is there, else writes a RANDOM one
#      (random weights speak noise: the pipeline is real, the voice is not), and points
#      models/local (config.local.yaml's model.path) at it,
#   4. exports the model for the CPU: the GPT as an 8-bit GGUF for llama.cpp (q8_0) beside the
#      Decoder and Vocos for ONNX Runtime, the CPU default; without llama.cpp (no compiler) ONNX
#      graphs with the GPT's weights 8-bit (int8). CPU_PRECISION=q4_k_m (faster, a larger error),
#      int8 or fp32 exports that instead (engines/README.md compares them). The daemon needs no
#      torch at run time (on a machine with a GPU, backend auto picks the GPU path);
#      engines/build/local (config.local.yaml's model.engine_dir) points at that export,
#   5. starts the daemon with config.local.yaml (socket out/appliance.sock), sends one sentence
#      with `chattts-appliance say`, and plays it on the sound device, or writes
#      out/<request-id>.wav when there is none, then stops the daemon (a daemon already running on
#      that socket is used and left running).
#
# Output: one line per step; the details go to out/quickstart.log (install, export) and
# out/daemon.log (the daemon).
#
# Options: --full   generate the full-size random checkpoint (1.2 GB, slow on a CPU) instead of tiny
#          --text T the sentence to speak
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SIZE=tiny
TEXT="你好，今天天气很好，我们去公园散步吧。The time is 9:30, and it is 21 degrees outside."
while [ $# -gt 0 ]; do
  case "$1" in
    --full) SIZE=full ;;
    --text) shift; TEXT=$1 ;;
    -h|--help) sed -n 2,22p "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 64 ;;
  esac
  shift
done

mkdir -p out
LOG=out/quickstart.log
: >"$LOG"
step() { printf '==> %s\n' "$*"; }
# run a step quietly: its output goes to the log; on failure show the end of the log
quiet() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "failed: $*" >&2
    tail -25 "$LOG" >&2
    echo "(full log: $LOG)" >&2
    exit 1
  fi
}

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libportaudio.so.2; then
  step "installing PortAudio (apt)"
  quiet apt-get update -qq
  quiet apt-get install -y -qq libportaudio2
fi

if [ ! -x .venv/bin/python ]; then
  step "creating .venv"
  quiet python3 -m venv .venv
fi
PY=$ROOT/.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
  step "installing PyTorch (${TORCH_SPEC:=torch==2.13.0}; set TORCH_SPEC to choose another build)"
  quiet "$PY" -m pip install -q "$TORCH_SPEC"
fi
# shellcheck source=/dev/null  # scripts/llama_build.sh: llama_install, llama_has_compiler
. scripts/llama_build.sh
export LLAMA_CPU=${LLAMA_CPU:-native}   # a development box: this CPU (scripts/test.sh and the installers: portable)
if "$PY" -c "import llama_cpp" 2>/dev/null || llama_has_compiler; then
  if [ "$LLAMA_CPU" = native ]; then took="about 5 min on two cores"; else took="up to an hour on two cores"; fi
  step "installing chattts-appliance into .venv (llama.cpp builds from source the first time: $took)"
  t0=$SECONDS
  quiet llama_install "$PY" -e ".[torch,llama]"
  step "installed in $((SECONDS - t0)) s; llama.cpp built for $(llama_describe) (LLAMA_CPU=$LLAMA_CPU)"
  CPU_PRECISION=${CPU_PRECISION:-q8_0}
else
  llama_install "$PY" -e ".[torch,llama]" || true   # prints the one message: no C/C++ compiler
  step "installing chattts-appliance into .venv without llama.cpp: the CPU backend is ONNX Runtime"
  quiet "$PY" -m pip install -q -e ".[torch]"
  CPU_PRECISION=int8
fi
CLI=$ROOT/.venv/bin/chattts-appliance

CKPT=models/chattts
SAY_ARGS=()
if [ -f "$CKPT/asset/gpt/config.json" ] && [ ! -f "$CKPT/RANDOM_WEIGHTS" ]; then
  step "using the checkpoint in $CKPT"
  RANDOM_CKPT=0
else
  CKPT=models/random-$SIZE
  RANDOM_CKPT=1
  # random weights rarely draw end-of-sequence: cap each SENTENCE (max_new_tokens is per sentence)
  # at 300 decode steps = 6.4 s of audio
  SAY_ARGS=(--max-new-tokens 300)
  if [ ! -f "$CKPT/asset/gpt/config.json" ]; then
    step "no checkpoint in models/chattts: writing a RANDOM $SIZE checkpoint to $CKPT"
    quiet "$CLI" model random --size "$SIZE" "$CKPT"
  fi
fi
ln -sfn "$(basename "$CKPT")" models/local
NAME=$(basename "$CKPT")
mkdir -p "engines/build/quickstart-$NAME"
ln -sfn "quickstart-$NAME" engines/build/local
step "config.local.yaml: model models/local -> $CKPT, engines engines/build/local -> engines/build/quickstart-$NAME"

if [ "$RANDOM_CKPT" = 1 ]; then
  cat <<WARN

  ****************************************************************************************
  *  RANDOM WEIGHTS: the daemon, the model and the audio path are real, but the voice is  *
  *  noise. For speech put the official checkpoint (2Noise/ChatTTS, CC BY-NC 4.0) in      *
  *  models/chattts (chattts-appliance model fetch models/chattts) and run this again.    *
WARN
  if [ "$SIZE" = tiny ]; then
    cat <<'WARN'
  *  The tiny checkpoint's tokenizer knows only 336 common Chinese characters (and       *
  *  ASCII): other characters are skipped and listed as "could not speak". The full-size *
  *  one (--full) and the real checkpoint know all of them.                               *
WARN
  fi
  echo "  ****************************************************************************************"
  echo
fi

KIND=llama
case "$CPU_PRECISION" in int8 | int4 | fp32) KIND=onnx ;; esac
if [ ! -f "engines/build/local/$KIND/$CPU_PRECISION/manifest.json" ]; then
  step "exporting the model ($CPU_PRECISION) to engines/build/quickstart-$NAME (a minute or two; log: $LOG)"
  t0=$SECONDS
  quiet "$CLI" engines export --config config.local.yaml --precision "$CPU_PRECISION"
  step "exported in $((SECONDS - t0)) s"
fi

SOCK=out/appliance.sock
DAEMON=
if "$CLI" status --config config.local.yaml >/dev/null 2>&1; then
  step "a daemon is already running on $SOCK: using it"
else
  step "starting the daemon: chattts-appliance serve --config config.local.yaml (log: out/daemon.log)"
  "$CLI" serve --config config.local.yaml >out/daemon.log 2>&1 &
  DAEMON=$!
  trap 'kill $DAEMON 2>/dev/null || true; wait $DAEMON 2>/dev/null || true' EXIT
  for _ in $(seq 1 600); do
    "$CLI" status --config config.local.yaml >/dev/null 2>&1 && break
    if ! kill -0 $DAEMON 2>/dev/null; then echo "the daemon exited; see out/daemon.log:" >&2; tail -20 out/daemon.log >&2; exit 1; fi
    sleep 0.5
  done
  "$CLI" status --config config.local.yaml >/dev/null 2>&1 || { echo "the daemon did not answer in time; see out/daemon.log" >&2; exit 1; }
  grep -hoE "inference backend.*|audio output: .*" out/daemon.log | sed 's/^/    /' || true
fi

step "speaking: $TEXT"
"$CLI" say --config config.local.yaml ${SAY_ARGS[@]+"${SAY_ARGS[@]}"} "$TEXT"

echo
echo "==> done. Where the sentence went: the 'done' line above ('-> device:...' or the WAV file in out/)."
echo "    Next, in this directory (every command reads config.local.yaml; source .venv/bin/activate first):"
if [ -n "$DAEMON" ]; then
  echo "      chattts-appliance serve                 # the daemon; Ctrl-C stops it"
else
  echo "      (the daemon you started keeps running on $SOCK)"
fi
if [ "${RANDOM_CKPT:-0}" = 1 ]; then
  echo "      chattts-appliance say --max-new-tokens 300 \"Hello there.\"   # another terminal; random weights rarely end a sentence"
else
  echo "      chattts-appliance say \"Hello there.\"    # in another terminal; also: status, cancel, health --daemon"
fi
