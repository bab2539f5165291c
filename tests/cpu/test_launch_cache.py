"""The fused ops' launch plans (``gemm_launch.launch_cached``): a repeat call replays the first call's
derived arguments with this call's tensors; a call that differs in anything the launch derives from
its arguments gets its own plan. Runs the real kernel in the interpreter."""

import torch

from tileweave.ops.compute import gemm_launch as _launch
from tileweave.tune.configs import INTERPRETER_CONFIG


def _call(a, b, out, bias=None):
    out.fill_(float("nan"))
    _launch.launch_cached(a=a, b=b, c=out, bias=bias, config=INTERPRETER_CONFIG,
                          m_chunk=a.shape[0], programs=4)
    return out


def _ref(a, b, bias=None):
    ref = a.double() @ b.double()
    return ref + bias.double() if bias is not None else ref


def test_replays_use_this_calls_tensors_and_new_layouts_get_new_plans():
    _launch._fused_plans.clear()
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    m, k, n = 48, 40, 72
    b = torch.randn(n, k, generator=g).t()  # an nn.Linear weight, read in place
    for i in range(3):  # fresh inputs and outputs each call: the same layout, one plan
        a = torch.randn(m, k, generator=g)
        out = torch.empty(m, n)
        torch.testing.assert_close(_call(a, b, out).double(), _ref(a, b), rtol=1e-4, atol=1e-4)
        assert len(_launch._fused_plans) == 1, i
    # A row-major b (another layout, no transpose read), a bias, and an a at an address that is not
    # 16-byte aligned (another specialisation): each its own plan, each right.
    b_kn = torch.randn(k, n, generator=g)
    torch.testing.assert_close(_call(a, b_kn, torch.empty(m, n)).double(), _ref(a, b_kn), rtol=1e-4, atol=1e-4)
    bias = torch.randn(n, generator=g)
    torch.testing.assert_close(_call(a, b, torch.empty(m, n), bias).double(), _ref(a, b, bias), rtol=1e-4,
                               atol=1e-4)
    shifted = torch.randn(m * k + 1, generator=g)[1:].view(m, k)
    assert shifted.data_ptr() % 16 != 0
    torch.testing.assert_close(_call(shifted, b, torch.empty(m, n)).double(), _ref(shifted, b), rtol=1e-4,
                               atol=1e-4)
    assert len(_launch._fused_plans) == 4
    # Another shape: another plan.
    a2 = torch.randn(m + 8, k, generator=g)
    torch.testing.assert_close(_call(a2, b, torch.empty(m + 8, n)).double(), _ref(a2, b), rtol=1e-4, atol=1e-4)
    assert len(_launch._fused_plans) == 5


def test_direct_launch_passes_every_kernel_constexpr_in_order():
    # Triton's launcher takes one argument per kernel parameter, constexprs (and their defaults)
    # included: the direct launch must give all of them, in the kernel's order.
    import inspect

    from tileweave.kernels.gemm import fused_gemm_kernel

    params = list(inspect.signature(fused_gemm_kernel.fn).parameters)
    assert tuple(params[params.index("BM"):]) == _launch.CONSTEXPR_NAMES
    a, b = torch.randn(24, 16), torch.randn(16, 40)
    plan = _launch.launch(a=a, b=b, c=torch.empty(24, 40), bias=None,
                          config=INTERPRETER_CONFIG, m_chunk=24, programs=2)
    assert len(plan.constexprs) == len(_launch.CONSTEXPR_NAMES)
