#!/usr/bin/env bash
# The GPU tests and the benchmark on a multi-GPU box, in one command (GPU time is scarce: batch it).
#
#   OUT=/some/dir M=1024,2048,4096,8192,16384 OPS="ag rs gemm block" bash scripts/gpu_check.sh
#
# Writes gpu_tests.txt and the benchmark's JSON, markdown and charts under $OUT/results, prints the
# tables last. Uses the machine's python3 (torch and triton preinstalled); nothing is installed.
# TESTS="oneshot or block" selects GPU tests (pytest -k); TEST_SHARD=1/2 runs every second of them
# from the first (a shard of two leaves room for one op's benchmark, ~2 minutes with one transport,
# within ten minutes). OPS="" skips the benchmark, TESTS=none the tests. Probes for questions still
# open live under bench/probes/ and run by hand.
# RS_TRANSPORTS="chunked" and AG_TRANSPORTS="mesh chunked": the transports each
# op's "ours" runs with, next to one set of baselines (one report section per transport). POLICY (default
# fused) is what "ours" runs: fused measures the kernels, auto what users get by default; the block
# section runs BLOCK_POLICY (default auto) with BLOCK_AG_TRANSPORT / BLOCK_RS_TRANSPORT at BLOCK_M
# (default 4096,8192,16384), each variant in its own processes (BLOCK_ISOLATE=0: all in one).
# TILEWEAVE_GPU_RANKS=2 on a one-GPU machine runs the distributed tests with both ranks on that GPU
# (tileweave.testing.shared_gpu; no timing). Set TILEWEAVE_GIT_COMMIT so the results name their commit
# (the tree may travel without .git, or with a stale one). BLOCK=1 also runs examples/train_block.py
# (fused, NCCL, floor), which writes block.txt.
# OPS may also name moe, decode and grouped: each runs with its defaults (plus SECTION_ARGS) into
# $OUT/results/<op>. SECTION_ARGS also reaches the gemm section, so one call can run both cores in FP8:
#   OPS="gemm grouped" SECTION_ARGS="--dtype fp8 --scaling tensorwise,rowwise,blockwise" M=4096,8192 \
#     BENCH_TIMEOUT=600 bash scripts/gpu_check.sh
# (each FP8 scaling adds two variants per gemm row and a row per grouped case; --quick in SECTION_ARGS
# shortens both sections; tensorwise-fast and rowwise-fast run ours and torch's with use_fast_accum=True).
# SECTION_ARGS reaches the block section too (each BLOCK_ISOLATE process): the FP8 block, on one GPU too,
#   OPS=block BLOCK_M=8192 SECTION_ARGS="--layer llama3-70b --dtype fp8 --scaling tensorwise,rowwise,blockwise" \
#     BENCH_TIMEOUT=600 bash scripts/gpu_check.sh
# (per scaling an FP8 row of ours and torch, NCCL + torch's scaled matmul, in the ours and torch processes).
# ROUNDS=2 (ag, rs) times each row's variants twice, the order mirrored (medians reported); OURS_FIRST=1
# times ours before the baselines in each row.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# A lost peer should fail in seconds here, not after a minute of polling.
export TILEWEAVE_MAX_SPIN=${TILEWEAVE_MAX_SPIN:-16777216}
OUT=${OUT:-bench/results}
M=${M:-1024,2048,4096,8192,16384}
OPS=${OPS-ag rs gemm block}
BLOCK_M=${BLOCK_M:-4096,8192,16384}
RS_TRANSPORTS=${RS_TRANSPORTS:-chunked}
AG_TRANSPORTS=${AG_TRANSPORTS:-mesh chunked}
TEST_TIMEOUT=${TEST_TIMEOUT:-$([ -n "${TEST_SHARD:-}" ] && echo 330 || echo 560)}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
if [ -z "${TILEWEAVE_GIT_COMMIT:-}" ]; then
  # A tree copied to a GPU machine may carry a stale .git: the results would name its HEAD.
  echo "gpu_check.sh: TILEWEAVE_GIT_COMMIT is not set; results will name the commit of this tree's .git," \
       "which may be stale" >&2
fi
mkdir -p "$OUT/results"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit --format=csv | tee "$OUT/gpus.txt"
status=0
if [ "${TESTS:-}" != none ]; then
  selection=(tests/gpu ${TESTS:+-k "$TESTS"})
  if [ -n "${TEST_SHARD:-}" ]; then
    [[ "$TEST_SHARD" =~ ^[1-9][0-9]*/[1-9][0-9]*$ ]] && [ "${TEST_SHARD%/*}" -le "${TEST_SHARD#*/}" ] \
      || { echo "gpu_check.sh: TEST_SHARD=$TEST_SHARD is not i/n with 1 <= i <= n (for example 1/2)" >&2; exit 1; }
    # Every n-th test from the i-th (TEST_SHARD=i/n), so the slow ones spread over the shards; the ids
    # already reflect TESTS.
    mapfile -t selection < <(python3 -m pytest --collect-only -q -p no:cacheprovider "${selection[@]}" 2>/dev/null | grep "::" | awk -v i="${TEST_SHARD%/*}" -v n="${TEST_SHARD#*/}" 'NR % n == i % n')
    echo "gpu_check.sh: test shard $TEST_SHARD: ${#selection[@]} tests"
    # An empty shard would let pytest fall back to every test path, the CPU tests among them.
    [ "${#selection[@]}" -gt 0 ] || { echo "gpu_check.sh: no GPU tests collected for $TEST_SHARD" >&2; exit 1; }
  fi
  # One line per test (-v), so a run cut short by the time limit still shows which tests passed.
  timeout "$TEST_TIMEOUT" python3 -m pytest -v --durations=15 -p no:cacheprovider "${selection[@]}" \
    > "$OUT/gpu_tests.txt" 2>&1 || status=1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.txt" | tail -40
fi
comma() { echo "$*" | tr ' ' ','; }
for op in $OPS; do
  if [ "$op" = moe ] || [ "$op" = decode ] || [ "$op" = grouped ]; then
    # Sections with options of their own (tileweave bench --op moe --help); SECTION_ARGS passes some.
    mkdir -p "$OUT/results/$op"
    timeout "$BENCH_TIMEOUT" python3 -m tileweave bench --op "$op" --out "$OUT/results/$op" ${SECTION_ARGS:-} 2>&1 \
      | grep -v -i warning | tail -60 || status=1
    continue
  fi
  m="$M"
  policy="${POLICY:-fused}"
  flags=()
  # Several transports of one op run next to one set of baselines (sections <op>-<transport>).
  [ "$op" = rs ] && flags=(--rs-transport "$(comma $RS_TRANSPORTS)")
  # shellcheck disable=SC2206  # SECTION_ARGS is a list of options, split on spaces
  [ "$op" = gemm ] && flags=(${SECTION_ARGS:-})
  [ "$op" = ag ] && flags=(--ag-transport "$(comma $AG_TRANSPORTS)")
  if [ "$op" = ag ] || [ "$op" = rs ]; then
    flags+=(--rounds "${ROUNDS:-1}")
    [ "${OURS_FIRST:-0}" != 0 ] && flags+=(--ours-first)
  fi
  # The block measures what users get: the default policy, unless BLOCK_POLICY says otherwise.
  if [ "$op" = block ]; then
    m="$BLOCK_M"
    policy="${BLOCK_POLICY:-auto}"
    # shellcheck disable=SC2206  # SECTION_ARGS is a list of options, split on spaces
    flags=(--ag-transport "${BLOCK_AG_TRANSPORT:-auto}" --rs-transport "${BLOCK_RS_TRANSPORT:-chunked}" ${SECTION_ARGS:-})
  fi
  if [ "$op" = block ] && [ "${BLOCK_ISOLATE:-1}" != 0 ]; then
    # Each block variant in its own processes, the reports merged: in one process a variant ran 2-4%
    # slower after another one than before it (NOTES.md, entry 35).
    rm -rf "$OUT/block_parts"
    for v in torch floor base ours; do
      timeout "$BENCH_TIMEOUT" python3 -m tileweave bench --op block --m "$m" --out "$OUT/block_parts" \
        --policy "$policy" ${flags[@]+"${flags[@]}"} --block-variants "$v" --tag "block-$v" 2>&1 \
        | grep -v -i warning | grep -E "wrote|Error|error" || status=1
    done
    python3 scripts/merge_results.py --out "$OUT/results" --tag block "$OUT"/block_parts/block-*_block_*.json \
      | tail -40 || status=1
    continue
  fi
  timeout "$BENCH_TIMEOUT" python3 -m tileweave bench --op "$op" --m "$m" --out "$OUT/results" \
    --policy "$policy" ${flags[@]+"${flags[@]}"} --tag "$op" 2>&1 | grep -v -i warning | tail -60 || status=1
done
if [ "${BLOCK:-0}" = 1 ]; then
  # The TP block, forward + backward: fused, NCCL + cuBLAS, and the compute floor.
  for policy in fused fallback floor; do
    timeout "$BENCH_TIMEOUT" python3 examples/train_block.py --policy "$policy" --steps 8 2>&1 \
      | grep -v -i warning | tail -1 | tee -a "$OUT/block.txt" || status=1
  done
fi
exit $status
