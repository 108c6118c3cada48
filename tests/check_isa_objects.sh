#!/usr/bin/env bash
# Fails if an object compiled for a specific ISA (AVX2, AVX-512) defines a weak symbol: an inline
# function or template instantiation there could be chosen by the linker for every caller and
# run AVX-512 instructions on a CPU without them. (Weak data objects, such as the compiler's
# DW.ref.__gxx_personality_v0, hold no instructions and are fine.)
set -euo pipefail
status=0
for obj in "$@"; do
  weak=$(nm -C --defined-only "$obj" | awk '$2 == "W" || $2 == "u"' || true)
  if [[ -n "$weak" ]]; then
    echo "$obj defines weak symbols:"
    echo "$weak"
    status=1
  fi
done
[[ $status -eq 0 ]] && echo "checked $# objects: no weak symbols"
exit $status
