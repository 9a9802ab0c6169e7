#!/bin/bash
# issue 56, the whole third measurement: run2_all.sh from the honest-closing SFT start (scored first too).
START=${START:-/tmp/m56h/sft-start} OUT=${OUT:-/tmp/m56h} exec bash "$(dirname "$0")/run2_all.sh"
