"""Former home of the checks and launchers, kept so that ``tileweave.ops._launch`` imports keep working:
the checks and path records live in ``tileweave.ops.common``, the GEMM launcher in
``tileweave.ops.gemm_launch``, the one-shot launchers in ``tileweave.ops.oneshot_launch``."""

from tileweave.ops.common import (CAPTURE_FUSED, SUPPORTED_DTYPES, capturing, check_bias, check_matrix,
                                  check_not_capturing, check_out, check_runs_dtype, debug_mode, env_flag,
                                  interpreting, last_path, raise_on_timeout, record_path)
from tileweave.ops.gemm_launch import (CONSTEXPR_NAMES, LaunchPlan, PlainLaunch, _fused_plans, _stream_k_kept,
                                       ag_stream_k_tail, b_layout, launch, launch_cached, layout, relaunch,
                                       stream_k_buffers, tiles_per_chunk)
from tileweave.ops.oneshot_launch import ONESHOT_BLOCK, OneshotPlan, launch_gather_rows, launch_reduce_rows

__all__ = ["CAPTURE_FUSED", "CONSTEXPR_NAMES", "LaunchPlan", "ONESHOT_BLOCK", "OneshotPlan", "PlainLaunch",
           "SUPPORTED_DTYPES", "_fused_plans", "_stream_k_kept", "ag_stream_k_tail", "b_layout", "capturing",
           "check_bias", "check_matrix", "check_not_capturing", "check_out", "check_runs_dtype", "debug_mode",
           "env_flag", "interpreting", "last_path", "launch", "launch_cached", "launch_gather_rows",
           "launch_reduce_rows", "layout", "raise_on_timeout", "record_path", "relaunch", "stream_k_buffers",
           "tiles_per_chunk"]
