"""The compute-only launchers: tensors in, kernels launched, with no op, workspace or agreement (the
one-shot kernels read the symmetric buffers they are given). The dense GEMM (``matmul``, ``linear``) and
its launcher (``gemm_launch``), the one-shot launchers (``oneshot_launch``), the grouped GEMM
(``grouped_gemm``), the MoE layer's other compute (``topk_reduce``, ``swiglu``, ``grouped_wgrad``) and the
SwiGLU's and RMSNorm's backwards of the dense FP8 layers (``swiglu``, ``rms_norm``). Of the ops they
import only ``tileweave.ops.common``; the op skeleton and the ops build on them."""
