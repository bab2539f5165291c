"""Recording kernel launches as plain data (``support.launches`` records the ops' launches with it; another
process compiles them for a GPU, ``support.gpu_compile``).

A launch is recorded as the kernel's name and its arguments as the launcher passed them: a tensor as
its dtype and whether its address is 16-byte aligned (what Triton specialises a pointer on), every
other value (ints, floats, bools, strings, None) as itself, the launch options (``num_warps``,
``num_stages``) among the keyword arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from typing import Callable

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import KernelInterface

import tileweave.kernels

TRITON_VERSIONS = ("3.6",)
"""Triton versions (major.minor) whose internals this module (``InterpretedFunction.run``) and
``support.gpu_compile`` (the JIT's binder and ``_pack_args``) were written for."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor argument: what a kernel's compilation depends on."""

    dtype: str
    """``torch.float16`` as ``"float16"``."""
    aligned: bool
    """Its address is a multiple of 16 bytes."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch: ``kernel`` is ``module:name``; ``args`` the positional arguments, ``kwargs`` the
    keyword ones (constexprs and launch options) as ``(name, value)`` pairs; ``origin`` the call that
    made it."""

    kernel: str
    args: tuple
    kwargs: tuple
    origin: str = ""
    h200: bool = False
    """Its tiles and launch options are those the launcher picks on an H200 (not the interpreter's), and
    its fp16 tensors stand for the bf16 of the GPU call (the interpreter refuses bf16)."""

    def dtypes(self) -> set[str]:
        """The dtypes of its tensors."""
        return {v.dtype for v in self.args + tuple(v for _, v in self.kwargs) if isinstance(v, Tensor)}

    def retyped(self, old: str, new: str) -> "Launch":
        """The same launch with every ``old`` tensor (a dtype name) of dtype ``new``."""
        if old not in self.dtypes():
            return self
        swap = lambda v: Tensor(new, v.aligned) if isinstance(v, Tensor) and v.dtype == old else v
        return dataclasses.replace(self, args=tuple(map(swap, self.args)),
                                   kwargs=tuple((k, swap(v)) for k, v in self.kwargs), origin=f"{self.origin}, {new}")

    def to_json(self) -> dict:
        encode = lambda v: {"tensor": v.dtype, "aligned": v.aligned} if isinstance(v, Tensor) else v
        return {"kernel": self.kernel, "origin": self.origin, "h200": self.h200,
                "args": [encode(v) for v in self.args], "kwargs": {name: encode(v) for name, v in self.kwargs}}

    @classmethod
    def from_json(cls, data: dict) -> "Launch":
        decode = lambda v: Tensor(v["tensor"], v["aligned"]) if isinstance(v, dict) else v
        return cls(data["kernel"], tuple(decode(v) for v in data["args"]),
                   tuple((name, decode(v)) for name, v in data["kwargs"].items()), data["origin"], data["h200"])


def _value(value):
    if isinstance(value, torch.Tensor):
        return Tensor(str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a kernel argument of type {type(value).__name__} cannot be recorded: teach "
                    f"support.launches._value (and support.gpu_compile) about it")


@contextlib.contextmanager
def recording():
    """Record every kernel launch of the block (in Triton's interpreter) into the list it yields.

    Wraps ``InterpretedFunction.run``, the entry of ``kernel[grid](...)`` in the interpreter (Triton
    3.6); calls of one ``@triton.jit`` function from another do not go through it."""
    if ".".join(triton.__version__.split(".")[:2]) not in TRITON_VERSIONS:
        raise RuntimeError(f"support.launches records launches at InterpretedFunction.run of Triton "
                           f"{TRITON_VERSIONS}, this is {triton.__version__}: check that it still does")
    launches: list[Launch] = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            launches.append(Launch(f"{self.fn.__module__}:{self.fn.__name__}", tuple(map(_value, args)),
                                   tuple((name, _value(v)) for name, v in kwargs.items())))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield launches
    finally:
        InterpretedFunction.run = original


def library_kernels() -> list[str]:
    """Every kernel of ``tileweave.kernels`` (``module:name``): the module-level ``@triton.jit``
    functions whose names end in ``_kernel``."""
    found = []
    for info in pkgutil.iter_modules(tileweave.kernels.__path__, "tileweave.kernels."):
        module = importlib.import_module(info.name)
        found += [f"{info.name}:{name}" for name, obj in vars(module).items()
                  if name.endswith("_kernel") and isinstance(obj, KernelInterface)
                  and getattr(obj, "fn", None) is not None and obj.fn.__module__ == info.name]
    return sorted(found)


def record(calls: dict[str, Callable[[], object]], *, h200: bool = False) -> list[Launch]:
    """The launches of each call, in order, each with the call's name as its ``origin``; ``h200``: the
    calls pass the configs that the library picks on an H200."""
    launches = []
    for origin, call in calls.items():
        with recording() as found:
            call()
        launches += [dataclasses.replace(launch, origin=origin, h200=h200) for launch in found]
    return launches
