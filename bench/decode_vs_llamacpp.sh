#!/usr/bin/env bash
# CPU inference throughput: `mt bench decode` against llama.cpp's llama-bench on the same random
# weights, for each model and dtype (float32, bfloat16): prefill of one 512-token prompt, and
# decode at batch 1 after a DEPTH-token prompt (default 128: llama-bench's tg test at that depth,
# mt's depth=), at the same thread count, interleaved (mt, then llama.cpp, then again) so that a
# machine shared with other work slows each alike. Prints every run's JSON line, then one
# summary line per model and dtype with the medians of each side, the ratios mt / llama.cpp, and
# both parameter counts (they must agree: the same tensors). A llama-bench test that fails is reported with its exit status and
# tried once more, prefill without weight repacking (--repack 0) and decode at depth 0; the
# summary then says so (llamacpp_prefill_without_repack, llamacpp_decode_depth).
#   bench/decode_vs_llamacpp.sh [model ...]
#   (default: llama-bench-m llama-bench-1b mixtral-bench-100m, the last a mixture of experts:
#   llama.cpp's converter writes Mixtral's experts as its merged expert tensors)
# A model is a name of configs/models, optionally with mt config overrides after a colon, e.g.
#   bench/decode_vs_llamacpp.sh llama-bench-m deepseek3-test:kv_lora_rank=16,vocab_size=512
# The weights: `mt convert --to=hf` without --input exports the initial weights that `mt bench
# decode` starts from (the same words, so the same init_weights_seed), and
# bench/peers/llamacpp_gguf.py turns that into float32 and bfloat16
# GGUF files through the checkout's own converter (convert_hf_to_gguf.py's conversion package)
# with a synthetic vocabulary of the model's size (llama-bench feeds token ids only). They are
# kept in WORK/models/ and made again when mt's build (binary, plugins, configs) is newer. llama.cpp keeps its default
# KV cache (f16; llama-bench has no f32 cache) and flash-attention setting (auto).
# Run it on an otherwise idle machine: with THREADS equal to the cores and one of them busy with
# other work, llama.cpp's threads wait for each other at every op (seen here on 2 cores: decode
# ~10x slower than at 1 thread), which would measure the machine's load, not llama.cpp.
# Environment:
#   LLAMA_CPP_DIR  a llama.cpp source checkout (convert_hf_to_gguf.py, gguf-py, tools/llama-bench);
#                  without one, or without a Python that has numpy, torch, safetensors and
#                  transformers (its converter's imports), llama.cpp is skipped, saying why, and
#                  mt still runs. llama-bench is built in WORK/llama-build (cmake, GGML_NATIVE=ON,
#                  static, the llama-bench target only, JOBS parallel jobs (default 2);
#                  reused once built).
#   MT_BUILD    mt's build directory (default build)
#   PYTHON      the Python for the converter (default .venv-tf5 if it imports torch, else python3)
#   THREADS     threads of both (default 2)
#   REPS        interleaved repetitions (default 3: each dtype's mt run beside its llama.cpp
#               run, mt first in odd repetitions); each llama-bench call times one run
#               (-r 1) after its own warm-up, as mt times one prefill after one
#   STEPS       decode steps timed (default 16: mt's steps=, llama-bench's -n)
#   DEPTH       the prompt's tokens before them (default 128: mt's depth=, llama-bench's -d); the
#               attention reads that much KV cache a step, e.g. DEPTH=4096 for long contexts
#   DTYPES      which of "float32 bfloat16 int8" to run (default "float32 bfloat16"; each is
#               one mt bench decode run of its own, dtypes=<it>). int8: mt's
#               quantization=int8 (bfloat16 compute) against llama.cpp's q8_0 GGUF of the same
#               weights
#   WORK        where llama.cpp's build, the weights and results.jsonl go (default
#               /tmp/mt-vs-llamacpp)
#   ISA         native (default): mt runs without an inherited OPENBLAS_CORETYPE, choosing its
#               f32 GEMM kernels itself as on a machine where nobody set it (an environment's
#               OPENBLAS_CORETYPE=Haswell held mt's f32 prefill to about 0.6x of its rate
#               without it on a Zen 5 EPYC, llama.cpp untouched); or avx2: both peers held to
#               AVX2 + FMA on an AVX-512 machine, to measure the kernels an AVX2-only CPU
#               (Zen 3, Intel client parts) runs, on this machine's memory: llama.cpp built
#               with GGML_NATIVE=OFF and GGML_AVX512=OFF (in WORK/llama-build-avx2), mt run
#               with MT_CPU_MATVEC=avx2,
#               MT_FLASH_KERNELS=avx2, MT_CPU_BF16DOT=0 (bf16 GEMMs on the f32 FMA path) and
#               OPENBLAS_CORETYPE=Haswell. mt's element-wise loops still take their x86-64-v4
#               clones (chosen by the CPU): a small share of a step. Not a measurement of an
#               AVX2 machine's memory system.
# The summary gives each side's median and best run: on a shared machine whose memory bandwidth
# moves between runs (seen here: 34 or 53 GB/s read, for minutes at a time), the best run is the
# code's own rate, the median the one a user sees; compare ratios of like with like. It also
# gives the median of each repetition's own ratio (paired_*: mt against the llama.cpp run made
# beside it), which a change of bandwidth between repetitions moves least.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(llama-bench-m llama-bench-1b mixtral-bench-100m)
threads=${THREADS:-2}
isa=${ISA:-native}
mt_env=()
case $isa in
  native) lc_flags=(-DGGML_NATIVE=ON) lc_build_name=llama-build mt_env=(-u OPENBLAS_CORETYPE) ;;
  avx2)
    lc_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
              -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
              -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
    lc_build_name=llama-build-avx2
    mt_env=(MT_CPU_MATVEC=avx2 MT_FLASH_KERNELS=avx2 MT_CPU_BF16DOT=0 OPENBLAS_CORETYPE=Haswell) ;;
  *) echo "decode_vs_llamacpp: ISA=$isa: want native or avx2" >&2; exit 2 ;;
esac
reps=${REPS:-3}
steps=${STEPS:-16}
depth=${DEPTH:-128}
read -r -a dtypes <<< "${DTYPES:-float32 bfloat16}"
mt_build=${MT_BUILD:-$root/build}
mt=$mt_build/bin/mt
work=${WORK:-/tmp/mt-vs-llamacpp}
mkdir -p "$work"
results=$work/results.jsonl
: > "$results"
: > "$work/mt.log"
: > "$work/llama-bench.log"

say() { echo "$1" | tee -a "$results"; }

py=${PYTHON:-}
if [ -z "$py" ]; then
  py=python3
  if "$root/.venv-tf5/bin/python" -c "import torch" 2>/dev/null; then py=$root/.venv-tf5/bin/python; fi
fi

# A model argument: NAME[:key=value,...] -> mt's words, and a label for files and JSON.
mt_words() {
  echo "--model=${1%%:*}"
  if [[ $1 == *:* ]]; then tr ',' '\n' <<< "${1#*:}"; fi
}
label_of() { tr ':,=/' '_+._' <<< "$1"; }  # no comma: llama-bench splits -m at commas

# llama.cpp: the checkout, a Python for its converter, and llama-bench built from it.
llama_bench=""
lcpp=${LLAMA_CPP_DIR:-}
if [ -z "$lcpp" ]; then
  say '{"peer": "llama.cpp", "skipped": "LLAMA_CPP_DIR is not set (a llama.cpp source checkout)"}'
elif [ ! -f "$lcpp/convert_hf_to_gguf.py" ] || [ ! -f "$lcpp/tools/llama-bench/llama-bench.cpp" ]; then
  say "{\"peer\": \"llama.cpp\", \"skipped\": \"LLAMA_CPP_DIR=$lcpp has no convert_hf_to_gguf.py or tools/llama-bench\"}"
elif ! "$py" -c "import numpy, torch, safetensors, transformers" 2>/dev/null; then
  say "{\"peer\": \"llama.cpp\", \"skipped\": \"$py lacks numpy, torch, safetensors or transformers for the GGUF converter (set PYTHON=...)\"}"
else
  build=$work/$lc_build_name
  if [ ! -x "$build/bin/llama-bench" ]; then
    echo "decode_vs_llamacpp: building llama-bench in $build (several minutes)..." >&2
    if ! { cmake -S "$lcpp" -B "$build" -DCMAKE_BUILD_TYPE=Release "${lc_flags[@]}" \
             -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF &&
           cmake --build "$build" --target llama-bench -j "${JOBS:-2}"; } > "$work/llama-build.log" 2>&1; then
      say "{\"peer\": \"llama.cpp\", \"skipped\": \"llama-bench did not build (see $work/llama-build.log)\"}"
    fi
  fi
  [ -x "$build/bin/llama-bench" ] && llama_bench=$build/bin/llama-bench
fi

# The GGUF files of one model, made unless those of an earlier run are newer than mt's build.
make_gguf() {
  local dir=$1 log=$1/make.log
  local -a words
  mapfile -t words < <(mt_words "$2")
  if [ -f "$dir/done" ] && [ -f "$dir/q8_0.gguf" ] && [ -z "$(find "$mt_build/bin" "$mt_build/lib" "$mt_build/share" -newer "$dir/done" -print -quit 2> /dev/null)" ]; then
    return 0
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  echo "decode_vs_llamacpp: writing $2's weights for llama.cpp (log: $log)..." >&2
  # The initial weights of the words' init_weights_seed, which `mt bench decode` starts from.
  "$mt" convert --to=hf "${words[@]}" max_target_length=1024 num_threads="$threads" \
    --output="$dir/hf" > "$log" 2>&1 || return 1
  local t
  for t in f32 bf16 q8_0; do
    "$py" "$root/bench/peers/llamacpp_gguf.py" --llama-cpp "$lcpp" --input "$dir/hf" \
      --outtype "$t" --outfile "$dir/$t.gguf" >> "$log" 2>&1 || return 1
  done
  rm -rf "$dir/hf"
  touch "$dir/done"
}

declare -A gguf_dir=()
if [ -n "$llama_bench" ]; then
  for m in "${models[@]}"; do
    dir=$work/models/$(label_of "$m")
    if make_gguf "$dir" "$m"; then
      gguf_dir[$m]=$dir
    else
      say "{\"peer\": \"llama.cpp\", \"model\": \"$m\", \"skipped\": \"its GGUF could not be written (see $dir/make.log)\"}"
    fi
  done
fi

# One JSON line per run: mt's per-dtype results, llama-bench's tests, tagged with model and rep.
tag() {
  python3 -c '
import json, sys
peer, model, rep, isa = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
for line in sys.stdin:
    if not line.strip().startswith("{"):
        continue
    j = json.loads(line)
    if peer == "mt":
        for r in j["results"]:
            if r.get("quantization") == "int8":
                r["dtype"] = "int8"
            print(json.dumps({"peer": "mt", "model": model, "rep": rep, "isa": isa, **{k: v for k, v in r.items() if k != "model"},
                              "memory_bandwidth_triad_bytes_per_sec": j["memory_bandwidth_triad_bytes_per_sec"]}))
    else:
        n_prompt, n_gen, depth = j["n_prompt"], j["n_gen"], j["n_depth"]
        test = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}@d{depth}"
        print(json.dumps({"peer": "llama.cpp", "model": model, "rep": rep, "isa": isa, "dtype": sys.argv[5], "test": test,
                          "tokens_per_sec": round(j["avg_ts"], 2), "model_n_params": j["model_n_params"],
                          "model_size": j["model_size"], "n_threads": j["n_threads"], "type_k": j["type_k"],
                          "flash_attn": j.get("flash_attn"), "repack": j.get("repack"),
                          "build_commit": j.get("build_commit")}))
' "$@"
}

# One dtype at a time, each peer's run right beside the other's (the machine's bandwidth moves
# between minutes: mt's three dtypes in one go, then llama.cpp's, put the two runs of a dtype
# minutes apart), and the order alternates between repetitions so a drift favours neither.
# Both read the loop's model ($m, its words) and repetition ($rep); they take the dtype.
mt_run() {
  local dt=$1 extra
  case $dt in int8) extra=(dtypes=bfloat16 quantization=int8) ;; *) extra=(dtypes="$dt") ;; esac
  env "${mt_env[@]}" "$mt" bench decode "${words[@]}" "${extra[@]}" num_threads="$threads" \
    steps="$steps" depth="$depth" 2>> "$work/mt.log" | tag mt "$m" "$rep" "$isa" | tee -a "$results" ||
    say "{\"peer\": \"mt\", \"model\": \"$m\", \"dtype\": \"$dt\", \"failed\": \"see $work/mt.log\"}"
}
lc_run() {
  local dt=$1 g gguf
  [ -n "${gguf_dir[$m]:-}" ] || return 0
  case $dt in float32) g=f32 ;; bfloat16) g=bf16 ;; *) g=q8_0 ;; esac
  gguf=${gguf_dir[$m]}/$g.gguf
  # Prefill and decode are separate calls, so that one test's failure keeps the other's figure,
  # and a test that fails is tried once more in a fallback form, said in its JSON: prefill
  # without llama.cpp's weight repacking (--repack 0), decode at depth 0 (no prompt before it).
  # Seen on a Xeon VM with AMX: llama.cpp's q8_0 prefill on its AMX tiles (the repacked
  # weights) died of SIGILL, which also killed the decode test's prompt; its q8_0
  # decode at depth 0 (the repacked weights' VNNI path) ran, about 1.6x its --repack 0 rate.
  local test args rc try
  for test in pp512 "tg$steps@d$depth"; do
    for try in 1 2; do
      case $test/$try in
        pp*/1) args=(-p 512 -n 0) ;;
        pp*/2) args=(-p 512 -n 0 --repack 0) ;;
        *1) args=(-p 0 -n "$steps" -d "$depth") ;;
        *2) args=(-p 0 -n "$steps" -d 0) ;;
      esac
      rc=0
      "$llama_bench" -m "$gguf" "${args[@]}" -t "$threads" -r 1 -o jsonl \
        2>> "$work/llama-bench.log" > "$work/lc.out" || rc=$?
      tag llama.cpp "$m" "$rep" "$isa" "$dt" < "$work/lc.out" | tee -a "$results"
      [ $rc != 0 ] || break
      say "{\"peer\": \"llama.cpp\", \"model\": \"$m\", \"dtype\": \"$dt\", \"test\": \"$test\", \"args\": \"${args[*]}\", \"failed\": \"llama-bench exited with status $rc$([ $rc -gt 128 ] && echo " (signal $((rc - 128)))"); see $work/llama-bench.log\"}"
    done
  done
}
for rep in $(seq "$reps"); do
  for m in "${models[@]}"; do
    mapfile -t words < <(mt_words "$m")
    for dt in "${dtypes[@]}"; do
      if [ $((rep % 2)) = 1 ]; then
        mt_run "$dt"
        lc_run "$dt"
      else
        lc_run "$dt"
        mt_run "$dt"
      fi
    done
  done
done

python3 - "$results" "$steps" "$isa" "$depth" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
isa = sys.argv[3]
tg = f"tg{sys.argv[2]}@d{sys.argv[4]}"
by = {}
for r in runs:
    if "dtype" not in r or ("failed" in r) or ("skipped" in r):
        continue
    d = by.setdefault((r["model"], r["dtype"]), {})
    rep = d.setdefault("by_rep", {}).setdefault(r.get("rep"), {})  # one run of each a rep
    if r["peer"] == "mt":
        rep["mt_prefill"] = r["prefill_512_tokens_per_sec"]
        rep["mt_decode"] = r["decode_batch1_tokens_per_sec"]
        d["mt_weight_bytes"] = r["weight_bytes"]
    elif r["test"] == "pp512":
        rep["lc_prefill"] = r["tokens_per_sec"]
        d["llamacpp_params"] = r["model_n_params"]
        if r.get("repack") is False:  # the fallback (see lc_run)
            d["llamacpp_prefill_without_repack"] = True
    elif r["test"] in (tg, tg.split("@")[0] + "@d0"):
        rep["lc_decode"] = r["tokens_per_sec"]
        if r["test"] != tg:  # the fallback: llama.cpp decodes without the prompt's context
            d["llamacpp_decode_depth"] = 0
for (model, dtype), d in by.items():
    series = {}  # each figure's runs, from the reps
    for x in d["by_rep"].values():
        for k, v in x.items():
            series.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in series.items()}
    best = {k: max(v) for k, v in series.items()}
    out = {"summary": "decode tokens/s, medians and best runs", "model": model, "dtype": dtype,
           "isa": isa, "decode_depth": int(sys.argv[4])}
    if "mt_weight_bytes" in d and dtype != "int8":  # int8 mixes int8 rows and bf16 tensors
        out["mt_params"] = d["mt_weight_bytes"] // (4 if dtype == "float32" else 2)
    if "llamacpp_params" in d:
        out["llamacpp_params"] = d["llamacpp_params"]
        if "mt_params" in out:
            out["same_params"] = out["mt_params"] == d["llamacpp_params"]
    for what, name in (("prefill", "prefill_512"), ("decode", "decode_batch1")):
        for side, peer in (("mt", "mt"), ("lc", "llamacpp")):
            if f"{side}_{what}" in med:
                out[f"{peer}_{name}_tokens_per_sec"] = round(med[f"{side}_{what}"], 2)
                out[f"{peer}_{name}_best_tokens_per_sec"] = round(best[f"{side}_{what}"], 2)
        if f"mt_{what}" in med and f"lc_{what}" in med:
            out[f"mt_over_llamacpp_{name}"] = round(med[f"mt_{what}"] / med[f"lc_{what}"], 3)
            out[f"best_mt_over_best_llamacpp_{name}"] = round(best[f"mt_{what}"] / best[f"lc_{what}"], 3)
            # Each repetition's mt run against the llama.cpp run beside it (the same minute's
            # memory bandwidth), the median of those ratios.
            pairs = [x[f"mt_{what}"] / x[f"lc_{what}"] for x in d["by_rep"].values()
                     if f"mt_{what}" in x and f"lc_{what}" in x]
            if pairs:
                out[f"paired_mt_over_llamacpp_{name}"] = round(statistics.median(pairs), 3)
    for k in ("llamacpp_prefill_without_repack", "llamacpp_decode_depth"):
        if k in d:
            out[k] = d[k]
    out["runs"] = {k: len(v) for k, v in series.items()}
    print(json.dumps(out))
PY
