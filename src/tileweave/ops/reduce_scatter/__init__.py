"""GEMM+ReduceScatter: the op (``op``), its transports (``chunked``, ``pull``, ``oneshot``, ``nccl``) and
how the chunked ones cut rows into blocks (``blocks``)."""
