#!/bin/bash
# The paired suffix-vs-off runs after the LM-head change (commit cd74a7d); same commands as the prefill runs.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
R=bench/spec-results/lmhead
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
