#!/usr/bin/env bash
# mt on an NVIDIA GPU in one command: build, test, benchmark against PyTorch, print one table.
#   bench/gpu/run.sh        (from anywhere; meant for a one-shot session on an H100/H200)
#
# 1. Builds mt, its plugins and the gpu test binaries into build-gpu (Release, MT_CUDA=ON,
#    sm_90; the project's CMakeLists uses ccache when present). Missing Debian packages are
#    taken from build-deps/*.deb when present (bench/gpu/fetch_deps.sh makes it on a machine
#    with network; carry it along), else installed with apt-get when the network allows.
# 2. ctest -L gpu; `mt plugins`; nvidia-smi.
# 3. mt bench gemm / attention / train (backend=cuda) and bench/peers/torch_gpu.py on the same
#    cases: GEMM TFLOP/s at llama2-7b and ~1B shapes (target mt/torch >= 0.95), attention
#    forward and forward+backward TFLOP/s (flash vs SDPA flash, dot_product vs SDPA math),
#    training tokens/s and MFU of llama2-7b with 4 layers (T=4096, batch 2) and llama-bench-1b
#    (T=2048, batch 4) against PyTorch eager, bf16 autocast with f32 masters (targets: MFU >=
#    45%, mt/eager >= 1.3), mt's decode throughput (llama-bench-1b, prefill and batch 1/8), the
#    7b run again with profile=true (time per op of the steady-state steps, into bench.log),
#    flash fwd+bwd with its dk/dv kernel on whole query tiles (MT_CUDA_FLASH_DKV_PARTS=1) as an
#    A/B against the default, and torch.compile when time allows.
# 4. One markdown table on stdout (last, so it is in any output tail). Files in $OUT when set,
#    else bench/gpu/results/: raw.jsonl (every JSON line, tagged source/case), table.md,
#    status.txt, build.log, ctest.log, bench.log (the commands' stderr), env.txt, and
#    sanitizer.log when time is left for compute-sanitizer (memcheck over the flash and GEMM
#    tests, then racecheck over the flash tiles). Eight files: what the device tool returns.
#
# Every step has a time limit and the whole run a budget (MT_GPU_BUDGET_S, default 530 s, for a
# 10-minute command limit); a step that fails or runs out of time is reported in the table and the
# run goes on. Knobs: BUILD_DIR, PYTHON (default python3), MT_CUDA_ARCH (90), MT_GPU_SKIP_BUILD=1
# (use an existing build), MT_GPU_STEPS (training steps, 6), MT_DEBS_DIR (build-deps),
# MT_GPU_FORCE_DEBS=1 (build against build-deps/ even when the system has the packages).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
start=$(date +%s)
budget=${MT_GPU_BUDGET_S:-530}
build=${BUILD_DIR:-$root/build-gpu}
res=${OUT:-$root/bench/gpu/results}
py=${PYTHON:-python3}
steps=${MT_GPU_STEPS:-6}
mkdir -p "$res"
raw=$res/raw.jsonl
blog=$res/bench.log
status=$res/status.txt
: >"$raw"
: >"$blog"
: >"$status"
: >"$res/build.log"
: >"$res/ctest.log"
: >"$res/env.txt"

elapsed() { echo $(($(date +%s) - start)); }
# note STEP RESULT [DETAIL]: one line of status.txt (the table's header) and of stderr.
note() {
  printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >>"$status"
  echo "run.sh [$(elapsed)s] $1: $2${3:+ ($3)}" >&2
}
# limit WANTED: seconds a step may take, WANTED or less so that 25 s stay for the table.
limit() {
  local left=$((start + budget - $(date +%s) - 25))
  if ((left < 1)); then left=1; fi
  if ((left < $1)); then echo "$left"; else echo "$1"; fi
}

table_done=0
make_table() {
  if ((table_done)); then return 0; fi
  table_done=1
  note total "$(elapsed)s" "budget ${budget}s"
  if command -v "$py" >/dev/null 2>&1; then
    "$py" "$root/bench/gpu/table.py" "$raw" "$status" | tee "$res/table.md" ||
      echo "run.sh: table.py failed; raw results in $raw" >&2
  else
    echo "run.sh: no $py to print the table; raw results in $raw, steps in $status" >&2
    cat "$status"
  fi
}
trap make_table EXIT
trap 'exit 143' TERM INT

# ---- environment ------------------------------------------------------------------------------
# CMake 4 refuses package files that ask for policies older than 3.5 unless told otherwise.
export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=$PATH:/usr/local/cuda/bin
fi
{
  echo "## date: $(date -u +%FT%TZ)  host: $(uname -srm)  cores: $(nproc)"
  echo "## nvidia-smi"
  timeout 30 nvidia-smi 2>&1 || echo "(nvidia-smi failed or missing)"
  echo "## nvcc"
  nvcc --version 2>&1 | tail -2 || echo "(no nvcc)"
  echo "## cmake: $(cmake --version 2>/dev/null | head -1)  ninja: $(ninja --version 2>/dev/null || echo none)  ccache: $(command -v ccache || echo none)"
} >>"$res/env.txt" 2>&1
gpu=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || true)
note gpu "${gpu:-none found}"

torch_ok=0
if torch_info=$(timeout 120 "$py" -c 'import torch, sys
ok = torch.cuda.is_available()
print(torch.__version__, torch.cuda.get_device_name(0) if ok else "no CUDA device")
sys.exit(0 if ok else 3)' 2>>"$blog"); then
  torch_ok=1
  note torch "$torch_info"
else
  note torch "n/a" "${torch_info:-$py cannot import torch}; torch columns are n/a"
fi

# ---- dependencies -----------------------------------------------------------------------------
# The Debian packages scripts/setup.sh installs; only those the GPU build needs are checked.
needed=(libboost-dev libyaml-cpp-dev libtbb-dev libopenblas-dev libfmt-dev libgtest-dev
  libgmock-dev libpcre2-dev libsentencepiece-dev libutf8proc-dev)
missing=()
if command -v dpkg-query >/dev/null 2>&1; then
  for p in "${needed[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
else
  missing=("${needed[@]}")  # not Debian: cannot tell, so use build-deps/ when it is there
fi
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
debs=${MT_DEBS_DIR:-$root/build-deps}
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DMT_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${MT_CUDA_ARCH:-90}"
  -DMT_BUILD_BENCH=OFF)
mt_env=()  # environment of every mt and ctest command (library path of unpacked packages)
if [ "${MT_GPU_FORCE_DEBS:-0}" = 1 ]; then missing+=("(MT_GPU_FORCE_DEBS=1)"); fi
if ((${#missing[@]})); then
  if compgen -G "$debs/*.deb" >/dev/null; then
    # Unpack into a private prefix (never over /), point CMake and pkg-config at it, and give
    # the linker and mt its library directories.
    prefix=/tmp/mt-gpu-deps
    rm -rf "$prefix" && mkdir -p "$prefix"
    for f in "$debs"/*.deb; do
      if command -v dpkg-deb >/dev/null 2>&1; then
        dpkg-deb -x "$f" "$prefix"
      else
        (t=$(mktemp -d) && cd "$t" && ar x "$f" && tar -xf data.tar.* -C "$prefix" && rm -rf "$t")
      fi
    done
    find "$prefix" -name '*.pc' -exec sed -i \
      -e "s#=/usr#=$prefix/usr#g" -e "s#-I/usr#-I$prefix/usr#g" -e "s#-L/usr#-L$prefix/usr#g" {} +
    lib=$prefix/usr/lib/x86_64-linux-gnu
    export PKG_CONFIG_PATH=$lib/pkgconfig:$lib/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    ld_path=$lib:$lib/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    link="-Wl,-rpath-link,$lib"
    cmake_args+=("-DCMAKE_PREFIX_PATH=$prefix/usr" "-DCMAKE_EXE_LINKER_FLAGS=$link"
      "-DCMAKE_SHARED_LINKER_FLAGS=$link" "-DCMAKE_MODULE_LINKER_FLAGS=$link")
    # pkg-config: the system's, else the unpacked pkgconf with its library (named explicitly, as
    # CMake would otherwise find the unpacked binary first and run it without its library).
    pc=$(command -v pkg-config || true)
    if [ -z "$pc" ]; then
      pc=$prefix/pkg-config
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$lib" "$prefix/usr/bin/pkgconf" >"$pc"
      chmod +x "$pc"
    fi
    cmake_args+=("-DPKG_CONFIG_EXECUTABLE=$pc")
    mt_env=(env "LD_LIBRARY_PATH=$ld_path")
    note deps "unpacked $(find "$debs" -maxdepth 1 -name '*.deb' | wc -l) packages" "$debs -> $prefix; not installed: ${missing[*]}"
  elif timeout 30 apt-get update -qq >>"$res/build.log" 2>&1; then
    # scripts/setup.sh's way, for a machine with network.
    sudo=()
    if [ "$(id -u)" -ne 0 ]; then sudo=(sudo); fi
    pkgs=()
    for p in "${missing[@]}"; do
      case $p in pkg-config) pkgs+=(pkgconf) ;; \(*) ;; *) pkgs+=("$p") ;; esac
    done
    if DEBIAN_FRONTEND=noninteractive timeout "$(limit 180)" ${sudo[@]+"${sudo[@]}"} apt-get install -y -qq \
      --no-install-recommends "${pkgs[@]}" >>"$res/build.log" 2>&1; then
      note deps "installed ${pkgs[*]}"
    else
      note deps "apt-get install failed" "${pkgs[*]}; see build.log"
    fi
  else
    note deps "missing, offline" "${missing[*]}: no build-deps/*.deb (bench/gpu/fetch_deps.sh) and no network; trying anyway"
  fi
else
  note deps "present"
fi
run_mt() { ${mt_env[@]+"${mt_env[@]}"} "$@"; }
mt=$build/bin/mt
mtc=(${mt_env[@]+"${mt_env[@]}"} "$mt")  # an mt command line, for `timeout`

# ---- build ------------------------------------------------------------------------------------
built=0
gpu_tests=()
for src in tests/unit/gpu_*_test.cpp; do
  if [ -e "$src" ]; then gpu_tests+=("$(basename "$src" .cpp)"); fi
done
if [ "${MT_GPU_SKIP_BUILD:-0}" = 1 ] && [ -x "$mt" ]; then
  note build "skipped" "MT_GPU_SKIP_BUILD=1, using $build"
  built=1
else
  if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    cmake_args+=(-G Ninja)
  fi
  tests=ON
  t0=$(date +%s)
  if ! timeout "$(limit 180)" cmake -S "$root" -B "$build" "${cmake_args[@]}" -DMT_BUILD_TESTS=ON \
    >>"$res/build.log" 2>&1; then
    # Without GoogleTest the benchmarks can still run.
    tests=OFF
    rm -rf "$build"
    if ! timeout "$(limit 180)" cmake -S "$root" -B "$build" "${cmake_args[@]}" -DMT_BUILD_TESTS=OFF \
      >>"$res/build.log" 2>&1; then
      tests=failed
    fi
  fi
  if [ "$tests" = failed ]; then
    why=$({ grep -m1 -E 'Could not find|No package|not found' "$res/build.log" ||
      grep -m1 'CMake Error' "$res/build.log" || true; } | cut -c1-200)
    note configure "FAILED" "$why; see build.log"
  else
    if [ "$tests" = OFF ]; then note configure "ok without tests" "GoogleTest not found: see build.log"; fi
    # mt, every plugin (as the build system names them: the family plugins are made in loops),
    # the gpu test binaries; keep going past a failing target.
    mapfile -t targets < <(cmake --build "$build" --target help 2>/dev/null |
      grep -oE '\bmt_(backend|model|data|comm)_[a-z0-9_]+' | sort -u)
    targets=(mt "${targets[@]}")
    if [ "$tests" = ON ]; then targets+=("${gpu_tests[@]}"); fi
    keep=(-k)
    if grep -q 'CMAKE_GENERATOR:INTERNAL=Ninja' "$build/CMakeCache.txt"; then keep=(-k 0); fi
    rc=0
    timeout "$(limit 420)" cmake --build "$build" -j "$(nproc)" --target "${targets[@]}" -- "${keep[@]}" \
      >>"$res/build.log" 2>&1 || rc=$?
    secs=$(($(date +%s) - t0))
    if [ -x "$mt" ] && [ -f "$build/lib/mt/plugins/libmt_backend_cuda.so" ]; then
      built=1
      if ((rc == 0)); then
        note build "ok" "${secs}s, ${#targets[@]} targets"
      else
        note build "partial (exit $rc)" "${secs}s; mt and the cuda plugin built; see build.log"
      fi
    else
      why=$({ grep -m1 'error:' "$res/build.log" || grep -m1 -E 'FAILED|Error' "$res/build.log" ||
        true; } | cut -c1-200)
      note build "FAILED (exit $rc)" "${secs}s; $why"
    fi
  fi
fi

# ---- tests, plugins ---------------------------------------------------------------------------
if ((built)); then
  t=$(limit 90)
  if ((t < 20)); then
    note ctest "skipped" "time budget"
  elif [ ! -f "$build/CTestTestfile.cmake" ]; then
    note ctest "not built" "configured without tests"
  else
    rc=0
    (cd "$build" && run_mt timeout -k 5 "$t" ctest -L gpu --output-on-failure -j 8) \
      >"$res/ctest.log" 2>&1 || rc=$?
    passed=$(grep -cE 'Test +#[0-9]+: .* Passed' "$res/ctest.log" || true)
    skipped=$(grep -cE '\*\*\*Skipped' "$res/ctest.log" || true)
    failed=$(grep -cE '\*\*\*(Failed|Timeout|Exception)|Not Run' "$res/ctest.log" || true)
    summary="$passed passed, $failed failed, $skipped skipped"
    case $rc in
      0) note ctest "ok" "$summary" ;;
      124 | 137) note ctest "TIMED OUT after ${t}s" "$summary so far" ;;
      *) note ctest "FAILED" "$summary; see ctest.log" ;;
    esac
  fi
  {
    echo "## mt plugins"
    run_mt timeout 60 "$mt" plugins 2>&1 || echo "(mt plugins failed)"
  } >>"$res/env.txt"
else
  note ctest "skipped" "no build"
fi
cat "$res/env.txt"

# ---- benchmarks -------------------------------------------------------------------------------
# bench SOURCE CASE SECONDS CMD...: runs CMD with a time limit; its JSON lines go to raw.jsonl
# tagged with source and case, its stderr to bench.log. Sets bench_rc.
bench_rc=0
bench() {
  local source=$1 label=$2 t
  t=$(limit "$3")
  shift 3
  bench_rc=0
  if ((t < 15)); then
    note "$source $label" "skipped" "time budget"
    bench_rc=124
    return 0
  fi
  echo "== [$(elapsed)s] $source $label: $* (limit ${t}s)" >>"$blog"
  local out
  out=$(timeout -k 5 "$t" "$@" 2>>"$blog") || bench_rc=$?
  printf '%s\n' "$out" | grep '^{' | sed "s/^{/{\"source\": \"$source\", \"case\": \"$label\", /" \
    >>"$raw" || true
  case $bench_rc in
    0) note "$source $label" "ok" ;;
    124 | 137) note "$source $label" "TIMED OUT" "after ${t}s" ;;
    *) note "$source $label" "exit $bench_rc" "$(tail -n 1 "$blog" | cut -c1-200)" ;;
  esac
}
peer=$root/bench/peers/torch_gpu.py
torch_bench() {
  local label=$1 t=$2
  shift 2
  if ((torch_ok)); then
    bench torch "$label" "$t" env PYTHONUNBUFFERED=1 "$py" "$peer" "$@"
  else
    note "torch $label" "n/a" "no torch with CUDA"
  fi
}

if ((built)); then bench mt gemm 60 "${mtc[@]}" bench gemm backend=cuda; fi
torch_bench gemm 60 gemm
if ((built)); then bench mt attention 90 "${mtc[@]}" bench attention backend=cuda; fi
torch_bench attention 60 attention

# Training: the same model, shapes and optimizer on both sides. mt uses flash attention, or
# dot_product when this build's cuda backend does not offer flash (the table says which).
train_case() {
  local label=$1 t=$2 model=$3 layers=$4 seq=$5 batch=$6
  local args=(--model="$model" max_target_length="$seq" per_device_batch_size="$batch"
    dtype=bfloat16 weight_dtype=float32 backend=cuda steps="$steps")
  if [ -n "$layers" ]; then args+=(base_num_decoder_layers="$layers"); fi
  if ((built)); then
    bench mt "$label" "$t" "${mtc[@]}" bench train "${args[@]}" attention=flash
    if ((bench_rc == 2)) && tail -n 3 "$blog" | grep -q "attention=flash is not available"; then
      bench mt "$label" "$t" "${mtc[@]}" bench train "${args[@]}" attention=dot_product
    fi
  fi
  local targs=(--model "$model" --seq "$seq" --batch "$batch" --steps "$steps" --name "$label")
  if [ -n "$layers" ]; then targs+=(--layers "$layers"); fi
  torch_bench "$label" 90 train "${targs[@]}"
}
# Batch 2 at T=4096 for the 4-layer 7b: with one sequence the optimizer's pass over 1.1B
# parameters (embedding and LM head included) is a large share of a step that real training
# amortises over a larger batch or accumulation; both sides run the same shapes.
train_case llama2-7b-4L 150 llama2-7b 4 4096 2
train_case llama-bench-1b 120 llama-bench-1b "" 2048 4
# Decode (mt only: prefill 512 tokens, then batch 1 and 8), the ~1B model in f32 and bf16 weights,
# then with int8 weights and an int8 KV cache (quantization=int8 quantize_kvcache=true).
if ((built)); then
  bench mt decode 60 "${mtc[@]}" bench decode backend=cuda --model=llama-bench-1b
  bench mt decode-int8 60 "${mtc[@]}" bench decode backend=cuda --model=llama-bench-1b \
    quantization=int8 quantize_kvcache=true
fi
# Where a step's time goes: the 4-layer 7b again with profile=true (a synchronisation after every
# op, so slower than the timed run above), 3 steps; the per-op table of steps 2..3 goes to
# bench.log, not to raw.jsonl (its throughput is not a result).
if ((built)); then
  t=$(limit 60)
  if ((t >= 15)); then
    echo "== [$(elapsed)s] mt profile: llama2-7b-4L, profile=true (limit ${t}s)" >>"$blog"
    prc=0
    timeout -k 5 "$t" "${mtc[@]}" bench train --model=llama2-7b base_num_decoder_layers=4 \
      max_target_length=4096 per_device_batch_size=2 dtype=bfloat16 weight_dtype=float32 \
      backend=cuda attention=flash steps=3 profile=true >/dev/null 2>>"$blog" || prc=$?
    if ((prc == 0)); then
      note "mt profile" "ok" "time per op in bench.log"
    else
      note "mt profile" "exit $prc" "$(tail -n 1 "$blog" | cut -c1-200)"
    fi
  else
    note "mt profile" "skipped" "time budget"
  fi
fi
# After the targets, an A/B: flash's dk/dv kernel on whole query tiles (more registers than a
# thread has at head_dim 128: ptxas spills) against the default two slices (the attention rows
# above); the table gives the ratio.
if ((built)); then
  bench mt-dkv1 attention 60 env MT_CUDA_FLASH_DKV_PARTS=1 "${mtc[@]}" bench attention \
    backend=cuda attention=flash shapes=1x4096x32x128,2x4096x32x128
fi
# torch.compile last and only with time to spare: compiling takes a minute or more.
if ((torch_ok)); then
  torch_bench llama2-7b-4L.compile 150 train --model llama2-7b --layers 4 --seq 4096 --batch 2 \
    --steps 8 --name llama2-7b-4L --compile
fi

# Last, with what time is left, compute-sanitizer over gpu_ops_test, both into sanitizer.log:
# memcheck over the flash and GEMM tests (out-of-bounds and misaligned accesses that a passing
# comparison can hide), then racecheck over the flash tiles (shared-memory hazards between warps,
# which the double-buffered tiles of the tensor-core kernels could have: a refill racing a read).
# sanitize TOOL FILTER FOUND: FOUND is the pattern of the line that names what the tool found.
sanitize() {
  local tool=$1 filter=$2 found=$3 t rc=0
  t=$(limit 90)
  if ((t < 30)); then
    note "$tool" "skipped" "time budget"
    return
  fi
  echo "==== $tool $filter" >>"$res/sanitizer.log"
  run_mt timeout -k 5 "$t" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$build/tests/gpu_ops_test" --gtest_filter="$filter" >"$res/sanitizer.tmp" 2>&1 || rc=$?
  cat "$res/sanitizer.tmp" >>"$res/sanitizer.log"
  case $rc in
    0) note "$tool" "ok" "nothing found ($filter)" ;;
    9) note "$tool" "FOUND" "$(grep -m1 -E "$found" "$res/sanitizer.tmp" | cut -c1-200)" ;;
    124 | 137) note "$tool" "TIMED OUT" "after ${t}s" ;;
    *) note "$tool" "exit $rc" "tests failed under $tool; see sanitizer.log" ;;
  esac
  rm -f "$res/sanitizer.tmp"
}
: >"$res/sanitizer.log"
if ((built)) && [ -x "$build/tests/gpu_ops_test" ] && command -v compute-sanitizer >/dev/null 2>&1; then
  sanitize memcheck 'GpuAttention.FlashSmall:GpuAttention.FlashTiles:GpuOps.Matmul' \
    'Invalid|Misaligned|ERROR'
  sanitize racecheck 'GpuAttention.FlashTiles' 'Race|hazard|ERROR'
fi

make_table
((built)) || exit 1
