#!/bin/bash
cd /work/main
export OMP_NUM_THREADS=1
R=bench/spec-results/prefill
PY=.venv/bin/python
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
for i in 2 3; do
  log "repeat $i"
  $PY bench/spec_ab.py --set agent --warm-requests 100 --warm-tokens 256 --json $R/ab-agent-warm100-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set edit --warm-requests 100 --warm-tokens 256 --json $R/ab-edit-warm100-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set agent --json $R/ab-agent-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set norepeat --temperature 1 --json $R/ab-norepeat-t1-$i.json 2>&1 | grep -v Warn | tail -1
  $PY bench/spec_ab.py --set norepeat --json $R/ab-norepeat-$i.json 2>&1 | grep -v Warn | tail -1
done
log done
