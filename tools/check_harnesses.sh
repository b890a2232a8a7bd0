#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the three developer harnesses (tile_harness.cpp, gemm_harness.cpp, decode_harness.cpp) for
# AVX2 and AVX-512 and runs each briefly on odd sizes: each harness checks its kernel's result against
# float64 before it times anything and exits 1 on a wrong one, so this keeps them building against
# the kernels they include (nothing else compiles them: pip and the test suite build only the
# library) and turns them into one more check of those kernels. The timings are not looked at.
# The AVX-512 builds run only on a CPU with AVX-512F (they are still compiled elsewhere).
#
#   tools/check_harnesses.sh        # ~1 minute on 2 cores (-O1 builds)
#
# Environment: CXX (default g++).
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=${CXX:-g++}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

declare -A flags=([avx2]="-DHARNESS_AVX2 -mavx2 -mfma -mf16c" [avx512]="-mavx512f -mavx2 -mfma -mf16c")
pids=()
for isa in avx2 avx512; do
  for h in tile gemm decode; do
    # shellcheck disable=SC2086
    $cxx -O1 -std=c++17 ${flags[$isa]} -Isrc/cpp "tools/${h}_harness.cpp" -o "$out/${h}_$isa" &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done  # a failed build fails the script (set -e)

if ! grep -qw avx2 /proc/cpuinfo; then
  echo "check_harnesses: no AVX2 on this CPU, the harnesses were only built"
  exit 0
fi
for isa in avx2 avx512; do
  if [[ $isa == avx512 ]] && ! grep -qw avx512f /proc/cpuinfo; then
    echo "check_harnesses: no AVX-512F on this CPU, the avx512 harnesses were only built"
    continue
  fi
  # Odd sizes: a query block's remainder rows, key counts off every tile and block width, head_dim
  # off the lane count, causal; GEMM rows off the register tile, columns off the panel; decode
  # groups of 1-4 rows, each storage, prefetching off, into L2 and into L1, the key range as one part
  # and as four (1001 keys: four parts of 250 and one key left over, read as a stream of its own).
  "$out/tile_$isa" 200 300 72 0.1
  "$out/tile_$isa" 67 259 33 0.1 1
  "$out/tile_$isa" 5 17 1 0.1
  "$out/gemm_$isa" 100 200 72 0.1
  "$out/gemm_$isa" 13 70 5 0.1
  for storage in f32 f16 bf16 i8; do
    "$out/decode_$isa" $storage 4 1000 3
    "$out/decode_$isa" $storage 2 1001 3 1 4
    "$out/decode_$isa" $storage 3 77 3 1
    "$out/decode_$isa" $storage 4 301 3 2
    "$out/decode_$isa" $storage 1 5 2
    "$out/decode_$isa" $storage 1 1000 3 2 1 1
  done
done
echo "check_harnesses: every harness built and agreed with float64"
