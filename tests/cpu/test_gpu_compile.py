"""Every kernel launch that tileweave's ops make compiles for an H200 (sm_90), without a GPU.

The CPU tests run the kernels in Triton's interpreter, which compiles nothing: code that the GPU
compiler refuses (an int argument of 1 that Triton passes as a constexpr, a tile that needs more shared
memory than sm_90 has, a ``tl.dot`` of shapes or dtypes it does not take) would surface only on a GPU.
Here the launches of a set of op calls on emulated ranks are recorded (``support.launches``) and each is
compiled as the GPU's JIT would specialise it (``support.gpu_compile``; through ptxas for every Gluon
kernel and one form of each ``tl`` kernel, the rest to PTX), in a process without the interpreter. The
calls include ones with the configs and tiles that the launchers pick on an H200, which compile in bf16
(the interpreter ran them in fp16: it refuses bf16).
"""

import json
import os
import subprocess
import sys

import pytest

import tileweave
from tileweave.testing.emulated import run_ranks
from support import launches

KERNELS = launches.library_kernels()
ASYNC_MMA = ("tileweave.kernels.gemm_fp8_sm90:fp8_gemm_sm90_kernel",
             "tileweave.kernels.gemm_fp8_sm90:fp8_gemm_sm90_ws_kernel",
             "tileweave.kernels.gemm_fp8_sm90_halves:fp8_gemm_sm90_halves_kernel",
             "tileweave.kernels.gemm_fp8_sm90_halves:fp8_gemm_sm90_staged_kernel")
"""Kernels built to keep one warp-group MMA in flight while they read another's product: ptxas must
neither serialise their MMAs nor spill."""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """``{"recorded": kernels launched, "results": one dict per distinct compiled kernel}``."""
    recorded = [launch for per_rank in run_ranks(2, launches.op_launches) for launch in per_rank]
    # What a GPU launches: a launch whose launcher picks other tiles off the interpreter is compiled with
    # the H200's tiles only (the interpreter's are never compiled on a GPU; also where a call given the
    # H200's configs launches such a kernel too), and the H200's launches in the dtype the GPU runs them in
    # (the interpreter ran them in fp16).
    chosen = []
    for launch in recorded:
        variant = launches.h200_variant(launch)
        on_gpu = variant if variant is not None else launch if launch.h200 else None
        chosen.append(launch if on_gpu is None else on_gpu.retyped("float16", "bfloat16"))
    folder = tmp_path_factory.mktemp("gpu_compile")
    path = folder / "launches.json"
    path.write_text(json.dumps([launch.to_json() for launch in chosen]))
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    src = os.path.dirname(os.path.dirname(tileweave.__file__))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, tests, env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(folder / "cache")  # compiled afresh, so that ptxas reports on each it assembles
    done = subprocess.run([sys.executable, "-m", "support.gpu_compile", str(path), str(min(2, os.cpu_count() or 1))],
                          env=env, capture_output=True, text=True, timeout=900)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert results and done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    spills = [f"{r['spill_bytes']:8d}  {r['launch'].split('(')[0]} from {r['origin']}" for r in results
              if r.get("spill_bytes")]
    print("ptxas spills (bytes stored and loaded):", *spills, sep="\n")
    return {"recorded": {launch.kernel for launch in recorded}, "results": results}


def test_kernels_compile_for_the_gpu(compiled):
    # One test over every kernel, not one per kernel: under pytest-xdist each worker that ran one of
    # them would compile the whole set again.
    problems = []
    for kernel in KERNELS:
        if kernel not in compiled["recorded"]:
            problems.append(f"no call of support.launches.op_launches launches {kernel}: add one that does")
            continue
        results = [r for r in compiled["results"] if r["kernel"] == kernel]
        if not results:
            problems.append(f"the compiler reported nothing on {kernel}")
        failures = [f"{r['launch']}\n  from: {r['origin']}\n  {r['error']}" for r in results if not r["ok"]]
        if failures:
            problems.append(f"{kernel}: {len(failures)} of {len(results)} launches do not compile for sm_90:\n\n"
                            + "\n\n".join(failures))
        if kernel in ASYNC_MMA:
            problems += [f"{r['launch']}\n  from: {r['origin']}\n  ptxas serialised its MMAs" for r in results
                         if r.get("mma_serialized")]
            problems += [f"{r['launch']}\n  from: {r['origin']}\n  spills {r['spill_bytes']} bytes" for r in results
                         if r.get("spill_bytes")]
    assert not problems, "\n\n".join(problems)
