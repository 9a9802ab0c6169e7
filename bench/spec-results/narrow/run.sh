#!/bin/bash
# The paired suffix-vs-off runs after the float64 kernels' rewrite (experts read as exact bfloat16 copies
# with eight weight rows' dots at a time, projections/router/LM head through linear_f64, attention keys
# transposed in registers; commits e5f6df2-cc2eb50), on the Intel Xeon VM of 2026-11-29's evening.
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/narrow --batch8
