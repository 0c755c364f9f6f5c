#!/usr/bin/env bash
# Session 25, fourth call (~5 min): where the ~1B B=8 steps' time goes, kernel by kernel, ours beside
# the JAX peer (fp16 ctx 2k: 8% behind it; int4 ctx 1k), at the landed code.
# To $OUT: prepare.log, profile_1.json, profile_2.json, profile.log.
set -uo pipefail
bash "$(dirname "$0")/../e2e_profile_cases.sh" "--models 1b --weights fp16 --batch 8 --ctx 2048" \
  "--models 1b --weights int4 --batch 8 --ctx 1024"
