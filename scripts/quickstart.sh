#!/usr/bin/env bash
# Command 1 of README.md: set up this machine and run the main job end to end.
#
#   1. installs the system packages (PortAudio for sounddevice) when run as root and missing,
#   2. creates .venv and installs chattts-appliance with the [torch] extra,
#   3. uses the real checkpoint in models/chattts if it is there, else writes a RANDOM one
#      (random weights speak noise: the pipeline is real, the voice is not),
#   4. exports the model to ONNX (int8 weight-only) so the daemon runs on ONNX Runtime, the CPU
#      default (no torch at run time; on a machine with a GPU, backend auto picks the GPU path),
#   5. starts the daemon on a UNIX socket in out/, sends one sentence with `chattts-appliance say`,
#      and plays it on the sound device, or writes out/<request-id>.wav when there is none,
#   6. stops the daemon.
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
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 64 ;;
  esac
  shift
done

say() { printf '\n==> %s\n' "$*"; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! ldconfig -p | grep -q libportaudio.so.2; then
  say "installing PortAudio (apt)"
  apt-get update -qq && apt-get install -y -qq libportaudio2 >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
PY=$ROOT/.venv/bin/python
if ! "$PY" -c "import torch" 2>/dev/null; then
  say "installing PyTorch (${TORCH_SPEC:=torch==2.13.0}; set TORCH_SPEC to choose another build)"
  "$PY" -m pip install -q "$TORCH_SPEC"
fi
say "installing chattts-appliance"
"$PY" -m pip install -q -e ".[torch]"
CLI=$ROOT/.venv/bin/chattts-appliance

mkdir -p out
CKPT=models/chattts
MAXTOK=2048
if [ -f "$CKPT/asset/gpt/config.json" ] && [ ! -f "$CKPT/RANDOM_WEIGHTS" ]; then
  say "using the checkpoint in $CKPT"
else
  CKPT=models/random-$SIZE
  MAXTOK=300   # random weights rarely emit end-of-sequence: cap the utterance at 6.4 s
  if [ ! -f "$CKPT/asset/gpt/config.json" ]; then
    say "no checkpoint in models/chattts: writing a RANDOM $SIZE checkpoint to $CKPT"
    "$CLI" model random --size "$SIZE" "$CKPT"
  fi
  cat <<'WARN'

  ****************************************************************************************
  *  RANDOM WEIGHTS: the daemon, the model and the audio path are real, but the voice is  *
  *  noise. For speech put the official checkpoint (2Noise/ChatTTS, CC BY-NC 4.0) in      *
  *  models/chattts (chattts-appliance model fetch models/chattts) and run this again.    *
  ****************************************************************************************
WARN
fi

ENGINES=engines/build/quickstart-$(basename "$CKPT")
cat > out/quickstart.yaml <<YAML
model: {path: ../$CKPT, backend: auto, engine_dir: ../$ENGINES}
synthesis: {max_new_tokens: $MAXTOK, seed: 7}
audio: {output: auto, wav_dir: .}
service: {socket: quickstart.sock}
YAML

if [ ! -f "$ENGINES/onnx/int8/manifest.json" ]; then
  say "exporting ONNX graphs (int8 weight-only) to $ENGINES"
  "$CLI" engines export --config out/quickstart.yaml --precision int8
fi

say "starting the daemon (log: out/daemon.log)"
"$CLI" serve --config out/quickstart.yaml >out/daemon.log 2>&1 &
DAEMON=$!
trap 'kill $DAEMON 2>/dev/null || true; wait $DAEMON 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  [ -S out/quickstart.sock ] && break
  if ! kill -0 $DAEMON 2>/dev/null; then echo "the daemon exited; see out/daemon.log:" >&2; tail -20 out/daemon.log >&2; exit 1; fi
  sleep 0.5
done
[ -S out/quickstart.sock ] || { echo "the daemon did not open its socket in time; see out/daemon.log" >&2; exit 1; }
grep -E "inference backend|audio output" out/daemon.log || true

say "speaking: $TEXT"
"$CLI" say --socket out/quickstart.sock "$TEXT"
say "done. Daemon log: out/daemon.log; WAV files (if no sound device): out/*.wav"
ls -l out/*.wav 2>/dev/null || true
