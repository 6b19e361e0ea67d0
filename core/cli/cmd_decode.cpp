// mt decode (MaxText's decode.py) and mt score: inference from a trained checkpoint.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "checkpoint_manager.h"
#include "cli.h"
#include "config_impl.h"
#include "decoder.h"
#include "file_util.h"
#include "hf_interop.h"
#include "host_threads.h"
#include "json.h"
#include "memory_plan.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/tokenizer.h"
#include "plugin_manager.h"
#include "safetensors.h"
#include "tokenizer_bpe.h"
#include "tokenizer_factory.h"
#include "trainer.h"

namespace fs = std::filesystem;

namespace mt::cli {

namespace {

struct Inference {
  Config cfg;
  std::unique_ptr<HostThreads> threads;  // num_threads for the host work (loading) too
  std::unique_ptr<PluginManager> pm;
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Tokenizer> tokenizer;  // null when no tokenizer_path is set
  bool add_bos = true;                   // add_bos, or the directory's add_bos_token
  int32_t bos = -1;                      // prepended when add_bos
  std::vector<int32_t> stop_ids;         // any of them ends a sequence
};

// The special tokens: the tokenizer's own, unless a Hugging Face directory says otherwise
// (tokenizer_config.json's bos/eos tokens and add_bos_token, which an add_bos the user set still
// overrides; generation_config.json's eos ids, which stop decoding as they stop generate).
void special_tokens(Inference& in) {
  const Config& cfg = in.cfg;
  in.add_bos = cfg.get_bool("add_bos");
  in.bos = in.tokenizer ? in.tokenizer->bos_id() : -1;
  int32_t eos = in.tokenizer ? in.tokenizer->eos_id() : -1;
  const std::string hf = cfg.get_string("hf_path");
  if (!hf.empty()) {
    const HfTokenSettings t = read_hf_token_settings(hf);
    const auto* bpe = dynamic_cast<const BpeTokenizer*>(in.tokenizer.get());
    auto id_of = [&](const std::string& token, const char* field) -> int32_t {
      if (!bpe || token.empty()) return -1;
      const int32_t id = bpe->token_to_id(token);
      if (id < 0)
        throw UsageError(mt::quoted(fs::path(hf) / "tokenizer_config.json") + " names " + field +
                         " '" + token + "', which the tokenizer has no token for.");
      return id;
    };
    if (const int32_t b = id_of(t.bos_token, "bos_token"); b >= 0)
      in.bos = b;
    else if (t.bos_token_id >= 0)
      in.bos = t.bos_token_id;
    if (const int32_t e = id_of(t.eos_token, "eos_token"); e >= 0) eos = e;
    const bool user_set = cfg.origin("add_bos").find("base.yml") == std::string::npos;
    if (t.add_bos_token && !user_set) in.add_bos = *t.add_bos_token;
    in.stop_ids = t.eos_token_ids;
  }
  if (in.stop_ids.empty() && eos >= 0) in.stop_ids = {eos};
  // An end-of-sequence id the model cannot produce is left out with a note, as transformers
  // warns and goes on (before: refused, though mt score never reads it; a default LlamaConfig
  // of a tiny vocabulary has eos 2).
  const int64_t vocab = in.runner->model().dims().vocab_size;
  std::vector<int32_t> kept;
  for (int32_t id : in.stop_ids) {
    if (id < vocab) {
      kept.push_back(id);
      continue;
    }
    std::fprintf(stderr,
                 "note: the end-of-sequence id %d is outside the model's vocabulary [0, %lld): "
                 "the model cannot produce it, so decoding does not stop at it.\n",
                 id, static_cast<long long>(vocab));
  }
  in.stop_ids = std::move(kept);
}

// profile=true: where the command's time went, per backend op (as mt run prints it).
void print_profile(const Inference& in, const char* command) {
  if (const ProfilingBackend* p = in.runner->profiler())
    std::fprintf(stderr, "mt %s: profile (loading left out):\n%s", command, p->report().c_str());
}

// Loads the model and its weights (load_parameters_path) and the tokenizer (tokenizer_path).
Inference load_inference(const Args& args, const char* command, bool need_tokenizer,
                         int64_t sequences = 1) {
  Inference in;
  // Inference never updates the weights: f32 masters with bf16 compute are held in bf16 from
  // the start (loaded with the rounding every forward's cast would give).
  in.cfg = inference_config(resolve_config(args));
  const Config& cfg = in.cfg;
  in.threads = std::make_unique<HostThreads>(cfg);
  const std::string ckpt = cfg.get_string("load_parameters_path");
  const std::string hf = cfg.get_string("hf_path");
  if (ckpt.empty() && hf.empty())
    throw UsageError(std::string("mt ") + command +
                     " needs trained weights: pass load_parameters_path=<checkpoint> (a run "
                     "directory, its checkpoints/ directory, or one step directory) or "
                     "hf_path=<Hugging Face model directory>.");
  if (!ckpt.empty())
    warn_changed_model_keys(cfg, "load_parameters_path", ckpt, "mt " + std::string(command));
  std::vector<fs::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  in.pm = std::make_unique<PluginManager>(dirs);
  {
    std::unique_ptr<Backend> device = in.pm->make_backend(cfg.get_string("backend"), cfg);
    // mt decode: the memory plan first (weights, caches of max_target_length, a prefill), so a
    // model that cannot fit is refused with the changes that make it fit before any loading;
    // mt score: the weights at least (its forward of a window is left to the allocator).
    if (std::string(command) == "decode")
      check_fits(cfg, *in.pm, *device, PlanFor::decode, command, 1, sequences);
    else
      check_weights_fit(cfg, *in.pm, *device, command);
    // quantization=int8: the projections held as int8 rows from the start, each quantized as
    // it is read, so the weights are never all held in the compute dtype.
    in.runner = std::make_unique<ModelRunner>(cfg, *in.pm, std::move(device), nullptr,
                                              ParamSharding{}, TensorSharding{}, ExpertSharding{},
                                              cfg.get_string("quantization") == "int8");
  }
  if (!ckpt.empty())
    load_checkpoint_weights(ckpt, *in.runner);
  else
    load_hf_weights(hf, *in.runner);
  in.runner->apply_quantization(cfg);
  // int8 rows are blocks of 32 values: a projection of another input width stays in the compute
  // dtype, which is said (before: silently; a model of such widths was not quantized at all).
  if (cfg.get_string("quantization") == "int8") {
    int64_t all = 0, kept = 0;
    std::string first;
    for (const auto& p : in.runner->params()) {
      if (!p.spec.projection && !p.tied_table()) continue;  // a tied head too
      ++all;
      if (p.layout == WeightLayout::q8) continue;
      if (kept++ == 0) first = p.name;
    }
    if (kept > 0)
      std::fprintf(stderr,
                   "note: quantization=int8: %lld of %lld projection weights stay in %s (%s%s): "
                   "their input width is not a multiple of 32, the int8 block.\n",
                   static_cast<long long>(kept), static_cast<long long>(all),
                   dtype_name(in.runner->compute_dtype()), first.c_str(), kept > 1 ? ", ..." : "");
  }
  // Only when text must be tokenized (score with token ids needs none).
  // mt decode of token ids loads a tokenizer it has too: its end-of-sequence id stops the
  // generation as it does for text (before: ignored, the ids ran to max_target_length).
  const std::string tok = cfg.get_string("tokenizer_path");
  if ((need_tokenizer || std::string(command) == "decode") && !tok.empty())
    in.tokenizer = make_tokenizer(tok, cfg.get_string("tokenizer_type"));
  if (need_tokenizer && !in.tokenizer)
    throw UsageError(std::string("mt ") + command +
                     " needs a tokenizer for text: set tokenizer_path= (or give token ids).");
  if (in.tokenizer && in.tokenizer->vocab_size() > in.runner->model().dims().vocab_size)
    cfg.reject("tokenizer_path",
               fmt::format("has {} tokens, more than the model's vocab_size={}.",
                           in.tokenizer->vocab_size(), in.runner->model().dims().vocab_size));
  special_tokens(in);
  in.runner->reset_profile();  // profile=true: the command's work, not the loading
  return in;
}

// `where` names the text's source in the error of a text the tokenizer refuses (not UTF-8).
std::vector<int32_t> encode(const Inference& in, const std::string& text,
                            const std::string& where) {
  std::vector<int32_t> ids;
  if (in.add_bos && in.bos >= 0) ids.push_back(in.bos);
  std::vector<int32_t> body;
  try {
    body = in.tokenizer->encode(text);
  } catch (const Error& e) {
    throw UsageError(where + ": " + e.what());
  }
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

// The kind of a text input, by its extension: .jsonl/.json lines are JSON (a guess from a line's
// first byte read a JSON line with a leading space as text, JSON syntax and all), .txt lines
// are text (one beginning with '{' too); any other file's lines are JSON when they begin with
// '{' (after blanks), else text.
enum class TextKind { json, text, sniff };
TextKind text_kind(const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".jsonl" || ext == ".json") return TextKind::json;
  if (ext == ".txt") return TextKind::text;
  return TextKind::sniff;
}

// The documents of a prompt or score input, a line each: the line, or of a JSON line (by
// text_kind) its `column` field.
std::vector<std::string> read_texts(const std::string& path, const std::string& column) {
  std::vector<std::string> out;
  const TextKind kind = text_kind(path);
  LineReader in(path, "prompt_file", kMaxRecordBytes);
  for (std::string_view line; in.next(line);) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t first = line.find_first_not_of(" \t");
    const bool json_line =
        kind == TextKind::json ||
        (kind == TextKind::sniff && first != std::string_view::npos && line[first] == '{');
    if (!json_line) {
      out.emplace_back(line);
      continue;
    }
    const std::string where = "'" + path + "' line " + std::to_string(in.line_number());
    if (first == std::string_view::npos) continue;  // a blank line
    json::Value v;
    try {
      v = json::parse(line);
    } catch (const json::ParseError& e) {
      throw UsageError(
          where + ": malformed JSON at byte " + std::to_string(e.offset) + ": " + e.what +
          (kind == TextKind::json ? " (a .jsonl file holds a JSON object a line)" : ""));
    }
    const json::Value* t = v.find(column);
    if (!t || !t->is_string())
      throw UsageError(where + ": the JSON line has no \"" + column +
                       "\" string (train_data_columns=" + column + ").");
    out.push_back(t->str);
  }
  return out;
}

std::vector<int32_t> parse_ids(const std::string& text, const std::string& where) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  bool gap = false;  // an empty item before this one: "1,,2" (a final comma is allowed)
  for (std::string item; std::getline(ss, item, ',');) {
    if (gap)
      throw UsageError(where +
                       ": an empty item between two commas; ids are comma-separated "
                       "integers (such as 1,5,42).");
    if (item.find_first_not_of(" \t\r\n") == std::string::npos) {
      gap = true;
      continue;
    }
    const size_t a = item.find_first_not_of(" \t\r\n");
    const size_t b = item.find_last_not_of(" \t\r\n");
    int32_t v = -1;
    const auto r = std::from_chars(item.data() + a, item.data() + b + 1, v);
    if (r.ec != std::errc() || r.ptr != item.data() + b + 1 || v < 0)
      throw UsageError(where + ": '" + item.substr(a, b + 1 - a) +
                       "' is not a token id (ids are comma-separated integers from 0 to "
                       "2147483647).");
    ids.push_back(v);
  }
  return ids;
}

// At most one of `keys` set (base.yml's default prompt does not count): a second one was
// silently ignored.
void one_source(const Config& cfg, const char* command, const std::vector<std::string>& keys) {
  std::vector<std::string> set;
  for (const auto& k : keys)
    if (!cfg.get_string(k).empty() && cfg.origin(k).find("base.yml") == std::string::npos)
      set.push_back(k + " (" + cfg.origin(k) + ")");
  if (set.size() > 1)
    throw UsageError(
        fmt::format("the input of mt {} is one of {}; {} are all set, and all but one "
                    "would be ignored. Keep one.",
                    command, fmt::join(keys, ", "), fmt::join(set, " and ")));
}

// A safetensors file holding "logprobs": one mt score wrote (which a new score may replace).
bool is_score_output(const std::filesystem::path& p) {
  try {
    return SafeTensorsFile(p).contains("logprobs");
  } catch (const Error&) {
    return false;  // not a safetensors file
  }
}
}  // namespace

// tokens= set to nothing (tokens= with no ids) is not "no tokens given": before, the default
// prompt was decoded instead.
void refuse_empty_tokens(const Config& probe) {
  if (probe.get_string("tokens").empty() &&
      probe.origin("tokens").find("base.yml") == std::string::npos)
    throw UsageError("tokens= (" + config_set_where(probe.origin("tokens")) +
                     ") holds no token id: give ids (tokens=1,5,42), or leave tokens out for "
                     "prompt=.");
}

int cmd_decode(const Args& args) {
  // tokens=<ids>: the prompt as token ids, and the output as ids (prompt and continuation, as
  // transformers' generate returns them), so a decode compares exactly with a reference.
  const Config probe = resolve_config(args, /*notes=*/false);
  one_source(probe, "decode", {"tokens", "prompt_file", "prompt"});
  refuse_empty_tokens(probe);
  const bool ids_given = !probe.get_string("tokens").empty();
  if (ids_given) parse_ids(probe.get_string("tokens"), "tokens");  // before the model loads
  // The prompts' texts before the model loads: their number is the batch the memory check
  // plans (each prompt has a cache of max_target_length; before, one was planned whatever
  // prompt_file held), and a bad file is refused before any weight is read.
  std::vector<std::string> texts;
  if (!ids_given) {
    if (!probe.get_string("prompt_file").empty())
      texts = read_texts(probe.get_string("prompt_file"), probe.get_string("train_data_columns"));
    else
      texts.push_back(probe.get_string("prompt"));
    if (texts.empty())
      throw UsageError("prompt_file=" + probe.get_string("prompt_file") +
                       " holds no prompt (every line is empty).");
  }
  Inference in = load_inference(args, "decode", /*need_tokenizer=*/!ids_given,
                                std::max<int64_t>(1, static_cast<int64_t>(texts.size())));
  const Config& cfg = in.cfg;
  std::vector<std::vector<int32_t>> prompts;
  if (ids_given) {
    prompts.push_back(parse_ids(cfg.get_string("tokens"), "tokens"));
    texts.emplace_back();
    const int64_t vocab = in.runner->model().dims().vocab_size;
    for (size_t i = 0; i < prompts[0].size(); ++i)
      if (prompts[0][i] >= vocab)
        throw UsageError(
            fmt::format("Token id {} at position {} is outside the model's "
                        "vocabulary [0, {}).",
                        prompts[0][i], i, vocab));
    if (prompts[0].empty()) throw UsageError("tokens= holds no token id.");
  } else {
    const std::string from = cfg.get_string("prompt_file").empty()
                                 ? std::string("prompt")
                                 : "prompt_file=" + cfg.get_string("prompt_file");
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string where = texts.size() > 1 ? fmt::format("{}, prompt {}", from, i + 1) : from;
      prompts.push_back(encode(in, texts[i], where));
      // (before: "Cannot decode from an empty prompt" from the decoder, naming none)
      if (prompts.back().empty())
        throw UsageError(where +
                         " gives no token (an empty text, and add_bos=false or a "
                         "tokenizer without a bos): there is nothing to continue.");
    }
  }
  const int64_t max_prefill = cfg.get_int("max_prefill_predict_length");
  // Which prompt, when a file holds several (before: "A prompt has ...", naming none).
  auto which = [&](size_t i) {
    return prompts.size() > 1
               ? fmt::format("Prompt {} of prompt_file={}", i + 1, cfg.get_string("prompt_file"))
               : std::string("The prompt");
  };
  for (size_t i = 0; i < prompts.size(); ++i)
    if (static_cast<int64_t>(prompts[i].size()) > max_prefill)
      throw UsageError(fmt::format("{} has {} tokens, more than max_prefill_predict_length={}.",
                                   which(i), prompts[i].size(), max_prefill));
  const int64_t max_len = cfg.get_int("max_target_length");
  // Checked before the prompt is printed (streamed): an error after it ran into the prompt.
  for (size_t i = 0; i < prompts.size(); ++i)
    if (static_cast<int64_t>(prompts[i].size()) >= max_len)
      throw UsageError(fmt::format(
          "{} has {} tokens, and max_target_length={} (the prompt and its continuation) "
          "leaves no room for a generated token; raise max_target_length above {}.",
          which(i), prompts[i].size(), max_len, prompts[i].size()));
  const SamplingParams sp = sampling_from_config(cfg);
  const bool stream = prompts.size() == 1 && !ids_given;
  std::string shown;
  // The text as bytes (fwrite): a generated NUL byte (byte-level BPE's token for 0x00) must not
  // end the line, as printf's %s and fputs would.
  auto put = [](const std::string& t, size_t from = 0) {
    if (t.size() > from) std::fwrite(t.data() + from, 1, t.size() - from, stdout);
  };
  if (stream) put(texts[0]);
  // The continuation's text is the whole sequence's decoded text past the prompt's: decoded on
  // its own, a SentencePiece/Metaspace continuation loses the space its first piece carries
  // ("Hello" + "by", not "Hello by"), as the decoder strips a text's leading space.
  const std::string prompt_text = ids_given ? std::string() : in.tokenizer->decode(prompts[0]);
  auto continuation = [&](const std::vector<int32_t>& prompt, const std::string& prompt_decoded,
                          const std::vector<int32_t>& cont) {
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), cont.begin(), cont.end());
    const std::string text = in.tokenizer->decode(all);
    if (text.compare(0, prompt_decoded.size(), prompt_decoded) == 0)
      return text.substr(prompt_decoded.size());
    return in.tokenizer->decode(cont);  // a decoder that rewrites the prompt's end
  };
  // The stream decodes a window, not the whole sequence, per token (that made long generations
  // quadratic: 14k tokens cost 5.8 s more streamed): the tokens [from, read) shown last, as
  // context, and those after. What the window's text adds to the context's is printed once it
  // does not end in U+FFFD (a character whose first bytes alone came: a byte-fallback or
  // byte-level decoder completes it when the rest arrive) and it extends the context's text;
  // the window then moves on. The context keeps a SentencePiece/Metaspace piece's leading space
  // (decoded alone, a text's first piece loses it). The prompt's last 5 tokens start it.
  std::vector<int32_t> seq = prompts[0];
  size_t from = seq.size() > 5 ? seq.size() - 5 : 0, read = seq.size();
  auto on_token = [&](int64_t, int32_t id) {
    if (!stream) return;
    seq.push_back(id);
    const std::string before =
        in.tokenizer->decode(std::vector<int32_t>(seq.begin() + static_cast<std::ptrdiff_t>(from),
                                                  seq.begin() + static_cast<std::ptrdiff_t>(read)));
    const std::string now = in.tokenizer->decode(
        std::vector<int32_t>(seq.begin() + static_cast<std::ptrdiff_t>(from), seq.end()));
    static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
    const bool incomplete =
        now.size() >= kReplacement.size() &&
        now.compare(now.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0;
    if (incomplete || now.size() <= before.size() || now.compare(0, before.size(), before) != 0)
      return;
    put(now, before.size());
    std::fflush(stdout);
    shown.append(now, before.size());
    from = read;
    read = seq.size();
  };
  // One or two sequences: each step is a read of every weight, which the CPU streams faster with
  // the projection weights transposed ([N, K]). More rows per step are bound by arithmetic,
  // which the [K, N] kernels do faster (llama-bench-m, 8 rows: 1.4-1.7x), as is the prefill,
  // unless bf16 rows run on dot products (ModelRunner::rows_layout_pays).
  // Then q/k/v and gate/up as one product each where they are rows (transposed or int8).
  if (in.runner->rows_layout_pays(prompts.size())) in.runner->transpose_projections();
  in.runner->fuse_projections();
  const GenerateResult r = generate(*in.runner, prompts, max_len, sp, in.stop_ids, on_token);
  if (ids_given) {
    std::string line;
    for (const std::vector<int32_t>* part : {&std::as_const(prompts[0]), &r.tokens[0]})
      for (int32_t id : *part) {
        if (!line.empty()) line += ',';
        line += std::to_string(id);
      }
    std::printf("%s\n", line.c_str());
  } else if (stream) {
    // What was held back (a character still incomplete at the end is printed as U+FFFD). A
    // decoder that rewrote text already shown (byte-fallback bytes that a later byte made
    // invalid UTF-8, all of them U+FFFD then) gets the rest past what both agree on: nothing
    // is left unprinted.
    const std::string text = continuation(prompts[0], prompt_text, r.tokens[0]);
    size_t same = 0;
    while (same < text.size() && same < shown.size() && text[same] == shown[same]) ++same;
    put(text, same == shown.size() ? shown.size() : same);
    std::printf("\n");
  } else {
    for (size_t b = 0; b < prompts.size(); ++b) {
      std::printf("[%zu] ", b);
      put(texts[b] + continuation(prompts[b], in.tokenizer->decode(prompts[b]), r.tokens[b]) +
          "\n");
    }
  }
  std::fprintf(stderr,
               "mt decode: %zu prompt(s); prefill %ld tokens at %.1f tokens/s; decode %ld tokens "
               "at %.1f tokens/s\n",
               prompts.size(), static_cast<long>(r.prefill_tokens),
               r.prefill_seconds > 0 ? r.prefill_tokens / r.prefill_seconds : 0.0,
               static_cast<long>(r.decoded_tokens),
               r.decode_seconds > 0 ? r.decoded_tokens / r.decode_seconds : 0.0);
  print_profile(in, "decode");
  return 0;
}

int cmd_score(const Args& args) {
  const Config probe = resolve_config(args, /*notes=*/false);
  one_source(probe, "score", {"tokens", "input", "prompt"});
  refuse_empty_tokens(probe);
  // Scoring runs no decode: the int8 cache would change nothing it measures.
  if (probe.get_bool("quantize_kvcache"))
    probe.reject("quantize_kvcache",
                 "has no effect on mt score, which runs the full forward with no KV cache: its "
                 "perplexity would be the cache-less model's. Measure an int8 cache with mt "
                 "decode (greedy continuations) instead.");
  if (!probe.get_string("tokens").empty()) parse_ids(probe.get_string("tokens"), "tokens");
  if (!probe.get_string("output").empty())  // before the model loads: nothing is lost, no time
    check_output_file("output", probe.get_string("output"),
                      {probe.get_string("input"), probe.get_string("tokenizer_path"),
                       probe.get_string("load_parameters_path")},
                      is_score_output, "logits file (safetensors)");
  const bool ids_given = !probe.get_string("tokens").empty();
  // input= of token ids: a file of digits, commas and blanks that is not .jsonl/.json (before,
  // ids with CRLF line ends were read as text); said, since a text of numbers reads the same.
  // Read before the model loads: such input needs no tokenizer (before: refused without one).
  std::optional<std::vector<int32_t>> file_ids;
  if (const std::string path = probe.get_string("input"); !ids_given && !path.empty()) {
    const std::string all = read_file(path, "input");
    if (text_kind(path) != TextKind::json &&
        all.find_first_not_of("0123456789, \t\r\n") == std::string::npos) {
      // Lines join as one sequence; a line may end with a comma or not.
      std::string joined;
      std::stringstream lines(all);
      for (std::string line; std::getline(lines, line);) {
        const size_t end = line.find_last_not_of(", \t\r");
        if (end == std::string::npos) continue;
        if (!joined.empty()) joined += ',';
        joined.append(line, 0, end + 1);
      }
      file_ids = parse_ids(joined, path);
      std::fprintf(stderr,
                   "mt score: input=%s holds only digits, commas and blanks: read as token ids.\n",
                   path.c_str());
    }
  }
  Inference in = load_inference(args, "score", /*need_tokenizer=*/!ids_given && !file_ids);
  const Config& cfg = in.cfg;
  // The sequences scored, each on its own: one, or one per document of a text input (a document
  // is not context for the next: mt run's evaluation restarts attention at each packed
  // document; before, the documents were joined into one stream).
  std::vector<std::vector<int32_t>> seqs;
  if (ids_given) {
    seqs.push_back(parse_ids(cfg.get_string("tokens"), "tokens"));
  } else if (file_ids) {
    seqs.push_back(std::move(*file_ids));
  } else if (!cfg.get_string("input").empty()) {
    const std::string path = cfg.get_string("input");
    for (const auto& t : read_texts(path, cfg.get_string("train_data_columns"))) {
      auto e = encode(in, t, "input=" + path);
      if (in.tokenizer->eos_id() >= 0 && cfg.get_bool("add_eos"))
        e.push_back(in.tokenizer->eos_id());
      seqs.push_back(std::move(e));
    }
  } else {
    seqs.push_back(encode(in, cfg.get_string("prompt"), "prompt"));
  }
  std::vector<int32_t> ids;  // every sequence's, in order
  std::vector<int32_t> seq_of;
  for (size_t q = 0; q < seqs.size(); ++q) {
    ids.insert(ids.end(), seqs[q].begin(), seqs[q].end());
    seq_of.insert(seq_of.end(), seqs[q].size(), static_cast<int32_t>(q));
  }
  const int64_t vocab = in.runner->model().dims().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      throw UsageError(
          fmt::format("Token id {} at position {} is outside the model's vocabulary "
                      "[0, {}).",
                      ids[i], i, vocab));
  size_t longest = 0;
  for (const auto& q : seqs) longest = std::max(longest, q.size());
  if (longest < 2) throw UsageError("mt score needs at least two tokens (one to predict).");
  // Windows of max_target_length tokens, scored independently: said, never done silently.
  const int64_t window = cfg.get_int("max_target_length");
  const auto n = static_cast<int64_t>(ids.size());
  if (static_cast<int64_t>(longest) > window) {
    const int64_t mpe = cfg.get_int("max_position_embeddings");
    const auto most = static_cast<int64_t>(longest);
    // The advice: a context that holds the sequence, or, past the model's positions, the
    // widest windows it allows (none wider when max_target_length is already that).
    std::string advice;
    if (mpe <= 0 || most <= mpe)
      advice = fmt::format("Set max_target_length={} to score it as one sequence.", most);
    else if (window < mpe)
      advice = fmt::format(
          "The model has positions for {} tokens (max_position_embeddings), so it cannot be "
          "scored as one sequence; max_target_length={} makes the windows as wide as it allows.",
          mpe, mpe);
    else
      advice = fmt::format(
          "The model has positions for {} tokens (max_position_embeddings), so it cannot be "
          "scored as one sequence.",
          mpe);
    std::fprintf(stderr,
                 "mt score: a sequence has %ld tokens, more than max_target_length=%ld: it is "
                 "scored in %ld independent windows of up to %ld tokens, each without the context "
                 "of the ones before (the first token of each is not predicted). %s\n",
                 static_cast<long>(most), static_cast<long>(window),
                 static_cast<long>((most + window - 1) / window), static_cast<long>(window),
                 advice.c_str());
  }
  std::vector<float> all_logits;
  // logprobs[j]: log p(token j | the tokens before it in its window); NaN where nothing
  // predicts it (a sequence's or a window's first token), so the file and the mean agree.
  std::vector<float> logprobs;
  const bool keep = !cfg.get_string("output").empty();
  // output= keeps every scored token's logits for the file (and the write needs about as much
  // again): refused before scoring when that cannot fit this machine's memory (before: an
  // out-of-memory error after the whole scoring pass, and no file).
  if (keep) {
    const double logits_bytes = static_cast<double>(n) * static_cast<double>(vocab) * 4.0;
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
    const double memory = pages > 0 && page > 0 ? static_cast<double>(pages) * page : 0.0;
    if (memory > 0 && 2 * logits_bytes > memory)
      cfg.reject("output",
                 fmt::format("would hold the logits of {} tokens x a vocabulary of {}: {} in "
                             "memory, about twice that while the file is written, more than this "
                             "machine's {}. Score fewer tokens a call (split input=), or leave "
                             "output= out for the loss alone.",
                             n, vocab, human_bytes(logits_bytes), human_bytes(memory)));
  }
  double nll = 0;
  int64_t counted = 0;
  Backend& be = in.runner->backend();
  for (const auto& seq : seqs) {
    const auto len = static_cast<int64_t>(seq.size());
    for (int64_t s = 0; s < len; s += window) {
      const int64_t t = std::min(window, len - s);
      HostBatch hb;
      hb.batch = 1;
      hb.seq = t;
      hb.inputs.assign(seq.begin() + s, seq.begin() + s + t);
      DeviceBatch db = in.runner->upload(hb);
      Graph g(be, /*record=*/false);
      Tensor logits = in.runner->forward(g, db);
      Tensor f = logits;
      if (f.dtype() != DType::f32) {
        f = be.empty(logits.shape(), DType::f32);
        be.cast(logits, f);
      }
      std::vector<float> host(static_cast<size_t>(t * vocab));
      be.copy_to_host(f, host.data());
      if (keep) logprobs.push_back(std::numeric_limits<float>::quiet_NaN());
      for (int64_t i = 0; i + 1 < t; ++i) {  // position i predicts token i + 1 of the window
        const float* row = host.data() + i * vocab;
        double mx = row[0];
        for (int64_t v = 1; v < vocab; ++v) mx = std::max(mx, double(row[v]));
        double z = 0;
        for (int64_t v = 0; v < vocab; ++v) z += std::exp(double(row[v]) - mx);
        const double lp = double(row[hb.inputs[static_cast<size_t>(i + 1)]]) - mx - std::log(z);
        nll -= lp;
        ++counted;
        if (keep) logprobs.push_back(static_cast<float>(lp));
      }
      if (keep) all_logits.insert(all_logits.end(), host.begin(), host.end());
    }
  }
  if (counted == 0)
    throw UsageError("mt score: no token is predicted: every sequence has one token.");
  const double mean = nll / static_cast<double>(counted);
  std::printf("tokens %ld  predicted %ld  mean loss %.6f  perplexity %.4f%s\n",
              static_cast<long>(n), static_cast<long>(counted), mean, std::exp(mean),
              seqs.size() > 1
                  ? fmt::format("  ({} sequences, each scored on its own)", seqs.size()).c_str()
                  : "");
  if (keep) {
    const std::string out = cfg.get_string("output");
    write_safetensors(
        out,
        {SafeTensorsEntry("logits", DType::f32, {n, vocab}, all_logits.data()),
         SafeTensorsEntry("logprobs", DType::f32, {n}, logprobs.data()),
         SafeTensorsEntry("tokens", DType::i32, {n}, ids.data()),
         SafeTensorsEntry("sequence", DType::i32, {n}, seq_of.data())},
        {{"mean_loss", fmt::format("{:.9g}", mean)}, {"predicted", std::to_string(counted)}});
    std::printf(
        "wrote logits [%ld, %ld], logprobs [%ld] (NaN where not predicted), tokens and "
        "sequence to %s\n",
        static_cast<long>(n), static_cast<long>(vocab), static_cast<long>(n), out.c_str());
  }
  print_profile(in, "score");
  return 0;
}

int64_t prompt_file_prompts(const Config& cfg) {
  const std::string path = cfg.get_string("prompt_file");
  if (path.empty()) return 1;
  return std::max<int64_t>(
      1, static_cast<int64_t>(read_texts(path, cfg.get_string("train_data_columns")).size()));
}

}  // namespace mt::cli
