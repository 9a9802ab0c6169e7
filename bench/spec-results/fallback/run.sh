#!/bin/bash
# The paired suffix-vs-off runs after the one-token fallback (where no pair of the context's last tokens
# occurs before, what followed the last token alone in the scope's recent outputs), on the Intel Xeon VM of
# 2026-11-29's night.
exec "$(dirname "$0")/../../spec_paired.sh" bench/spec-results/fallback --batch8
