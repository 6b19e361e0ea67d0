// The `mt` executable: commands, exit codes, and the one-paragraph errors of the foundation issue.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <utility>

#include "checkpoint_manager.h"
#include "mt/version.h"
#include "safetensors.h"
#include "test_support.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

test::MtResult mt_cmd(const std::string& args) {
  return test::run_mt(args);
}

TEST(Cli, HelpAndVersion) {
  auto r = mt_cmd("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* c :
       {"run", "decode", "convert", "score", "bench", "tokenize", "plugins", "models", "config"})
    EXPECT_NE(r.out.find(std::string("  ") + c), std::string::npos) << c;
  r = mt_cmd("--version");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("plugin ABI"), std::string::npos);
  for (const char* c :
       {"run", "decode", "convert", "score", "bench", "plugins", "models", "config"}) {
    r = mt_cmd(std::string(c) + " --help");
    EXPECT_EQ(r.code, 0) << c;
    EXPECT_NE(r.out.find("Usage: mt " + std::string(c)), std::string::npos) << c << r.out;
  }
}

TEST(Cli, UnknownCommandIsAUsageError) {
  auto r = mt_cmd("frobnicate");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("unknown command 'frobnicate'"), std::string::npos) << r.out;
}

// mt tokenize reproduces the shipped token file, which Hugging Face's tokenizers library made.
TEST(Cli, TokenizeReproducesTheShippedTokenFile) {
  const fs::path out =
      fs::temp_directory_path() / ("mt_tok_" + std::to_string(::getpid()) + ".tokens");
  const std::string data = test::source_dir() + "/data/";
  auto r = mt_cmd("tokenize tokenizer_path=" + data + "tokenizer.json input=" + data +
                  "corpus.eval.jsonl output=" + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("MB/s"), std::string::npos) << r.out;
  std::ifstream a(out, std::ios::binary), b(data + "corpus.eval.tokens", std::ios::binary);
  std::stringstream sa, sb;
  sa << a.rdbuf();
  sb << b.rdbuf();
  EXPECT_GT(sa.str().size(), 1000u);
  EXPECT_TRUE(sa.str() == sb.str()) << "mt tokenize differs from the shipped corpus.eval.tokens";
  fs::remove(out);
  // num_threads is taken (before: always the cores), with the same file.
  r = mt_cmd("tokenize tokenizer_path=" + data + "tokenizer.json input=" + data +
             "corpus.eval.jsonl num_threads=1 output=" + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("MB/s on 1 thread\n"), std::string::npos) << r.out;
  std::ifstream c(out, std::ios::binary);
  std::stringstream sc;
  sc << c.rdbuf();
  EXPECT_TRUE(sc.str() == sb.str());
  fs::remove(out);
  // A corpus is read and written a chunk at a time (before: held whole, with every document's
  // ids, about three times its size): chunks of a few documents give the same file.
  r = test::run_mt("tokenize tokenizer_path=" + data + "tokenizer.json input=" + data +
                       "corpus.eval.jsonl output=" + out.string(),
                   0, "MT_TOKENIZE_CHUNK_BYTES=700");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream d(out, std::ios::binary);
  std::stringstream sd;
  sd << d.rdbuf();
  EXPECT_TRUE(sd.str() == sb.str()) << "a chunked mt tokenize differs";
  fs::remove(out);
  // Neither bos nor eos written: the file cannot tell its documents apart, and says so.
  r = mt_cmd("tokenize tokenizer_path=" + data + "tokenizer.json input=" + data +
             "corpus.eval.jsonl add_bos=false add_eos=false output=" + out.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("documents are not marked"), std::string::npos) << r.out;
  fs::remove(out);
  r = mt_cmd("tokenize tokenizer_path=" + data +
             "tokenizer.json input=/nonexistent.jsonl output=" + out.string());
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/nonexistent.jsonl"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(out));
}

// mt tokenize and mt score write their output only where nothing is lost: never over one of
// their inputs (before: a corpus tokenized onto itself was replaced by its tokens) or over a file
// another program wrote, never into a missing directory or onto a directory; a file of their own
// kind is replaced. mt tokenize names the file and line of a malformed line or non-UTF-8 document
// and with data_strict=false skips them (before: data_strict was ignored and the message named no
// file).
TEST(Cli, OutputsNeverReplaceAnInputOrAForeignFile) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_out_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string tok = " tokenizer_path=" + test::source_dir() + "/data/tokenizer.json";
  const fs::path corpus = dir / "c.jsonl", bad = dir / "bad.jsonl", other = dir / "notes.txt";
  std::ofstream(corpus) << "{\"text\": \"one two\"}\n";
  std::ofstream(bad)
      << "{\"text\": \"one\"}\n{\"text\": \"\xff\"}\nnot json\n{\"text\": \"two\"}\n";
  std::ofstream(other) << "keep me";
  auto contents = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  const std::string corpus_text = contents(corpus);
  auto refused = [&](const std::string& args, const std::string& says) {
    const auto r = mt_cmd(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(says), std::string::npos) << args << "\n" << r.out;
  };
  const std::string in = "tokenize" + tok + " input=" + corpus.string();
  refused(in + " output=" + corpus.string(), "is also an input of the command");
  EXPECT_EQ(contents(corpus), corpus_text);
  refused(in + " output=" + other.string(), "exists and is not a tokens file");
  EXPECT_EQ(contents(other), "keep me");
  refused(in + " output=" + dir.string(), "is a directory");
  refused(in + " output=" + (dir / "no" / "x.tokens").string(), "does not exist");
  refused(in + " output=" + (other / "x.tokens").string(), "is a file, not a directory");
  // An empty text file is no document (it was one of BOS and EOS alone, exit 0).
  const fs::path empty = dir / "empty.txt";
  std::ofstream{empty};
  refused("tokenize" + tok + " input=" + empty.string() + " output=" + (dir / "e.tokens").string(),
          "input=" + empty.string() + " holds no documents (only empty files or blank lines)");
  const auto with_empty = mt_cmd("tokenize" + tok + " input=" + empty.string() + "," +
                                 corpus.string() + " output=" + (dir / "e.tokens").string());
  EXPECT_EQ(with_empty.code, 0) << with_empty.out;
  EXPECT_NE(with_empty.out.find("mt tokenize: 1 documents"), std::string::npos) << with_empty.out;
  const fs::path tokens = dir / "c.tokens";
  ASSERT_EQ(mt_cmd(in + " output=" + tokens.string()).code, 0);
  const auto again = mt_cmd(in + " output=" + tokens.string());  // its own kind: replaced
  EXPECT_EQ(again.code, 0) << again.out;
  // Malformed input: refused naming the file and line, or skipped with data_strict=false.
  const std::string from_bad =
      "tokenize" + tok + " input=" + bad.string() + " output=" + (dir / "b.tokens").string();
  refused(from_bad, bad.string() + ":3: not a JSON line");
  std::ofstream(bad) << "{\"text\": \"one\"}\n{\"text\": \"\xff\"}\n";
  refused(from_bad, bad.string() + ":2: tokenizer");
  std::ofstream(bad)
      << "{\"text\": \"one\"}\n{\"text\": \"\xff\"}\nnot json\n{\"text\": \"two\"}\n";
  const auto lenient = mt_cmd(from_bad + " data_strict=false");
  EXPECT_EQ(lenient.code, 0) << lenient.out;
  EXPECT_NE(lenient.out.find("skipped 2 malformed"), std::string::npos) << lenient.out;
  EXPECT_NE(lenient.out.find("2 documents"), std::string::npos) << lenient.out;
  // A UTF-8 byte order mark at the start of the file is skipped (it was "not a JSON line").
  const fs::path bom = dir / "bom.jsonl";
  std::ofstream(bom) << "\xEF\xBB\xBF{\"text\": \"one\"}\n{\"text\": \"two\"}\n";
  const auto with_bom = mt_cmd("tokenize" + tok + " input=" + bom.string() +
                               " output=" + (dir / "m.tokens").string());
  EXPECT_EQ(with_bom.code, 0) << with_bom.out;
  EXPECT_NE(with_bom.out.find("2 documents"), std::string::npos) << with_bom.out;
  // mt score: refused before the model loads (no checkpoint is needed to see it).
  const std::string score = "score --model=llama-test load_parameters_path=" + dir.string();
  refused(score + " tokens=1,2,3 output=" + other.string(), "exists and is not a logits file");
  EXPECT_EQ(contents(other), "keep me");
  refused(score + " input=" + corpus.string() + " output=" + corpus.string(),
          "is also an input of the command");
  EXPECT_EQ(contents(corpus), corpus_text);
  // mt run: a file where the run keeps its checkpoints is said before the first step (before:
  // at the first save, checkpoint_period steps in); a directory where it writes its metrics
  // says why it cannot write them.
  const std::string run =
      "run --model=llama-test steps=2 dataset_type=synthetic "
      "per_device_batch_size=1 max_target_length=16 base_output_directory=" +
      dir.string() + " run_name=";
  fs::create_directories(dir / "r1");
  std::ofstream(dir / "r1" / "checkpoints") << "keep me";
  refused(run + "r1", "is a file, where this run keeps its checkpoints");
  EXPECT_EQ(contents(dir / "r1" / "checkpoints"), "keep me");
  EXPECT_FALSE(fs::exists(dir / "r1" / "metrics.jsonl"));
  fs::create_directories(dir / "r2" / "metrics.jsonl");
  const auto r2 = mt_cmd(run + "r2");
  EXPECT_EQ(r2.code, 1) << r2.out;
  EXPECT_NE(r2.out.find("metrics.jsonl': Is a directory"), std::string::npos) << r2.out;
  fs::remove_all(dir);
}

TEST(Cli, BenchNeedsAKnownTarget) {
  auto r = mt_cmd("bench frob");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("'frob' is not one of them"), std::string::npos) << r.out;
}

// The CPU backend's switches take 0 or 1 only (another value silently meant the default):
// refused before any work with the variable, what it switches and the default.
TEST(Cli, BackendSwitchesTakeZeroOrOne) {
  const std::string bench = "bench decode --model=llama-test steps=2 dtypes=bfloat16 parts=batch1";
  for (const char* v :
       {"MT_CPU_AMX", "MT_CPU_BF16DOT", "MT_CPU_MATVEC_BF16DOT", "MT_DECODE_RECORDING"}) {
    const test::MtResult r = test::run_mt(bench, 60, std::string(v) + "=yes");
    EXPECT_EQ(r.code, 2) << v << r.out;
    EXPECT_NE(r.out.find(std::string(v) + "=yes: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("set 0 or 1, or unset it for the default"), std::string::npos) << r.out;
  }
  EXPECT_EQ(test::run_mt(bench + " 2>/dev/null", 60, "MT_CPU_BF16DOT=0 MT_CPU_AMX=1").code, 0);
}

TEST(Cli, BenchPrintsOneJsonObject) {
  auto r = mt_cmd("bench train --model=llama-test steps=4 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* k :
       {"\"tokens_per_sec\"", "\"model_tflops_per_sec\"", "\"mfu\"", "\"step_time_ms\""})
    EXPECT_NE(r.out.find(k), std::string::npos) << k << r.out;
  r = mt_cmd("bench decode --model=llama-test steps=2 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* k :
       {"\"prefill_512_tokens_per_sec\"", "\"decode_batch1_tokens_per_sec\"",
        "\"decode_batch1_bytes_per_sec\"", "\"decode_batch8_tokens_per_sec\"", "\"bfloat16\""})
    EXPECT_NE(r.out.find(k), std::string::npos) << k << r.out;
  // The cache bytes per token come from the layers' cache specs: llama-test's 2 layers of k and
  // v, 2 heads of 16 (f32: 512 bytes); deepseek3-test's latent (3 layers of 32 + 16 features, 576).
  EXPECT_NE(r.out.find("\"kv_cache_bytes_per_token\": 512"), std::string::npos) << r.out;
  r = mt_cmd("bench decode --model=deepseek3-test steps=2 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"kv_cache_bytes_per_token\": 576"), std::string::npos) << r.out;
  // dtypes= picks the runs; its values and steps= are checked (steps=abc was an internal error).
  r = mt_cmd("bench decode --model=llama-test steps=2 dtypes=bfloat16 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("\"float32\""), std::string::npos) << r.out;
  // A --config file without a model is one model, labelled with the file (before: two rows
  // labelled llama-bench-m and llama-bench-1b, both the file's model).
  {
    const fs::path yml =
        fs::temp_directory_path() / ("mt_bench_" + std::to_string(::getpid()) + ".yml");
    std::ofstream(yml) << "base_emb_dim: 64\nbase_num_decoder_layers: 1\n";
    r = mt_cmd("bench decode --config=" + yml.string() +
               " steps=2 dtypes=float32 parts=batch1 2>/dev/null");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("\"model\": \"llama-bench-m + --config=" + yml.string() + "\""),
              std::string::npos)
        << r.out;
    EXPECT_EQ(r.out.find("llama-bench-1b"), std::string::npos) << r.out;
    fs::remove(yml);
  }
  r = mt_cmd("bench decode --model=llama-test steps=abc 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("steps=abc must be an integer of at least 1"), std::string::npos) << r.out;
  r = mt_cmd("bench decode --model=llama-test dtypes=f16 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("dtypes=f16 names 'f16'"), std::string::npos) << r.out;
  // parts= runs only the parts named; the others print null.
  r = mt_cmd("bench decode --model=llama-test steps=2 dtypes=float32 parts=batch1 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"prefill_512_tokens_per_sec\": null"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"decode_batch8_tokens_per_sec\": null"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("\"decode_batch1_tokens_per_sec\": null"), std::string::npos) << r.out;
  // No decode part, no depth read (before: 0, a figure no run measured).
  r = mt_cmd("bench decode --model=llama-test dtypes=float32 parts=prefill 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"decode_depth\": null"), std::string::npos) << r.out;
  // A step reads one row of GPT's learned position table, as of the token embedding: gpt3-52k's
  // 209,856 f32 bytes less 2047 of the table's 2048 rows of 16 (before: all 209,856).
  r = mt_cmd("bench decode --model=gpt3-52k steps=2 dtypes=float32 parts=batch1 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"decode_weight_bytes_per_token\": 7.885e+04"), std::string::npos) << r.out;
  // Decode runs no training-only work: an MoE model's per-op profile has the experts' products
  // and no router z-loss (its cross-entropy) or load-balancing products (Graph::wants_aux).
  r = mt_cmd(
      "bench decode --model=mixtral-test steps=2 dtypes=float32 parts=batch1 profile=true 2>&1");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("grouped_matmul"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("cross_entropy_forward"), std::string::npos) << r.out;
  // depth= is the prompt before the timed steps (llama-bench's -d), past the default cache of
  // 1024 rows too; the line says what the first timed step read: the prompt and 2 warm-up steps.
  r = mt_cmd(
      "bench decode --model=llama-test steps=2 dtypes=float32 parts=batch1,batch8 depth=1500 "
      "2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"decode_depth\": 1502"), std::string::npos) << r.out;
  r = mt_cmd("bench decode --model=llama-test depth=0 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("depth=0 must be an integer of at least 1"), std::string::npos) << r.out;
  r = mt_cmd("bench decode --model=llama-test parts=batch2 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("parts=batch2 names 'batch2'"), std::string::npos) << r.out;
  // quantization=int8: the same runs on int8 projection weights, a quarter of f32's bytes and
  // said in the line; MaxText's other modes and training with it are refused.
  r = mt_cmd(
      "bench decode --model=llama-test steps=2 dtypes=float32 quantization=int8 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\"quantization\": \"int8\""), std::string::npos) << r.out;
  r = mt_cmd("bench decode --model=llama-test steps=2 quantization=int4w 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("quantization=int4w"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not one of the choices: \"\" (none), int8"), std::string::npos) << r.out;
  // dtype= beside dtypes= would run another configuration under the row's label (before: a
  // "float32" row measured bf16's cache).
  r = mt_cmd("bench decode --model=llama-test steps=2 dtypes=float32 dtype=bfloat16 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("from dtypes="), std::string::npos) << r.out;
  // The kernel benches take no quantization keys (before: accepted, ignored).
  r = mt_cmd("bench gemm shapes=64x64x64 quantization=int8 warmup=1 iters=1 repeats=1 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has no effect on mt bench"), std::string::npos) << r.out;
  r = mt_cmd(
      "run --model=llama-test dataset_type=synthetic steps=2 quantization=int8 "
      "base_output_directory=/nonexistent-mt-dir 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("quantization"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("training with int8 weights"), std::string::npos) << r.out;
  // A value that is none of the modes says so (before: "training with int8 weights").
  r = mt_cmd("run --model=llama-test steps=1 quantization=nf4 2>&1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not one of the choices"), std::string::npos) << r.out;
  // The MoE layer against dense GEMMs of its FLOPs.
  r = mt_cmd("bench moe --model=mixtral-test tokens=16 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* k : {"\"bench\": \"moe\"", "\"experts\": 8", "\"top_k\": 2",
                        "\"ratio_fwd_moe_over_dense\"", "\"ratio_fwd_bwd_moe_over_dense\""})
    EXPECT_NE(r.out.find(k), std::string::npos) << k << r.out;
  // Times in 4 significant digits (2 decimals read 0.00 beside non-zero GFLOP/s).
  EXPECT_EQ(r.out.find("_ms\": 0.00,"), std::string::npos) << r.out;
  // DeepSeek's layer is not the block it times (its figures were labelled deepseek3-test).
  r = mt_cmd("bench moe --model=deepseek3-test tokens=16");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("routes with its family's own layer"), std::string::npos) << r.out;
}

// The first 2 steps of a run warm up and are not timed: with no step left, no throughput is
// reported (not a median of nothing printed as 0), and the benchmark refuses such a run.
TEST(Cli, ThroughputNeedsThreeSteps) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_short_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto r =
      mt_cmd("run --model=llama-test steps=2 enable_checkpointing=false base_output_directory=" +
             dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("no throughput"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("0 tokens/s"), std::string::npos) << r.out;
  r = mt_cmd("run --model=llama-test steps=3 enable_checkpointing=false base_output_directory=" +
             dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("median "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("no throughput"), std::string::npos) << r.out;
  r = mt_cmd("bench train --model=llama-test steps=2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("steps=3 or more (now 2)"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

TEST(Cli, BenchKernelsPrintJsonLines) {
  auto r = mt_cmd("bench gemm shapes=32x48x16,8x8x8 iters=1 repeats=1 warmup=0 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* k : {"\"bench\": \"gemm\"", "\"M\": 32", "\"K\": 48", "\"N\": 16", "\"M\": 8",
                        "\"tflops\"", "\"median_ms\""})
    EXPECT_NE(r.out.find(k), std::string::npos) << k << r.out;
  r = mt_cmd("bench attention shapes=1x32x2x16 kv_heads=1 iters=1 repeats=1 warmup=0 2>/dev/null");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* k : {"\"bench\": \"attention\"", "\"attention\": \"flash\"", "\"T\": 32",
                        "\"kv_heads\": 1", "\"fwd_bwd_tflops\""})
    EXPECT_NE(r.out.find(k), std::string::npos) << k << r.out;
  // Bad shapes and counts are usage errors naming the value.
  r = mt_cmd("bench gemm shapes=32x0x16");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("32x0x16"), std::string::npos) << r.out;
  r = mt_cmd("bench attention shapes=1x32x3x16 kv_heads=2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("kv_heads=2"), std::string::npos) << r.out;
  // A shape past the backend's memory is a failed case with the reason, nothing allocated
  // (before: the kernel's OOM killer ended the process with no output); the others still run.
  for (const std::string& cmd :
       {std::string("bench gemm shapes=1000000x1000000x1000000,8x8x8"),
        std::string("bench attention attention=dot_product shapes=64x65536x32x128,1x32x2x16")}) {
    r = mt_cmd(cmd + " iters=1 repeats=1 warmup=0 2>/dev/null");
    EXPECT_EQ(r.code, 1) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("\"error\": \"does not fit: "), std::string::npos) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find("_ms\": "), std::string::npos) << cmd << "\n" << r.out;
  }
}

TEST(Cli, InferenceNeedsACheckpoint) {
  for (const char* c : {"decode", "score"}) {
    auto r = mt_cmd(c);
    EXPECT_EQ(r.code, 2) << c << r.out;
    EXPECT_NE(r.out.find("load_parameters_path"), std::string::npos) << c << r.out;
  }
  auto r = mt_cmd("decode load_parameters_path=/nonexistent/run");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/nonexistent/run"), std::string::npos) << r.out;
}

// Train a few steps of the default model with checkpoints, then decode and score from them.
TEST(Cli, TrainThenDecodeAndScore) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_flow_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string train =
      "run --model=llama-small steps=3 eval_interval=3 eval_steps=1 "
      "per_device_batch_size=1 max_target_length=32 base_num_decoder_layers=1 "
      "checkpoint_period=3 async_checkpointing=false base_output_directory=" +
      dir.string();
  auto r = mt_cmd(train);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("eval loss"), std::string::npos) << r.out;
  // The same run again is already at its last step: it says so, and prints no loss of its own
  // (before: "final train loss 0.0000").
  const auto again = mt_cmd(train);
  EXPECT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("No step ran: the run is at step 3"), std::string::npos) << again.out;
  EXPECT_EQ(again.out.find("loss"), std::string::npos) << again.out;
  // Asked for fewer steps than the checkpoint has: it says where the run is (before: "at step
  // 2") and leaves config.yml as the run that wrote it (before: rewritten with steps: 2).
  std::string shorter = train;
  shorter.replace(shorter.find("steps=3"), 7, "steps=2");
  const auto past = mt_cmd(shorter);
  EXPECT_EQ(past.code, 0) << past.out;
  EXPECT_NE(past.out.find("No step ran: the run is at step 3, past steps=2"), std::string::npos)
      << past.out;
  {
    std::ifstream c(dir / "default" / "config.yml");
    std::stringstream ss;
    ss << c.rdbuf();
    EXPECT_NE(ss.str().find("\nsteps: 3"), std::string::npos) << ss.str().substr(0, 2000);
  }
  const std::string ckpt = " --model=llama-small base_num_decoder_layers=1 load_parameters_path=" +
                           (dir / "default").string();
  r = mt_cmd("decode" + ckpt + " prompt=\"It is a truth\" max_target_length=12");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("It is a truth", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("tokens/s; decode"), std::string::npos) << r.out;
  r = mt_cmd("score" + ckpt + " tokens=1,5,42,7 output=" + (dir / "s.safetensors").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("perplexity"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(dir / "s.safetensors"));
  // A text input of several documents scores each on its own (before: one joined stream, each
  // document seeing the ones before it): the second document's log-probs are the same as when it
  // is scored alone. The file's logprobs align with its tokens, NaN where nothing predicts one,
  // and their mean is the printed mean loss, windows included.
  {
    std::ofstream(dir / "ab.jsonl")
        << "{\"text\": \"It is a truth universally acknowledged.\"}\n"
        << "{\"text\": \"Emma Woodhouse, handsome, clever, and rich.\"}\n";
    std::ofstream(dir / "b.jsonl")
        << "{\"text\": \"Emma Woodhouse, handsome, clever, and rich.\"}\n";
    auto read = [](const fs::path& f, const std::string& name) {
      SafeTensorsFile st(f);
      const SafeTensorInfo& i = st.info(name);
      std::vector<float> v(static_cast<size_t>(i.numel()));
      if (i.dtype == "F32") {
        std::memcpy(v.data(), i.data, i.nbytes());
      } else {  // I32
        std::vector<int32_t> w(v.size());
        std::memcpy(w.data(), i.data, i.nbytes());
        for (size_t k = 0; k < w.size(); ++k) v[k] = static_cast<float>(w[k]);
      }
      return std::make_pair(v, st.metadata());
    };
    r = mt_cmd("score" + ckpt + " input=" + (dir / "ab.jsonl").string() +
               " output=" + (dir / "ab.safetensors").string());
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("(2 sequences, each scored on its own)"), std::string::npos) << r.out;
    r = mt_cmd("score" + ckpt + " input=" + (dir / "b.jsonl").string() +
               " output=" + (dir / "b.safetensors").string());
    ASSERT_EQ(r.code, 0) << r.out;
    const auto [ab, ab_meta] = read(dir / "ab.safetensors", "logprobs");
    const auto [seq, unused] = read(dir / "ab.safetensors", "sequence");
    const auto [b, b_meta] = read(dir / "b.safetensors", "logprobs");
    std::vector<float> ab_b;
    for (size_t k = 0; k < ab.size(); ++k)
      if (seq[k] == 1) ab_b.push_back(ab[k]);
    ASSERT_EQ(ab_b.size(), b.size());
    for (size_t k = 0; k < b.size(); ++k) {
      if (k == 0) {
        EXPECT_TRUE(std::isnan(ab_b[k]) && std::isnan(b[k]));
      } else {
        EXPECT_EQ(ab_b[k], b[k]) << k;
      }
    }
    // Windows of 5 tokens: NaN at each window's first token; the mean of the rest is mean_loss.
    r = mt_cmd("score" + ckpt + " input=" + (dir / "b.jsonl").string() +
               " max_target_length=5 output=" + (dir / "w.safetensors").string());
    ASSERT_EQ(r.code, 0) << r.out;
    const auto [w, w_meta] = read(dir / "w.safetensors", "logprobs");
    double sum = 0;
    int predicted = 0, nans = 0;
    for (size_t k = 0; k < w.size(); ++k) {
      if (std::isnan(w[k])) {
        ++nans;
        EXPECT_EQ(k % 5, 0u) << k;
      } else {
        sum -= w[k];
        ++predicted;
      }
    }
    EXPECT_EQ(nans, static_cast<int>((w.size() + 4) / 5));
    EXPECT_EQ(std::to_string(predicted), w_meta.at("predicted"));
    EXPECT_NEAR(sum / predicted, std::stod(w_meta.at("mean_loss")), 1e-6);
  }
  // input='s format: ids with CRLF line ends are ids (before: text); a .jsonl line with a
  // leading blank is JSON (before: its syntax was scored as text); the JSON field is
  // train_data_columns' (before: "text" always). Each scores as its plain form does.
  {
    auto score_line = [&](const std::string& args) {
      const auto s = mt_cmd("score" + ckpt + " " + args);
      EXPECT_EQ(s.code, 0) << s.out;
      return s.out.substr(s.out.find("tokens "));
    };
    std::ofstream(dir / "crlf.ids") << "1,5,42\r\n7\r\n";
    EXPECT_EQ(score_line("input=" + (dir / "crlf.ids").string()), score_line("tokens=1,5,42,7"));
    std::ofstream(dir / "plain.jsonl") << "{\"text\": \"Emma Woodhouse\"}\n";
    std::ofstream(dir / "blank.jsonl") << " {\"text\": \"Emma Woodhouse\"}\n";
    std::ofstream(dir / "content.jsonl") << "{\"content\": \"Emma Woodhouse\"}\n";
    const std::string plain = score_line("input=" + (dir / "plain.jsonl").string());
    EXPECT_EQ(score_line("input=" + (dir / "blank.jsonl").string()), plain);
    EXPECT_EQ(
        score_line("input=" + (dir / "content.jsonl").string() + " train_data_columns=content"),
        plain);
  }
  // int8 weights read from the run's step directory, each quantized as it streams through one
  // read of the checkpoint (load_checkpoint_weights).
  r = mt_cmd("score" + ckpt + " tokens=1,5,42,7 quantization=int8");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("perplexity"), std::string::npos) << r.out;
  // With no model named, decode and score take the checkpoint's (its config: the run's model
  // file and base_num_decoder_layers=1 from its command line), as hf_path takes config.json;
  // before, base.yml's default model was built and the weights refused. A model named that is
  // not the checkpoint's is refused naming the checkpoint's.
  {
    const std::string bare = " load_parameters_path=" + (dir / "default").string();
    const auto named = mt_cmd("decode" + ckpt + " prompt=\"It is a truth\" max_target_length=12");
    const auto taken = mt_cmd("decode" + bare + " prompt=\"It is a truth\" max_target_length=12");
    ASSERT_EQ(taken.code, 0) << taken.out;
    EXPECT_EQ(taken.out.substr(0, taken.out.find("mt decode:")),
              named.out.substr(0, named.out.find("mt decode:")));
    const auto scored = mt_cmd("score" + bare + " tokens=1,5,42,7");
    const auto scored_named = mt_cmd("score" + ckpt + " tokens=1,5,42,7");
    ASSERT_EQ(scored.code, 0) << scored.out;
    EXPECT_EQ(scored.out, scored_named.out);
    const auto other = mt_cmd("score --model=llama-test" + bare + " tokens=1,5,42,7");
    EXPECT_EQ(other.code, 2) << other.out;
    EXPECT_NE(other.out.find("written by a run of model_name=llama-small"), std::string::npos)
        << other.out;
  }
  r = mt_cmd("score" + ckpt + " tokens=1,5,99999");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("99999"), std::string::npos) << r.out;
  // Text the tokenizer refuses names where it came from (before: exit 1, no file named); a
  // prompt file of empty lines is no prompt (before: "0 prompt(s)" and exit 0).
  std::ofstream(dir / "latin1.txt") << "fine\ncaf\xe9\n";
  std::ofstream(dir / "blank.txt") << "\n\n";
  r = mt_cmd("decode" + ckpt + " prompt_file=" + (dir / "latin1.txt").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("latin1.txt, prompt 2: tokenizer"), std::string::npos) << r.out;
  r = mt_cmd("score" + ckpt + " input=" + (dir / "latin1.txt").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("input=" + (dir / "latin1.txt").string() + ": tokenizer"), std::string::npos)
      << r.out;
  r = mt_cmd("decode" + ckpt + " prompt_file=" + (dir / "blank.txt").string());
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("holds no prompt"), std::string::npos) << r.out;
  // A NUL byte in a text (a prompt's, or a generated byte-level token's) is printed, and what
  // follows it too (printf's %s ended the line there).
  {
    std::ofstream f(dir / "nul.txt", std::ios::binary);
    f << "It is" << '\0' << " a truth\nEmma\n";
  }
  r = mt_cmd("decode" + ckpt + " max_target_length=12 prompt_file=" + (dir / "nul.txt").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(std::string("[0] It is\0 a truth", 18)), std::string::npos) << r.out;
  fs::remove_all(dir);
}

// mt decode prints the prompt and then the whole sequence's text past the prompt's, as the
// tokenizer decodes prompt and continuation together: with a SentencePiece-style tokenizer the
// first generated piece keeps its space (before: "Hello" + "by" printed "Helloby"), and a
// character written through byte-fallback tokens appears once its bytes are all there (before:
// the stream printed U+FFFD for its first byte and then nothing more). The streamed line equals
// the text of the ids the same decode gives from token ids, for several seeds (a random model
// of llama2.json's 956 tokens, a quarter of them bytes; seeds 2, 4 and 5 differed before).
// A relative tokenizer_path (or data path) that exists is recorded absolute in the run's config
// and checkpoints: mt decode of the checkpoint finds the same tokenizer from any directory
// (before: data/tokenizer.json was looked up again from the current directory, and another
// directory's tokenizer used silently, or none with no word).
TEST(Cli, RelativePathsAreRecordedWhereTheyAre) {
  const fs::path dir = fs::temp_directory_path() / ("mt_rel_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "proj" / "data");
  fs::create_directories(dir / "elsewhere");
  fs::copy_file(test::source_dir() + "/data/tokenizer.json", dir / "proj/data/tokenizer.json");
  std::string out;
  const std::string mt = "MT_PLUGIN_PATH= " + test::mt_exe();
  ASSERT_EQ(test::run_command("cd " + (dir / "proj").string() + " && " + mt +
                                  " run --model=llama-test vocab_size=8192 dataset_type=synthetic "
                                  "steps=2 tokenizer_path=data/tokenizer.json "
                                  "base_output_directory=out run_name=r",
                              out),
            0)
      << out;
  std::ifstream cfg(dir / "proj/out/r/config.yml");
  std::stringstream ss;
  ss << cfg.rdbuf();
  const std::string abs = (dir / "proj/data/tokenizer.json").string();
  EXPECT_NE(ss.str().find("tokenizer_path: " + abs), std::string::npos) << ss.str();
  // From another directory the checkpoint's tokenizer is the one the run used.
  const std::string decode = mt + " decode load_parameters_path=" + (dir / "proj/out/r").string() +
                             " prompt=hi max_target_length=6";
  ASSERT_EQ(test::run_command("cd " + (dir / "elsewhere").string() + " && " + decode, out), 0)
      << out;
  // Moved away: said, not dropped silently.
  fs::rename(dir / "proj/data", dir / "proj/data2");
  EXPECT_NE(test::run_command("cd " + (dir / "elsewhere").string() + " && " + decode, out), 0);
  EXPECT_NE(out.find("the checkpoint's tokenizer_path " + abs + " no longer exists"),
            std::string::npos)
      << out;
  fs::remove_all(dir);
}

// Under a launcher, rank 0 says a refusal every rank shares; a rank that refuses alone (its
// node's files or environment differ) says why with its rank, after giving rank 0 time to end the
// job (before: it exited with no word, and mpirun ended the job with it).
TEST(Cli, ARankThatRefusesAloneSaysWhy) {
  const auto r = test::run_mt("run --model=llama-test steps=abc", 60,
                              "OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=1");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("mt run: error on rank 1 of 2: steps=abc"), std::string::npos) << r.out;
}

// A reader of mt run's output that goes away (`mt run | head -1`) does not end the training, and
// mt says at the end that what it printed is lost, exit 1 (before: killed by SIGPIPE at its last
// flush, exit 141, no word).
TEST(Cli, ARunWhoseReaderLeavesSaysSo) {
  const fs::path dir = fs::temp_directory_path() / ("mt_pipe_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string out;
  test::run_command("bash -c 'MT_PLUGIN_PATH= " + test::mt_exe() +
                        " run --model=llama-test dataset_type=synthetic steps=20 log_period=1 "
                        "base_output_directory=" +
                        dir.string() + " run_name=a 2>" + (dir.string() + ".err") +
                        " | head -1 >/dev/null; echo rc=${PIPESTATUS[0]}'",
                    out);
  EXPECT_NE(out.find("rc=1"), std::string::npos) << out;
  std::ifstream f(dir.string() + ".err");
  std::stringstream err;
  err << f.rdbuf();
  EXPECT_NE(err.str().find("writing to standard output failed"), std::string::npos) << err.str();
  EXPECT_TRUE(fs::exists(dir / "a" / "checkpoints" / "20"));
  fs::remove_all(dir);
  fs::remove(dir.string() + ".err");
}

// A checkpoint read into a model other than the one it was trained as (a model named beside it,
// a model key changed) is said on every path that reads one, as a resume in the run's own
// directory says it (before: mt score --model=..., load_parameters_path and load_full_state_path
// in a new run read it with no word, and scored or trained another model).
TEST(Cli, ACheckpointReadIntoAnotherModelIsSaid) {
  const fs::path dir = fs::temp_directory_path() / ("mt_other_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string out = " base_output_directory=" + dir.string();
  auto r = mt_cmd("run --model=llama-test dataset_type=synthetic steps=2 sliding_window_size=4" +
                  out + " run_name=sw");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string ckpt = (dir / "sw").string();
  const char* said = "was written with other model keys than these (sliding_window_size: 4 -> 0)";
  r = mt_cmd("score load_parameters_path=" + ckpt + " tokens=5,17,33,2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("other model keys"), std::string::npos) << r.out;  // its own model
  r = mt_cmd("score --model=llama-test load_parameters_path=" + ckpt + " tokens=5,17,33,2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(said), std::string::npos) << r.out;
  // profile=true reports where decode's and score's time went, as mt run's (before: taken,
  // and nothing printed).
  for (const char* cmd : {"decode", "score"}) {
    r = mt_cmd(std::string(cmd) + " load_parameters_path=" + ckpt +
               " tokens=5,17,33,2 profile=true");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string("mt ") + cmd + ": profile (loading left out):"),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("matmul"), std::string::npos) << r.out;
  }
  for (const char* key : {"load_parameters_path", "load_full_state_path"}) {
    r = mt_cmd(std::string("run --model=llama-test dataset_type=synthetic steps=3 ") + key + "=" +
               ckpt + "/checkpoints/2" + out + " run_name=" + key);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(said), std::string::npos) << key << "\n" << r.out;
  }
  fs::remove_all(dir);
}

TEST(Cli, DecodePrintsTheWholeSequencesText) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_text_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string tok_file = test::source_dir() + "/tests/golden/tokenizer/llama2.json";
  const auto tok = make_tokenizer(tok_file, "");
  const std::string prompt = "Hello 中";
  const std::vector<int32_t> ids = tok->encode(prompt);  // add_bos=false below
  std::string prompt_ids;
  for (int32_t id : ids) prompt_ids += (prompt_ids.empty() ? "" : ",") + std::to_string(id);
  for (const int seed : {1, 2, 3, 4, 5, 6}) {
    SCOPED_TRACE(seed);
    const fs::path m = dir / ("m" + std::to_string(seed));
    auto r = mt_cmd(
        "convert --to=hf --model=llama-test vocab_size=956 max_target_length=64 "
        "init_weights_seed=" +
        std::to_string(seed) + " --output=" + m.string());
    ASSERT_EQ(r.code, 0) << r.out;
    fs::copy_file(tok_file, m / "tokenizer.json");
    const std::string common =
        "decode hf_path=" + m.string() + " max_target_length=40 add_bos=false ";
    // stdout alone: the subshell's stderr goes nowhere (run_command joins 2>&1 to the line).
    auto stdout_of = [&](const std::string& args) {
      test::MtResult o;
      o.code = test::run_command(
          "(MT_PLUGIN_PATH= " + test::mt_exe() + " " + args + " 2>/dev/null)", o.out);
      return o;
    };
    r = stdout_of(common + "prompt=\"" + prompt + "\"");
    ASSERT_EQ(r.code, 0) << r.out;
    const auto by_ids = stdout_of(common + "tokens=" + prompt_ids);
    ASSERT_EQ(by_ids.code, 0) << by_ids.out;
    std::vector<int32_t> all;
    std::stringstream list(by_ids.out);
    for (std::string id; std::getline(list, id, ',');) all.push_back(std::stoi(id));
    ASSERT_GT(all.size(), ids.size()) << by_ids.out;
    EXPECT_EQ(std::vector<int32_t>(all.begin(), all.begin() + ids.size()), ids);
    // The text path stops at the tokenizer's end-of-sequence token; token ids come without a
    // tokenizer, so that decode goes on to max_target_length.
    const auto eos =
        std::find(all.begin() + static_cast<std::ptrdiff_t>(ids.size()), all.end(), tok->eos_id());
    if (eos != all.end()) all.erase(eos + 1, all.end());
    const std::string want = tok->decode(all) + "\n";
    if (seed != 3) {
      EXPECT_EQ(r.out, want);
      continue;
    }
    // Seed 3's random bytes: a \r byte token shown, then bytes after it that make their run
    // invalid UTF-8, which the decoder then writes as U+FFFD from the \r on. What is shown
    // stays; the rest follows it, nothing is lost (before: the stream ended at the \r).
    ASSERT_GE(r.out.size(), want.size() - 3) << r.out;
    EXPECT_EQ(r.out.substr(r.out.size() - 40), want.substr(want.size() - 40)) << r.out;
  }
  fs::remove_all(dir);
}

// SIGTERM (a scheduler's preemption notice, `kill`) or SIGINT (Ctrl-C) during mt run: the step
// under way ends, a checkpoint of it is saved (async saves too: the last is waited for), the
// exit code is 128 + the signal's, and the same command resumes and continues exactly as a
// straight run. Without checkpointing the stop says nothing was saved.
TEST(Cli, SignalStopsTheRunAfterItsStepWithACheckpoint) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_stop_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string common =
      " --model=llama-test num_threads=1 enable_tensorboard=false eval_interval=-1 "
      "learning_rate_schedule_steps=1000 base_output_directory=" +
      dir.string();
  for (const auto& [sig, extra] :
       {std::pair{std::string("TERM"), std::string("checkpoint_period=1000")},
        std::pair{std::string("INT"),
                  std::string("checkpoint_period=1000 async_checkpointing=false")},
        std::pair{std::string("TERM"), std::string("enable_checkpointing=false")},
        // A closed terminal or ssh session (before: its default ended the run, no checkpoint).
        std::pair{std::string("HUP"), std::string("checkpoint_period=1000")}}) {
    SCOPED_TRACE(sig + " " + extra);
    const std::string run = (dir / "stopped").string();
    fs::remove_all(run);
    // Started in the background, signalled once it has logged 4 steps; the shell prints its
    // exit code. (timeout(1) passes the signal on; it also makes the background job's SIGINT,
    // which a shell without job control ignores, the default for mt again.)
    std::string out;
    const int code = test::run_command(
        "MT_PLUGIN_PATH= timeout -k 10 60 " + test::mt_exe() + " run" + common +
            " run_name=stopped steps=100000 " + extra +
            " & p=$!; for i in $(seq 1200); do [ $(cat " + run +
            "/metrics.jsonl 2>/dev/null | wc -l) -ge 4 ] && break; sleep 0.05; done; kill -" + sig +
            " $p; wait $p; echo \"exit=$?\"",
        out);
    ASSERT_EQ(code, 0) << out;
    const int sig_no = sig == "TERM" ? 15 : sig == "HUP" ? 1 : 2;
    EXPECT_NE(out.find("exit=" + std::to_string(128 + sig_no)), std::string::npos) << out;
    const std::map<int64_t, double> stopped = test::losses_by_step(run);
    ASSERT_GE(stopped.size(), 4u) << out;
    const int64_t last = stopped.rbegin()->first;
    EXPECT_EQ(static_cast<int64_t>(stopped.size()), last) << out;
    EXPECT_NE(out.find("stopped by SIG" + sig + " after step " + std::to_string(last) +
                       " of steps=100000"),
              std::string::npos)
        << out;
    if (extra.find("enable_checkpointing=false") != std::string::npos) {
      EXPECT_NE(out.find("no checkpoint was saved (enable_checkpointing=false)"), std::string::npos)
          << out;
      EXPECT_FALSE(fs::exists(run + "/checkpoints/" + std::to_string(last))) << out;
      continue;
    }
    EXPECT_NE(out.find("its state is in the checkpoint of step " + std::to_string(last)),
              std::string::npos)
        << out;
    // The only checkpoint is the stop's (checkpoint_period=1000), complete.
    EXPECT_TRUE(fs::exists(run + "/checkpoints/" + std::to_string(last) + "/metadata.json")) << out;
    const std::string until = " steps=" + std::to_string(last + 3);
    auto r = test::run_mt("run" + common + " run_name=stopped " + extra + until, 60);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("resumed from step " + std::to_string(last)), std::string::npos) << r.out;
    fs::remove_all(dir / "straight");
    r = test::run_mt("run" + common + " run_name=straight " + extra + until, 60);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(test::losses_by_step(run), test::losses_by_step((dir / "straight").string()));
  }
  fs::remove_all(dir);
}

// A run killed (SIGKILL) after its last checkpoint logged steps its restart runs again: the
// restart moves their records to metrics.discarded.jsonl, so metrics.jsonl holds each step once
// (before: those steps twice), and nothing is lost.
TEST(Cli, RestartMovesTheUndoneStepsMetrics) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_undone_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Steps of several milliseconds (batch 8 x 256), so that the kill lands in the step logged.
  const std::string run =
      " --model=llama-test num_threads=1 enable_tensorboard=false "
      "per_device_batch_size=8 max_target_length=256 "
      "eval_interval=-1 checkpoint_period=5 async_checkpointing=false "
      "max_num_checkpoints_to_keep=3 learning_rate_schedule_steps=1000 run_name=r "
      "base_output_directory=" +
      dir.string();
  std::string out;
  // mt itself in the background (under timeout(1), SIGKILL would end timeout and leave mt
  // running), the wait bounded to 30 s. mt is bounded too: prlimit execs it (the same pid) with
  // 120 s of CPU, and it keeps 3 checkpoints, so a test killed before its `kill -9` (ctest's
  // timeout under a sanitizer) leaves no run going on to steps=100000 (one filled 25 GB of /tmp).
  test::run_command("MT_PLUGIN_PATH= prlimit --cpu=120 " + test::mt_exe() + " run" + run +
                        " steps=100000 & p=$!; for i in $(seq 3000); do n=$(cat " +
                        (dir / "r").string() +
                        "/metrics.jsonl 2>/dev/null | wc -l); [ $n -ge 8 ] && [ $((n % 5)) -ge 2 "
                        "] && break; sleep 0.005; done; kill -9 $p; wait $p",
                    out);
  const size_t logged = test::losses_by_step((dir / "r").string()).size();
  const int64_t ckpt =
      CheckpointManager(dir / "r" / "checkpoints", false, 0, test::cpu()).latest_step();
  ASSERT_GE(ckpt, 5) << out;
  // Killed between checkpoints (a kill just after one leaves nothing to move, which the checks
  // below allow).
  const auto r = test::run_mt("run" + run + " steps=" + std::to_string(ckpt + 2), 60);
  ASSERT_EQ(r.code, 0) << r.out;
  if (static_cast<int64_t>(logged) > ckpt) {
    EXPECT_NE(r.out.find("moved to " + (dir / "r" / "metrics.discarded.jsonl").string()),
              std::string::npos)
        << r.out;
  }
  std::ifstream m(dir / "r" / "metrics.jsonl");
  size_t lines = 0;
  for (std::string l; std::getline(m, l);) ++lines;
  EXPECT_EQ(lines, static_cast<size_t>(ckpt + 2));
  EXPECT_EQ(test::losses_by_step((dir / "r").string()).size(), static_cast<size_t>(ckpt + 2));
  std::ifstream d(dir / "r" / "metrics.discarded.jsonl");
  size_t discarded = 0;
  for (std::string l; std::getline(d, l);) ++discarded;
  EXPECT_EQ(discarded, logged - static_cast<size_t>(ckpt));
  fs::remove_all(dir);
}

// Under an address-space limit (ulimit -v) the CPU backend leaves OpenBLAS alone, whose buffer
// allocation retries a failed mapping forever (before: mt run spun at full CPU under limits of
// 150-460 MB, and SIGTERM's stop never came): the start-up line says why, and a run that fits
// trains; stdout closed is a write error, not a run.lock full of log lines (fd 1 reused).
TEST(Cli, AnAddressSpaceLimitLeavesOpenBlasAlone) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer's shadow memory cannot be mapped under an address-space limit";
#else
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_as_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  std::string out;
  const std::string run =
      " run --model=llama-test steps=2 dataset_type=synthetic "
      "enable_checkpointing=false base_output_directory=" +
      dir.string();
  const int code = test::run_command(
      "MT_PLUGIN_PATH= timeout -k 10 60 prlimit --as=2000000000 " + test::mt_exe() + run, out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("an address-space limit of 1907 MiB is set"), std::string::npos) << out;
  // (stderr to the pipe first, then stdout closed; run_command's own 2>&1 is the subshell's)
  const int closed = test::run_command(
      "(MT_PLUGIN_PATH= timeout -k 10 60 " + test::mt_exe() + run + " run_name=closed 2>&1 >&-)",
      out);
  EXPECT_EQ(closed, 1) << out;
  EXPECT_NE(out.find("writing to standard output failed (it was closed)"), std::string::npos)
      << out;
  std::ifstream lock(dir / "closed" / "run.lock");
  std::string held((std::istreambuf_iterator<char>(lock)), std::istreambuf_iterator<char>());
  EXPECT_EQ(held.find("mt run"), std::string::npos) << held;
  fs::remove_all(dir);
#endif
}

// Resuming with model keys other than the checkpoint's (the shapes unchanged) reads its weights
// into another model: said, naming the keys and both values. Keys a resumed run may change (the
// dtypes) are not.
TEST(Cli, ResumeWithOtherModelKeysSaysWhich) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_keys_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const std::string run =
      "run --model=llama-test num_threads=1 enable_tensorboard=false "
      "eval_interval=-1 base_output_directory=" +
      dir.string();
  auto r = test::run_mt(run + " steps=2", 60);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_mt(run + " steps=3 dtype=bfloat16", 60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("other model keys"), std::string::npos) << r.out;
  r = test::run_mt(run + " steps=4 rope_max_timescale=500000", 60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("other model keys than this run's (rope_max_timescale: 10000.0 -> "
                       "500000.0)"),
            std::string::npos)
      << r.out;
  fs::remove_all(dir);
}

TEST(Cli, PluginsListsKindNameVersionAbiPathAndFailures) {
  auto r = mt_cmd(std::string("plugins plugin_dirs=[") + MT_TEST_PLUGIN_DIR + "]");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("backend  cpu            0.1.0    " + std::to_string(MT_ABI_VERSION)),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("GEMM"), std::string::npos) << r.out;  // the CPU backend's path
  EXPECT_NE(r.out.find("libmt_model_badabi.so"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("FAILED: was built for plugin ABI"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("libmt_test_missing.so"), std::string::npos) << r.out;
}

TEST(Cli, ModelsListsFamiliesAndPublishedSizes) {
  auto r = mt_cmd("models");
  EXPECT_EQ(r.code, 0) << r.out;
  const std::pair<const char*, const char*> expect[] = {
      {"llama2-7b", "6.74B"},       {"llama2-13b", "13.02B"}, {"llama2-70b", "68.98B"},
      {"llama3-8b", "8.03B"},       {"llama3.1-8b", "8.03B"}, {"llama3-70b", "70.55B"},
      {"llama3.1-405b", "405.85B"}, {"llama3.2-1b", "1.24B"}, {"llama3.2-3b", "3.21B"}};
  for (const auto& [name, size] : expect) {
    const auto pos = r.out.find(std::string("\n") + name + " ");
    ASSERT_NE(pos, std::string::npos) << name << "\n" << r.out;
    const std::string line = r.out.substr(pos + 1, r.out.find('\n', pos + 1) - pos - 1);
    EXPECT_NE(line.find("llama"), std::string::npos) << line;
    EXPECT_NE(line.find(size), std::string::npos) << line;
  }
  // The columns stay columns with names and families longer than the headings (before,
  // deepseek2-bench-1b and deepseek_v2 pushed their row's columns right).
  const size_t config_col = r.out.find("CONFIG");
  ASSERT_NE(config_col, std::string::npos) << r.out;
  std::istringstream rows(r.out);
  for (std::string row; std::getline(rows, row);)
    if (row.find(".yml") != std::string::npos) {
      EXPECT_EQ(row.find('/'), config_col) << row;
    }
  // A plugin directory's models/ file named like a shipped model is listed as shadowed, and a
  // run of that name says which file it is (before: ignored without a word).
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_shadow_" + std::to_string(::getpid()));
  fs::create_directories(dir / "models");
  std::ofstream(dir / "models" / "llama-test.yml") << "decoder_block: llama\nbase_emb_dim: 32\n";
  r = mt_cmd("models plugin_dirs=" + dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("(SHADOWS " + (dir / "models" / "llama-test.yml").string()),
            std::string::npos)
      << r.out;
  r = mt_cmd("config --model=llama-test plugin_dirs=" + dir.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find((dir / "models" / "llama-test.yml").string() +
                       " has the same name and is not used"),
            std::string::npos)
      << r.out;
  fs::remove_all(dir);
}

TEST(Cli, ConfigPrintsTheLayeredConfig) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path file = dir / "exp.yml";
  std::ofstream(file) << "learning_rate: 0.001\nsteps: 7\n";
  auto r = mt_cmd("config --model=llama2-7b --config=" + file.string() + " steps=9 --log_period=3");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\nbase_emb_dim: 4096\n"), std::string::npos) << r.out;    // model file
  EXPECT_NE(r.out.find("\nlearning_rate: 0.001\n"), std::string::npos) << r.out;  // --config
  EXPECT_NE(r.out.find("\nsteps: 9\n"), std::string::npos) << r.out;              // override wins
  EXPECT_NE(r.out.find("\nlog_period: 3\n"), std::string::npos) << r.out;         // --key=value
  // --model NAME and --config FILE, as argparse users write them, are the same.
  const auto spaced =
      mt_cmd("config --model llama2-7b --config " + file.string() + " steps=9 --log_period=3");
  EXPECT_EQ(spaced.code, 0) << spaced.out;
  EXPECT_EQ(spaced.out, r.out);
  fs::remove_all(dir);
}

// --config FILE (the space form) takes a file whose path holds '=' or starts with '-' (before:
// "--config needs a value" with the value given).
TEST(Cli, ConfigFileNamesMayHoldEqualsOrADash) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_cfg_" + std::to_string(::getpid()));
  fs::create_directories(dir / "a=b");
  std::ofstream(dir / "a=b" / "t.yml") << "steps: 7\n";
  std::ofstream(dir / "-d.yml") << "steps: 8\n";
  auto r = mt_cmd("config --config " + (dir / "a=b" / "t.yml").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\nsteps: 7"), std::string::npos) << r.out;
  std::string out;
  EXPECT_EQ(test::run_command("cd " + dir.string() + " && MT_PLUGIN_PATH= " + test::mt_exe() +
                                  " config --config -d.yml",
                              out),
            0)
      << out;
  EXPECT_NE(out.find("\nsteps: 8"), std::string::npos) << out;
  fs::remove_all(dir);
}

TEST(Cli, BadInputIsRefusedWithExitCode2) {
  const fs::path dir = fs::temp_directory_path() / ("mt_cli_bad_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "bad.yml") << "steps: 3\nlearning_rate: [1, 2\n";
  struct Case {
    std::string args, needle;
  } cases[] = {
      {"config --config=" + (dir / "bad.yml").string(), "bad.yml:"},
      {"config learning_rte=0.1", "learning_rate"},
      {"config steps=abc", "steps"},
      {"config steps=0", "steps"},
      {"config attention=fast", "dot_product"},
      {"config --model=llama9", "llama2-7b"},
      {"config --config=/nonexistent/x.yml", "/nonexistent/x.yml"},
      {"config --model", "--model needs a value"},
      // One model, one config file: a second file was dropped silently; --model beat
      // model_name= in either order.
      {"config --model=llama-test model_name=gemma-test", "name two models"},
      {"config --config=" + (dir / "bad.yml").string() + " --config=/x.yml",
       "--config is given twice"},
      {"config --config", "--config needs a value"},
      {"config --config steps=3", "the next word, steps=3, looks like an option"},
      {"config 'base_output_directory=~/runs'", "starts with ~, which mt does not expand"},
      {"run --model=llama-test steps=1 dataset_type=tokens add_eos=false dataset_path=" +
           test::source_dir() +
           "/data/corpus.eval.tokens base_output_directory=" + (dir / "out").string(),
       "add_eos=false (set on the command line) has no effect on dataset_type=tokens"},
      {"decode --model=llama-test prompt_file=/nonexistent/p.txt", "prompt_file file"},
      {"config --config=", "--config= has no value"},
      // AdamW divides by 1 - b^step and by sqrt(v) + eps: these made NaN at the first step,
      // reported at the second as "no parameters were updated".
      {"config adam_b1=1", "adam_b1 must be >= 0 and < 1"},
      {"config adam_b2=1", "adam_b2 must be >= 0 and < 1"},
      {"config adam_eps=0", "adam_eps must be > 0"},
      {"run --model=llama-test steps=1 adam_eps=1e300 base_output_directory=" +
           (dir / "out").string(),
       "is infinite in float32"},
      // Below 1 but 1 in float32: NaN at step 1 (before: exit 1 at step 2, advice on the rate).
      {"run --model=llama-test steps=1 adam_b2=0.999999999 base_output_directory=" +
           (dir / "out").string(),
       "rounds to 1 in float32"},
      // (before: accepted, then the rope kernel's internal check stopped mt run, exit 1)
      {"config --model=mistral-test head_dim=7", "head_dim=7"},
      // (before: 100000 threads took a minute to start, or aborted in pthread_create)
      {"config num_threads=100000", "num_threads"},
      // A path that is not there is the user's (before: exit 1).
      {"decode load_parameters_path=/nonexistent/ckpt tokens=1", "/nonexistent/ckpt"},
      {"run backend=tpu", "libmt_backend_tpu.so"},
      {"run --model=llama2-7b backend=cuda steps=1", "cuda"},
      // A model key the family does not implement would silently build another model.
      {"run --model=llama-test steps=1 rope_linear_scaling_factor=8 base_output_directory=" +
           (dir / "out").string(),
       "llama model family does not use rope_linear_scaling_factor=8.0"},
      // A rope scaling's keys without its rope_type changed nothing.
      {"run --model=qwen3-test steps=1 rope_factor=4 base_output_directory=" +
           (dir / "out").string(),
       "qwen3 model family does not use rope_factor=4.0"},
      {"run --model=llama-test steps=1 rope_type=llama3.1 beta_fast=16 base_output_directory=" +
           (dir / "out").string(),
       "does not use beta_fast=16.0 (set on the command line) with rope_type=llama3.1"},
      {"run --model=llama-test steps=1 beta_slow=2 base_output_directory=" + (dir / "out").string(),
       "set the rope_type whose scaling takes it (llama3.1: rope_factor, rope_low_freq_factor, "
       "rope_high_freq_factor, original_max_position_embeddings; yarn: rope_factor, "
       "original_max_position_embeddings, beta_fast, beta_slow)"},
      // Dense mistral took the experts' keys and changed nothing.
      {"run --model=mistral-test steps=1 capacity_factor=0.5 base_output_directory=" +
           (dir / "out").string(),
       "mistral model family does not use capacity_factor=0.5"},
      // Data that does not fit the model is bad input (before: exit 1).
      {"run --model=llama-test steps=1 dataset_type=tokens dataset_path=" + test::source_dir() +
           "/data/corpus.eval.tokens base_output_directory=" + (dir / "out").string(),
       "is >= vocab_size 256"},
      // Two inputs where one is read: the other was ignored silently.
      {"decode --model=llama-test load_parameters_path=" + dir.string() +
           " tokens=1,2 prompt_file=" + (dir / "bad.yml").string(),
       "tokens (command line) and prompt_file (command line) are all set"},
      {"score --model=llama-test load_parameters_path=" + dir.string() + " tokens=1,2 prompt=hi",
       "tokens (command line) and prompt (command line) are all set"},
      {"decode --model=llama-test load_parameters_path=" + dir.string() + " tokens=1,,2",
       "tokens: an empty item between two commas"},
      {"run --model=llama-test steps=1 load_parameters_path=" + dir.string() +
           " load_full_state_path=" + dir.string() +
           " base_output_directory=" + (dir / "out").string(),
       "and load_full_state_path are both set"},
  };
  for (const auto& c : cases) {
    auto r = mt_cmd(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.needle), std::string::npos) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find("error:"), std::string::npos) << r.out;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt
