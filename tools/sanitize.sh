#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds pyattn with AddressSanitizer + UndefinedBehaviorSanitizer into a scratch virtual environment
# and runs the test suite against that build. Any sanitizer report fails the run.
#
#   tools/sanitize.sh                 # whole suite (a quarter of an hour on 2 cores, build included)
#   tools/sanitize.sh -k "fuzz or api" # extra arguments go to pytest
#   SANITIZE_OPT=-O0 SANITIZE_TESTS="tests/test_fuzz.py tests/test_api.py" tools/sanitize.sh  # CI's
#
# Environment: PYTHON (default python3), PYATTN_SANITIZE (default address,undefined), SANITIZE_JOBS
# (pytest workers, default 2), SANITIZE_TESTS (test paths, default tests), SANITIZE_OPT (the build's
# optimisation flag, default -O1; -O0 compiles ~3x faster and runs slower), SANITIZE_WORKDIR
# (default: a fresh temporary directory, removed afterwards unless KEEP=1).
#
# How it works. The interpreter is not instrumented, so GCC's libasan is preloaded (it must come
# first in the library list), with libstdc++ (see below). ASAN_OPTIONS: detect_leaks=0 (CPython keeps memory alive on purpose at
# exit), allocator_may_return_null=1 (the memory tests ask numpy for terabytes and expect a clean
# MemoryError -> ValueError, not an ASan abort). Reports go to per-process log files that this script
# checks afterwards: pytest's output capture would otherwise swallow them. The build uses
# -fno-sanitize-recover, so the first report also aborts the test process.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
sanitizers=${PYATTN_SANITIZE:-address,undefined}
work=${SANITIZE_WORKDIR:-$(mktemp -d)}
if [[ -z ${SANITIZE_WORKDIR:-} && -z ${KEEP:-} ]]; then
  trap 'rm -rf "$work"' EXIT
fi
mkdir -p "$work/logs"
start=$(date +%s)

cxx=${CXX:-g++}
libasan=$("$cxx" -print-file-name=libasan.so)
libstdcxx=$("$cxx" -print-file-name=libstdc++.so)
if [[ ! -e $libasan ]]; then
  echo "sanitize.sh: $cxx has no libasan.so (install the compiler's sanitizer runtime)" >&2
  exit 1
fi
# libstdc++ is preloaded too: ASan resolves its __cxa_throw interceptor when it starts, and the
# python binary does not link libstdc++, so the first C++ exception (every ValueError raised by the
# binding) would otherwise abort with "CHECK failed: real___cxa_throw != 0".
preload="$libasan $libstdcxx"

echo "== sanitize: building pyattn with -fsanitize=$sanitizers ($cxx, $libasan)"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install --quiet --upgrade pip
"$venv_python" -m pip install --quiet numpy "pytest>=7" "hypothesis>=6" "ml_dtypes>=0.2" pytest-xdist  # the test extra (bfloat16 tests skip without ml_dtypes), and xdist (below)
# RelWithDebInfo keeps -g (the CMake file sets -O1 for sanitizer builds); install.strip=false keeps the symbols so
# reports show function names and lines. Warnings are errors in this build (PYATTN_WERROR), so CI
# also fails on a new compiler warning.
"$venv_python" -m pip install --quiet . \
  -Ccmake.define.PYATTN_SANITIZE="$sanitizers" \
  -Ccmake.define.PYATTN_WERROR=ON \
  -Ccmake.define.PYATTN_TEST_OPT="${SANITIZE_OPT:--O1}" \
  -Ccmake.build-type=RelWithDebInfo \
  -Cinstall.strip=false \
  -Cbuild-dir="$work/build"
echo "== sanitize: built in $(( $(date +%s) - start )) s"

# Run from a copy of the tests so the installed (instrumented) package is imported, never src/.
rm -rf "$work/tests"  # a reused SANITIZE_WORKDIR: a fresh copy, not tests/tests
cp -r tests "$work/tests"
cp pyproject.toml "$work/"
cd "$work"
export ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:abort_on_error=1:log_path=$work/logs/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/logs/ubsan"
export PYTHONFAULTHANDLER=1

echo "== sanitize: checking that CPython + numpy run under the preloaded runtime"
LD_PRELOAD="$preload" "$venv_python" -c "
import numpy as np, pyattn
assert pyattn.__file__.startswith('$work/venv'), pyattn.__file__
q = np.ones((2, 3, 4), np.float32)
pyattn.scaled_dot_product_attention(q, q, q)
try:
    pyattn._core._set_isa('no-such-isa')  # a C++ exception crossing into Python
except ValueError:
    pass
else:
    raise SystemExit('expected ValueError')
print('pyattn', pyattn.__version__, 'isa', pyattn.get_isa(), 'under', '$sanitizers')
"

status=0
# --capture=sys: pytest captures Python's sys.stdout/stderr only, so whatever the runtimes write to
# file descriptor 2 reaches this script's output. UBSan's report of a misaligned load went to stderr
# despite log_path, and with pytest's default fd capture it vanished with the process (exit status
# 1, no log file, no summary).
# -n: pytest-xdist workers (SANITIZE_JOBS, default 2). The instrumented suite is mostly
# single-threaded Python and reference code: two workers on 2 cores took its tests from 309 to 234 s
# (Xeon VM, 2026-12-03). A worker killed by a report fails the run like any crash.
# shellcheck disable=SC2086
LD_PRELOAD="$preload" "$venv_python" -m pytest -q -p no:cacheprovider --capture=sys -n "${SANITIZE_JOBS:-2}" "$@" ${SANITIZE_TESTS:-tests} ||
  status=$?

# Log files also hold harmless notes (allocator_may_return_null prints "failed to allocate"
# warnings); an error report always has one of these lines.
pattern='ERROR: AddressSanitizer|runtime error:|CHECK failed|SUMMARY: (Address|UndefinedBehavior)Sanitizer'
reports=$(grep -lE "$pattern" "$work"/logs/* 2>/dev/null | sort || true)
notes=$(find "$work/logs" -type f | wc -l)
for f in $reports; do
  echo "---- sanitizer report $f" >&2
  cat "$f" >&2
done
if [[ -n $reports ]]; then
  status=1
elif [[ $status -ne 0 ]]; then
  echo "sanitize.sh: pytest stopped with status $status and no sanitizer log: look for a report on stderr above" >&2
fi
echo "== sanitize: pytest exit status $status, $(wc -w <<<"$reports") sanitizer report(s)" \
  "($notes log file(s) in all), $(( $(date +%s) - start )) s in total"
exit "$status"
