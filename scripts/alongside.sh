#!/usr/bin/env bash
# Run commands side by side: each BACKGROUND command (one quoted string each) with its output
# kept, and MAIN in the foreground with its output live. Each kept output is printed, under
# its command, once everything has ended. Fails when any command failed, naming each one.
#   scripts/alongside.sh BACKGROUND... -- MAIN...
set -uo pipefail
cd "$(dirname "$0")/.."
background=()
while [[ $# -gt 0 && $1 != -- ]]; do background+=("$1"); shift; done
[[ ${1:-} == -- ]] || { echo "alongside: usage: alongside.sh BACKGROUND... -- MAIN..." >&2; exit 2; }
shift
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$logs"' EXIT
pids=()
for i in "${!background[@]}"; do
  bash -c "${background[$i]}" >"$logs/$i" 2>&1 &
  pids+=($!)
done
"$@"
main_rc=$?
failed=()
[[ $main_rc == 0 ]] || failed+=("$* (exit $main_rc)")
for i in "${!background[@]}"; do
  wait "${pids[$i]}"
  rc=$?
  echo "----- ${background[$i]} (exit $rc) -----"
  cat "$logs/$i"
  [[ $rc == 0 ]] || failed+=("${background[$i]} (exit $rc)")
done
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
