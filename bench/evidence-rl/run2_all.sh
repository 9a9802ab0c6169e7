#!/bin/bash
# issue 56, the whole second measurement: seed pairs one after another (run2.sh), each pair's two final
# checkpoints scored on the held-out set while the next pair trains.
cd /work/main
export OMP_NUM_THREADS=1
heldout() {  # seed -> bench/evidence-rl/heldout2-sS.json (greedy, float64, the 50 tasks of the first measurement)
  .venv/bin/python bench/tiny_heldout.py claims-s$1=/tmp/m56/claims-s$1/rl/final control-s$1=/tmp/m56/control-s$1/rl/final \
    --families bugfix --seeds 50 --seed-offset 200 --kinds seen --max-turns 8 --out /tmp/m56/heldout-s$1 \
    > /tmp/m56/heldout-s$1.log 2>&1
  echo "heldout s$1 rc=$? $(date +%T)"
}
for seed in ${SEEDS:-0 1 2}; do
  [ -d /tmp/m56/claims-s$seed/rl/final ] && [ -d /tmp/m56/control-s$seed/rl/final ] || SEEDS=$seed bash bench/evidence-rl/run2.sh
  heldout $seed &
done
wait
