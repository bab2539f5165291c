# Sourced by main.sh and test.sh: chooses the Python to run with and puts src/ on its path.
#
# A machine whose python3 already has torch and triton and sees a CUDA GPU (the GPU images, which
# cannot install from the network) runs as it is. Anywhere else a project environment .venv is made
# once, with the CPU build of torch, triton and numpy<2.4 (Triton's interpreter fails on range() with
# numpy 2.4), and this package installed into it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if python3 -c "import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  PY=python3
else
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  PY=.venv/bin/python
  if ! "$PY" -c "import torch, triton, numpy, pytest" 2>/dev/null; then
    echo "setting up .venv (CPU torch 2.13.0, triton 3.6.0, numpy<2.4, pytest)..." >&2
    "$PY" -m pip install -q --disable-pip-version-check "torch==2.13.0" "triton==3.6.0" "numpy<2.4" \
      pytest tqdm matplotlib >&2
  fi
  # Test-only: the reference that the Hugging Face checkpoint tests compare against (tests/cpu/test_models.py);
  # the library itself reads checkpoints without them.
  "$PY" -c "import transformers, safetensors" 2>/dev/null \
    || "$PY" -m pip install -q --disable-pip-version-check "transformers==5.18.0" safetensors >&2
  # Optional: spreads the CPU tests over the cores (scripts/test.sh); the tests run without it.
  "$PY" -c "import xdist" 2>/dev/null \
    || "$PY" -m pip install -q --disable-pip-version-check pytest-xdist >/dev/null 2>&1 || true
  # The package itself, editable, so that `tileweave` works as a command in .venv (.venv/bin/tileweave).
  # Not into a .venv linked from elsewhere: that environment belongs to another checkout.
  if [ ! -L .venv ] && ! "$PY" -c "import importlib.metadata as m; m.distribution('tileweave')" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps -e . >&2
  fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
