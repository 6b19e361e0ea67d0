#!/usr/bin/env bash
# The CPU backend's exp loops must be vectorized in the AVX2 clone: no test times them, and GCC
# turns simd.h's fexp select into a branch, and the loops calling it into scalar code, when the
# plugin loses -fno-trapping-math (4-7x slower activations, softmax and cross-entropy on an AVX2
# CPU, every number still right). This reads the built plugin's x86-64-v3 clones of the loops
# whose only work is fexp or ftanh and requires each to hold packed 256-bit FMAs (vfmadd...ps on
# ymm registers); the scalar loop holds only ...ss forms on xmm.
#   tests/vectorized_exp.sh <libmt_backend_cpu.so> [objdump]
set -euo pipefail
plugin=$1
objdump=${2:-objdump}
functions=(silu_gated_n silu_gated_bwd_n softcap_fwd_n sum_exp_n exp_store_n ce_bwd_n)
listing=$(mktemp)
trap 'rm -f "$listing"' EXIT
"$objdump" -d -C --no-show-raw-insn "$plugin" > "$listing"
failed=0
for f in "${functions[@]}"; do
  # A function's listing runs from its header line ("<...f(...) [clone .arch_x86_64_v3]>:") to
  # the blank line after it.
  body=$(awk -v name="::${f}(" -v clone="[clone .arch_x86_64_v3]>:" \
           'index($0, name) && index($0, clone) { on = 1; next }
            on && NF == 0 { exit } on { print }' \
           "$listing")
  if [ -z "$body" ]; then
    echo "vectorized_exp: no x86-64-v3 clone of $f in $plugin (renamed, or no longer" \
         "cloned?): update tests/vectorized_exp.sh" >&2
    failed=1
    continue
  fi
  packed=$(grep -c -E 'vfn?madd[0-9]+ps[[:space:]].*%ymm' <<< "$body" || true)
  echo "$f [x86-64-v3]: $packed packed ymm FMAs"
  if [ "$packed" -eq 0 ]; then
    echo "vectorized_exp: the AVX2 clone of $f runs one lane at a time (no packed ymm FMA): the" \
         "exp loops no longer vectorize; is the CPU plugin still built with -fno-trapping-math" \
         "(plugins/backends/cpu/CMakeLists.txt)?" >&2
    failed=1
  fi
done
exit $failed
