#!/usr/bin/env bash
# CI step after scripts/test.sh: the ONNX export under the oldest torch pyproject.toml allows (its
# floor, 'torch>=X.Y' -> torch==X.Y.0), in a venv of its own: `engines export --precision fp16`
# (TensorRT's graphs, what install_jetson.sh exports) of a random tiny checkpoint, then the export
# tests (fp32, int8, the static-cache GPT graph, the vocoder stream graphs against torch).
#
# PyPI's Linux torch wheel brings NVIDIA's CUDA libraries (about 4 GB to fetch, 6.5 GB installed;
# pip keeps no copy of them here), so the venv is kept between runs outside the checkout:
# ${TORCH_FLOOR_VENV:-~/.cache/chattts-appliance/venv-torch-X.Y.0}. First run on a machine: about
# 5 min to install; afterwards only the export and the tests (bench/HISTORY.md: the test suite's time).
set -euo pipefail
cd "$(dirname "$0")/.."

FLOOR=$(sed -n 's/^torch = \["torch>=\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$FLOOR" ] || { echo "no 'torch>=X.Y' in pyproject.toml's torch extra" >&2; exit 1; }
case "$FLOOR" in *.*.*) WANT=$FLOOR ;; *) WANT=$FLOOR.0 ;; esac
VENV=${TORCH_FLOOR_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/chattts-appliance/venv-torch-$WANT}
PY=$VENV/bin/python

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9    # one checkout at a time installs into it and runs from it

echo "==> torch $WANT (pyproject.toml's floor) in $VENV"
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$WANT')" 2>/dev/null \
  || "$PY" -m pip install -q "torch==$WANT"
"$PY" -m pip install -q -e ".[torch,dev]"   # this checkout (editable) and its dependencies

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m appliance model random --size tiny "$tmp/ckpt" >/dev/null
"$PY" -m appliance engines export --checkpoint "$tmp/ckpt" --precision fp16 --out "$tmp/engines"
"$PY" -m pytest -q -ra -p no:cacheprovider tests/test_engines_onnx.py tests/test_model_stream.py
