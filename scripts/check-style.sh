#!/usr/bin/env bash
# Checks the house style of the project's own files:
#
#   scripts/check-style.sh [BUILD_DIR]     (BUILD_DIR defaults to build-clang)
#
# - clang-format-16 (.clang-format): every tracked *.hpp/*.cpp outside
#   subprojects/ must be formatted; fix with
#     git ls-files '*.hpp' '*.cpp' ':!:subprojects/' ':!:**/subprojects/**' | xargs clang-format-16 -i
# - ASCII only: no source file holds a non-ASCII byte (which rules out
#   look-alike identifiers; see .clang-tidy).
# - Includes only point down (scripts/check-includes.py, where the order of
#   src/'s folders is written).
# - clang-tidy-16 (.clang-tidy): no finding in any project .cpp file listed in
#   BUILD_DIR/compile_commands.json, nor in the project headers they include
#   (HeaderFilterRegex). Configure BUILD_DIR with Clang and one unit a test
#   file (CXX=clang++-16 meson setup -Dtests_unity=false BUILD_DIR): the
#   compile commands then carry the Asio
#   coroutine defines Clang needs. It need not be compiled.
# Prints the unformatted files and the findings, then a one-line summary with
# the time taken; exits non-zero if either check fails.
# Environment: JOBS (clang-tidy processes, default 2).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath -m "${1:-$root/build-clang}")
jobs=${JOBS:-2}
start=$SECONDS

for tool in clang-format-16 clang-tidy-16; do
  command -v "$tool" >/dev/null || { echo "$tool not found (apt-get install $tool)" >&2; exit 2; }
done
[[ -f $build/compile_commands.json ]] || {
  echo "$build/compile_commands.json not found: configure it first (CXX=clang++-16 meson setup -Dtests_unity=false $build)" >&2
  exit 2
}

# The project's own sources: tracked files, never subprojects (ours or a
# consumer example's) or third-party code.
cd "$root"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t sources < <(git ls-files -- '*.hpp' '*.cpp' ':!:subprojects/' ':!:**/subprojects/**')
else
  mapfile -t sources < <(find include src tests bench examples -path '*/subprojects' -prune -o \
    \( -name '*.hpp' -o -name '*.cpp' \) -print | sort)
fi

echo "=== clang-format-16: ${#sources[@]} files"
unformatted=()
for f in "${sources[@]}"; do
  clang-format-16 --dry-run --Werror "$f" >/dev/null 2>&1 || unformatted+=("$f")
done
for f in "${unformatted[@]}"; do echo "not formatted: $f (clang-format-16 -i $f)"; done
non_ascii=()
for f in "${sources[@]}"; do
  LC_ALL=C grep -q '[^[:print:][:space:]]' "$f" && non_ascii+=("$f")
done
for f in "${non_ascii[@]}"; do echo "not ASCII: $f ($(LC_ALL=C grep -n -m 1 '[^[:print:][:space:]]' "$f" | cut -d: -f1))"; done

echo "=== includes point down"
includes_ok=1
python3 "$root/scripts/check-includes.py" "$root" || includes_ok=0

# The project's .cpp files in the build's compile commands (each once).
mapfile -t units < <(python3 - "$build/compile_commands.json" "$root" <<'PY'
import json, os, re, sys
db, root = sys.argv[1], os.path.realpath(sys.argv[2])
seen = set()
for entry in json.load(open(db)):
    f = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    if re.search(r"-unity[0-9]+\.cpp$", f):
        sys.exit(f"{db}: {entry['file']} is a unity unit: clang-tidy needs one unit a file "
                 "(configure BUILD_DIR with -Dtests_unity=false)")
    rel = os.path.relpath(f, root)
    if rel.startswith("..") or not f.endswith(".cpp") or "subprojects" in rel.split(os.sep):
        continue
    if f not in seen:
        seen.add(f)
        print(f)
PY
)
echo "=== clang-tidy-16: ${#units[@]} translation units, $jobs jobs"
tidy_log=$(mktemp)
trap 'rm -f "$tidy_log"' EXIT
tidy_status=0
# clang-tidy-16 itself, JOBS at a time: run-clang-tidy-16 cannot pass
# --warnings-as-errors on to it.
if [[ ${#units[@]} -gt 0 ]]; then
  printf '%s\0' "${units[@]}" | xargs -0 -n 1 -P "$jobs" clang-tidy-16 -p "$build" --quiet \
    --warnings-as-errors='*' >"$tidy_log" 2>&1 || tidy_status=$?
fi
# Keep the findings and the source lines they quote; drop progress lines.
grep -vE '^([0-9]+ (warnings?|errors?)( and [0-9]+ errors?)? generated|Suppressed [0-9]+ warnings|Use -header-filter|[0-9]+ warnings? treated as errors?)' \
  "$tidy_log" || true
# A finding in a header shows once per unit that includes it: count it once.
findings=$( (grep -E '(warning|error): .*\[[a-z0-9.,-]+\]$' "$tidy_log" || true) | sort -u | wc -l)
if [[ $tidy_status -ne 0 && $findings -eq 0 ]]; then
  findings=1  # clang-tidy failed without a finding (e.g. a file did not compile): see above
fi

elapsed=$((SECONDS - start))
if [[ ${#unformatted[@]} -eq 0 && ${#non_ascii[@]} -eq 0 && $includes_ok -eq 1 && $tidy_status -eq 0 ]]; then
  echo "check-style: OK: ${#sources[@]} files formatted, 0 clang-tidy findings in ${#units[@]} units (${elapsed} s)"
else
  echo "check-style: FAILED: ${#unformatted[@]} unformatted file(s), ${#non_ascii[@]} non-ASCII file(s), $((1 - includes_ok)) include check(s) failed, ${findings} clang-tidy finding(s) in ${#units[@]} units (${elapsed} s)"
  exit 1
fi
