#!/usr/bin/env bash
# Runs clang-tidy (the repository's .clang-tidy) on the .cpp files changed relative to a base
# ref, or on the files given; headers are checked through the .cpp files that include them.
#
#   scripts/tidy.sh                  files changed since origin/main (HEAD~1 without it),
#                                    including uncommitted changes
#   scripts/tidy.sh --base REF       files changed since REF
#   scripts/tidy.sh FILE...          these files
#   scripts/tidy.sh --werror ...     treat every finding as an error
#
# Uses $HP_BUILD_DIR/compile_commands.json (default build/; configured if missing); files it
# does not list are skipped with a note. Prints the findings; exits 1 when clang-tidy reports an
# error (a compile error, or any finding with --werror), 0 otherwise. HP_JOBS files at a time.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
BUILD_DIR=${HP_BUILD_DIR:-build}
JOBS=${HP_JOBS:-$(nproc)}
TIDY=${CLANG_TIDY:-$(command -v clang-tidy-14 || command -v clang-tidy || true)}
[ -n "$TIDY" ] || { echo "tidy: clang-tidy not found (apt-get install clang-tidy-14)" >&2; exit 2; }

base=
werror=
files=()
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=$2; shift 2 ;;
    --werror) werror="--warnings-as-errors=*"; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) files+=("$(cd "$caller" && realpath -m "$1")"); shift ;;
  esac
done

if [ ${#files[@]} -eq 0 ]; then
  if [ -z "$base" ]; then
    if git rev-parse -q --verify origin/main >/dev/null; then base=origin/main; else base=HEAD~1; fi
  fi
  mb=$(git merge-base "$base" HEAD)
  mapfile -t files < <( { git diff --name-only --diff-filter=d "$mb"; \
                          git ls-files --others --exclude-standard; } | grep -E '\.cpp$' | sort -u)
  echo "tidy: ${#files[@]} .cpp file(s) changed since $base"
fi
[ ${#files[@]} -gt 0 ] || exit 0

if [ ! -f "$BUILD_DIR/compile_commands.json" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${HP_CMAKE_ARGS:-} >/dev/null
fi
listed=$(python3 -c 'import json,sys; print("\n".join(e["file"] for e in json.load(open(sys.argv[1]))))' \
  "$BUILD_DIR/compile_commands.json")
todo=()
for f in "${files[@]}"; do
  abs=$(realpath -m "$f")
  if grep -qxF "$abs" <<<"$listed"; then todo+=("$abs"); else echo "tidy: skipped $f (not in $BUILD_DIR/compile_commands.json)"; fi
done
[ ${#todo[@]} -gt 0 ] || exit 0

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# The build's precompiled headers (cmake/pch.cmake: GCC .gch files) mean nothing to clang: tidy reads
# a copy of the compile commands without them (every source includes what it uses).
python3 - "$BUILD_DIR/compile_commands.json" "$logs/db/compile_commands.json" <<'PY'
import json, os, re, sys
entries = json.load(open(sys.argv[1]))
pch = re.compile(r" -Winvalid-pch| -include \S*cmake_pch\.hxx")
for e in entries:
    if "command" in e:
        e["command"] = pch.sub("", e["command"])
os.makedirs(os.path.dirname(sys.argv[2]))
json.dump(entries, open(sys.argv[2], "w"))
PY
status=0
# One log per file (parallel runs would interleave), printed in order afterwards.
i=0
for f in "${todo[@]}"; do
  printf '%s\0%s\0' "$f" "$logs/$(printf %04d $i).log"
  i=$((i + 1))
done | TIDY=$TIDY BUILD_DIR=$logs/db WERROR=$werror xargs -0 -n 2 -P "$JOBS" bash -c \
  '"$TIDY" -p "$BUILD_DIR" --quiet ${WERROR:+"$WERROR"} "$1" >"$2" 2>&1' _ || status=$?
cat "$logs"/*.log > "$logs/all"
# clang-tidy's own chatter ("N warnings generated.") is noise.
grep -vE '^[0-9]+ warnings? (and [0-9]+ errors? )?generated\.$|^$' "$logs/all" || true
warnings=$(grep -cE ': warning: ' "$logs/all" || true)
errors=$(grep -cE '(^|: )error: ' "$logs/all" || true)
echo "tidy: ${#todo[@]} file(s), $warnings warning(s), $errors error(s)"
if [ "$errors" -gt 0 ] || [ "$status" -ne 0 ]; then exit 1; fi
