"""CPU tests run Triton kernels in the interpreter: it must be on before triton is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
