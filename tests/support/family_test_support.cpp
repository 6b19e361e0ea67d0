#include "family_test_support.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "config_loader.h"
#include "mt/dtype.h"
#include "plugin_manager.h"

namespace fs = std::filesystem;

namespace mt::test {

Reference::Reference(const fs::path& dir) : file(dir / "reference.safetensors") {}

std::vector<int32_t> Reference::ints(const std::string& name) const {
  const auto& i = file.info(name);
  EXPECT_EQ(i.dtype, "I32") << name;
  std::vector<int32_t> v(static_cast<size_t>(i.numel()));
  std::memcpy(v.data(), i.data, i.nbytes());
  return v;
}

std::vector<float> Reference::floats(const std::string& name) const {
  const auto& i = file.info(name);
  EXPECT_EQ(i.dtype, "F32") << name;
  std::vector<float> v(static_cast<size_t>(i.numel()));
  std::memcpy(v.data(), i.data, i.nbytes());
  return v;
}

std::vector<float> Reference::widened(const std::string& name) const {
  const auto& i = file.info(name);
  if (i.dtype != "BF16") return floats(name);
  std::vector<float> v(static_cast<size_t>(i.numel()));
  for (size_t k = 0; k < v.size(); ++k) {
    uint16_t b;
    std::memcpy(&b, i.data + 2 * k, 2);
    v[k] = bf16_to_f32(b);
  }
  return v;
}

Scratch::Scratch() {
  const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(t->test_suite_name()) + "_" + t->name();
  std::replace(name.begin(), name.end(), '/', '_');
  root = fs::temp_directory_path() / ("mt_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(root);
  fs::create_directories(root);
}

Scratch::~Scratch() {
  fs::remove_all(root);
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string replace_first(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from << " not found";
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

void edit_file(const fs::path& file, const std::string& from, const std::string& to) {
  SCOPED_TRACE(file.string());
  const std::string text = replace_first(slurp(file), from, to);
  std::ofstream(file) << text;
}

fs::path with_config(const Scratch& s, const fs::path& golden, const std::string& name,
                     const std::string& config) {
  const fs::path dir = s.root / (name + "_" + config);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(golden / name / "model.safetensors", dir / "model.safetensors");
  fs::copy_file(golden / name / config, dir / "config.json");
  return dir;
}

std::vector<float> score(const fs::path& dir, const Reference& ref, const Scratch& s,
                         std::string& out, const std::string& extra, const Shape* shape) {
  const fs::path file = s.root / "logits.safetensors";
  fs::remove(file);
  const MtResult r =
      run_mt("score hf_path=" + dir.string() + " tokens=" + join_ids(ref.ints("input_ids")) +
                 " output=" + file.string() + (extra.empty() ? "" : " " + extra),
             120);
  out = r.out;
  EXPECT_EQ(r.code, 0) << r.out;
  if (r.code != 0 || !fs::exists(file)) return {};
  SafeTensorsFile got(file);
  const auto& li = got.info("logits");
  if (shape) EXPECT_EQ(li.shape, *shape);
  std::vector<float> v(static_cast<size_t>(li.numel()));
  std::memcpy(v.data(), li.data, li.nbytes());
  return v;
}

void expect_logits_in_both_forms(const Scratch& s, const fs::path& golden, const std::string& name,
                                 double tol) {
  const Reference ref(golden / name);
  const std::vector<float> want = ref.floats("logits");
  std::string out;
  const std::vector<float> v5 = score(golden / name, ref, s, out);
  ASSERT_EQ(v5.size(), want.size()) << out;
  EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
  EXPECT_LT(scaled_err(v5, want), tol);
  const std::vector<float> legacy =
      score(with_config(s, golden, name, "legacy_config.json"), ref, s, out);
  EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
  ASSERT_EQ(legacy.size(), want.size()) << out;
  EXPECT_EQ(legacy, v5) << "the two config.json forms configured different models";
}

void expect_bf16_as_close_as_transformers(const Scratch& s, const fs::path& dir, double ratio) {
  const Reference ref(dir);
  const std::vector<float> f32 = ref.floats("logits");
  SafeTensorsFile theirs_file(dir / "bf16_reference.safetensors");
  const auto& ti = theirs_file.info("logits");
  ASSERT_EQ(ti.dtype, "F32");
  std::vector<float> theirs(static_cast<size_t>(ti.numel()));
  std::memcpy(theirs.data(), ti.data, ti.nbytes());
  ASSERT_EQ(theirs.size(), f32.size());
  std::string out;
  const std::vector<float> ours = score(dir, ref, s, out, "dtype=bfloat16 weight_dtype=bfloat16");
  ASSERT_EQ(ours.size(), f32.size()) << out;
  const double e_ours = scaled_err(ours, f32), e_theirs = scaled_err(theirs, f32);
  // How many positions pick the float32 reference's most likely token.
  const size_t vocab = static_cast<size_t>(ti.shape.back());
  auto agree = [&](const std::vector<float>& v) {
    size_t n = 0;
    for (size_t t = 0; t * vocab < v.size(); ++t) {
      auto row = [&](const std::vector<float>& x) {
        return std::max_element(x.begin() + t * vocab, x.begin() + (t + 1) * vocab) -
               (x.begin() + t * vocab);
      };
      n += row(v) == row(f32) ? 1 : 0;
    }
    return n;
  };
  std::printf("%s: bf16 error against f32: mt %.3e, transformers %.3e; argmax agrees %zu vs %zu\n",
              dir.filename().string().c_str(), e_ours, e_theirs, agree(ours), agree(theirs));
  EXPECT_LE(e_ours, ratio * e_theirs);
}

MtResult decode(const fs::path& dir, const std::vector<int32_t>& prompt, size_t length,
                const std::string& extra) {
  return run_mt("decode hf_path=" + dir.string() + " tokens=" + join_ids(prompt) +
                    " max_target_length=" + std::to_string(length) +
                    " max_prefill_predict_length=" + std::to_string(prompt.size()) +
                    (extra.empty() ? "" : " " + extra),
                120);
}

void expect_decode_equals_generate(const Reference& ref, const std::string& name,
                                   const fs::path& dir, size_t new_tokens) {
  const std::vector<int32_t> prompt = ref.ints(name + ".prompt");
  const std::vector<int32_t> want = ref.ints(name + ".ids");
  ASSERT_EQ(want.size(), prompt.size() + new_tokens);
  const MtResult r = decode(dir, prompt, want.size());
  ASSERT_EQ(r.code, 0) << r.out;
  // stdout holds the ids alone on a line; the throughput line (stderr) is merged here.
  EXPECT_TRUE(has_ids_line(r.out, want)) << r.out;
}

bool has_ids_line(const std::string& out, const std::vector<int32_t>& ids) {
  const size_t at = out.find(join_ids(ids) + "\n");
  return at != std::string::npos && (at == 0 || out[at - 1] == '\n');
}

void convert_round_trip(const fs::path& hf, const fs::path& mtdir, const fs::path& back) {
  MtResult r =
      run_mt("convert --from=hf --input=" + hf.string() + " --output=" + mtdir.string(), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_mt("convert --to=hf --config=" + (mtdir / "model.yml").string() +
                 " --input=" + mtdir.string() + " --output=" + back.string(),
             120);
  ASSERT_EQ(r.code, 0) << r.out;
  SafeTensorsFile a(hf / "model.safetensors"), b(back / "model.safetensors");
  EXPECT_EQ(a.names(), b.names());
  for (const auto& n : a.names()) {
    const auto &x = a.info(n), &y = b.info(n);
    EXPECT_EQ(x.shape, y.shape) << n;
    ASSERT_EQ(x.nbytes(), y.nbytes()) << n;
    EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << n << " differs after the round trip";
  }
  // generation_config.json (the ids generate stops at) comes back too (before: lost unless a
  // tokenizer_path directory held one).
  if (fs::exists(hf / "generation_config.json")) {
    ASSERT_TRUE(fs::exists(back / "generation_config.json")) << back;
    EXPECT_EQ(slurp(back / "generation_config.json"), slurp(hf / "generation_config.json"));
  }
}

MtResult run_training(const std::string& model, const std::string& options, const fs::path& base,
                      const std::string& name) {
  return run_mt("run --model=" + model + " " + options +
                    " log_period=1 eval_interval=-1 num_threads=2 run_name=" + name +
                    " base_output_directory=" + base.string(),
                120);
}

std::string corpus_options(int steps, const std::string& learning_rate) {
  return "dataset_type=tokens dataset_path=" + source_dir() +
         "/data/corpus.train.tokens vocab_size=8192 steps=" + std::to_string(steps) +
         " learning_rate=" + learning_rate + " per_device_batch_size=4 enable_checkpointing=false";
}

std::string resume_options(int period, int schedule) {
  return "dataset_type=synthetic enable_checkpointing=true checkpoint_period=" +
         std::to_string(period) +
         " async_checkpointing=true learning_rate_schedule_steps=" + std::to_string(schedule);
}

std::vector<std::string> losses(const fs::path& run) {
  std::ifstream f(run / "metrics.jsonl");
  std::vector<std::string> r;
  for (std::string l; std::getline(f, l);) {
    const size_t p = l.find("\"loss\": ");
    if (p != std::string::npos) r.push_back(l.substr(p + 8, l.find(',', p) - p - 8));
  }
  return r;
}

double last_five_mean(const std::vector<std::string>& l) {
  double last = 0;
  for (size_t i = l.size() - 5; i < l.size(); ++i) last += std::stod(l[i]) / 5;
  return last;
}

void expect_resumed_equals_straight(const std::string& model, const std::string& options,
                                    const fs::path& base) {
  auto run = [&](const std::string& name, int steps) {
    const MtResult r = run_training(
        model, resume_options(3, 6) + " steps=" + std::to_string(steps) + " " + options, base,
        name);
    ASSERT_EQ(r.code, 0) << r.out;
  };
  ASSERT_NO_FATAL_FAILURE(run("straight", 6));
  ASSERT_NO_FATAL_FAILURE(run("resumed", 3));
  ASSERT_NO_FATAL_FAILURE(run("resumed", 6));
  ASSERT_NO_FATAL_FAILURE(expect_same_runs(base / "straight", base / "resumed", 6));
}

void expect_same_runs(const fs::path& straight, const fs::path& resumed, size_t steps) {
  const auto a = losses(straight), b = losses(resumed);
  ASSERT_EQ(a.size(), steps);
  EXPECT_EQ(a, b);
  const fs::path params = fs::path("checkpoints") / std::to_string(steps) / "params.safetensors";
  const std::string pa = slurp(straight / params), pb = slurp(resumed / params);
  ASSERT_GT(pa.size(), 1000u);
  EXPECT_TRUE(pa == pb) << "final parameters differ";
}

void expect_refused(const std::string& args, const std::string& says) {
  const MtResult r = run_mt(args, 60);
  EXPECT_EQ(r.code, 2) << args << "\n" << r.out;
  EXPECT_NE(r.out.find(says), std::string::npos) << args << "\n" << r.out;
}

void expect_named_sizes(const std::vector<std::pair<const char*, const char*>>& expect,
                        const std::string& family) {
  const MtResult r = run_mt("models", 60);
  for (const auto& [name, size] : expect) {
    const auto pos = r.out.find(std::string("\n") + name + " ");
    ASSERT_NE(pos, std::string::npos) << name << "\n" << r.out;
    const std::string line = r.out.substr(pos + 1, r.out.find('\n', pos + 1) - pos - 1);
    EXPECT_NE(line.find(family), std::string::npos) << line;
    EXPECT_NE(line.find(size), std::string::npos) << line;
  }
}

std::unique_ptr<Model> build_named(const std::string& model) {
  ConfigRequest req;
  req.configs_dir = source_dir() + "/configs";
  req.model = model;
  req.schemas_for = family_schemas;
  const Config cfg = load_config(req);
  return plugins().make_model_family(cfg.get_string("decoder_block"))->build(cfg);
}

}  // namespace mt::test
