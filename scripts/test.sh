#!/usr/bin/env bash
# The test suite: CPU tests (Triton interpreter, emulated ranks) everywhere; GPU tests where CUDA GPUs
# are visible. They run as two pytest processes, because the CPU tests switch Triton to its
# interpreter for their whole process. Extra arguments go to both.
source "$(dirname "$0")/env.sh"
# With pytest-xdist the CPU tests run in one process per core (TEST_WORKERS, default auto): on two
# cores about 5 minutes (emulated ranks fork from a server that has imported torch once).
workers=()
if [ "${TEST_WORKERS:-auto}" != 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
  # loadgroup: tests that share a module fixture (an xdist_group) run on one worker, which builds it once.
  workers=(-n "${TEST_WORKERS:-auto}" --dist loadgroup)
fi
"$PY" -m pytest -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} tests/cpu "$@"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
fi
