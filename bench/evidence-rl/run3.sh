#!/bin/bash
# issue 56, third measurement: run2.sh from the honest-closing SFT start (/tmp/m56h/sft, built by
# honest_teacher.py + composer-train sft): the claim-token credit (the default) against a control without
# the evidence term; the two arms of a seed side by side (1 torch thread each).
cd /work/main
START=${START:-/tmp/m56h/sft-start}
COMMON="--families bugfix,find-def --sizes small --train-seeds 500 --model-families bugfix --eval-seeds 1 --max-turns 8 --rl-steps ${STEPS:-6} --group-size 8 --groups-per-step 4 --rl-from $START"
export OMP_NUM_THREADS=1
for seed in ${SEEDS:-0 1 2}; do
  for arm in claims control; do
    out=/tmp/m56h/$arm-s$seed
    extra=""
    [ $arm = control ] && extra="--reward evidence_unsupported=0 --reward evidence_contradicted=0"
    echo "=== $arm seed $seed $(date +%T)"
    timeout 1800 .venv/bin/composer-train recipe tiny --out $out --seed $seed $COMMON $extra > $out.log 2>&1 &
  done
  wait
  echo "done seed $seed $(date +%T)"
done
