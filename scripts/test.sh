#!/usr/bin/env bash
# The test suite: CPU tests (Triton interpreter, emulated ranks) everywhere; GPU tests where CUDA GPUs
# are visible (they skip cleanly otherwise). Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
exec "$PY" -m pytest -q -p no:cacheprovider tests "$@"
