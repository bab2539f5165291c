"""AllGather+GEMM: the op (``op``), its transports (``fused``, ``chunked``, ``oneshot``, ``nccl``) and
the copy-engine push protocol they share (``push``)."""
