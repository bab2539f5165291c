"""The walk of one input through each of the five ops goes through at most six of the library's files,
and nothing below an op calls back up into it.

How the files are counted (``support.walk``, which traces the calls): a file is on the walk when a
function defined in it receives one of the call's inputs (a tensor the caller passed, a view of one, or
an object holding one: the MoE plan) between the op's ``__call__`` and its return. Every file of
``src/tileweave`` counts (the op's folder, the skeleton, ``ops/common.py``, the runtime, ``tune/``) but
``kernels/`` (the ``@triton.jit`` code the walk ends in) and ``testing/`` (the emulated ranks' harness);
``runtime/emulated.py`` counts as ``runtime/backend.py``, the backend it stands in for. The walk ends at
the compute layer: the first ``ops/compute/`` function that receives an input (the launcher) counts,
what runs under it does not. No call back up: no function outside the op's own class code receives the
op (or a bound method of it, or an object that holds it), and the op's code never runs under another
module's frame (a helper calling back into it). Both hold for every path of every op (``WALKS``), at a
signature's first call (checks, agreement, planning, the first call's mark) and at a repeat call.

Two emulated ranks, the plain (not float8) call of each op on small shapes.
"""

import sys
import textwrap

import pytest
import torch

from support import walk
from tileweave.testing.emulated import run_ranks

MAX_FILES = 6
pytestmark = pytest.mark.xdist_group("op_walk")  # one worker runs the walks (scripts/test.sh: loadgroup)

CASES = [(op, label, path) for op, calls in walk.WALKS.items() for label, _, path in calls]


@pytest.fixture(scope="module")
def walks():
    return run_ranks(2, walk.walk_check)


@pytest.mark.parametrize("op, label, path", CASES)
def test_the_walk_of_one_input_goes_through_at_most_six_files(walks, op, label, path):
    for rank, results in enumerate(walks):
        for which, found in zip(("first call", "repeat call"), results[op, label]):
            assert found["path"] == path, (rank, which, found["path"])
            assert len(found["files"]) <= MAX_FILES, (rank, which, found["files"])


@pytest.mark.parametrize("op, label, path", CASES)
def test_nothing_below_the_op_calls_back_up_into_it(walks, op, label, path):
    for rank, results in enumerate(walks):
        for which, found in zip(("first call", "repeat call"), results[op, label]):
            assert found["back_up"] == [], (rank, which)


@pytest.mark.parametrize("op, label, path", CASES)
def test_a_signatures_first_call_is_marked_as_one_and_a_repeat_is_not(walks, op, label, path):
    # The mark that keeps a peer's bounded wait from counting this rank's first compile of the call's
    # kernels (test_first_call_bound.py).
    for rank, results in enumerate(walks):
        first, repeat = results[op, label]
        assert (first["first_call"], repeat["first_call"]) == (True, False), rank


# -- the tracer itself, on a package made here ------------------------------------------------------------

PACKAGE = {
    "op.py": """
        from walkpkg import chain1, helper, untouched

        class Op:
            def __call__(self, x):
                untouched.sizes(x.shape[0])
                chain1.f(x)
                return self._own(x)

            def _own(self, x):
                return x

        class LeakyOp(Op):
            def __call__(self, x):
                helper.call_back(self._own, x)
                helper.hold(self)
        """,
    "chain1.py": "from walkpkg import chain2\ndef f(x):\n    chain2.f([x[1:]])\n",
    "chain2.py": "from walkpkg import chain3\ndef f(rows):\n    chain3.f(box=rows[0].contiguous())\n",
    "chain3.py": "from walkpkg import chain4\nclass Box:\n    def __init__(self, t):\n        self.t = t\n"
                 "def f(*, box):\n    chain4.f(Box(box))\n",
    "chain4.py": "from walkpkg import emulated\ndef f(box):\n    emulated.f(box)\n",
    "emulated.py": "from walkpkg.compute import launch\ndef f(box):\n    launch.run(box.t.clone(), box.t)\n",
    "compute/__init__.py": "",
    "compute/launch.py": "from walkpkg import deep\nfrom walkpkg.kernels import k\n"
                         "def run(copy, t):\n    deep.f(t)\n    k.f(t)\n",
    "deep.py": "def f(t):\n    pass\n",
    "kernels/__init__.py": "",
    "kernels/k.py": "def f(t):\n    pass\n",
    "helper.py": "def call_back(fn, x):\n    fn(x)\ndef hold(op):\n    pass\n",
    "untouched.py": "def sizes(n):\n    pass\n",
}


@pytest.fixture
def walkpkg(tmp_path, monkeypatch):
    root = tmp_path / "walkpkg"
    for name, text in {"__init__.py": "", **PACKAGE}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    import walkpkg.op

    yield root, walkpkg.op
    for name in [m for m in sys.modules if m.split(".")[0] == "walkpkg"]:
        del sys.modules[name]


def test_the_tracer_counts_the_files_that_receive_the_input(walkpkg):
    root, module = walkpkg
    rule = walk.Rule(root, aliases={"emulated.py": "backend.py"}, boundary="compute/")
    x = torch.zeros(4)
    op = module.Op()
    found = walk.trace(lambda: op(x), inputs=[x], op=op, rule=rule)
    # A view, a list holding it, a keyword argument, an object holding one, the first compute function;
    # not: a copy (compute's first argument is a clone), under the compute layer, a kernel, a scalar.
    assert found.files == {"op.py", "chain1.py", "chain2.py", "chain3.py", "chain4.py", "backend.py",
                           "compute/launch.py"}
    assert {"untouched.py", "deep.py"} <= found.ran and "kernels/k.py" not in found.ran
    assert found.back_up == []
    assert len(found.files) > MAX_FILES  # a chain this long fails the rule


def test_the_tracer_finds_calls_back_up_into_the_op(walkpkg):
    root, module = walkpkg
    x = torch.zeros(4)
    op = module.LeakyOp()
    found = walk.trace(lambda: op(x), inputs=[x], op=op, rule=walk.Rule(root))
    assert len(found.back_up) == 3, found.back_up
    assert "helper.py:call_back calls back into the op: op.py:Op._own" in found.back_up
    assert "helper.py:call_back receives the op" in found.back_up  # a bound method of it
    assert "helper.py:hold receives the op" in found.back_up
