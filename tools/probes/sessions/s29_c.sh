#!/usr/bin/env bash
# Session 29, call C (~8 min): call B's steps (s29_b.sh) on 4b0cb85: call B's kernel with each warp
# of a 1 x N layout copying its own rows of a tile (no CTA barrier a tile) and kQuantRegsMinRows at
# 131072. To $OUT: as s29_b.sh.
exec bash "$(dirname "$0")/s29_b.sh" "$@"
