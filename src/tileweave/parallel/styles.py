"""``ColwiseParallel``, ``RowwiseParallel`` and ``SequenceParallel`` on tileweave's fused ops.

Each style subclasses torch's style of the same name and takes its arguments. ``parallelize_module``
calls ``_apply`` on each planned submodule: an ``nn.Linear`` gets DTensor parameters exactly as torch's
style makes them, and its forward runs on tileweave's ops (the module's class becomes a subclass of
``nn.Linear`` whose forward asks the style; its state dict and parameters are unchanged, as FSDP2 does
when it wraps a module). ``nn.Embedding`` is handed to torch's style: it has no GEMM to fuse.

What runs, per linear, W ranks on the mesh, ``[B, S, H]`` activations sequence-sharded as ``Shard(1)``:

===================  ==========================================  ==========================================
style                layouts                                     computation
===================  ==========================================  ==========================================
``ColwiseParallel``  input ``Shard(d)``, d not last              ``AllGather+GEMM``: ``[B, S/W, K]`` ->
                                                                 ``[B, S, N/W]`` (``tileweave.nn.linear``)
``ColwiseParallel``  input ``Replicate`` or other                torch's: DTensor GEMM, nothing to fuse
``RowwiseParallel``  output ``Shard(d)``, d not last             ``GEMM+ReduceScatter``: ``[B, S, K/W]`` ->
                                                                 ``[B, S/W, N]``
``RowwiseParallel``  output ``Replicate`` (torch's default)      ``gemm_all_reduce`` (``tileweave.nn.inference``)
``RowwiseParallel``  output ``Shard(-1)``, ``Partial``           torch's: DTensor GEMM, then redistribute
===================  ==========================================  ==========================================

The fused ops gather and scatter rank-major rows (``tileweave.parallel.layouts``): ``Shard(0)``, or a
batch of one under ``Shard(1)``, needs no copy; a larger batch under ``Shard(1)`` copies the
full-sequence activation once per linear (and its gradient once). The sequence length must be divisible
by W. Colwise outputs are ``Shard(-1)`` and taken to ``output_layouts`` by DTensor's redistribute, as
torch's style does. Every rank of the mesh must run the same modules in the same order, like any
collective; the fused ops' own rules apply (``tileweave.all_gather_gemm``: dtypes, no bf16 in Triton's
interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import style as torch_style

from tileweave.nn.inference import row_parallel_linear
from tileweave.nn.linear import TPOps, all_gather_linear, linear_reduce_scatter
from tileweave.parallel.layouts import from_rank_major, is_replicate, shard_dim, to_rank_major


class _FusedLinear(nn.Linear):
    """An ``nn.Linear`` that a tileweave style has parallelized: its forward is the style's. Never
    constructed: ``_apply`` sets an ``nn.Linear``'s class to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._tileweave_style.forward_linear(self, self._tileweave_mesh, x)


def _local(param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local shard (differentiable: its gradient becomes the DTensor's)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _check_linear(style: torch_style.ParallelStyle, module: nn.Module, mesh: DeviceMesh, split: str) -> None:
    """Refuse what the fused forward cannot run: a module that is not exactly ``nn.Linear`` (a subclass
    may have a forward of its own, which the style would replace), a mesh that is not 1-D, features
    that do not split evenly (the fused ops give every rank the same shapes)."""
    name = type(style).__name__
    if type(module) is not nn.Linear:
        raise TypeError(f"tileweave.parallel.{name} parallelizes nn.Linear (and nn.Embedding, as torch's style "
                        f"does), got {type(module).__name__}: plan its nn.Linear submodules instead, or use "
                        f"torch.distributed.tensor.parallel.{name} for this module")
    if mesh.ndim != 1:
        raise ValueError(f"tileweave.parallel.{name} needs a 1-D mesh (the TP dimension, e.g. mesh['tp']), got "
                         f"a mesh of shape {tuple(mesh.shape)}")
    features = getattr(module, split)
    if features % mesh.size():
        raise ValueError(f"tileweave.parallel.{name}: {split}={features} of {module} must be divisible by the "
                         f"TP size {mesh.size()} (the fused ops need equal shards)")


def _install(style: torch_style.ParallelStyle, module: nn.Linear, mesh: DeviceMesh) -> nn.Linear:
    module._tileweave_style = style
    module._tileweave_mesh = mesh
    module.__class__ = _FusedLinear
    return module


def _sequence_length(x: torch.Tensor, dim: int, world: int, name: str) -> None:
    if x.shape[dim] % world:
        raise ValueError(f"tileweave.parallel.{name}: the sequence dimension {dim} of the "
                         f"{'global ' if isinstance(x, DTensor) else ''}activation {tuple(x.shape)} must be "
                         f"divisible by the TP size {world}")


class ColwiseParallel(torch_style.ColwiseParallel):
    """torch's ``ColwiseParallel`` (same arguments, same ``Shard(0)`` weight and bias) with the
    all-gather of a sequence-sharded input fused into the GEMM.

    ``input_layouts=Shard(1)`` (for ``[B, S, H]``; any ``Shard(d)`` but the last dimension) describes a
    local input; a DTensor input brings its own placement. Such an input runs ``AllGather+GEMM``:
    ``x_shard [B, S/W, in] -> y [B, S, out/W]`` (``Shard(-1)``), the backward on GEMM+ReduceScatter.
    A replicated input (``Replicate``, torch's default) runs as torch's style does: a local GEMM, with
    nothing to fuse. To fuse, give the sequence-sharded activation to the linear itself, not to a
    ``PrepareModuleInput`` that gathers it first.

    ``save_gathered``: keep the gathered input for the weight gradient (memory ``[B*S, in]``) or gather
    it again in backward. ``ops``: the communication GEMMs (``tileweave.nn.TPOps``; None: tileweave's).
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 save_gathered: bool = True, ops: TPOps | None = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.save_gathered, self.ops = save_gathered, ops

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        _check_linear(self, module, device_mesh, "out_features")
        self._partition_linear_fn("", module, device_mesh)
        return _install(self, module, device_mesh)

    def forward_linear(self, module: nn.Linear, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
        """The parallelized linear's forward (``nn.Module.__call__`` runs it)."""
        placement = x.placements[0] if isinstance(x, DTensor) else self.input_layouts[0]
        dim = shard_dim(placement, x.dim())
        if dim is None or dim == x.dim() - 1:
            x = self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, module, (x,), mesh)
            y = F.linear(x, module.weight, module.bias)
            return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, mesh)
        world = mesh.size()
        if isinstance(x, DTensor):
            _sequence_length(x, dim, world, "ColwiseParallel")
            x = x.to_local()
        y = all_gather_linear(x.reshape(-1, x.shape[-1]), _local(module.weight), _local(module.bias),
                              mesh.get_group(), save_gathered=self.save_gathered, ops=self.ops)
        y = from_rank_major(y, world, x.shape[:-1], dim)
        wanted = self.output_layouts[0]
        if shard_dim(wanted, y.dim()) == y.dim() - 1:
            return y if self.use_local_output else DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
        y = DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
        return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, mesh)


class RowwiseParallel(torch_style.RowwiseParallel):
    """torch's ``RowwiseParallel`` (same arguments, ``Shard(1)`` weight, replicated bias) with the
    reduction fused into the GEMM.

    The input is sharded on its last dimension (``Shard(-1)``, the output of a ``ColwiseParallel``;
    other layouts are redistributed to it, as torch does). ``output_layouts=Shard(1)`` (sequence
    parallel; any ``Shard(d)`` but the last dimension) runs ``GEMM+ReduceScatter``: ``x [B, S, in/W] ->
    y_shard [B, S/W, out]``, the backward on AllGather+GEMM. ``Replicate`` (torch's default) runs
    ``gemm_all_reduce``, whose backward is local (every rank must then compute the same loss from the
    output, as with torch's style). ``Shard(-1)`` and ``Partial`` outputs run as torch's style does.
    ``ops``: the communication GEMMs of the sequence-parallel form (``tileweave.nn.TPOps``).
    """

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True,
                 ops: TPOps | None = None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.ops = ops

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)
        _check_linear(self, module, device_mesh, "in_features")
        self.desired_input_layouts = (Shard(-1),)
        self._partition_linear_fn("", module, device_mesh)
        return _install(self, module, device_mesh)

    def _local_input(self, module: nn.Linear, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``[..., in/W]`` of the input."""
        if not isinstance(x, DTensor) and shard_dim(self.input_layouts[0], x.dim()) == x.dim() - 1:
            return x
        x = self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, module, (x,), mesh)
        return x.to_local()

    def forward_linear(self, module: nn.Linear, mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
        """The parallelized linear's forward (``nn.Module.__call__`` runs it)."""
        wanted = self.output_layouts[0]
        dim = shard_dim(wanted, x.dim())
        if (dim is None or dim == x.dim() - 1) and not is_replicate(wanted):
            x = self._prepare_input_fn(self.input_layouts, self.desired_input_layouts, module, (x,), mesh)
            y = F.linear(x, module.weight, module.bias)
            return self._prepare_output_fn(self.output_layouts, self.use_local_output, module, y, mesh)
        x = self._local_input(module, mesh, x)
        weight, bias, world = _local(module.weight), _local(module.bias), mesh.size()
        if dim is None:  # Replicate
            y = row_parallel_linear(x.reshape(-1, x.shape[-1]), weight, bias, mesh.get_group())
            y = y.view(*x.shape[:-1], y.shape[-1])
            return y if self.use_local_output else DTensor.from_local(y, mesh, [Replicate()], run_check=False)
        _sequence_length(x, dim, world, "RowwiseParallel")
        y = linear_reduce_scatter(to_rank_major(x, world, dim), weight, bias, mesh.get_group(), ops=self.ops)
        local_lead = (*x.shape[:dim], x.shape[dim] // world, *x.shape[dim + 1:-1])
        y = y.view(*local_lead, y.shape[-1])
        return y if self.use_local_output else DTensor.from_local(y, mesh, [Shard(dim)], run_check=False)


class SequenceParallel(torch_style.SequenceParallel):
    """torch's ``SequenceParallel``, unchanged (norms and dropout run on the sequence shard, parameters
    replicated; there is no GEMM to fuse), offered here so that a plan imports its styles from one place.
    Its output is a ``Shard(1)`` DTensor (``use_local_output=False``): a following
    ``ColwiseParallel(input_layouts=Shard(1))`` gathers it inside its GEMM, and modules in between see
    the global shape (``x.shape`` gives the whole sequence)."""
