#!/bin/bash
# issue 56 measurement: RL from the built-in model with and without the evidence term, 3 seeds
cd /work/main && . .venv/bin/activate
COMMON="--families bugfix,find-def --sizes small --train-seeds 500 --model-families bugfix --eval-seeds 30 --max-turns 8 --rl-steps 8 --group-size 8 --groups-per-step 4 --rl-from serve/builtin/composer-tiny"
for seed in 0 1; do  # 2 seeds were run (time); seed 2 was not
  for arm in evidence control; do
    out=/tmp/m56/$arm-s$seed
    extra=""
    [ $arm = control ] && extra="--reward evidence_unsupported=0 --reward evidence_contradicted=0"
    if [ -d /tmp/m56/evidence-s0/eval-sft ] && [ ! -d $out/eval-sft ]; then mkdir -p $out && cp -r /tmp/m56/evidence-s0/eval-sft $out/; fi
    echo "=== $arm seed $seed $(date +%T)"
    timeout 1200 composer-train recipe tiny --out $out --seed $seed $COMMON $extra > $out.log 2>&1
    echo "rc=$? $(date +%T)"; tail -2 $out.log
  done
done
