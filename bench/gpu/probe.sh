#!/usr/bin/env bash
# A short device call (a few minutes) for a session whose GPU time is scarce: the gpu tests, the
# flash attention kernels against PyTorch's SDPA with their knobs as an A/B, Nsight Compute's
# reading of each flash kernel, llama2-7b's start-up and first steps (issue 21) and the NCCL
# communicator (world size 1). bench/gpu/run.sh is the full run (builds, every benchmark, the
# table); this one reuses a build made elsewhere when it runs here, and builds only when not.
#   bash bench/gpu/probe.sh [STEP ...]     steps: tests attention ncu 7b nccl train profile
#                                          sanitize decode int8 layouts gemv decodeprof
#                                          (default: tests attention ncu 7b nccl)
# MT_OLD_CUDA_PLUGIN=path/libmt_backend_cuda.so: another build of the cuda plugin (the version
# before a change) run beside this one, interleaved, in the attention and train steps ("old").
#
# The build: BUILD_DIR (default build-gpu: `cmake -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release
# -DMT_CUDA=ON -DMT_BUILD_TESTS=ON` on a Debian 12 developer machine, then mt, the plugins and the
# gpu_* tests) carried with the call, with the Debian packages it loads in MT_DEBS_DIR (default
# .devcarry/debs, unpacked into a private prefix). The build's paths are absolute (rpaths, the
# tests' plugin directory), so MT_BUILT_AT (default /work/main, where it was built) is made a link
# to this checkout when that path is free. Logs and results go to $OUT (else /tmp/mt-probe).
# The packages: `mkdir -p .devcarry/debs && cd .devcarry/debs && apt-get download libyaml-cpp0.7
# libfmt9 libtbb12 libtbbmalloc2 libtbbbind-2-5 libhwloc15 libopenblas0-pthread libgfortran5
# libquadmath0 libpcre2-8-0 libsentencepiece0 libutf8proc2 libopenmpi3 openmpi-bin openmpi-common
# libpmix2 libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0 libibverbs1 librdmacm1
# libnl-3-200 libnl-route-3-200 libpsm2-2 libpsm-infinipath1 libudev1` (15 MB; echo /.devcarry/
# >> .git/info/exclude). The workplace's device tool then carries, 8 paths: build-gpu/bin,
# build-gpu/lib, build-gpu/share, build-gpu/tests/gpu_ops_test, build-gpu/tests/gpu_train_test,
# build-gpu/tests/gpu_nccl_test, build-gpu/tests/plugins, .devcarry (~30 MB with the tree).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
start=$(date +%s)
res=${OUT:-/tmp/mt-probe}
mkdir -p "$res"
build=${BUILD_DIR:-build-gpu}
steps=("$@")
((${#steps[@]})) || steps=(tests attention ncu 7b nccl)
summary=$res/summary.txt
: >"$summary"
say() { echo "[$(($(date +%s) - start))s] $*" | tee -a "$summary" >&2; }
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }

# ---- the carried build and its libraries ------------------------------------------------------
built_at=${MT_BUILT_AT:-/work/main}
if [ ! -e "$built_at" ] && [ "$built_at" != "$root" ]; then
  mkdir -p "$(dirname "$built_at")" && ln -s "$root" "$built_at"
fi
debs=${MT_DEBS_DIR:-.devcarry/debs}
prefix=/tmp/mt-probe-deps
if compgen -G "$debs/*.deb" >/dev/null; then
  rm -rf "$prefix" && mkdir -p "$prefix"
  for f in "$debs"/*.deb; do dpkg-deb -x "$f" "$prefix" 2>/dev/null || (t=$(mktemp -d) && cd "$t" &&
    ar x "$root/$f" && tar -xf data.tar.* -C "$prefix"); done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$lib:$lib/openblas-pthread:$lib/openmpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # Open MPI from the unpacked packages: its components and helpers under the prefix.
  export OPAL_PREFIX=$prefix/usr OPAL_EXEC_PREFIX=$prefix/usr OPAL_BINDIR=$prefix/usr/bin \
    OPAL_LIBDIR=$lib/openmpi/lib OPAL_PKGLIBDIR=$lib/openmpi/lib/openmpi3 \
    OPAL_DATADIR=$prefix/usr/share OPAL_PKGDATADIR=$prefix/usr/share/openmpi \
    OPAL_SYSCONFDIR=$prefix/etc/openmpi
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_ess_singleton_isolated=1
  export OMPI_MCA_btl=self OMPI_MCA_plm=isolated OMPI_MCA_rmaps_base_oversubscribe=1
fi
# NCCL: the toolkit's, else the one PyTorch's wheels bring.
nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib"))' \
  2>/dev/null || true)
if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ]; then export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir; fi
mt=$build/bin/mt
{
  echo "## $(date -u +%FT%TZ) $(uname -srm), $(nproc) cores, root $root, build $build"
  timeout 20 nvidia-smi 2>&1 | head -20
  echo "## nccl: ${nccl_dir:-none from python}; toolkit: $(ls /usr/local/cuda/lib*/libnccl* 2>/dev/null | head -1)"
  echo "## mpi: $(command -v mpirun || echo 'no mpirun on PATH')"
  timeout 60 "$mt" plugins 2>&1
} >"$res/env.txt" 2>&1
if ! timeout 60 "$mt" plugins >/dev/null 2>&1 || ! grep -q "cuda" "$res/env.txt"; then
  say "carried build does not run here ($(tail -n 2 "$res/env.txt" | tr '\n' ' ')); building"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  build=build-probe
  mt=$build/bin/mt
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMT_CUDA=ON -DMT_BUILD_BENCH=OFF \
    -DMT_BUILD_TESTS=ON >"$res/build.log" 2>&1
  targets=$(ninja -C "$build" -t targets all | grep -o '^lib/mt/plugins/libmt_[a-z0-9_]*\.so' | sort -u)
  # shellcheck disable=SC2086
  timeout 300 ninja -C "$build" bin/mt $targets tests/gpu_ops_test tests/gpu_train_test \
    tests/gpu_nccl_test >>"$res/build.log" 2>&1 || say "build FAILED: $(grep -m1 error "$res/build.log")"
fi
say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)"

# run LABEL SECONDS CMD...: CMD's output into $res/LABEL.log; one line of the summary.
run() {
  local label=$1 t=$2 rc=0 t0
  shift 2
  t0=$(date +%s)
  timeout -k 5 "$t" "$@" >>"$res/$label.log" 2>&1 || rc=$?
  say "$label: exit $rc in $(($(date +%s) - t0))s: $(grep -E 'PASSED|FAILED|tests ran|Skipped|^\{' "$res/$label.log" | tail -n 2 | cut -c1-160 | tr '\n' ' ')"
  return $rc
}

# The old plugin: a copy of the build's lib/ and share/ with that plugin in place of this one
# (mt finds its plugins beside the core library, which LD_LIBRARY_PATH picks).
old=()
if [ -n "${MT_OLD_CUDA_PLUGIN:-}" ] && [ -f "$MT_OLD_CUDA_PLUGIN" ]; then
  od=/tmp/mt-probe-old
  rm -rf "$od" && mkdir -p "$od/lib/mt/plugins"
  cp -a "$build"/lib/libmt_core.so* "$od/lib/"
  for pl in "$build"/lib/mt/plugins/*.so; do ln -s "$root/$pl" "$od/lib/mt/plugins/"; done
  rm "$od/lib/mt/plugins/libmt_backend_cuda.so" &&
    cp "$MT_OLD_CUDA_PLUGIN" "$od/lib/mt/plugins/libmt_backend_cuda.so"
  ln -s "$root/$build/share" "$od/share"
  old=(env "LD_LIBRARY_PATH=$od/lib:$LD_LIBRARY_PATH")
fi

if want tests; then
  run tests 150 "$build/tests/gpu_ops_test" --gtest_brief=1
  run tests 120 "$build/tests/gpu_train_test" --gtest_brief=1 \
    "--gtest_filter=${MT_PROBE_TRAIN_FILTER:-*}"
  grep -E '^\[  FAILED|Failure|error' "$res/tests.log" | head -20 >>"$summary"
fi
if want nccl; then
  run nccl 90 "$build/tests/gpu_nccl_test"
  grep -E 'SKIPPED|FAILED|Failure|error|what' "$res/nccl.log" | head -8 >>"$summary"
fi

shapes=1x1024x32x128,2x4096x32x128,2x4096x32x64
if want attention; then
  for knob in MT_CUDA_FLASH_WARPS=4 MT_CUDA_FLASH_WARPS=8 MT_CUDA_FLASH_DKV_WARPS=4; do
    echo "== $knob" >>"$res/attention.log"
    run attention 90 env $knob "$mt" bench attention backend=cuda dtype=bfloat16 attention=flash \
      shapes=$shapes
    if ((${#old[@]})) && [ $knob = MT_CUDA_FLASH_WARPS=4 ]; then
      echo "== old" >>"$res/attention.log"
      run attention 90 "${old[@]}" "$mt" bench attention backend=cuda dtype=bfloat16 \
        attention=flash shapes=$shapes
    fi
  done
  echo "== causal=false" >>"$res/attention.log"
  run attention 60 "$mt" bench attention backend=cuda dtype=bfloat16 attention=flash \
    shapes=2x4096x32x128 causal=false
  echo "== gqa kv_heads=8" >>"$res/attention.log"
  run attention 60 "$mt" bench attention backend=cuda dtype=bfloat16 attention=flash \
    shapes=2x4096x32x128 kv_heads=8
  echo "== torch" >>"$res/attention.log"
  run attention 120 env PYTHONUNBUFFERED=1 python3 bench/peers/torch_gpu.py attention \
    --attention flash --shapes $shapes
  echo "== torch gqa kv_heads=8" >>"$res/attention.log"
  run attention 60 env PYTHONUNBUFFERED=1 python3 bench/peers/torch_gpu.py attention \
    --attention flash --shapes 2x4096x32x128 --kv_heads 8
  echo "== torch causal=false" >>"$res/attention.log"
  run attention 60 env PYTHONUNBUFFERED=1 python3 bench/peers/torch_gpu.py attention \
    --attention flash --shapes 2x4096x32x128 --causal false
  python3 - "$res/attention.log" >>"$summary" 2>&1 <<'EOF'
import json, sys
section = "?"
for line in open(sys.argv[1]):
    if line.startswith("== "):
        section = line[3:].strip()
    elif line.startswith("{"):
        r = json.loads(line)
        shape = "x".join(str(r.get(k)) for k in ("B", "T", "H", "D"))
        print(f"{section:24} {shape:14} causal={r.get('causal')} fwd {r.get('fwd_tflops')} "
              f"fwd+bwd {r.get('fwd_bwd_tflops')} TFLOP/s")
EOF
fi
if want int8; then
  # Issue 23's int8 decode on the device (never run on one before 2026-11-27): the backend op
  # tests on "cuda" (dequantize_rows_q8, matmul_q8, the cache writes), then mt bench decode with
  # an int8 KV cache and with int8 weights.
  bo=${MT_BACKEND_OPS_TEST:-$build/tests/backend_ops_test}
  run int8 120 "$bo" --gtest_brief=1 --gtest_filter='*/cuda'
  grep -E '^\[  FAILED|Failure' "$res/int8.log" | head -10 >>"$summary"
  for words in "" "quantize_kvcache=true" "quantize_kvcache=true kv_quant_axis=dkv" "quantization=int8"; do
    echo "== decode $words" >>"$res/int8.log"
    # shellcheck disable=SC2086
    run int8 120 "$mt" bench decode backend=cuda --model=llama-bench-1b $words
  done
  grep -E '^==|tokens_per_sec' "$res/int8.log" | grep -o '^==.*\|"dtype": "[a-z0-9]*"\|"[a-z0-9_]*tokens_per_sec": [0-9.]*' | tr '\n' ' ' | sed 's/==/\n==/g' >>"$summary"
  echo >>"$summary"
fi
if want ncu && command -v ncu >/dev/null; then
  # One launch of each tensor-core flash kernel at B=2 T=4096 H=32 D=128 (after the warm-up).
  run ncu 150 ncu --clock-control none --kernel-name regex:'tc_(fwd|dq|dkv)_kernel' \
    --launch-skip 2 --launch-count 3 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    "$mt" bench attention backend=cuda dtype=bfloat16 attention=flash shapes=2x4096x32x128 \
    warmup=1 iters=1 repeats=1
  grep -E 'tc_(fwd|dq|dkv)|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall' \
    "$res/ncu.log" | head -60 >>"$summary"
fi
if want train; then
  # The 4-layer llama2-7b of bench/gpu/run.sh (T=4096, batch 2, bf16 with f32 masters), this
  # build and the old one, then PyTorch eager on the same script.
  targs=(--model=llama2-7b base_num_decoder_layers=4 max_target_length=4096 per_device_batch_size=2
    dtype=bfloat16 weight_dtype=float32 backend=cuda steps=6 attention=flash)
  run train 120 "$mt" bench train "${targs[@]}"
  run train 120 env MT_CUDA_FLASH_DKV_WARPS=4 "$mt" bench train "${targs[@]}"
  if ((${#old[@]})); then run train 120 "${old[@]}" "$mt" bench train "${targs[@]}"; fi
  run train 120 env PYTHONUNBUFFERED=1 python3 bench/peers/torch_gpu.py train --model llama2-7b \
    --layers 4 --seq 4096 --batch 2 --steps 6 --name llama2-7b-4L
  grep -o '"tokens_per_sec": [0-9.]*\|"mfu": [0-9.]*' "$res/train.log" | paste - - >>"$summary"
fi
if want profile; then
  # Where a training step's time goes: the same run with profile=true (a synchronisation after
  # every op), the per-op table of the steady steps.
  run profile 120 "$mt" bench train --model=llama2-7b base_num_decoder_layers=4 \
    max_target_length=4096 per_device_batch_size=2 dtype=bfloat16 weight_dtype=float32 \
    backend=cuda steps=3 attention=flash profile=true
  grep -E '^  [a-z_0-9]+ +[0-9.]+%' "$res/profile.log" | head -24 >>"$summary"
fi
if want sanitize && command -v compute-sanitizer >/dev/null; then
  run sanitize 90 compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/gpu_ops_test" \
    --gtest_filter='GpuAttention.Flash*' --gtest_brief=1
  [ "${MT_PROBE_RACECHECK:-1}" = 1 ] && run sanitize 90 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "$build/tests/gpu_ops_test" --gtest_filter='GpuAttention.FlashTiles*' --gtest_brief=1
  grep -E 'ERROR SUMMARY|Invalid|Race|hazard' "$res/sanitize.log" | head -6 >>"$summary"
fi
if want decode; then
  # mt's decode on the device (issue 22: the whole bench within 60 s): llama-bench-1b, f32 and
  # bf16 weights, prefill 512 and batch 1 and 8.
  # Decode steps recorded as CUDA graphs (the default) against each op as it comes
  # (MT_DECODE_RECORDING=0), then the Hugging Face peer (eager generate, dynamic and static cache).
  echo "== recorded" >>"$res/decode.log"
  run decode 120 "$mt" bench decode backend=cuda --model=llama-bench-1b
  echo "== each op (MT_DECODE_RECORDING=0)" >>"$res/decode.log"
  run decode 120 env MT_DECODE_RECORDING=0 "$mt" bench decode backend=cuda --model=llama-bench-1b
  echo "== transformers" >>"$res/decode.log"
  run decode 120 env PYTHONUNBUFFERED=1 python3 bench/peers/hf_decode_gpu.py --model llama-bench-1b
  run decode 120 env PYTHONUNBUFFERED=1 python3 bench/peers/hf_decode_gpu.py --model llama-bench-1b --static
  grep -E '^==|"dtype": "[a-z0-9]*"|tokens_per_sec' "$res/decode.log" | grep -o '^==.*\|"dtype": "[a-z0-9]*"\|"cache": "[a-z]*"\|"decode_steps": "[^"]*"\|"[a-z0-9_]*tokens_per_sec": [0-9.]*' | tr '\n' ' ' | sed 's/==/\n==/g' >>"$summary"
  echo >>"$summary"
fi
if want layouts; then
  # Decode with the projections as [N, K] rows and q/k/v, gate/up fused (the default since
  # 2026-11-27), against rows apart (MT_FUSE_PROJECTIONS=0) and [K, N] as declared
  # (MT_TRANSPOSE_PROJECTIONS=0), interleaved, two rounds; then int8 weights fused and apart.
  # MT_PROBE_AB_ONLY=1: only the A/B against MT_OLD_CUDA_PLUGIN and the sanitizers.
  ab_only=${MT_PROBE_AB_ONLY:-0}
  for round in 1 2; do
    [ "$ab_only" = 1 ] && break
    for env in MT_FUSE_PROJECTIONS=1 MT_FUSE_PROJECTIONS=0 MT_TRANSPOSE_PROJECTIONS=0; do
      echo "== bf16 $env round $round" >>"$res/layouts.log"
      run layouts 90 env $env "$mt" bench decode backend=cuda --model=llama-bench-1b dtypes=bfloat16
    done
  done
  # The cuda plugin before a change (MT_OLD_CUDA_PLUGIN), interleaved with this one.
  if ((${#old[@]})); then
    for round in 1 2 3; do
      echo "== bf16 this plugin round $round" >>"$res/layouts.log"
      run layouts 90 "$mt" bench decode backend=cuda --model=llama-bench-1b dtypes=bfloat16
      echo "== bf16 old plugin round $round" >>"$res/layouts.log"
      run layouts 90 "${old[@]}" "$mt" bench decode backend=cuda --model=llama-bench-1b \
        dtypes=bfloat16
    done
  fi
  for env in MT_FUSE_PROJECTIONS=1 MT_TRANSPOSE_PROJECTIONS=0; do
    [ "$ab_only" = 1 ] && break
    echo "== f32 $env" >>"$res/layouts.log"
    run layouts 90 env $env "$mt" bench decode backend=cuda --model=llama-bench-1b dtypes=float32
  done
  for env in MT_FUSE_PROJECTIONS=1 MT_FUSE_PROJECTIONS=0; do
    [ "$ab_only" = 1 ] && break
    echo "== int8 $env" >>"$res/layouts.log"
    run layouts 90 env $env "$mt" bench decode backend=cuda --model=llama-bench-1b \
      dtypes=bfloat16 quantization=int8
  done
  command -v compute-sanitizer >/dev/null && run layouts 120 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$build/tests/gpu_train_test" --gtest_filter='*FusedRows*' --gtest_brief=1
  command -v compute-sanitizer >/dev/null && run layouts 120 compute-sanitizer --tool racecheck \
    --error-exitcode 9 "$build/tests/gpu_ops_test" --gtest_filter='GpuAttention.FlashDecode*' \
    --gtest_brief=1
  grep -E 'ERROR SUMMARY|Invalid|Race|hazard' "$res/layouts.log" | head -6 >>"$summary"
  grep -E '^==|tokens_per_sec' "$res/layouts.log" | grep -o '^==.*\|"[a-z0-9_]*tokens_per_sec": [0-9.]*' | tr '\n' ' ' | sed 's/==/\n==/g' >>"$summary"
  echo >>"$summary"
fi
if want gemv; then
  # Two launch-side choices, off by default until measured here: decode's matrix-vector products
  # in rows_gemv_kernel (MT_CUDA_ROWS_GEMV=1) instead of cuBLASLt, and programmatic dependent
  # launch of every mt kernel (MT_CUDA_PDL=1). First the gpu tests with both on (PDL's waits are
  # what keeps each kernel after the one before: a missing one shows as a wrong result here) and
  # memcheck of the new kernel; then llama-bench-1b decode (batch 1 and 8), bf16, each of the four
  # settings interleaved over three rounds, and f32 with both off and on. A fifth bf16 setting,
  # both on with MT_FUSE_PROJECTIONS=0, asks whether batch 8 should still fuse q/k/v and gate/up
  # under the GEMV: fused, a step pays five column copies a layer (Graph::split of the fused
  # output, views only at one row); apart, three more products, which a GEMV reads at the same
  # bytes as the fused one. A sixth, all three on with MT_CUDA_JOINT_COPIES=1, writes each
  # split's pieces in one launch (five copy launches a layer become two at batch 8) and a
  # step's k and v cache rows in one.
  # `MT_CUDA_ROWS_GEMV=1 MT_CUDA_PDL=1 MT_CUDA_JOINT_COPIES=1 bash bench/gpu/probe.sh decodeprof`
  # shows the kernels' times.
  on="MT_CUDA_ROWS_GEMV=1 MT_CUDA_PDL=1 MT_CUDA_JOINT_COPIES=1"
  run gemv 150 env $on "$build/tests/gpu_ops_test" --gtest_brief=1
  run gemv 150 env $on "$build/tests/gpu_train_test" --gtest_brief=1
  command -v compute-sanitizer >/dev/null && run gemv 120 compute-sanitizer --tool memcheck \
    --error-exitcode 9 "$build/tests/gpu_ops_test" \
    --gtest_filter='*RowsGemv*:*SplitColumns*:*ScatterRowsEach*' \
    --gtest_brief=1
  for round in 1 2 3; do
    for v in "0 0 1 0" "1 0 1 0" "0 1 1 0" "1 1 1 0" "1 1 0 0" "1 1 1 1"; do
      read -r gemv pdl fuse joint <<<"$v"
      echo "== bf16 MT_CUDA_ROWS_GEMV=$gemv MT_CUDA_PDL=$pdl MT_FUSE_PROJECTIONS=$fuse" \
        "MT_CUDA_JOINT_COPIES=$joint round $round" >>"$res/gemv.log"
      run gemv 90 env MT_CUDA_ROWS_GEMV=$gemv MT_CUDA_PDL=$pdl MT_FUSE_PROJECTIONS=$fuse \
        MT_CUDA_JOINT_COPIES=$joint "$mt" \
        bench decode backend=cuda --model=llama-bench-1b dtypes=bfloat16 parts=batch1,batch8
    done
  done
  for v in 0 1; do
    echo "== f32 MT_CUDA_ROWS_GEMV=$v MT_CUDA_PDL=$v" >>"$res/gemv.log"
    run gemv 90 env MT_CUDA_ROWS_GEMV=$v MT_CUDA_PDL=$v "$mt" bench decode backend=cuda \
      --model=llama-bench-1b dtypes=float32 parts=batch1,batch8
  done
  grep -E 'ERROR SUMMARY|Invalid|FAILED|PASSED' "$res/gemv.log" | head -8 >>"$summary"
  grep -E '^==|tokens_per_sec' "$res/gemv.log" | grep -o '^==.*\|"[a-z0-9_]*tokens_per_sec": [0-9.]*' | tr '\n' ' ' | sed 's/==/\n==/g' >>"$summary"
  echo >>"$summary"
fi
if want decodeprof && command -v ncu >/dev/null; then
  # Each kernel of a bf16 decode step on llama-bench-1b, batch 1 and batch 8, as it runs in
  # place (no cache flush, no clock control; steps run as they come, MT_DECODE_RECORDING=0, the
  # same kernels a recorded step replays): the last step's kernels by name (count, total and
  # mean time) and in order, in decodeprof_batchN.txt.
  for part in batch1 batch8; do
    csv=/tmp/mt-probe-decodeprof-$part.csv
    run decodeprof 240 env MT_DECODE_RECORDING=0 ncu --clock-control none --cache-control none \
      --metrics gpu__time_duration.sum --csv --page raw --log-file "$csv" \
      "$mt" bench decode backend=cuda --model=llama-bench-1b dtypes=bfloat16 parts=$part steps=2
    python3 - "$csv" >"$res/decodeprof_$part.txt" 2>&1 <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
h = rows[head]
name, dur = h.index("Kernel Name"), h.index("gpu__time_duration.sum")
ks = []  # (name, microseconds); ncu writes nanoseconds with thousands separators
for r in rows[head + 2:]:
    try:
        ks.append((r[name], float(r[dur].replace(",", "")) / 1e3))
    except (ValueError, IndexError):
        pass
# The last step: after the second-to-last occurrence of the run's last kernel (a step's last).
last = ks[-1][0]
ends = [i for i, k in enumerate(ks) if k[0] == last]
step = ks[ends[-2] + 1:] if len(ends) > 1 else ks[-400:]
print(f"last step: {len(step)} kernels, total {sum(d for _, d in step):.1f} us")
agg = {}
for n, d in step:
    a = agg.setdefault(n[:90], [0, 0.0])
    a[0] += 1
    a[1] += d
for n, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{c:5d} {t:10.1f} {t / c:9.2f}  {n}")
print("the step's first 40 kernels:")
for n, d in step[:40]:
    print(f"{d:9.2f}  {n[:100]}")
PY
    echo "== decodeprof $part" >>"$summary"
    head -16 "$res/decodeprof_$part.txt" >>"$summary"
  done
fi
if want 7b; then
  # Issue 21's acceptance: `mt run --model=llama2-7b --backend=cuda` on this device as the user
  # types it (on an 80 GB card the plan refuses it, exit 2, before allocating), the words the plan
  # proposes, and the bf16 words that fit an 80 GB card at GPU speed; each whole run's wall time
  # includes start-up (initialisation on the device).
  run 7b 120 "$mt" run --model=llama2-7b --backend=cuda steps=2 log_period=1 \
    base_output_directory=/tmp/mt-7b-0 enable_checkpointing=false
  grep -E 'DOES NOT FIT|fits|^  [a-z_]+=.*peak|error' "$res/7b.log" | head -4 >>"$summary"
  run 7b 150 "$mt" run --model=llama2-7b --backend=cuda steps=2 log_period=1 \
    optimizer_memory_host_offload=true base_output_directory=/tmp/mt-7b-a enable_checkpointing=false
  words=(dtype=bfloat16 weight_dtype=bfloat16 remat_policy=full)
  "$mt" plan --model=llama2-7b "${words[@]}" backend=cuda 2>&1 | grep -E '^  peak' | head -1 >>"$summary"
  run 7b 150 "$mt" run --model=llama2-7b backend=cuda steps=4 log_period=1 "${words[@]}" \
    base_output_directory=/tmp/mt-7b-c enable_checkpointing=false
  grep -E 'done\.' "$res/7b.log" >>"$summary"
  for d in 0 a c; do tail -n 1 /tmp/mt-7b-$d/default/metrics.jsonl >>"$summary" 2>/dev/null; done
fi
say "done"
cat "$summary"
