#!/bin/bash
# The paired suffix-vs-off runs with the float64 C++ kernels (few-query attention, experts; commit 7e0810f); same commands as the LM-head runs.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
R=bench/spec-results/f64
PY=.venv/bin/python
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
for i in 1 2 3; do
  log "run $i"
  $PY bench/spec_ab.py --set edit --warm-requests 100 --warm-tokens 256 --json $R/edit-warm100-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set agent --warm-requests 100 --warm-tokens 256 --json $R/agent-warm100-$i.json 2>&1 | grep -v Warn | tail -1
done
for i in 1 2; do
  $PY bench/spec_ab.py --set norepeat --json $R/norepeat-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set norepeat --temperature 1 --json $R/norepeat-t1-$i.json 2>&1 | grep -v Warn | tail -1
done
log done
# batch 8, paired by group of 8 (run after the loop above)
$PY bench/spec_ab.py --set norepeat --concurrency 8 --limit 96 --json $R/norepeat-b8-96.json 2>&1 | grep -v Warn | tail -1
$PY bench/spec_ab.py --set norepeat --concurrency 8 --limit 96 --temperature 1 --json $R/norepeat-b8-96-t1.json 2>&1 | grep -v Warn | tail -1
