"""Compile recorded kernel launches (``support.launches``) for an H200 (sm_90) without a GPU: Triton's
front end, its CUDA backend and ptxas all run on the CPU.

Each launch is specialised by Triton's own JIT code, as ``kernel[grid](...)`` on a GPU would: the
binder that ``JITFunction.run`` builds turns the arguments into a signature (an int equal to 1 becomes
a constexpr, ints and aligned pointers divisible by 16 get ``tt.divisibility``, bools are i1, floats
fp32, None constexpr, ``do_not_specialize`` honoured), and the launch options are parsed by the CUDA
backend. Launches that the JIT would compile once are compiled once.

    PYTHONPATH=src:tests python -m support.gpu_compile launches.json [jobs]   # a JSON line per kernel

Run it in a process without ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels' JIT objects).
Pointing ``TRITON_CACHE_DIR`` at an empty folder compiles everything afresh, so that ptxas reports the
registers and spills of each kernel. ptxas runs on every Gluon kernel (their MMA pipelines are what its
report checks) and on the first compiled form of each ``tl`` kernel; the others stop at PTX (ptxas is
about a third of the time, and Triton's errors come before it), and report no registers or spills.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import multiprocessing
import re
import sys

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from support.launches import TRITON_VERSIONS, Launch, Tensor

TARGET = GPUTarget("cuda", 90, 32)
"""An H200 (or H100): compute capability 9.0, warps of 32."""
MAX_SHARED = 232448
"""Shared memory a program may use on sm_90 (227 KB, ``sharedMemPerBlockOptin``); Triton raises
``OutOfResources`` when it loads a kernel that needs more, which only a GPU run would show."""


class _Pointer:
    """What Triton's binder reads of a tensor: its dtype and its address."""

    def __init__(self, t: Tensor) -> None:
        self.dtype = getattr(torch, t.dtype)
        self._address = 0 if t.aligned else 8

    def data_ptr(self) -> int:
        return self._address


def describe(launch: Launch, fn: JITFunction) -> str:
    """``name(arg=value, ...)`` with tensors as ``*dtype``, followed by ``unaligned`` where the address
    is not a multiple of 16."""
    show = lambda v: f"*{v.dtype}{'' if v.aligned else ' unaligned'}" if isinstance(v, Tensor) else repr(v)
    named = [f"{name}={show(v)}" for name, v in zip(fn.arg_names, launch.args)]
    named += [f"{name}={show(v)}" for name, v in launch.kwargs]
    return f"{fn.__name__}({', '.join(named)})"


def _ptxas_report(log: str) -> dict:
    registers = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(registers[-1]) if registers else None,
            "spill_bytes": sum(int(s) + int(l) for s, l in spills) if spills else None,
            # ptxas's C7514: it made every warp-group MMA of the kernel wait for the previous one.
            "mma_serialized": "wgmma.mma_async instructions are serialized" in log}


class Compiler:
    """Compiles launches for ``TARGET``."""

    def __init__(self) -> None:
        self.backend = make_backend(TARGET)
        self._binders: dict[str, object] = {}

    def bind(self, launch: Launch) -> tuple:
        """``(key, fn, kwargs, bound, specialization, options)``: the launch bound as ``JITFunction.run``
        binds it; launches with one key are one compiled kernel (the key of the JIT's cache)."""
        module, attr = launch.kernel.split(":")
        fn = getattr(importlib.import_module(module), attr)
        if not isinstance(fn, JITFunction):
            raise RuntimeError(f"{launch.kernel} is a {type(fn).__name__}, not a JITFunction: is TRITON_INTERPRET set?")
        binder = self._binders.get(launch.kernel)
        if binder is None:
            binder = self._binders[launch.kernel] = create_function_from_signature(fn.signature, fn.params,
                                                                                  self.backend)
        args = [_Pointer(v) if isinstance(v, Tensor) else v for v in launch.args]
        kwargs = {name: _Pointer(v) if isinstance(v, Tensor) else v for name, v in launch.kwargs}
        # What JITFunction.run adds before binding.
        kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        bound, specialization, options = binder(*args, **kwargs)
        key = launch.kernel + compute_cache_key({}, specialization, options)
        return key, fn, kwargs, bound, specialization, options

    def compile(self, launch: Launch, assemble: bool = True) -> dict:
        """The outcome of compiling ``launch``: ``ok``, ``error``, ``shared`` bytes, and ptxas's
        ``registers`` and ``spill_bytes`` (None without ``assemble``: compiled to PTX only)."""
        _, fn, kwargs, bound, specialization, options = self.bind(launch)
        result = {"kernel": launch.kernel, "origin": launch.origin, "launch": describe(launch, fn), "ok": False}
        log = io.StringIO()
        try:
            options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization,
                                                                  options)
            with contextlib.redirect_stdout(log):  # ptxas's report, and the PTX of a failed ptxas run
                source = (GluonASTSource if fn.is_gluon() else ASTSource)(fn, signature, constexprs, attrs)
                if assemble:
                    metadata = triton.compile(source, target=TARGET, options=options.__dict__).metadata
                else:
                    metadata = _to_ptx(source, options)
        except Exception as exc:  # noqa: BLE001 - reported per launch
            result["error"] = f"{type(exc).__name__}: {exc}"
            return result
        shared = metadata["shared"] if isinstance(metadata, dict) else metadata.shared
        result.update(_ptxas_report(log.getvalue()), shared=shared)
        if shared > MAX_SHARED:
            result["error"] = f"needs {shared} bytes of shared memory, sm_90 has {MAX_SHARED}"
        else:
            result["ok"] = True
        return result


class _AtPTX(Exception):
    """Raised in place of ptxas: the compile stops with its PTX made, before Triton caches a kernel."""

    def __init__(self, metadata: dict) -> None:
        super().__init__("stopped at PTX")
        self.metadata = metadata


def _to_ptx(source, options) -> dict:
    # Triton's compile up to its PTX, the metadata (shared memory) as the cubin stage receives it. Raising
    # there leaves no cache entry that a later compile of the same kernel could take for a whole one.
    def stop(self, src, metadata, opt, capability):
        raise _AtPTX(dict(metadata))

    assemble = CUDABackend.make_cubin
    CUDABackend.make_cubin = stop
    try:
        triton.compile(source, target=TARGET, options=options.__dict__)
    except _AtPTX as done:
        return done.metadata
    finally:
        CUDABackend.make_cubin = assemble
    raise RuntimeError("Triton's compile did not reach the cubin stage")


def distinct(compiler: Compiler, launches: list[Launch]) -> list[Launch]:
    """The first launch of each compiled kernel the JIT would make for ``launches``."""
    seen: dict[str, Launch] = {}
    for launch in launches:
        seen.setdefault(compiler.bind(launch)[0], launch)
    return list(seen.values())


def _compile_in_worker(job: tuple[Launch, bool]) -> dict:
    return Compiler().compile(*job)


def _jobs(launches: list[Launch]) -> list[tuple[Launch, bool]]:
    # (launch, assemble): every Gluon kernel's launches and the first of each tl kernel's through ptxas.
    seen: set[str] = set()
    jobs = []
    for launch in launches:
        module, attr = launch.kernel.split(":")
        gluon = getattr(importlib.import_module(module), attr).is_gluon()
        jobs.append((launch, gluon or launch.kernel not in seen))
        seen.add(launch.kernel)
    return jobs


def main(argv: list[str]) -> int:
    """``launches.json [jobs]``: one JSON line per distinct compiled kernel; exit status 1 if any fails."""
    if ".".join(triton.__version__.split(".")[:2]) not in TRITON_VERSIONS:
        print(json.dumps({"error": f"support.gpu_compile was written for Triton {TRITON_VERSIONS}, this is "
                                   f"{triton.__version__}: check its use of the JIT's internals (_pack_args, "
                                   f"create_function_from_signature)"}))
        return 2
    knobs.nvidia.dump_ptxas_log = True  # printed into each compile's captured output
    with open(argv[0]) as f:
        launches = distinct(Compiler(), [Launch.from_json(item) for item in json.load(f)])
    jobs = int(argv[1]) if len(argv) > 1 else 1
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        jobs = _jobs(launches)
        results = pool.imap(_compile_in_worker, jobs) if pool else map(_compile_in_worker, jobs)
        failed = 0
        for result in results:
            failed += not result["ok"]
            print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
