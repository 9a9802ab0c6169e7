#!/bin/bash
# Issue 50's paired suffix-vs-off runs (bench/spec_ab.py; BENCHMARKS, speculative decoding), their JSON into
# DIR: the edit and agent replays three times each (warmed on 100 requests of the next set, 256 tokens
# each), text that never repeats twice at T=0 and T=1, and with --batch8 that text at batch 8 too (paired by
# group of 8). Usage: bench/spec_paired.sh DIR [--batch8]
set -o pipefail
cd "$(dirname "$0")/.."
R=${1:?usage: bench/spec_paired.sh DIR [--batch8]}
export OMP_NUM_THREADS=1
PY=.venv/bin/python
log() { echo "[$(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)] $*"; }
ab() { $PY bench/spec_ab.py "$@" 2>&1 | grep -v Warn | tail -1; }
mkdir -p "$R"
for i in 1 2 3; do
  log "run $i"
  ab --set edit --warm-requests 100 --warm-tokens 256 --json "$R/edit-warm100-$i.json"
  ab --set agent --warm-requests 100 --warm-tokens 256 --json "$R/agent-warm100-$i.json"
done
for i in 1 2; do
  ab --set norepeat --json "$R/norepeat-$i.json"
  ab --set norepeat --temperature 1 --json "$R/norepeat-t1-$i.json"
done
if [ "$2" = "--batch8" ]; then
  ab --set norepeat --concurrency 8 --limit 96 --json "$R/norepeat-b8-96.json"
  ab --set norepeat --concurrency 8 --limit 96 --temperature 1 --json "$R/norepeat-b8-96-t1.json"
fi
log done
