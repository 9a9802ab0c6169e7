#!/bin/bash
# issue 56, a whole measurement: seed pairs one after another (run2.sh), each pair's two final checkpoints
# scored on the held-out set (the same 50 tasks in every measurement; greedy, float64) while the next pair
# trains. START/OUT as in run2.sh; a start other than the built-in model is scored too, first.
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=1
export START=${START:-serve/builtin/composer-tiny} OUT=${OUT:-/tmp/m56}
mkdir -p "$OUT"
score() {  # name=checkpoint ... -> $OUT/heldout-<tag>/heldout.json
  local tag=$1; shift
  .venv/bin/python bench/tiny_heldout.py "$@" --families bugfix --seeds 50 --seed-offset 200 --kinds seen \
    --max-turns 8 --out $OUT/heldout-$tag > $OUT/heldout-$tag.log 2>&1
  echo "heldout $tag rc=$? $(date +%T)"
}
if [ "$START" != serve/builtin/composer-tiny ] && [ ! -f $OUT/heldout-start/heldout.json ]; then
  score start sft-start=$START
fi
for seed in ${SEEDS:-0 1 2}; do
  [ -d $OUT/claims-s$seed/rl/final ] && [ -d $OUT/control-s$seed/rl/final ] || SEEDS=$seed bash bench/evidence-rl/run2.sh
  score s$seed claims-s$seed=$OUT/claims-s$seed/rl/final control-s$seed=$OUT/control-s$seed/rl/final &
done
wait
