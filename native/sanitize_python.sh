#!/usr/bin/env bash
# Build kvevents_native with AddressSanitizer and UndefinedBehaviorSanitizer into a
# private folder (never into the environment's site-packages: other processes load the
# core from there) and run the differential tests (tests/native) and every entry point
# (native/fuzz/exercise.py) against it, the sanitizer runtimes preloaded into Python.
# Usage, from the repository root: native/sanitize_python.sh [ROUNDS]   (default 2000)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${TMPDIR:-/tmp}/kvevents-native-asan"
rm -rf "$out/site"
python -m pip install -q --no-deps --target "$out/site" "$root/native" \
  -C cmake.build-type=RelWithDebInfo -C build-dir="$out/build" \
  -C cmake.define.CMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
export PYTHONPATH="$out/site:$root${PYTHONPATH:+:$PYTHONPATH}"
export LD_PRELOAD="$(${CXX:-g++} -print-file-name=libasan.so) $(${CXX:-g++} -print-file-name=libubsan.so)"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
python -c "import kvevents_native as k, sys; assert k.__file__.startswith('$out'), k.__file__"
python -m pytest -q -p no:cacheprovider "$root/tests/native"
python "$root/native/fuzz/exercise.py" "${1:-2000}"
echo "sanitized Python run clean"
