#!/usr/bin/env bash
# The test suite: CPU tests (Triton interpreter, emulated ranks) everywhere; GPU tests where CUDA GPUs
# are visible. They run as two pytest processes, because the CPU tests switch Triton to its
# interpreter for their whole process. Extra arguments go to both.
source "$(dirname "$0")/env.sh"
"$PY" -m pytest -q -p no:cacheprovider tests/cpu "$@"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
fi
