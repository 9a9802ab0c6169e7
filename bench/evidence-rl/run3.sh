#!/bin/bash
# issue 56, third measurement's arms: run2.sh from the honest-closing SFT start.
START=${START:-/tmp/m56h/sft-start} OUT=${OUT:-/tmp/m56h} exec bash "$(dirname "$0")/run2.sh"
