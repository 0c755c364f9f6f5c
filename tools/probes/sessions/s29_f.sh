#!/usr/bin/env bash
# Session 29, call F (~5 min): call D's steps (s29_d.sh) on the register kernel with a score tile's
# k steps in two MMA chains (d <= 128; a56d369+wip, reverted), against call D's run of feb0275.
exec bash "$(dirname "$0")/s29_d.sh" "$@"
