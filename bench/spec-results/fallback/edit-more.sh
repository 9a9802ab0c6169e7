#!/bin/bash
# Four more paired runs of the edit-heavy replay (warmed as run.sh warms it): one run read 1.875x on the
# decode steps alone where the others read 2.00-2.09x, so the figure is read on the median of all.
cd "$(dirname "$0")/../../.."
export OMP_NUM_THREADS=1
for i in 4 5 6 7; do
  .venv/bin/python bench/spec_ab.py --set edit --warm-requests 100 --warm-tokens 256 --json bench/spec-results/fallback/edit-warm100-$i.json 2>&1 | grep -v Warn | tail -1
done
