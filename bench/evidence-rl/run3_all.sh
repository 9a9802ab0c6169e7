#!/bin/bash
# issue 56, the whole third measurement: seed pairs one after another (run3.sh), each pair's two final
# checkpoints scored on the held-out set (the 50 tasks of the first and second measurements) while the next
# pair trains. The SFT start itself: heldout_start below (run first, before the arms).
cd /work/main
export OMP_NUM_THREADS=1
heldout() {  # seed -> /tmp/m56h/heldout-sS/heldout.json (greedy, float64)
  .venv/bin/python bench/tiny_heldout.py claims-s$1=/tmp/m56h/claims-s$1/rl/final control-s$1=/tmp/m56h/control-s$1/rl/final \
    --families bugfix --seeds 50 --seed-offset 200 --kinds seen --max-turns 8 --out /tmp/m56h/heldout-s$1 \
    > /tmp/m56h/heldout-s$1.log 2>&1
  echo "heldout s$1 rc=$? $(date +%T)"
}
heldout_start() {
  .venv/bin/python bench/tiny_heldout.py sft-start=/tmp/m56h/sft-start --families bugfix --seeds 50 --seed-offset 200 \
    --kinds seen --max-turns 8 --out /tmp/m56h/heldout-start > /tmp/m56h/heldout-start.log 2>&1
  echo "heldout start rc=$? $(date +%T)"
}
[ -f /tmp/m56h/heldout-start/heldout.json ] || heldout_start
for seed in ${SEEDS:-0 1 2}; do
  [ -d /tmp/m56h/claims-s$seed/rl/final ] && [ -d /tmp/m56h/control-s$seed/rl/final ] || SEEDS=$seed bash bench/evidence-rl/run3.sh
  heldout $seed &
done
wait
