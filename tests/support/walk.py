"""The walk of one input through an op: which of the library's files a call hands its inputs to, and
whether anything below the op calls back up into it. Traced with ``sys.settrace`` (this thread only:
the emulated backend's producer thread is the backend's, not the op's).

The rule (``tests/cpu/test_op_walk.py`` asserts it):

- **The inputs** are the call's tensors, every tensor on the same storage (a view, a row block, a
  ``contiguous()`` that copied nothing), and the objects that hold one (the MoE plan).
- **A file is on the walk** when a Python function defined in it is called, between the op's
  ``__call__`` and its return, with an input among its arguments: as the argument itself, in a tuple,
  list or dict argument, or as an attribute of a tileweave object argument (a plan, a float8 call's
  scales), one level down.
- **Counted**: every file of ``src/tileweave`` but ``kernels/`` (the ``@triton.jit`` code the walk ends
  in) and ``testing/`` (the emulated ranks' harness); ``runtime/emulated.py`` counts as
  ``runtime/backend.py``, the backend it stands in for.
- **The walk ends at the compute layer**: the first ``ops/compute/`` function that receives an input
  (the launcher: ``matmul``, ``grouped_gemm``, ``gemm_launch``, the float8 ``scaling`` checks) counts;
  what runs under it does not (its own checks and launch caches), as the kernel's code does not.

No call back up: a function that is not the op's own code (a method of its class or a base, or a
function nested in one) never receives the op, a bound method of it, or a tileweave object that holds
it (one level down); and the op's code never runs under a frame of another tileweave module (a helper
that calls back into the op, through a closure or a bound method).

Also recorded: every file whose functions ran at all during the call (the temporal count, for the
engineering record), and whether the call marked itself as a signature's first call
(``runtime.agreement.first_call``).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

CO_VARARGS, CO_VARKEYWORDS = inspect.CO_VARARGS, inspect.CO_VARKEYWORDS


@dataclasses.dataclass
class Rule:
    """Which files count, relative to ``root`` (a package directory)."""

    root: Path
    excluded: tuple[str, ...] = ("kernels/", "testing/")
    aliases: dict = dataclasses.field(default_factory=lambda: {"runtime/emulated.py": "runtime/backend.py"})
    boundary: str = "ops/compute/"
    """Files under this folder end the walk: the first one reached counts, what it calls does not."""

    def file(self, filename: str) -> str | None:
        """The counted name of a code object's file, None outside ``root``."""
        try:
            rel = Path(filename).resolve().relative_to(self.root).as_posix()
        except ValueError:
            return None
        return self.aliases.get(rel, rel)


@dataclasses.dataclass
class Walk:
    files: set[str]
    """The files on the input's walk (the rule)."""
    ran: set[str]
    """Every counted file whose functions ran during the call (the temporal count)."""
    back_up: list[str]
    """How the rule of no call back up was broken (empty: it was not)."""
    functions: set[tuple[str, str]]
    """``(file, qualified name)`` of every function of the package that ran (excluded files too)."""
    result: object = None


def _storage(t: torch.Tensor) -> int | None:
    ptr = t.untyped_storage().data_ptr()
    return ptr or None


def _holds(value, test: Callable[[object], bool], package: str, depth: int = 0) -> bool:
    """Whether ``value`` passes ``test`` or holds something that does: in a tuple, list or dict, or as
    an attribute of an object of ``package``, one level down."""
    if test(value):
        return True
    if depth >= 2:
        return False
    if isinstance(value, (tuple, list)):
        return any(_holds(v, test, package, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds(v, test, package, depth + 1) for v in value.values())
    if (type(value).__module__ or "").split(".")[0] == package and hasattr(value, "__dict__") \
            and not isinstance(value, type):
        return any(_holds(v, test, package, depth + 1) for v in vars(value).values())
    return False


def _arguments(frame) -> list:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & CO_VARARGS) + bool(code.co_flags & CO_VARKEYWORDS)
    local = frame.f_locals
    return [local[name] for name in code.co_varnames[:count] if name in local]


def _own_code(op) -> set[tuple[str, str]]:
    """``(file, class name)`` of the op's class and its bases: the frames of the op's own code."""
    owned = set()
    for cls in type(op).__mro__:
        if cls is object:
            continue
        try:
            owned.add((str(Path(inspect.getsourcefile(cls)).resolve()), cls.__name__))
        except TypeError:
            continue
    return owned


def trace(call: Callable[[], object], *, inputs: Iterable, op, rule: Rule) -> Walk:
    """Run ``call()`` (a call of ``op``) and return its walk under ``rule``."""
    inputs = list(inputs)
    storages = set()
    for value in inputs:
        for t in [value] + (list(vars(value).values()) if hasattr(value, "__dict__") else []):
            if isinstance(t, torch.Tensor) and _storage(t):
                storages.add(_storage(t))

    def is_input(value) -> bool:
        if isinstance(value, torch.Tensor):
            return _storage(value) in storages
        return any(value is x for x in inputs if not isinstance(x, torch.Tensor))

    def is_op(value) -> bool:
        return value is op or getattr(value, "__self__", None) is op

    owned = _own_code(op)
    package = rule.root.name
    kinds: dict = {}

    def kind(code) -> tuple[str | None, bool, bool]:
        """``(counted file or None, excluded, the op's own code)`` of a code object."""
        found = kinds.get(code)
        if found is None:
            name = rule.file(code.co_filename)
            excluded = name is not None and name.startswith(rule.excluded)
            own = (str(Path(code.co_filename).resolve()), code.co_qualname.split(".")[0]) in owned
            found = kinds[code] = (name, excluded, own)
        return found

    files, ran, back_up, functions = set(), set(), [], set()
    outer = sys._getframe()

    def tracer(frame, event, arg):
        name, excluded, own = kind(frame.f_code)
        if name is None:
            return None
        functions.add((name, frame.f_code.co_qualname))
        if excluded:
            return None
        ran.add(name)
        # The frames between this one and the caller of ``call``: the nearest of the package's, and
        # whether one of them is the compute layer's.
        caller, under_compute = None, False
        parent = frame.f_back
        while parent is not None and parent is not outer:
            parent_name, parent_excluded, parent_own = kind(parent.f_code)
            if parent_name is not None:
                if caller is None:
                    caller = (parent_name, parent.f_code.co_qualname, parent_own, parent_excluded)
                if parent_name.startswith(rule.boundary):
                    under_compute = True
            parent = parent.f_back
        where = f"{name}:{frame.f_code.co_qualname}"
        if own and caller is not None and not caller[2]:
            back_up.append(f"{caller[0]}:{caller[1]} calls back into the op: {where}")
        arguments = _arguments(frame)
        if not own and any(_holds(a, is_op, package) for a in arguments):
            back_up.append(f"{where} receives the op")
        if not under_compute and any(_holds(a, is_input, package) for a in arguments):
            files.add(name)
        return None

    sys.settrace(tracer)
    try:
        result = call()
    finally:
        sys.settrace(None)
    return Walk(files, ran, back_up, functions, result)


# -- the five ops on emulated ranks -----------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "tileweave"

MC, K, N = 8, 16, 24
"""Rows per rank, depth and columns of the dense calls (the all-reduce's M: ``MC // 2``)."""
E, H, F, TOPK = 4, 16, 8, 2
"""Experts, hidden size, expert width per rank and top-k of the MoE calls."""

WALKS = {
    "all_gather_gemm": [("auto", {}, "fused"),
                        ("mesh", {"policy": "fused", "transport": "mesh"}, "fused"),
                        ("ring", {"policy": "fused", "transport": "ring"}, "fused"),
                        ("chunked", {"policy": "fused", "transport": "chunked"}, "chunked"),
                        ("oneshot", {"policy": "oneshot"}, "oneshot"),
                        ("fallback", {"policy": "fallback"}, "fallback")],
    "gemm_reduce_scatter": [("auto", {}, "chunked"),
                            ("push", {"policy": "fused", "pull": False}, "chunked"),
                            ("oneshot", {"policy": "oneshot"}, "oneshot"),
                            ("fallback", {"policy": "fallback"}, "fallback")],
    "gemm_all_reduce": [("auto", {}, "oneshot"),
                        ("oneshot", {"policy": "oneshot"}, "oneshot"),
                        ("twoshot", {"policy": "twoshot"}, "twoshot"),
                        ("fallback", {"policy": "fallback"}, "fallback")],
    "moe_all_gather_gemm": [("auto", {}, "fused"), ("fallback", {"policy": "fallback"}, "fallback")],
    "moe_gemm_reduce_scatter": [("auto", {}, "chunked"), ("fallback", {"policy": "fallback"}, "fallback")],
}
"""Per op, the calls walked: a name, the op's constructor arguments and the path the call takes
(``"auto"``: the default route, in the interpreter a fused path; every path of every op)."""


def _inputs(op_name: str, world: int, rank: int):
    """``(make the op, its call's positional arguments)`` of ``op_name``, seeded by rank."""
    import tileweave
    from tileweave.ops.moe import moe_plan

    g = torch.Generator().manual_seed(rank)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    if op_name == "all_gather_gemm":
        return tileweave.AllGatherGemm, (randn(MC, K), randn(K, N))
    if op_name == "gemm_reduce_scatter":
        return tileweave.GemmReduceScatter, (randn(MC * world, K), randn(K, N))
    if op_name == "gemm_all_reduce":
        return tileweave.GemmAllReduce, (randn(MC // 2, K + rank), randn(K + rank, N))
    plan = moe_plan(torch.randint(0, E, (MC, TOPK), generator=g), num_experts=E)
    if op_name == "moe_all_gather_gemm":
        return tileweave.MoEAllGatherGemm, (randn(MC, H), randn(E, H, F), plan)
    return tileweave.MoEGemmReduceScatter, (randn(MC * world * TOPK, F), randn(E, F, H), plan, torch.rand(MC, TOPK))


def walk_check(rank: int, world: int) -> dict:
    """Every call of ``WALKS``, twice (the first call of its signature, then a repeat), traced; per
    ``(op, call)`` the two walks as plain data: files on the walk, files that ran, the breaches of no
    call back up, whether the call was marked as a first call (``runtime.agreement.first_call``), and
    the path."""
    import tileweave
    from tileweave.runtime.backend import get_backend

    get_backend(None, torch.device("cpu"))  # the group's backend exists before any traced call
    rule = Rule(PACKAGE)
    results = {}
    for op_name, calls in WALKS.items():
        for label, options, _ in calls:
            make, args = _inputs(op_name, world, rank)
            op = make(**options)
            walks = []
            for _ in range(2):
                walk = trace(lambda: op(*args), inputs=args, op=op, rule=rule)
                walks.append({"files": sorted(walk.files), "ran": sorted(walk.ran), "back_up": walk.back_up,
                              "first_call": ("runtime/agreement.py", "first_call") in walk.functions,
                              "path": tileweave.last_path(op_name)})
            results[op_name, label] = walks
    return results
