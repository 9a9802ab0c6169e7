#!/bin/bash
# The paired suffix-vs-off runs after the LM-head change (commit cd74a7d).
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/lmhead
