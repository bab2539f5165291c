#!/usr/bin/env bash
# The main job: with two or more CUDA GPUs, the benchmark (`tileweave bench`, results under
# bench/results/); without, the CPU demo of the fused ops on emulated ranks. Extra arguments go to it.
source "$(dirname "$0")/env.sh"
exec "$PY" -m tileweave "$@"
