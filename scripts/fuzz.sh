#!/usr/bin/env bash
# Builds a libFuzzer target (tests/fuzz) and runs it for SECONDS.
#
#   scripts/fuzz.sh SECONDS [BUILD_DIR [TARGET]]
#
# BUILD_DIR defaults to build-fuzz; TARGET to fuzz_cache (the cache against
# its model, corpus tests/fuzz/corpus), fuzz_resp (the Redis tier's RESP
# parser, corpus tests/fuzz/resp_corpus) or fuzz_events (the KV event
# publisher's request parser, replay buffer and batch queue, corpus
# tests/fuzz/events_corpus).
#
# Clang 16 with ASan + UBSan, the library instrumented for coverage too.
# Fuzzes a copy of the target's corpus: the committed corpus is only written
# with FUZZ_MERGE=1, which adds a few inputs that reach code it does not. Crashing
# inputs go to BUILD_DIR/fuzz-artifacts; replay one with
#   GHOSTLINK_FUZZ_VERBOSE=1 BUILD_DIR/tests/fuzz/TARGET FILE
# Prints executions, coverage and crashes; exits non-zero on a crash.
# Environment: CXX (default clang++-16), FUZZ_MERGE=1.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
  echo "usage: $0 SECONDS [BUILD_DIR]" >&2
  exit 2
fi
seconds=$1
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath -m "${2:-$root/build-fuzz}")
target=${3:-fuzz_cache}
case $target in
  fuzz_cache) corpus=$root/tests/fuzz/corpus ;;
  fuzz_resp) corpus=$root/tests/fuzz/resp_corpus ;;
  fuzz_events) corpus=$root/tests/fuzz/events_corpus ;;
  *) echo "unknown target $target (fuzz_cache, fuzz_resp or fuzz_events)" >&2; exit 2 ;;
esac

if [[ ! -f $build/build.ninja ]]; then
  CXX=${CXX:-clang++-16} meson setup "$build" "$root" -Dfuzz=enabled -Db_sanitize=address,undefined -Db_lundef=false \
    -Dcpp_args=-fsanitize=fuzzer-no-link -Dexamples=disabled -Dbenchmarks=disabled
fi
meson compile -C "$build" "$target"
fuzzer=$build/tests/fuzz/$target
[[ -x $fuzzer ]] || { echo "$fuzzer was not built: configure $build with -Dfuzz=enabled" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$build/fuzz-artifacts"
cp "$corpus"/* "$work/corpus/"
touch "$work/start"

# UBSan must stop at the first report, or libFuzzer records nothing.
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
# -entropic=0: entropic scheduling's rare-feature bookkeeping took 82% of the
# time with this target's ~100k features (140 exec/s against 1,100 in a
# 60 s run, and less coverage).
status=0
"$fuzzer" "$work/corpus" -max_total_time="$seconds" -entropic=0 -timeout=60 -print_final_stats=1 \
  -artifact_prefix="$build/fuzz-artifacts/" 2>"$work/log" || status=$?

final_stat() { sed -n "s/^stat::$1: *//p" "$work/log"; }
last=$(grep -E '^#[0-9]+' "$work/log" | tail -n 1 || true)
new_artifacts() { find "$build/fuzz-artifacts" -type f -newer "$work/start"; }
crashes=$(new_artifacts | wc -l)
echo "$target: ${seconds}s, $(final_stat number_of_executed_units) executions," \
  "$(final_stat average_exec_per_sec) exec/s, peak RSS $(final_stat peak_rss_mb) MB"
echo "last status: ${last:-none}"
echo "crashes: $crashes"
if [[ $status -ne 0 || $crashes -ne 0 ]]; then
  grep -E 'MISMATCH|ERROR|runtime error|SUMMARY' "$work/log" | head -n 20 || true
  new_artifacts
  tail -n 40 "$work/log"
  exit 1
fi

if [[ ${FUZZ_MERGE:-0} == 1 ]]; then
  # Copies in a small set of inputs that reach code the corpus does not:
  # edges only (-use_counters=0: a new hit count is not new code), chosen
  # greedily (set cover). They keep libFuzzer's names (SHA-1 of the input).
  "$fuzzer" -set_cover_merge=1 -use_counters=0 "$corpus" "$work/corpus" 2>>"$work/log"
  echo "merged into $corpus: $(find "$corpus" -type f | wc -l) files"
fi
