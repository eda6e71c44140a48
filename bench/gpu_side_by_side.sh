#!/usr/bin/env bash
# One GPU session: CUDA tests, then bench/bench_gpu.py on an earlier tree (a checkout in .old/,
# e.g. `git archive REV | tar -x -C .old`; REV since the one-generation-path redesign: the bench
# calls this tree's runner API) and on this tree, in turns, on the same random full-size checkpoint. Writes everything under $OUT (or out/gpu_side_by_side).
# Usage (device machine, wheels from .whl/ for the packages its image lacks):
#   bash bench/gpu_side_by_side.sh [plain,compiled]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-out/gpu_side_by_side}
# shellcheck source=bench/gpu_env.sh
. bench/gpu_env.sh
[ "${SKIP_TESTS:-0}" = 1 ] || {
echo "== CUDA tests"
APPLIANCE_FULL_CKPT=$CKPT PYTHONPATH=${PYTHONPATH:-}:$PWD timeout 240 python3 -m pytest -p no:cacheprovider -q -rA \
  tests/test_gpu_cuda.py tests/test_model_cuda.py tests/test_same_seed.py tests/test_gpu_loop.py > "$OUT/pytest_cuda.log" 2>&1
tail -3 "$OUT/pytest_cuda.log"
}
for v in ${VARIANTS//,/ }; do
  for tree in old new; do
    if [ "$tree" = old ]; then [ -d .old/appliance ] || continue; export APPLIANCE_TREE=$PWD/.old; label="earlier tree (.old)"
    else unset APPLIANCE_TREE; label="this tree"; fi
    echo "== $tree $v"
    sections=ours
    [ "$v" = plain ] && sections=ours,copies
    timeout 200 python3 bench/bench_gpu.py --out "$OUT/$tree-$v" --ckpt $CKPT --variants "$v" --compiled-max-seq 512 \
      --sections "$sections" --label "$label" \
      > "$OUT/$tree-$v.log" 2>&1
    grep '^\[' "$OUT/$tree-$v.log" | tail -8
  done
done
