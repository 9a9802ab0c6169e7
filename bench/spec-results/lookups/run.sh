#!/bin/bash
# The paired suffix-vs-off runs after the planner's cheaper look-ups (ec085a7: plan ~124 -> 67-100 us a
# step, the same drafts) and the expert kernel's one widened copy per expert (cebe05b), on the Intel Xeon
# VM of 2026-11-29's night.
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/lookups --batch8
