"""Per-rank checks of the fused ops, run on emulated ranks by the tests and the CPU demo, and on GPUs by
the GPU tests. Each returns plain data (errors, flags) so that the caller asserts. One module per op
family; every check of the two sequence-parallel ops and their layers is also importable from here
(GEMM + AllReduce's, whose names repeat theirs, from ``scenarios.all_reduce`` only)."""

from support.scenarios.common import (  # noqa: F401
    GemmCase, Case, randn, weight_b, rel_err, device_name, shared_ops_graphable,
)
from support.scenarios.all_gather import (  # noqa: F401
    all_gather_call, all_gather_gemm_check, all_gather_stream_k_check, lent_gathered_check, all_gather_auto_transport_check, all_gather_only_check, dropped_sources_check, gather_holds_sources_check,
)
from support.scenarios.reduce_scatter import (  # noqa: F401
    gemm_reduce_scatter_check, rs_padded_out_check,
)
from support.scenarios.ops import (  # noqa: F401
    shared_gpu_refused_check, missing_peer_check, back_to_back_check, oneshot_slots_check, settings_change_check, input_errors_check, bf16_cpu_check, fallback_check, compile_check, foreign_group_check, capture_rules_check, grad_refused_check,
)
from support.scenarios.layers import (  # noqa: F401
    tp_mlp_check, small_block_data, tp_block_check, block_bench_variants_check, block_bench_gpu_check,
    block_hf_layer_check, hf_block_state, seq_sharded_check,
)
from support.scenarios.graphs import (  # noqa: F401
    captured, cuda_graph_unfused_gpu_check, cuda_graph_fused_gpu_check, tp_mlp_graph_gpu_check,
)
from support.scenarios.groups import two_groups_check, across_hosts_check  # noqa: F401
from support.scenarios.styles import styles_mlp_check, styles_llama_check, styles_refusals_check  # noqa: F401
from support.scenarios.train_2d import train_2d_check, load_2d_check  # noqa: F401
