#!/usr/bin/env bash
# A short follow-up of gpu_check.sh on a GPU machine (carry .whl): the small workload's sides alternated
# (--repeat 2), the large workload's cohort-cuda-w4 with the host passes in one thread and in the default
# threads, alternated (A, B, A, B), the cohort on CUDA without workers, and the standard workload on CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-ab}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDTIER_CACHE_DIR=/tmp/fedtier-cache
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
B=benchmarks/gpu.py
CELLS=${CELLS:+--cells $CELLS}
timeout 80 $PY $B --workloads small --sides cohort-cpu,cohort-cuda,cohort-auto --rounds 150 --repeat 2 2>&1 | tee "$OUT/small.log"
for threads in 1 0 1 0; do
  extra=(); [ "$threads" = 1 ] && extra=(--host-threads 1)
  echo "== large cohort-cuda-w4, host threads ${threads/0/default}" | tee -a "$OUT/large.log"
  timeout 60 $PY $B --workloads large --sides cohort-cuda-w4 --rounds 1 --breakdown $CELLS "${extra[@]}" 2>&1 | tee -a "$OUT/large.log"
done
echo "== large cohort-cuda (no workers), host threads default" | tee -a "$OUT/large.log"
timeout 60 $PY $B --workloads large --sides cohort-cuda --rounds 1 --breakdown $CELLS 2>&1 | tee -a "$OUT/large.log"
timeout 50 $PY $B --workloads standard --sides cohort-cuda,cohort-auto --rounds 8 --breakdown 2>&1 | tee "$OUT/standard.log"
grep -h "^RATIO\|^  cohort\|^== " "$OUT"/*.log
