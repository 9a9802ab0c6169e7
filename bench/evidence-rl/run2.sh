#!/bin/bash
# issue 56: the evidence penalty credited to the claim tokens (train/claim_credit.py, the default) against a
# control without the term; 3 seeds, the two arms of a seed side by side (1 torch thread each).
# Second measurement: RL from the built-in model (the defaults). Third: START=/tmp/m56h/sft-start OUT=/tmp/m56h
# (run3.sh), the honest-closing SFT start made by honest_teacher.py + composer-train sft.
# Fourth: START=/tmp/m56w/sft-w3 OUT=/tmp/m56w (run2_all.sh), a weaker start: honest_teacher.py --honest-share 0.2.
# Fifth: the fourth's start with a larger claim weight, CLAIMS_ARGS="--reward evidence_claim_weight=10", OUT=/tmp/m56x
# holding links to the fourth's control arms (same start, seeds and steps): an arm whose final checkpoint exists
# is not trained again.
cd "$(dirname "$0")/../.."
START=${START:-serve/builtin/composer-tiny}
OUT=${OUT:-/tmp/m56}
COMMON="--families bugfix,find-def --sizes small --train-seeds 500 --model-families bugfix --eval-seeds 1 --max-turns 8 --rl-steps ${STEPS:-6} --group-size 8 --groups-per-step 4 --rl-from $START"
export OMP_NUM_THREADS=1
mkdir -p "$OUT"
for seed in ${SEEDS:-0 1 2}; do
  for arm in claims control; do
    out=$OUT/$arm-s$seed
    extra=""
    [ -d $out/rl/final ] && continue
    [ $arm = control ] && extra="--reward evidence_unsupported=0 --reward evidence_contradicted=0"
    [ $arm = claims ] && extra="${CLAIMS_ARGS:-}"
    echo "=== $arm seed $seed $(date +%T)"
    timeout 1800 .venv/bin/composer-train recipe tiny --out $out --seed $seed $COMMON $extra > $out.log 2>&1 &
  done
  wait
  echo "done seed $seed $(date +%T)"
done
