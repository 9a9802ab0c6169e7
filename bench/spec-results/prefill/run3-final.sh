#!/bin/bash
cd /work/main
export OMP_NUM_THREADS=1
R=bench/spec-results/prefill
PY=.venv/bin/python
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
for i in 1 2; do
  log "final $i"
  $PY bench/spec_ab.py --set norepeat --temperature 1 --json $R/final-norepeat-t1-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set norepeat --json $R/final-norepeat-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set agent --warm-requests 100 --warm-tokens 256 --json $R/final-agent-warm100-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set edit --warm-requests 100 --warm-tokens 256 --json $R/final-edit-warm100-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set agent --json $R/final-agent-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set edit --json $R/final-edit-$i.json 2>&1 | grep -v Warn | tail -1
done
log "batch 8, text that never repeats"
$PY bench/spec.py --sets norepeat --temperatures 0 1 --concurrency 8 --repeat 5 --out $R/final-norepeat-c8 > $R/final-norepeat-c8.log 2>&1
grep -E "T=[01] c=" $R/final-norepeat-c8.log
log done
