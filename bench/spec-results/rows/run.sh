#!/bin/bash
# The paired suffix-vs-off runs after the verify step's row costs were cut (host sampling by row, the
# few-query attention kernel's register sums and prefetch, projections as W·xᵀ; commits 1d40299-f4846ba).
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/rows --batch8
