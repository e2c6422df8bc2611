#!/usr/bin/env bash
# Build the wire parser's fuzz driver under AddressSanitizer and UndefinedBehaviorSanitizer
# and run it over the golden payloads, their mutations and random bytes (no Python in
# the process).  Usage: native/sanitize.sh [ITERATIONS]   (default 200000)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${TMPDIR:-/tmp}/kvevents-native-sanitize"
mkdir -p "$out"
"${CXX:-g++}" -std=c++17 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I"$here/cpp" "$here/fuzz/driver.cpp" -o "$out/driver"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
  "$out/driver" "$here/../tests/golden/vllm-wire-vectors.jsonl" "${1:-200000}"
echo "sanitizer run clean"
