#!/usr/bin/env bash
# The long run, outside CI: everything scripts/test.sh does, plus
#   - 10 minutes of fuzzing (MOERUN_FUZZ_SECONDS to change)
#   - the serving, HTTP and client tests under the address sanitizer
#   - the thread-sanitizer build and its unit tests
#   - every kernel variant the CPU has, forced one at a time through the CLI tests (MOERUN_ISA)
#   - the whole multi-rank matrix: every golden fixture x 2/3/4 ranks x placements x
#     microbatching, under mpirun and across two network-namespace hosts (MOERUN_FULL=1)
#   - 64 ranks on this machine (4 routers, 60 expert ranks, mpirun --oversubscribe) over mpi and
#     ucx: forward bitwise, serve under verified load, start-up and memory per rank
#     (tests/mpi/scale_ranks.sh; JSON lines in build/bench/scale_ranks_64.jsonl)
#   - a 60 s soak of moerun serve under moebench serve --verify (resident memory per rank)
#   - tests/serving/rebalance_restart.sh: skewed load, moectl placement plan, the plan applied
#     by a restart; tests/serving/migrate_netns.sh: the same online, each expert rank on its own
#     namespace host behind a tbf-limited link; tests/serving/migrate_e2e.sh over ucx (online
#     migration with 2 routers, canary update and rollback), and over mpi with FP8 experts and
#     an FP8 update file (MOERUN_TEST_DTYPE=fp8)
#   - placement and the expert cache on recorded routing (tests/data/routing): moebench replay
#     (every policy, DeepSeek-R1 at 32 and 64 expert ranks, the Qwen3 batch at 4 nodes, Mixtral)
#     and moebench cache-replay (Qwen3 and Mixtral against Belady), JSON in build/bench/
#   - moebench layer on the qwen3-30b-a3b shape (f32 and bf16 weights) and moebench transport
#     over ucx (shared memory, TCP) and mpi at 1 and 16 MiB per peer, JSON in build/bench/
#   - the multi-rank, CLI and Python tests again with mpi as the default transport
#     (MOERUN_TRANSPORT=mpi; CI runs them on the default, ucx)
#   - the CPU container image built with podman from deploy/Dockerfile and run: the main job and
#     a 4-rank serve answered by moebench --verify from outside (scripts/container-check.sh;
#     needs podman, runc and debootstrap: apt-get install podman buildah runc debootstrap)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
MOERUN_FUZZ_SECONDS=${MOERUN_FUZZ_SECONDS:-600} scripts/test.sh

printf '\n==== address sanitizer: serving, HTTP and client tests ====\n'
cmake --build build-asan -j "$jobs" --target moerun_serving_tests moerun_http_tests moerun_client_tests \
  moerun_serving_alloc_tests
ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -L unit --timeout 1800 \
  -R 'Serving|Http|Metrics|HostPort|Frame|ClientData|ServeConnection|InferCodec|Allocation'

printf '\n==== thread sanitizer ====\n'
cmake --preset tsan >/dev/null
cmake --build build-tsan -j "$jobs" --target moerun_unit_tests moerun_serving_tests \
  moerun_serving_alloc_tests
# UCX's malloc hooks (libucm, loaded with the ucx transport) and TSan's interceptors do not mix:
# the serving tests crash in free() with both; the hooks only serve UCX's registration cache.
UCX_MEM_MALLOC_HOOKS=no UCX_MEM_EVENTS=no TSAN_OPTIONS=halt_on_error=1 \
  ctest --test-dir build-tsan --output-on-failure -L unit --timeout 1800

for isa in scalar avx2 avx512; do
  printf '\n==== CLI tests with MOERUN_ISA=%s ====\n' "$isa"
  MOERUN_ISA=$isa ctest --test-dir build --output-on-failure -L cli --timeout 900
done

printf '\n==== multi-rank matrix (mpirun, namespace hosts) ====\n'
MOERUN_FULL=1 ctest --test-dir build --output-on-failure -L 'mpi|multihost' --timeout 1800

printf '\n==== 64 ranks on one machine (tests/mpi/scale_ranks.sh) ====\n'
mkdir -p build/bench
rm -f build/bench/scale_ranks_64.jsonl
UCX_TLS=sm,self MOERUN_SCALE_SUMMARY=build/bench/scale_ranks_64.jsonl \
  bash tests/mpi/scale_ranks.sh build/bin/moerun build/bin/moebench tests/data 64 mpi,ucx 8

printf '\n==== serving soak: 60 s of verified load, resident memory per rank ====\n'
bash tests/serving/serve_e2e.sh build/bin/moerun build/bin/moectl build/bin/moebench tests/data 60

printf '\n==== the planner on skewed traffic (applied by a restart) ====\n'
bash tests/serving/rebalance_restart.sh build/bin/moerun build/bin/moectl build/bin/moebench 8
MOERUN_K8S_REQUIRE_CRD=1 bash tests/deploy/k8s_validate.sh build/bin/moerun build/bin/moectl

printf '\n==== online migration: expert ranks on namespace hosts behind 50 Mbit/s links ====\n'
bash tests/serving/migrate_netns.sh build/bin/moerun build/bin/moectl build/bin/moebench 8 ||
  [[ $? == 77 ]]
printf '\n==== Slurm (tests/deploy/slurm.sh): serve -N 2 across two namespace nodes, verified, drained ====\n'; bash tests/deploy/slurm.sh build/bin/moerun build/bin/moectl build/bin/moebench . --two-nodes

printf '\n==== online migration and a canary expert update over ucx (2 routers) ====\n'
UCX_TLS=sm,self MOERUN_UCX_PUT_MIN=256 \
  bash tests/serving/migrate_e2e.sh build/bin/moerun build/bin/moectl build/bin/moebench ucx

printf '\n==== online migration and a canary update of FP8 experts (FP8 update file) ====\n'
MOERUN_TEST_DTYPE=fp8 \
  bash tests/serving/migrate_e2e.sh build/bin/moerun build/bin/moectl build/bin/moebench mpi

printf '\n==== benchmarks ====\n'
mkdir -p build/bench
for dtype in f32 bf16; do
  build/bin/moebench layer --preset qwen3-30b-a3b --dtype "$dtype" --tokens 1,16,128,1024 --json \
    > "build/bench/layer-qwen3-$dtype.json"
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for bytes in 1048576 16777216; do
  for tls in sm,self tcp,self; do
    btl=(); [[ $tls == tcp,self ]] && btl=(--mca btl tcp,self)
    UCX_TLS=$tls mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 "${btl[@]}" \
      -np 4 -x UCX_TLS build/bin/moebench transport --transport ucx --bytes-per-peer "$bytes" \
      --iters 20 --no-layer --json > "build/bench/transport-ucx-${tls%%,*}-$bytes.json"
  done
  mpirun --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 -np 4 build/bin/moebench \
    transport --transport mpi --bytes-per-peer "$bytes" --iters 20 --no-layer --json \
    > "build/bench/transport-mpi-$bytes.json"
done
R=tests/data/routing
for f in $R/deepseek-r1/*.json; do
  for rn in "32 4" "64 8"; do
    set -- $rn
    build/bin/moebench replay --trace "$f" --ranks "$1" --nodes "$2" --groups 8 \
      --policies default,eplb-global,eplb-hierarchical,node-aware --json \
      > "build/bench/replay-$(basename "$f" .json)-$1.json"
  done
done
Q=$R/qwen3-30b-a3b/batch_8_topk_ids_layers48_x_tokens_x_top8.npy
for frac in 0 0.5; do
  build/bin/moebench replay --trace "$Q" --ranks 32 --nodes 4 --routers-per-node 2 \
    --plan-fraction "$frac" --batch 64,256,1024 \
    --policies default,eplb-global,node-aware --json > "build/bench/replay-qwen3-$frac.json"
done
build/bin/moebench replay --trace $R/mixtral-8x7b/gsm8k_2_routing.jsonl --ranks 4,8 --nodes 2 \
  --batch 16,64 --policies default,eplb-global,node-aware --json > build/bench/replay-mixtral.json
build/bin/moebench cache-replay --trace "$Q" --ranks 1,4 --batch 64,256 --policies lfu,lru,cycle \
  --lookahead 0,1 --json > build/bench/cache-replay-qwen3.json
build/bin/moebench cache-replay --trace $R/mixtral-8x7b/gsm8k_2_routing.jsonl --ranks 1,4 \
  --batch 1 --policies lfu,lru,cycle --lookahead 0,1 --json > build/bench/cache-replay-mixtral.json
echo "benchmarks: build/bench/*.json"

# The multi-rank, CLI and Python tests once more with mpi as the default transport (CI runs
# them on the default, ucx; the tests that name a transport run both either way).
printf '\n==== the multi-rank, CLI and Python tests with MOERUN_TRANSPORT=mpi ====\n'
MOERUN_TRANSPORT=mpi ctest --test-dir build -L 'cli|mpi|python' -j "$jobs" --output-on-failure

printf '\n==== the container image: podman build and run (scripts/container-check.sh) ====\n'
if command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; then
  scripts/container-check.sh
else
  echo "container-check: FAIL: podman, runc or debootstrap missing (apt-get install podman buildah runc debootstrap)"
  exit 1
fi
