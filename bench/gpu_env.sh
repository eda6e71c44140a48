#!/usr/bin/env bash
# Sourced by the bench/gpu_*.sh sessions: wheels from .whl/ (packages the GPU machine's image
# lacks), unbuffered Python, the random full-size checkpoint in $CKPT, $OUT, and run() that runs
# one step with a time limit into $OUT/NAME.log and prints its summary lines.
# shellcheck disable=SC2034  # CKPT is for the sourcing scripts
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
CKPT=/tmp/ckpt_full
[ -d $CKPT/asset ] || PYTHONPATH=${PYTHONPATH:-}:$PWD python3 -c \
  "from appliance.build.random_ckpt import write_random_checkpoint as w; w('$CKPT','full',seed=0)" > /dev/null 2>&1
run() { local name=$1 t=$2; shift 2; echo "== $name"; timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep '^\[' "$OUT/$name.log" | tail -8; }
