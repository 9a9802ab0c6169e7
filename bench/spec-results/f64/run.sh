#!/bin/bash
# The paired suffix-vs-off runs with the float64 C++ kernels (few-query attention, experts; commit 7e0810f).
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/f64 --batch8
