#!/usr/bin/env bash
# The far end of the supported dependency range, checked locally: builds and
# tests ghostlink against an Asio and a Catch2 v3 other than Debian's, with
# GCC 12 and Clang 16. (CI checks the near end: Debian 12's Asio 1.22.1 and
# Catch2 2.13.10, see .ci/run.)
#
#   scripts/check-deps-range.sh ASIO_DIR CATCH2_DIR
#
# ASIO_DIR: a checkout or release tree of standalone Asio (ASIO_DIR/include,
#   ASIO_DIR/asio/include or ASIO_DIR itself holds asio/version.hpp).
# CATCH2_DIR: a checkout or release tree of Catch2 v3 (with its meson.build).
# For example, with copies of the release tags that are never committed:
#   git --git-dir=/path/to/asio.git archive asio-1-38-2 include | tar -x -C /tmp/deps/asio
#   git --git-dir=/path/to/Catch2.git archive v3.7.1 | tar -x -C /tmp/deps/catch2
#   scripts/check-deps-range.sh /tmp/deps/asio /tmp/deps/catch2
#
# Catch2 is built with Meson (C++20, as ghostlink's tests) and installed into
# a temporary prefix; ghostlink finds it there through PKG_CONFIG_PATH
# (catch2-with-main) and finds the given Asio first through
# -Dcpp_args=-isystem... (a system include dir: warnings inside Asio are not
# ours, -Werror stays on for ghostlink's own code). Subproject fallbacks are
# off (--wrap-mode=nofallback): nothing is downloaded, and a dependency that
# is not the one given fails the check instead of being replaced. For each
# compiler: configure, build everything (library, tests, examples,
# benchmark), check that the given versions were picked up, run the whole
# test suite and the examples with short arguments.
#
# The Boost flavour is built and tested too (-Dasio=both, the whole suite in
# both flavours) when Boost 1.81 or newer is found: under BOOST_ROOT if set
# (BOOST_ROOT/include/boost/version.hpp), else Debian's libboost1.81-dev in
# /usr/include. BOOST=off skips it.
#
# Environment: GCC_CXX (default g++), CLANG_CXX (default clang++-16), JOBS
# (default 2, for compiling and for meson test), KEEP_WORK=1 to keep the
# build directories (in a mktemp dir, printed at the end).
# Exit status: 0 if everything passed for every compiler, 1 otherwise, 2 on
# bad arguments.
set -uo pipefail

usage() { sed -n '7,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -eq 2 ] || usage

src=$(cd "$(dirname "$0")/.." && pwd)
asio_dir=$(cd "$1" 2>/dev/null && pwd) || { echo "no such directory: $1" >&2; exit 2; }
catch2_dir=$(cd "$2" 2>/dev/null && pwd) || { echo "no such directory: $2" >&2; exit 2; }
jobs=${JOBS:-2}
compilers=("gcc:${GCC_CXX:-g++}" "clang:${CLANG_CXX:-clang++-16}")

asio_inc=""
for d in "$asio_dir/include" "$asio_dir/asio/include" "$asio_dir"; do
  if [ -f "$d/asio/version.hpp" ] && [ -f "$d/asio.hpp" ]; then asio_inc=$(cd "$d" && pwd -P); break; fi
done
[ -n "$asio_inc" ] || { echo "no asio/version.hpp under $asio_dir/include, $asio_dir/asio/include or $asio_dir" >&2; exit 2; }
asio_number=$(sed -n 's/^#define ASIO_VERSION \([0-9]*\).*/\1/p' "$asio_inc/asio/version.hpp")
[ -n "$asio_number" ] || { echo "cannot read ASIO_VERSION from $asio_inc/asio/version.hpp" >&2; exit 2; }
asio_version="$((asio_number / 100000)).$((asio_number / 100 % 1000)).$((asio_number % 100))"

[ -f "$catch2_dir/meson.build" ] || { echo "$catch2_dir has no meson.build (Catch2 v3 source tree expected)" >&2; exit 2; }
catch2_version=$(sed -n "s/^ *version: *'\([0-9.]*\)'.*/\1/p" "$catch2_dir/meson.build" | head -n1)
case "$catch2_version" in
  3.*) ;;
  *) echo "$catch2_dir is Catch2 '$catch2_version', not v3" >&2; exit 2 ;;
esac

boost_args=()
boost_version="not checked"
if [ "${BOOST:-auto}" != off ]; then
  boost_header="${BOOST_ROOT:-/usr}/include/boost/version.hpp"
  boost_number=$(sed -n 's/^#define BOOST_VERSION \([0-9]*\).*/\1/p' "$boost_header" 2>/dev/null)
  if [ -n "$boost_number" ] && [ "$boost_number" -ge 108100 ]; then
    boost_version="$((boost_number / 100000)).$((boost_number / 100 % 1000)).$((boost_number % 100))"
    boost_args=(-Dasio=both)
  else
    boost_version="not checked (no Boost >= 1.81 at $boost_header)"
  fi
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/ghostlink-deps-range.XXXXXX")
if [ "${KEEP_WORK:-0}" != 1 ]; then trap 'rm -rf "$work"' EXIT; fi

section() { printf '\n=== %s\n' "$*"; }
started=$SECONDS
failed=0
summary=()
note() { summary+=("$*"); }

# Runs a command, its output to a log (shown in full if it fails).
step() {
  local log=$1; shift
  local rc=0
  "$@" >"$log" 2>&1 || rc=$?
  [ $rc -ne 0 ] || return 0
  cat "$log"
  echo "FAILED (exit $rc): $*" >&2
  return 1
}

section "Asio $asio_version from $asio_inc; Catch2 $catch2_version from $catch2_dir; Boost $boost_version; ghostlink from $src"

section "Catch2 $catch2_version: build and install into $work/catch2"
catch2_prefix=$work/catch2
if step "$work/catch2-setup.log" env CXX="${GCC_CXX:-g++}" meson setup "$work/catch2-build" "$catch2_dir" \
     --prefix "$catch2_prefix" --libdir lib -Dtests=false -Dcpp_std=c++20 -Dbuildtype=release \
     --wrap-mode=nodownload &&
   step "$work/catch2-compile.log" meson compile -C "$work/catch2-build" -j "$jobs" &&
   step "$work/catch2-install.log" meson install -C "$work/catch2-build"; then
  echo "installed"
else
  echo "Catch2 $catch2_version did not build: nothing else to check" >&2
  exit 1
fi
export PKG_CONFIG_PATH="$catch2_prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

for entry in "${compilers[@]}"; do
  name=${entry%%:*}
  cxx=${entry#*:}
  build=$work/build-$name
  t0=$SECONDS
  if ! command -v "$cxx" >/dev/null; then
    note "$name: $cxx not found: FAILED"; failed=1; continue
  fi
  cxx_version=$("$cxx" -dumpfullversion -dumpversion 2>/dev/null | head -n1)

  section "$name ($cxx $cxx_version): configure"
  if ! CXX=$cxx meson setup "$build" "$src" --wrap-mode=nofallback "${boost_args[@]}" \
       -Dcpp_args="-isystem $asio_inc" >"$work/setup-$name.log" 2>&1; then
    cat "$work/setup-$name.log"
    note "$name ($cxx_version): configure FAILED"; failed=1; continue
  fi
  sed -n '/^ghostlink/,$p' "$work/setup-$name.log"
  # The versions actually picked up, from the configure summary.
  got_asio=$(sed -n 's/^ *asio *: *\([0-9.]*\) .*/\1/p' "$work/setup-$name.log" | head -n1)
  got_catch2=$(sed -n 's/^ *catch2 *: *\([0-9.]*\).*/\1/p' "$work/setup-$name.log" | head -n1)
  if [ "$got_asio" != "$asio_version" ] || [ "$got_catch2" != "$catch2_version" ]; then
    note "$name ($cxx_version): configured with Asio '$got_asio', Catch2 '$got_catch2' instead of $asio_version, $catch2_version: FAILED"
    failed=1; continue
  fi
  if [ ${#boost_args[@]} -gt 0 ]; then
    got_boost=$(sed -n 's/^ *boost *: *\([0-9.]*\).*/\1/p' "$work/setup-$name.log" | head -n1)
    if [ "$got_boost" != "$boost_version" ]; then
      note "$name ($cxx_version): configured with Boost '$got_boost' instead of $boost_version: FAILED"
      failed=1; continue
    fi
  fi

  section "$name: build"
  if ! step "$work/compile-$name.log" meson compile -C "$build" -j "$jobs" --ninja-args=-k0; then
    note "$name ($cxx_version): build FAILED (log above)"; failed=1; continue
  fi
  # An Asio header missing from the given tree would silently come from
  # another Asio on the include path (e.g. Debian's in /usr/include).
  foreign=$(ninja -C "$build" -t deps | grep -E '/asio(\.hpp|/)' | grep -v '/boost/asio' | sed 's/^ *//' |
            grep -v "^$asio_inc/" | sort -u)
  if [ -n "$foreign" ]; then
    echo "$foreign"
    note "$name ($cxx_version): Asio headers from outside $asio_inc (listed above): FAILED"; failed=1; continue
  fi
  echo "built; every Asio header from $asio_inc"

  section "$name: meson test"
  meson test -C "$build" --num-processes "$jobs" --print-errorlogs >"$work/test-$name.log" 2>&1
  test_rc=$?
  sed -n '/^ *[0-9]*\/[0-9]* /p;/^Ok:/,/^Timeout:/p' "$work/test-$name.log"
  counts=$(sed -n 's/^\(Ok\|Fail\|Expected Fail\|Unexpected Pass\|Skipped\|Timeout\): *\([0-9]*\) *$/\1 \2/p' \
             "$work/test-$name.log" | paste -sd, | sed 's/,/, /g')
  [ -n "$counts" ] || counts="no test summary"
  # Catch2's own count, summed over the test executables.
  cases=$(sed -n 's/^All tests passed (\([0-9]*\) assertions\{0,1\} in \([0-9]*\) test cases\{0,1\})/\1 \2/p' \
            "$build/meson-logs/testlog.txt" 2>/dev/null | awk '{a += $1; c += $2; n++} END {printf "%d Catch2 runs: %d test cases, %d assertions", n, c, a}')
  counts="$counts; $cases"
  if [ $test_rc -ne 0 ]; then
    cat "$work/test-$name.log"
    tail -n 80 "$build/meson-logs/testlog.txt" 2>/dev/null
    result="FAILED"; failed=1
  else
    result="passed"
  fi

  section "$name: examples"
  examples_result="passed"
  for run in "serving_loop --steps 64" "parallel_sampling --prompt 200 --decode 40" "batch_writes"; do
    # shellcheck disable=SC2086 # the arguments are split on purpose
    set -- $run
    exe=$1; shift
    if step "$work/example-$name-$exe.log" "$build/examples/$exe" "$@"; then
      echo "$exe${*:+ $*}: ok ($(tail -n1 "$work/example-$name-$exe.log" | sed 's/^ *//'))"
    else
      examples_result="FAILED ($exe)"; failed=1
    fi
  done
  note "$name ($cxx $cxx_version): meson test $result [$counts]; examples $examples_result; $((SECONDS - t0)) s"
done

section "Summary: Asio $asio_version ($asio_inc), Catch2 $catch2_version ($catch2_dir), Boost $boost_version"
for line in "${summary[@]}"; do echo "  $line"; done
echo "  total time: $((SECONDS - started)) s"
if [ "${KEEP_WORK:-0}" = 1 ]; then echo "  build directories kept in $work"; fi
if [ $failed -ne 0 ]; then
  echo "RESULT: FAILED"
  exit 1
fi
echo "RESULT: passed"
