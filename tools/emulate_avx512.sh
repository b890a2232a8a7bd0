#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs the AVX-512 kernels on a host without AVX-512: builds pyattn with PYATTN_EMULATE_AVX512 (the
# AVX-512 body of simd.h compiled for AVX2 against SIMDe's portable AVX-512 intrinsics,
# src/cpp/simd_emulate_avx512.h) into a scratch virtual environment and runs the test suite on the
# "avx512" path, and the precision tests on the "avx512bf16" path (AVX512-BF16's vdpbf16ps, SIMDe's
# too). On a host with both it does nothing: the normal suite already runs them natively
# (tests/conftest.py's isa fixture); on a host with AVX-512 only, it tests avx512bf16.
#
#   tools/emulate_avx512.sh                # the suite on the emulated path (~3 minutes on 2 cores, build included)
#   tools/emulate_avx512.sh -k "gemm"      # extra arguments go to pytest
#
# Why: the AVX-512 code (transposes, masked loads, 16-bit conversions, the GEMM's register tiles) is
# otherwise only exercised where the CI machine happens to have AVX-512. SIMDe computes each
# intrinsic lane by lane as Intel documents it, so a wrong shuffle constant or mask shows up here as
# a failing parity test (checked: swapping two lanes of the 16 x 16 transpose fails the suite).
# Speed under emulation means nothing.
#
# Needs SIMDe's headers (Debian: libsimde-dev; installed with apt-get when missing and root).
# Environment: PYTHON (default python3), EMULATE_WORKDIR (default: a fresh temporary directory,
# removed afterwards unless KEEP=1), FORCE=1 to emulate even on a host with AVX-512,
# EMULATE_OPTIONAL=1 to skip (loudly, exit 0) instead of failing when SIMDe cannot be had.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

# What the CPU runs natively: both paths (nothing to do), avx512 only (emulate avx512bf16), neither.
native_avx512=
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then native_avx512=1; fi
if [[ -z ${FORCE:-} && -n $native_avx512 ]] && grep -qw avx512_bf16 /proc/cpuinfo 2>/dev/null; then
  echo "== emulate_avx512: this CPU has AVX-512 and AVX512-BF16; the main suite runs both natively, nothing to do"
  exit 0
fi
if [[ ! -e /usr/include/simde/x86/avx512.h ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "== emulate_avx512: installing libsimde-dev"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsimde-dev >/dev/null ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsimde-dev >/dev/null; }
  fi
fi
if [[ ! -e /usr/include/simde/x86/avx512.h ]]; then
  echo "emulate_avx512.sh: SIMDe headers not found (/usr/include/simde); install libsimde-dev" >&2
  # .ci/run sets EMULATE_OPTIONAL=1: a CI machine that cannot install packages still runs the rest.
  if [[ -n ${EMULATE_OPTIONAL:-} ]]; then
    echo "== emulate_avx512: SKIPPED (no SIMDe): the AVX-512 path was not tested on this machine" >&2
    exit 0
  fi
  exit 1
fi

work=${EMULATE_WORKDIR:-$(mktemp -d)}
if [[ -z ${EMULATE_WORKDIR:-} && -z ${KEEP:-} ]]; then
  trap 'rm -rf "$work"' EXIT
fi
start=$(date +%s)
echo "== emulate_avx512: building pyattn with PYATTN_EMULATE_AVX512=ON"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install --quiet --upgrade pip
"$venv_python" -m pip install --quiet numpy "pytest>=7" "hypothesis>=6" "ml_dtypes>=0.2"
"$venv_python" -m pip install --quiet . -Ccmake.define.PYATTN_EMULATE_AVX512=ON -Cbuild-dir="$work/build"
echo "== emulate_avx512: built in $(( $(date +%s) - start )) s"

# Run from a copy of the tests so the installed (emulating) package is imported, never src/.
cp -r tests "$work/tests"
cp pyproject.toml "$work/"
cd "$work"
"$venv_python" - <<'EOF'
import pyattn
assert "avx512" in pyattn.available_isas(), pyattn.available_isas()
print("== emulate_avx512: isa", pyattn.runtime_info()["isa"], "of", pyattn.available_isas())
EOF
# PYATTN_ISA=avx512: the isa fixture then runs only that path, and every other test runs on it too.
# EMULATE_TESTS: the test paths (default: the whole suite). EMULATE_BF16_TESTS: the paths run on the
# avx512bf16 kernels (the bfloat16 pair products of precision="fast"; default
# tests/test_precision.py). On a CPU with AVX-512 only the second set runs.
if [[ -z $native_avx512 || -n ${FORCE:-} ]]; then
  # shellcheck disable=SC2086
  PYATTN_ISA=avx512 "$venv_python" -m pytest -q -p no:cacheprovider ${EMULATE_TESTS:-tests} "$@"
fi
echo "== emulate_avx512: the avx512bf16 kernels"
# shellcheck disable=SC2086
PYATTN_ISA=avx512bf16 "$venv_python" -m pytest -q -p no:cacheprovider ${EMULATE_BF16_TESTS:-tests/test_precision.py} "$@"
echo "== emulate_avx512: done in $(( $(date +%s) - start )) s"
