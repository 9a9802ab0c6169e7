#!/bin/bash
# issue 50 measurements after the embedder training: quiet machine, one at a time
cd /work/main
export OMP_NUM_THREADS=1
R=bench/spec-results/prefill
mkdir -p $R
PY=.venv/bin/python
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
log start
$PY bench/spec_ab.py --set agent --warm-requests 100 --warm-tokens 256 --json $R/ab-agent-warm100.json 2>&1 | grep -v Warn | tail -1
$PY bench/spec_ab.py --set edit --warm-requests 100 --warm-tokens 256 --json $R/ab-edit-warm100.json 2>&1 | grep -v Warn | tail -1
log "default warm-up"
$PY bench/spec_ab.py --set agent --json $R/ab-agent.json 2>&1 | grep -v Warn | tail -1
$PY bench/spec_ab.py --set edit --json $R/ab-edit.json 2>&1 | grep -v Warn | tail -1
log "prefill drafts against none (same method)"
$PY bench/spec_ab.py --set agent --against no-prefill --warm-requests 100 --warm-tokens 256 --json $R/ab-agent-vs-noprefill.json 2>&1 | grep -v Warn | tail -1
$PY bench/spec_ab.py --set edit --against no-prefill --warm-requests 100 --warm-tokens 256 --json $R/ab-edit-vs-noprefill.json 2>&1 | grep -v Warn | tail -1
log "norepeat"
$PY bench/spec_ab.py --set norepeat --json $R/ab-norepeat.json 2>&1 | grep -v Warn | tail -1
$PY bench/spec_ab.py --set norepeat --temperature 1 --json $R/ab-norepeat-t1.json 2>&1 | grep -v Warn | tail -1
log "trio runs"
$PY bench/spec.py --sets edit agent --temperatures 0 --concurrency 1 --repeat 3 --warm-requests 100 --warm-tokens 256 --out $R/trio-warm100 > $R/trio-warm100.log 2>&1
grep -E "T=0 c=" $R/trio-warm100.log
$PY bench/spec.py --sets norepeat --temperatures 0 1 --concurrency 1 8 --repeat 3 --out $R/norepeat > $R/norepeat.log 2>&1
grep -E "T=[01] c=" $R/norepeat.log
log done
