// Encode throughput of the tokenizers on the shipped corpus (data/corpus.train.jsonl, 3.8 MB),
// one thread. bytes_per_second is input text per CPU second. The reference libraries on the
// same input: tools/bench_tokenizer_reference.py.
//
// BpeEncodeWarm reuses one tokenizer, so its word cache is warm after the first pass (the
// steady state of a long run); BpeEncodeCold makes a fresh one per pass (construction not
// timed), so every distinct word goes through the merge loop once per pass.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "json.h"
#include "tokenizer_bpe.h"
#include "tokenizer_factory.h"
#include "tokenizer_util.h"

namespace {

std::string source_dir() {
  if (const char* d = std::getenv("MT_SOURCE_DIR")) return d;
  // This file sits at <root>/bench/kernels/.
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path().string();
}

const std::vector<std::string>& corpus() {
  static const std::vector<std::string> docs = [] {
    std::vector<std::string> out;
    const std::string bytes = mt::read_file(source_dir() + "/data/corpus.train.jsonl", "corpus");
    size_t pos = 0;
    while (pos < bytes.size()) {
      size_t end = bytes.find('\n', pos);
      if (end == std::string::npos) end = bytes.size();
      if (end > pos) out.push_back(mt::json::parse(bytes.substr(pos, end - pos)).find("text")->str);
      pos = end + 1;
    }
    return out;
  }();
  return docs;
}

int64_t corpus_bytes() {
  int64_t n = 0;
  for (const auto& d : corpus()) n += static_cast<int64_t>(d.size());
  return n;
}

void encode_all(benchmark::State& state, const mt::Tokenizer& tok) {
  int64_t ids = 0;
  for (const auto& d : corpus()) ids += static_cast<int64_t>(tok.encode(d).size());
  benchmark::DoNotOptimize(ids);
  state.counters["ids"] = static_cast<double>(ids);
}

void BM_BpeEncodeWarm(benchmark::State& state) {
  auto tok = mt::make_tokenizer(source_dir() + "/data/tokenizer.json", "");
  for (auto _ : state) encode_all(state, *tok);
  state.SetBytesProcessed(state.iterations() * corpus_bytes());
}
BENCHMARK(BM_BpeEncodeWarm)->Unit(benchmark::kMillisecond);

void BM_BpeEncodeCold(benchmark::State& state) {
  const std::string json = mt::read_file(source_dir() + "/data/tokenizer.json", "tokenizer");
  for (auto _ : state) {
    state.PauseTiming();
    auto tok = std::make_unique<mt::BpeTokenizer>(json, "tokenizer.json");
    state.ResumeTiming();
    encode_all(state, *tok);
  }
  state.SetBytesProcessed(state.iterations() * corpus_bytes());
}
BENCHMARK(BM_BpeEncodeCold)->Unit(benchmark::kMillisecond);

void BM_SentencePieceEncode(benchmark::State& state) {
  auto tok = mt::make_tokenizer(source_dir() + "/tests/golden/tokenizer/sp.model", "");
  for (auto _ : state) encode_all(state, *tok);
  state.SetBytesProcessed(state.iterations() * corpus_bytes());
}
BENCHMARK(BM_SentencePieceEncode)->Unit(benchmark::kMillisecond);

void BM_BpeDecode(benchmark::State& state) {
  auto tok = mt::make_tokenizer(source_dir() + "/data/tokenizer.json", "");
  std::vector<std::vector<int32_t>> ids;
  for (const auto& d : corpus()) ids.push_back(tok->encode(d));
  for (auto _ : state)
    for (const auto& v : ids) benchmark::DoNotOptimize(tok->decode(v));
  state.SetBytesProcessed(state.iterations() * corpus_bytes());
}
BENCHMARK(BM_BpeDecode)->Unit(benchmark::kMillisecond);

void BM_BpeLoad(benchmark::State& state) {
  const std::string json = mt::read_file(source_dir() + "/data/tokenizer.json", "tokenizer");
  for (auto _ : state) benchmark::DoNotOptimize(mt::BpeTokenizer(json, "tokenizer.json"));
}
BENCHMARK(BM_BpeLoad)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
