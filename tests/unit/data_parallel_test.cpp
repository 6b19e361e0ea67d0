// Data parallelism over MPI (communicator=mpi under mpirun): N ranks train exactly as one rank
// given the whole global batch; a mesh that does not fit the ranks, or one the trainer cannot
// run yet, is one clear error (exit 2); a rank that fails ends the job. The mpirun tests skip
// where OpenMPI's mpirun is not installed. Every command runs under timeout(1), so a hang fails
// the test instead of stalling the suite.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_manager.h"
#include "collective_queue.h"
#include "config_impl.h"
#include "memory_plan.h"
#include "mt/backend.h"
#include "mt/data.h"
#include "mt/graph.h"
#include "mt/plugin.h"
#include "mt/tokenizer.h"
#include "plugin_manager.h"
#include "safetensors.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// How far 20 AdamW steps carry the f32 rounding of sums taken in another order (a batch's
// gradient in parts, a tensor group's partial products), as each tensor's largest difference
// relative to its largest magnitude: AdamW's step is near lr x sign(g) wherever g is near 0, so a
// rounding there moves a parameter by up to lr a step. Measured: up to 3.2e-5 where the CPU's
// kernels are AVX-512's, up to 1.4e-4 on an AVX2-only CPU (AMD EPYC, Zen 3; its f32 GEMMs sum in
// another order and magnitude). The losses, within 1e-6 of one rank's, are the sharp check.
constexpr double kReorderedParams = 2e-4;

bool have_mpirun() {
  std::string out;
  return test::run_command("command -v mpirun", out) == 0;
}

#define MT_NEED_MPIRUN()                                                               \
  if (!have_mpirun())                                                                  \
  GTEST_SKIP() << "mpirun was not found on PATH (Debian: apt-get install openmpi-bin " \
                  "libopenmpi-dev); the multi-rank tests need it"

struct Dir {
  fs::path root;
  Dir() {
    root = fs::temp_directory_path() /
           ("mt_dp_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ~Dir() { fs::remove_all(root); }
};

// A session directory of one mpirun's own. Open MPI 4 makes its session directory under
// /tmp/ompi.<host>.<uid> with a check-then-mkdir that two mpiruns started at once can lose
// ("A call to mkdir was unable to create the desired directory ... File exists", orte_init
// fails, the job exits 1: open-mpi/ompi#8510), and ctest -j runs these tests side by side.
// Giving each mpirun its own base (orte_tmpdir_base; prte_tmpdir_base for Open MPI 5's PRRTE)
// removes the shared directory. Removed with everything under it at the end of the call.
struct MpiSessionDir {
  fs::path path;
  MpiSessionDir() {
    std::string name = (fs::temp_directory_path() / "mt_ompi_XXXXXX").string();
    if (!mkdtemp(name.data())) throw std::runtime_error("mkdtemp failed under /tmp");
    path = name;
  }
  ~MpiSessionDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  MpiSessionDir(const MpiSessionDir&) = delete;
  MpiSessionDir& operator=(const MpiSessionDir&) = delete;
  // `timeout -k 10 <seconds> mpirun ... -np <ranks> ` in this directory (the arguments follow).
  std::string mpirun(int ranks, int seconds) const {
    return "OMPI_MCA_orte_tmpdir_base=" + path.string() +
           " PRTE_MCA_prte_tmpdir_base=" + path.string() + " timeout -k 10 " +
           std::to_string(seconds) + " mpirun --oversubscribe --allow-run-as-root -np " +
           std::to_string(ranks) + " ";
  }
};

// `mpirun -np <ranks> mt <args>`, bounded by `seconds`. `prefix`: a shell command line that
// ends by exec'ing its arguments (to give one rank another environment).
test::MtResult mpirun(int ranks, const std::string& args, int seconds = 60,
                      const std::string& prefix = "") {
  const MpiSessionDir session;
  test::MtResult r;
  r.code = test::run_command("MT_PLUGIN_PATH= " + session.mpirun(ranks, seconds) + prefix + " " +
                                 test::mt_exe() + " " + args,
                             r.out);
  return r;
}

std::vector<double> losses(const fs::path& run) {
  std::ifstream f(run / "metrics.jsonl");
  std::vector<double> r;
  std::string line;
  while (std::getline(f, line)) {
    const size_t k = line.find("\"loss\": ");
    if (k != std::string::npos) r.push_back(std::stod(line.substr(k + 8)));
  }
  return r;
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// The training run every comparison uses: 20 steps of llama-test on one thread per rank, the
// final parameters checkpointed.
std::string train_args(const fs::path& root, const std::string& name, int batch,
                       const std::string& extra = "") {
  return "run --model=llama-test steps=20 num_threads=1 learning_rate=3e-3 "
         "enable_checkpointing=true async_checkpointing=false checkpoint_period=20 "
         "enable_tensorboard=false eval_interval=10 eval_steps=2 base_output_directory=" +
         root.string() + " run_name=" + name + " per_device_batch_size=" + std::to_string(batch) +
         " " + extra;
}

// A group of a run's checkpoint of step 20 ("params", "opt_m", "opt_v"), whole, whichever
// ranks wrote it (one file, or the ranks' parts of a sharded checkpoint).
std::map<std::string, Tensor> saved(const fs::path& run, const std::string& group = "params") {
  return load_checkpoint_tensors(run / "checkpoints" / "20", group, test::cpu());
}

// Each tensor's bytes, for bit-exact comparisons.
std::map<std::string, std::vector<char>> saved_bytes(const fs::path& run,
                                                     const std::string& group) {
  std::map<std::string, std::vector<char>> out;
  for (const auto& [name, t] : saved(run, group)) {
    std::vector<char> b(t.nbytes());
    t.backend()->copy_to_host(t, b.data());
    out[name] = std::move(b);
  }
  return out;
}

// Each tensor's largest difference from `b_run`'s relative to its largest magnitude (every
// tensor of one run in the other).
std::map<std::string, double> param_errs(const fs::path& a_run, const fs::path& b_run) {
  const std::map<std::string, Tensor> a = saved(a_run), b = saved(b_run);
  EXPECT_EQ(a.size(), b.size());
  std::map<std::string, double> e;
  for (const auto& [n, t] : b) {
    EXPECT_TRUE(a.count(n)) << n;
    if (a.count(n)) e[n] = test::scaled_err(test::to_vector(a.at(n)), test::to_vector(t));
  }
  return e;
}

double max_param_err(const fs::path& a_run, const fs::path& b_run) {
  double e = 0;
  for (const auto& [n, err] : param_errs(a_run, b_run)) e = std::max(e, err);
  return e;
}

double max_loss_err(const fs::path& a_run, const fs::path& b_run) {
  const std::vector<double> a = losses(a_run), b = losses(b_run);
  EXPECT_EQ(b.size(), 20u);
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    e = std::max(e, std::fabs(a[i] - b[i]) / std::fabs(b[i]));
  return e;
}

// N ranks with per_device_batch_size b (and `accum` micro-batches) against one rank given the
// same global batch, N x b, and against one rank with batch b and N x accum micro-batches.
// Every loss agrees within 1e-6. The final parameters (each tensor's largest difference
// relative to its largest magnitude) agree with the accumulating run within 1e-6 (accum = 1); from
// the N x b run, summing the batch's gradient in parts moves them by the f32 rounding of the sum,
// which 20 AdamW steps magnify to a few 1e-6 of their scale, as much as one rank's gradient
// accumulation does (N ranks add the same parts in rank order, which is accumulation's order).
// `mesh`: the many-rank run's own words (FSDP's axes). `rank_order`: the ranks' gradients are
// added in rank order (not so under HSDP, which adds within each group, then the groups).
void compare_runs(const fs::path& root, int ranks, int batch, int accum, const std::string& extra,
                  const std::string& mesh = "", bool rank_order = true) {
  const std::string acc = " gradient_accumulation_steps=";
  const test::MtResult whole = test::run_mt(
      train_args(root, "whole", ranks * batch, extra + acc + std::to_string(accum)), 120);
  ASSERT_EQ(whole.code, 0) << whole.out;
  const test::MtResult parts = test::run_mt(
      train_args(root, "parts", batch, extra + acc + std::to_string(ranks * accum)), 120);
  ASSERT_EQ(parts.code, 0) << parts.out;
  const auto t0 = std::chrono::steady_clock::now();
  const test::MtResult many = mpirun(
      ranks, train_args(root, "many", batch, mesh + " " + extra + acc + std::to_string(accum)),
      120);
  ASSERT_EQ(many.code, 0) << many.out;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double loss = max_loss_err(root / "many", root / "whole");
  const double params = max_param_err(root / "many", root / "whole");
  const double params_acc = max_param_err(root / "many", root / "parts");
  const double acc_vs_whole = max_param_err(root / "parts", root / "whole");
  std::printf(
      "  %d ranks x batch %d (%.1f s) vs 1 rank x batch %d: losses %.3g, parameters "
      "%.3g; vs 1 rank x batch %d x %d micro-batches: losses %.3g, parameters %.3g "
      "(that run vs batch %d: parameters %.3g)\n",
      ranks, batch, secs, ranks * batch, loss, params, batch, ranks * accum,
      max_loss_err(root / "many", root / "parts"), params_acc, ranks * batch, acc_vs_whole);
  EXPECT_LE(loss, 1e-6);
  EXPECT_LE(max_loss_err(root / "many", root / "parts"), 1e-6);
  // Same parts in the same order when each rank has one micro-batch (ranks added in rank
  // order): the accumulating run to the bit, losses and parameters, since the backward kernels
  // that sum rows into a parameter's gradient (the norms' weights, the embedding's rows,
  // scatter-adds) sum a micro-batch's rows before adding them to the running gradient (before
  // 2026-11-29 they added row by row onto it, and 20 AdamW steps magnified that rounding to
  // 2e-7, 4.7e-6 under ASan), and the weight gradients' GEMMs over these micro-batches' few
  // tokens add one product sum to it (a GEMM whose K, the tokens, spans several of the BLAS's
  // panels adds each panel's sum: exact no more). A tied table gets its lookup's and its head's
  // parts in another order, so tied models are not exact either. HSDP adds within each group,
  // then the groups: only as far from the whole batch's run as accumulation is (another order
  // of the sums, by a part of that again: 1.3e-5 against 1.2e-5 under ASan's kernels, 1.39e-4
  // against 1.31e-4 on AVX2). With several micro-batches, each rank first adds its own (rows r,
  // r + N, ...): a third order, whose rounding adds to accumulation's (under ASan on AVX2:
  // 2.07e-5 from the whole batch's run, 9.1e-6 + 1.16e-5 by way of the accumulating run's), so
  // only the bound.
  if (accum == 1) {
    if (rank_order) {
      EXPECT_EQ(params_acc, 0.0);
      EXPECT_EQ(losses(root / "many"), losses(root / "parts"));
    }
    EXPECT_LE(params, acc_vs_whole * (rank_order ? 1.0 : 1.5) + 1e-6);
  }
  EXPECT_LE(params_acc, kReorderedParams);
  EXPECT_LE(params, kReorderedParams);
}

// One launch of the training run: `ranks` processes (1: without mpirun), each with
// per_device_batch_size `batch`, and more words.
struct Launch {
  int ranks = 1, batch = 1;
  std::string words;
};
test::MtResult launch(const fs::path& root, const std::string& name, const Launch& l,
                      const std::string& common) {
  const std::string args = train_args(root, name, l.batch, common + " " + l.words);
  return l.ranks == 1 ? test::run_mt(args, 120) : mpirun(l.ranks, args, 120);
}

// The words of check_resumes' runs: the same tokens file, the learning rate decayed over 20 steps.
std::string resume_words() {
  return "dataset_type=tokens vocab_size=8192 dataset_path=" + test::source_dir() +
         "/data/corpus.train.tokens learning_rate_schedule_steps=20";
}

// A checkpoint saved at step 10 by `saver` resumes under each of `resumers` (the same global
// batch), and each continues as `straight`, which ran the 20 steps at once: every loss within
// 1e-6. Returns the runs' names (straight first) for further checks. Every run reads the same
// tokens file and decays the learning rate over 20 steps.
std::vector<std::string> check_resumes(const fs::path& root, const Launch& straight,
                                       const Launch& saver, const std::vector<Launch>& resumers) {
  const std::string common = resume_words();
  std::vector<std::string> names{"straight"};
  test::MtResult r = launch(root, "straight", straight, common);
  EXPECT_EQ(r.code, 0) << r.out;
  r = launch(root, "saved", saver, common + " checkpoint_period=10 steps=10");
  EXPECT_EQ(r.code, 0) << r.out;
  for (size_t k = 0; k < resumers.size(); ++k) {
    names.push_back("resumed" + std::to_string(k));
    fs::copy(root / "saved", root / names.back(), fs::copy_options::recursive);
    r = launch(root, names.back(), resumers[k], common + " checkpoint_period=10");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("resumed from step 10"), std::string::npos) << r.out;
  }
  const std::vector<double> want = losses(root / "straight");
  EXPECT_EQ(want.size(), 20u);
  for (size_t k = 1; k < names.size(); ++k) {
    const std::vector<double> got = losses(root / names[k]);
    EXPECT_EQ(got.size(), want.size()) << names[k];
    for (size_t i = 0; i < got.size() && i < want.size(); ++i)
      EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i])) << names[k] << " step " << i + 1;
  }
  return names;
}

// A queue destroyed while this rank's failure unwinds: a collective the other ranks complete
// (here: one that ends after 300 ms) is waited for, so its thread no longer runs when the
// communicator and buffers it uses are destroyed next (before: left running, a use after free);
// one that never ends is left behind after the grace period, the destructor returning.
TEST(CollectiveQueueUnwinding, WaitsForACollectiveUnderWayThenLeavesAStuckOne) {
  std::atomic<bool> finished{false};
  try {
    CollectiveQueue q;
    q.submit({nullptr,
              [&] {
                std::this_thread::sleep_for(std::chrono::milliseconds(300));
                finished = true;
              },
              nullptr});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the job under way
    throw std::runtime_error("this rank failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(finished.load());
  // Stuck: released only after the destructor has returned.
  auto gate = std::make_shared<std::pair<std::mutex, std::condition_variable>>();
  auto open = std::make_shared<bool>(false);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    CollectiveQueue q;
    q.submit({nullptr,
              [gate, open] {
                std::unique_lock lock(gate->first);
                gate->second.wait(lock, [&] { return *open; });
              },
              nullptr});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    throw std::runtime_error("this rank failed");
  } catch (const std::runtime_error&) {
  }
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(waited, 1.5);
  EXPECT_LT(waited, 10.0);
  {
    std::lock_guard lock(gate->first);
    *open = true;
  }
  gate->second.notify_all();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the left thread end
}

TEST(DataParallel, TwoRanksTrainAsOneRankWithTheGlobalBatch) {
  MT_NEED_MPIRUN();
  Dir d;
  compare_runs(d.root, 2, 2, 1, "dataset_type=synthetic");
}

TEST(DataParallel, FourRanksWithAccumulationOnATokensFile) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string data = test::source_dir() + "/data/";
  compare_runs(d.root, 4, 1, 2,
               "vocab_size=8192 dataset_type=tokens dataset_path=" + data +
                   "corpus.train.tokens eval_dataset_path=" + data + "corpus.eval.tokens");
}

TEST(DataParallel, ResumedRanksContinueAsAStraightRun) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string common =
      "dataset_type=tokens vocab_size=8192 dataset_path=" + test::source_dir() +
      "/data/corpus.train.tokens";
  ASSERT_EQ(mpirun(2, train_args(d.root, "straight", 2, common)).code, 0);
  // 10 steps, then a second job resumes from rank 0's checkpoint at step 10.
  test::MtResult r = mpirun(2, train_args(d.root, "resumed", 2,
                                          common + " checkpoint_period=10 steps=10 "
                                                   "learning_rate_schedule_steps=20"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = mpirun(2, train_args(d.root, "resumed", 2,
                           common + " checkpoint_period=10 learning_rate_schedule_steps=20"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from step 10"), std::string::npos) << r.out;
  EXPECT_EQ(losses(d.root / "resumed"), losses(d.root / "straight"));
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The last "peak_memory_mb" of a run's metrics.
double last_peak_mb(const fs::path& run) {
  std::ifstream f(run / "metrics.jsonl");
  std::string line, last;
  while (std::getline(f, line))
    if (line.find("\"peak_memory_mb\": ") != std::string::npos) last = line;
  const size_t k = last.find("\"peak_memory_mb\": ");
  return k == std::string::npos ? -1 : std::stod(last.substr(k + 18));
}

// shard_optimizer_over_data (ZeRO-1): the reduce-scatter adds each element in rank order as the
// all-reduce does, AdamW is elementwise and the all-gather copies, so the run is plain data
// parallelism's to the bit (losses, parameters and the moments the checkpoint gathers), with
// half the moments on each of 2 ranks: the device peak drops by that much.
// Plain data parallelism sums each layer's gradients on a second thread while the backward goes
// on to the layers below (the top parameters after it): the same rank-ordered sums, so the run
// equals one that sums everything after the backward (MT_OVERLAP_COMMUNICATION=0) to the bit,
// with gradient accumulation (only the last micro-batch's backward overlaps) and with remat.
// FSDP's overlap (MT_OVERLAP_COMMUNICATION=1: the next layer's gathers started early, the
// reduce-scatters queued during the backward; its re-runs' gathers under remat full) too, and
// HSDP's.
TEST(DataParallel, OverlappedCommunicationChangesNoBits) {
  MT_NEED_MPIRUN();
  Dir d;
  struct Case {
    int ranks;
    std::string words, said;
  };
  const std::string fsdp = " ici_fsdp_parallelism=2 ici_data_parallelism=";
  for (const Case& c :
       {Case{2, "gradient_accumulation_steps=2", "each layer's gradient sum overlaps the backward"},
        Case{2, "remat_policy=full", "each layer's gradient sum overlaps the backward"},
        Case{2, "gradient_accumulation_steps=2 eval_interval=5" + fsdp + "1",
             "each layer's gathers overlap the layer before it"},
        Case{2, "remat_policy=full" + fsdp + "1",
             "each layer's gathers overlap the layer before it"},
        Case{4, "remat_policy=full" + fsdp + "2",
             "each layer's gathers overlap the layer before it"}}) {
    SCOPED_TRACE(c.words);
    const std::string args = "dataset_type=synthetic " + c.words;
    test::MtResult r = mpirun(c.ranks, train_args(d.root, "overlap", 2, args), 120,
                              "env MT_OVERLAP_COMMUNICATION=1");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(c.said), std::string::npos) << r.out;
    r = mpirun(c.ranks, train_args(d.root, "after", 2, args), 120,
               "env MT_OVERLAP_COMMUNICATION=0");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.find("overlap"), std::string::npos) << r.out;
    EXPECT_EQ(losses(d.root / "overlap"), losses(d.root / "after"));
    EXPECT_EQ(losses(d.root / "overlap").size(), 20u);
    for (const char* g : {"params", "opt_m", "opt_v"})
      EXPECT_TRUE(saved_bytes(d.root / "overlap", g) == saved_bytes(d.root / "after", g)) << g;
    fs::remove_all(d.root / "overlap");
    fs::remove_all(d.root / "after");
  }
}

TEST(DataParallel, ShardedOptimizerStateTrainsAsPlainDataParallelism) {
  MT_NEED_MPIRUN();
  Dir d;
  test::MtResult r = mpirun(2, train_args(d.root, "plain", 2, "dataset_type=synthetic"), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = mpirun(
      2, train_args(d.root, "sharded", 2, "dataset_type=synthetic shard_optimizer_over_data=true"),
      120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("optimizer state sharded over them (shard_optimizer_over_data)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(losses(d.root / "sharded"), losses(d.root / "plain"));
  // Every step records the time its collectives took (exposed: nothing overlaps them).
  for (const char* run : {"plain", "sharded"}) {
    std::ifstream f(d.root / run / "metrics.jsonl");
    std::string line;
    int timed = 0;
    while (std::getline(f, line)) {
      const size_t k = line.find("\"communication_ms\": ");
      ASSERT_NE(k, std::string::npos) << run << ": " << line;
      EXPECT_GT(std::stod(line.substr(k + 20)), 0.0) << run << ": " << line;
      ++timed;
    }
    EXPECT_EQ(timed, 20) << run;
  }
  // The sharded run saves its parts (each rank its moments); read whole, they are plain data
  // parallelism's to the bit.
  EXPECT_TRUE(fs::exists(d.root / "sharded" / "checkpoints" / "20" / "opt_m.1-of-2.safetensors"));
  size_t moment_bytes = 0;
  for (const char* g : {"params", "opt_m", "opt_v"}) {
    const auto a = saved_bytes(d.root / "plain", g), b = saved_bytes(d.root / "sharded", g);
    ASSERT_FALSE(a.empty()) << g;
    EXPECT_TRUE(a == b) << g << " differs from plain data parallelism's";
    if (std::string(g) != "params")
      for (const auto& [n, bytes] : a) moment_bytes += bytes.size();
  }
  // The same in rounds of 1000 elements per rank (a large model's parts take several rounds).
  r = mpirun(
      2, train_args(d.root, "rounds", 2, "dataset_type=synthetic shard_optimizer_over_data=true"),
      120, "env MT_MPI_ROUND_ELEMENTS=1000");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* g : {"params", "opt_m", "opt_v"})
    EXPECT_TRUE(saved_bytes(d.root / "plain", g) == saved_bytes(d.root / "rounds", g))
        << g << " differs in rounds of 1000";
  // Half the moments (less the files' headers) fewer on each rank; metrics round to 0.1 MB.
  const double saved = last_peak_mb(d.root / "plain") - last_peak_mb(d.root / "sharded");
  EXPECT_GE(saved, 0.5 * static_cast<double>(moment_bytes) / 1e6 * 0.9 - 0.1) << saved;
}

// A checkpoint holds the moments whole: saved by 2 sharded ranks, it resumes under 1 rank and
// under 4 sharded ranks (the same global batch), and both continue as the straight run.
TEST(DataParallel, ShardedCheckpointsResumeOnAnyNumberOfRanks) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string sharded = "shard_optimizer_over_data=true";
  check_resumes(d.root, {2, 2, sharded}, {2, 2, sharded}, {{1, 4, ""}, {4, 1, sharded}});
}

TEST(DataParallel, AMeshThatDoesNotFitTheRanksIsOneErrorOnRankZero) {
  MT_NEED_MPIRUN();
  Dir d;
  const auto t0 = std::chrono::steady_clock::now();
  const test::MtResult r =
      mpirun(2, train_args(d.root, "bad", 2, "dataset_type=synthetic ici_data_parallelism=3"), 30);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(count(r.out, "has 3 devices but 2 ranks run"), 1u) << r.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20);
  EXPECT_FALSE(fs::exists(d.root / "bad" / "metrics.jsonl"));
}

// Every "<name>/..." field of each line of a run's metrics.jsonl, by field, in step order.
std::map<std::string, std::vector<double>> fields(const fs::path& run, const std::string& name) {
  std::ifstream f(run / "metrics.jsonl");
  std::map<std::string, std::vector<double>> r;
  for (std::string line; std::getline(f, line);)
    for (size_t k = line.find("\"" + name + "/"); k != std::string::npos;
         k = line.find("\"" + name + "/", k + 1)) {
      const size_t end = line.find('"', k + 1);
      r[line.substr(k + 1, end - k - 1)].push_back(std::stod(line.substr(end + 3)));
    }
  return r;
}

// The expert-load metrics are the step's (each expert's slots summed over micro-batches and
// ranks), so 2 data-parallel ranks and 4 micro-batches give one rank's figures for the whole
// batch (before: the ranks' and micro-batches' own shares averaged, up to 36% off).
TEST(DataParallel, ExpertLoadsAreTheWholeBatchs) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string model = "--model=mixtral-test dataset_type=synthetic steps=3 ";
  ASSERT_EQ(test::run_mt(train_args(d.root, "one", 4, model), 120).code, 0);
  ASSERT_EQ(mpirun(2, train_args(d.root, "two", 2, model), 120).code, 0);
  ASSERT_EQ(
      test::run_mt(train_args(d.root, "acc", 1, model + "gradient_accumulation_steps=4"), 120).code,
      0);
  for (const char* metric : {"moe_load_min", "moe_load_max"}) {
    const auto one = fields(d.root / "one", metric);
    ASSERT_EQ(one.size(), 2u) << metric;  // mixtral-test's two layers
    EXPECT_EQ(fields(d.root / "two", metric), one) << metric;
    EXPECT_EQ(fields(d.root / "acc", metric), one) << metric;
  }
}

// The one-process commands refuse to run as ranks (before: mt score under -np 2 scored twice and
// both ranks raced to write its output; mt decode printed everything twice).
TEST(DataParallel, OneProcessCommandsRefuseRanks) {
  MT_NEED_MPIRUN();
  Dir d;
  for (const std::string& cmd :
       {"score --model=llama-test tokens=1,2,3 output=" + (d.root / "s.safetensors").string(),
        std::string("decode --model=llama-test tokens=1,2"),
        std::string("plan --model=llama-test")}) {
    const test::MtResult r = mpirun(2, cmd, 30);
    EXPECT_EQ(r.code, 2) << cmd << "\n" << r.out;
    EXPECT_EQ(count(r.out, "runs as one process, but was started as one of 2 ranks"), 1u)
        << cmd << "\n"
        << r.out;
  }
  EXPECT_FALSE(fs::exists(d.root / "s.safetensors"));
}

// MPI starts once a process, and the mpi communicator that started it finalizes it when
// destroyed: a second communicator made after that is refused with a sentence naming the cause,
// not an MPI abort (in a child process, which may start MPI as a singleton).
TEST(DataParallel, ACommunicatorAfterMpiWasFinalizedIsRefusedWithASentence) {
  MT_NEED_MPIRUN();
  EXPECT_EXIT(
      {
        const Config cfg = config_from_pairs({});
        test::plugins().make_communicator("mpi", cfg).reset();
        try {
          test::plugins().make_communicator("mpi", cfg);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::_Exit(3);
        }
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(3), "MPI was already finalized in this process");
}

// Tensor parallelism (Megatron): 2 ranks divide the attention heads and MLP columns and sum
// each block's output over the pair. llama-test, gpt3-52k (biases, layer norms, learned
// positions), qwen3-test (per-head q/k norms, whose replicated weights get their gradient
// summed over the ranks), deepseek3-test (latent attention and its own experts whole on each
// rank, its dense MLP split), mixtral-test (the experts divided among the ranks: expert
// parallelism) and qwen3-moe-test with experts off the tensor axis (each expert's hidden
// columns divided) each train as one rank with the same batch: losses within 1e-6, and
// llama-test's final parameters within kReorderedParams of each tensor's scale (sums of parts:
// f32 rounding that AdamW magnifies).
TEST(DataParallel, TensorParallelRanksTrainAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  for (std::string model :
       {"llama-test", "gpt3-52k", "qwen3-test", "deepseek3-test", "mixtral-test",
        "qwen3-moe-test logical_axis_rules=[heads:tensor,"
        "kv_heads:tensor,mlp:tensor]"}) {
    SCOPED_TRACE(model);
    const std::string common = "dataset_type=synthetic --model=" + model;
    model = model.substr(0, model.find(' '));
    test::MtResult r = test::run_mt(train_args(d.root, "one" + model, 2, common), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(2,
               train_args(d.root, "tp" + model, 2,
                          common + " ici_tensor_parallelism=2 ici_data_parallelism=1"),
               120);
    ASSERT_EQ(r.code, 0) << r.out;
    if (model == "llama-test") {
      EXPECT_NE(r.out.find("tensor parallelism over 2 ranks per batch (logical_axis_rules): "
                           "73.7K parameters divided among them, 33.1K whole on each"),
                std::string::npos)
          << r.out;
      EXPECT_LE(max_param_err(d.root / ("tp" + model), d.root / ("one" + model)), kReorderedParams);
    }
    EXPECT_LE(max_loss_err(d.root / ("tp" + model), d.root / ("one" + model)), 1e-6);
  }
}

// logical_axis_rules with vocab:tensor (Graph::set_vocab_part): each tensor rank holds its rows
// of the embedding and columns of the LM head, looks up the tokens whose ids it holds and sums
// the group's rows, makes its columns of the logits, and the loss combines the ranks'
// log-sum-exps. llama-test (an LM head of its own), gemma2-test (tied to the embedding, a final
// soft-cap, a z-loss on the whole vocabulary's log-sum-exp), gpt3-52k (tied; its position embedding
// stays whole), deepseek3-test with a multi-token prediction depth (a second lookup, head and
// loss), mixtral-test (its routers' z-losses stay cross-entropies of the routers' own logits),
// and 2 fsdp x 2 tensor ranks of llama-test train as one rank with their batch. adam_eps=1
// with learning_rate=1 makes AdamW a momentum SGD, whose parameters keep a gradient's rounding at
// the rounding's size (AdamW's normalisation turns the rounding of a near-zero gradient into a
// whole step): the losses agree within 1e-6 and every final parameter within 1e-5 of its tensor's
// scale, or within twice what the same mesh without the vocabulary split gets (gpt3-52k's key bias,
// whose gradient is rounding noise alone, starts at zero: 0.5 of its scale either way).
constexpr const char* kVocabRules =
    " logical_axis_rules=[heads:tensor,kv_heads:tensor,mlp:tensor,vocab:tensor]";

// A model on a mesh of `ranks` ranks, `batch` sequences each.
struct MeshCase {
  int ranks, batch;
  std::string model, mesh;
};

TEST(DataParallel, VocabParallelRanksTrainAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string tp = " ici_tensor_parallelism=2 ici_data_parallelism=1";
  for (const MeshCase& c :
       std::vector<MeshCase>{{2, 2, "llama-test", tp},
                             {2, 2, "gemma2-test z_loss_multiplier=1e-3", tp},
                             {2, 2, "gpt3-52k", tp},
                             {2, 2, "deepseek3-test mtp_num_layers=1", tp},
                             // A router's z-loss is a cross-entropy of its own logits (it was
                             // taken for the vocabulary's: an internal check failed).
                             {2, 2, "mixtral-test", tp},
                             {4, 1, "llama-test", tp + " ici_fsdp_parallelism=2"}}) {
    const std::string name = c.model.substr(0, c.model.find(' ')) + std::to_string(c.ranks);
    SCOPED_TRACE(name);
    const std::string common =
        "dataset_type=synthetic adam_eps=1 learning_rate=1 --model=" + c.model;
    test::MtResult r = test::run_mt(train_args(d.root, "one" + name, 2, common), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(c.ranks, train_args(d.root, "tp" + name, c.batch, common + c.mesh), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(c.ranks, train_args(d.root, "vp" + name, c.batch, common + c.mesh + kVocabRules),
               120);
    ASSERT_EQ(r.code, 0) << r.out;
    if (name == "llama-test2") {  // the embedding and the LM head are divided too now
      EXPECT_NE(r.out.find("tensor parallelism over 2 ranks per batch (logical_axis_rules): "
                           "106.5K parameters divided among them, 320 whole on each"),
                std::string::npos)
          << r.out;
    }
    const fs::path one = d.root / ("one" + name), vp = d.root / ("vp" + name);
    const double loss = max_loss_err(vp, one);
    const std::map<std::string, double> vp_errs = param_errs(vp, one),
                                        tp_errs = param_errs(d.root / ("tp" + name), one);
    double worst = 0;
    for (const auto& [n, e] : vp_errs) {
      worst = std::max(worst, e);
      EXPECT_LE(e, std::max(1e-5, 2 * tp_errs.at(n)))
          << n << " (without the vocabulary split " << tp_errs.at(n) << ")";
    }
    std::printf("  %s: losses %.3g, parameters %.3g\n", name.c_str(), loss, worst);
    EXPECT_LE(loss, 1e-6);
  }
}

// num_vocab_tiling on ranks: each run of positions is a remat block that re-makes its graph's
// vocabulary part (gemma2-test: tied, soft-cap, z-loss; deepseek3-test: an MTP depth's head) and
// its FSDP-gathered top parameters (llama-test on 2 fsdp ranks) in the backward; the runs train
// as one rank without tiling (the same bounds as above).
TEST(DataParallel, VocabTilingOnRanksTrainsAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string tp = " ici_tensor_parallelism=2 ici_data_parallelism=1";
  for (const MeshCase& c : std::vector<MeshCase>{
           {2, 2, "gemma2-test z_loss_multiplier=1e-3", tp + kVocabRules},
           {2, 2, "deepseek3-test mtp_num_layers=1", tp + kVocabRules},
           {2, 1, "llama-test", " ici_fsdp_parallelism=2 ici_data_parallelism=1"}}) {
    const std::string name = c.model.substr(0, c.model.find(' '));
    SCOPED_TRACE(name);
    const std::string common =
        "dataset_type=synthetic adam_eps=1 learning_rate=1 --model=" + c.model;
    test::MtResult r = test::run_mt(train_args(d.root, "one" + name, 2, common), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(c.ranks,
               train_args(d.root, "vt" + name, c.batch, common + c.mesh + " num_vocab_tiling=3"),
               120);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("num_vocab_tiling=3"), std::string::npos) << r.out;
    const fs::path one = d.root / ("one" + name), vt = d.root / ("vt" + name);
    double worst = 0;
    for (const auto& [n, e] : param_errs(vt, one)) {
      worst = std::max(worst, e);
      EXPECT_LE(e, 1e-5) << n;
    }
    const double loss = max_loss_err(vt, one);
    std::printf("  %s: losses %.3g, parameters %.3g\n", name.c_str(), loss, worst);
    EXPECT_LE(loss, 1e-6);
  }
}

// A checkpoint of 2 vocabulary-parallel tensor ranks (the embedding's rows in two parts)
// resumes on one rank, on 2 tensor ranks holding the whole vocabulary each, and on 2 like it,
// and each continues as the straight run.
TEST(DataParallel, VocabParallelCheckpointsResumeOnAnyMesh) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string tp = "ici_tensor_parallelism=2 ici_data_parallelism=1";
  const std::string vocab = tp + kVocabRules;
  check_resumes(d.root, {1, 2, ""}, {2, 2, vocab}, {{1, 2, ""}, {2, 2, tp}, {2, 2, vocab}});
}

// 2 data-parallel groups of 2 tensor ranks train as one rank given both groups' batches.
TEST(DataParallel, DataTimesTensorParallelTrainsAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  test::MtResult r = test::run_mt(train_args(d.root, "one", 2, "dataset_type=synthetic"), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = mpirun(4,
             train_args(d.root, "mesh", 1,
                        "dataset_type=synthetic ici_tensor_parallelism=2 ici_data_parallelism=2"),
             120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("data parallelism over 2 ranks (communicator mpi): global batch 2 "
                       "sequences; tensor parallelism over 2 ranks per batch"),
            std::string::npos)
      << r.out;
  EXPECT_LE(max_loss_err(d.root / "mesh", d.root / "one"), 1e-6);
  EXPECT_LE(max_param_err(d.root / "mesh", d.root / "one"), kReorderedParams);
}

// Expert parallelism (ici_expert_parallelism): the ranks divide every MoE layer's experts and
// have batches of their own; each layer sends each token copy to its expert's rank and the
// output back (all-to-all). mixtral-test on 2 and 4 expert ranks and on 2 fsdp x 2 expert ranks
// (FSDP dividing each rank's experts and the rest again), and qwen3-moe-test with token dropping
// under remat on 2 data x 2 expert ranks and on 2 data x 2 fsdp x 2 expert ranks (8 ranks on 2
// cores), each train as one rank given the global batch: losses within 1e-6, and mixtral-test's
// final parameters within kReorderedParams of each tensor's scale.
TEST(DataParallel, ExpertParallelRanksTrainAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  struct Case {
    std::string name, words;
    int ranks;
    std::string mesh;
    int global = 4;            // sequences a step
    int tensor = 1;            // tensor ranks (sharing a batch)
    std::string experts = {};  // how the start line says they are divided
  };
  for (const Case& c : std::vector<Case>{
           {"mixtral", "--model=mixtral-test", 2,
            "ici_expert_parallelism=2 ici_data_parallelism=1"},
           {"fsdp", "--model=mixtral-test", 4,
            "ici_expert_parallelism=2 ici_fsdp_parallelism=2 ici_data_parallelism=1"},
           {"four", "--model=mixtral-test", 4, "ici_expert_parallelism=4 ici_data_parallelism=1"},
           {"qwen3moe", "--model=qwen3-moe-test capacity_factor=1.0 remat_policy=full", 4,
            "ici_expert_parallelism=2 ici_data_parallelism=2"},
           {"cube", "--model=qwen3-moe-test remat_policy=full", 8,
            "ici_expert_parallelism=2 ici_fsdp_parallelism=2 ici_data_parallelism=2", 8},
           {"tensor", "--model=mixtral-test", 4,
            "ici_expert_parallelism=2 ici_tensor_parallelism=2 ici_data_parallelism=1", 4, 2,
            "98.3K expert parameters divided among them and the 2 tensor ranks of each (4 ranks)"},
           // One sequence a batch: the tensor ranks share its tokens (dropless).
           {"tensorone", "--model=mixtral-test", 4,
            "ici_expert_parallelism=2 ici_tensor_parallelism=2 ici_data_parallelism=1", 2, 2},
           {"tensordrop", "--model=qwen3-moe-test capacity_factor=1.0 remat_policy=full", 8,
            "ici_expert_parallelism=2 ici_tensor_parallelism=2 ici_data_parallelism=2", 8, 2},
           {"tensorfsdp", "--model=mixtral-test", 8,
            "ici_expert_parallelism=2 ici_tensor_parallelism=2 ici_fsdp_parallelism=2 "
            "ici_data_parallelism=1",
            4, 2,
            "98.3K expert parameters divided among them and the 2 tensor ranks of each (4 "
            "ranks)"}}) {
    SCOPED_TRACE(c.name);
    const std::string common = "dataset_type=synthetic " + c.words;
    test::MtResult r = test::run_mt(train_args(d.root, "one" + c.name, c.global, common), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(
        c.ranks,
        train_args(d.root, "ep" + c.name, c.global * c.tensor / c.ranks, common + " " + c.mesh),
        180);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("global batch " + std::to_string(c.global) +
                         " sequences; expert parallelism over " + (c.name == "four" ? "4" : "2") +
                         " ranks"),
              std::string::npos)
        << r.out;
    EXPECT_LE(max_loss_err(d.root / ("ep" + c.name), d.root / ("one" + c.name)), 1e-6);
    if (c.name == "mixtral" || c.name == "fsdp" || c.name == "four" || c.name == "tensor" ||
        c.name == "tensorfsdp") {
      EXPECT_NE(r.out.find(c.experts.empty() ? "98.3K expert parameters divided among them, "
                                             : c.experts),
                std::string::npos)
          << r.out;
      // (With the tensor axis, 2 tensor ranks alone differ from one rank as much: 3.2e-5 in a
      // layer's w_up with AVX-512's kernels, the tensor group's sums of parts rounding in f32
      // and AdamW magnifying it.)
      EXPECT_LE(max_param_err(d.root / ("ep" + c.name), d.root / ("one" + c.name)),
                kReorderedParams);
    }
  }
}

// Graph::expert_exchange and expert_gather_counts on 3 ranks of one job (this test binary
// under mpirun, running ExpertExchangeRank below on each rank): rows go where the counts say,
// a rank may send nothing (rank 1) or receive nothing (rank 2), the backward sends each row's
// gradient back to the rank it came from, and it runs on a rank no gradient reached (rank 2's
// root does not use the exchange): without that the other ranks would wait for it and the
// job time out.
TEST(DataParallel, ExpertExchangeMovesRowsAndGradientsBetweenRanks) {
  MT_NEED_MPIRUN();
  const MpiSessionDir session;
  std::string out;
  const int code = test::run_command(
      "MT_PLUGIN_PATH= MT_EXCHANGE_RANK_TEST=1 " + session.mpirun(3, 60) + test::build_dir() +
          "/tests/data_parallel_test --gtest_color=no --gtest_filter=ExpertExchangeRank.*",
      out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(count(out, "[       OK ] ExpertExchangeRank.RowsAndGradients"), 3u) << out;
}

TEST(ExpertExchangeRank, RowsAndGradients) {
  if (!std::getenv("MT_EXCHANGE_RANK_TEST")) {
    GTEST_SKIP() << "one rank of DataParallel.ExpertExchangeMovesRowsAndGradientsBetweenRanks";
  }
  const std::unique_ptr<Communicator> comm =
      test::plugins().make_communicator("mpi", config_from_pairs({}));
  ASSERT_EQ(comm->size(), 3);
  const int me = comm->rank();
  Backend& be = test::cpu();
  // send[src][dst] rows of 2 values; row i of rank src holds (100 src + i, -(100 src + i)).
  const int64_t send[3][3] = {{1, 2, 0}, {0, 0, 0}, {3, 1, 0}};
  std::vector<int64_t> sends, recvs;
  for (int r = 0; r < 3; ++r) {
    sends.push_back(send[me][r]);
    recvs.push_back(send[r][me]);
  }
  auto row = [](int src, int64_t i) { return static_cast<float>(100 * src + i); };
  const int64_t n = send[me][0] + send[me][1] + send[me][2];
  std::vector<float> xv;
  for (int64_t i = 0; i < n; ++i) xv.insert(xv.end(), {row(me, i), -row(me, i)});
  Tensor x = n ? test::from_vector(be, {n, 2}, xv) : be.empty({0, 2}, DType::f32);
  Tensor dx = be.empty({n, 2}, DType::f32);
  be.fill(dx, 0.f);
  Graph::track(x, dx);
  Tensor other = test::from_vector(be, {1}, {1.f}), dother = be.empty({1}, DType::f32);
  be.fill(dother, 0.f);
  Graph::track(other, dother);
  Graph g(be);
  g.set_expert_group(comm.get(), 3, me);
  EXPECT_EQ(g.expert_gather_counts({me, 10 * me}), (std::vector<int64_t>{0, 0, 1, 10, 2, 20}));
  const Tensor y = g.expert_exchange(x, sends, recvs);
  // The rows from each rank in rank order, each rank's in its order: rows [at, at + count) of
  // its sends to this rank.
  std::vector<float> want;
  for (int src = 0; src < 3; ++src) {
    int64_t at = 0;
    for (int dst = 0; dst < me; ++dst) at += send[src][dst];
    for (int64_t i = at; i < at + send[src][me]; ++i)
      want.insert(want.end(), {row(src, i), -row(src, i)});
  }
  ASSERT_EQ(y.dim(0), static_cast<int64_t>(want.size() / 2));
  if (y.numel()) {
    EXPECT_EQ(test::to_vector(y), want);
  }
  if (me != 2) {
    // dy = 3 y: each sent row's gradient comes back as 3 x.
    std::vector<float> dy(want.begin(), want.end());
    for (float& v : dy) v *= 3.f;
    g.backward(y, y.numel() ? test::from_vector(be, y.shape(), dy) : be.empty({0, 2}, DType::f32));
  } else {
    g.backward(g.scale(other, 2.f));  // the exchange's output gets no gradient here
    EXPECT_EQ(test::to_vector(dother), std::vector<float>{2.f});
  }
  std::vector<float> dx_want(xv);
  for (float& v : dx_want) v *= 3.f;
  if (n) {
    EXPECT_EQ(test::to_vector(dx), dx_want);
  }
}

// Each expert rank saves its experts: saved by 2 expert ranks, the checkpoint resumes under 1
// rank, 2 expert ranks, 2 tensor ranks that divide the experts (experts:tensor), 2 fsdp x 2
// expert ranks and 2 expert x 2 tensor ranks (the experts in 4 parts), and each continues as
// the straight run (on packed documents: the router's
// losses weighted by sequences). Only the experts are split; the rest is written once.
TEST(DataParallel, ExpertParallelCheckpointsResumeOnAnyMesh) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string model = "--model=mixtral-test ";
  const std::string ep = model + "ici_expert_parallelism=2 ici_data_parallelism=1";
  check_resumes(d.root, {1, 4, model}, {2, 2, ep},
                {{1, 4, model},
                 {2, 2, ep},
                 {2, 4, model + "ici_tensor_parallelism=2 ici_data_parallelism=1"},
                 {4, 1, ep + " ici_fsdp_parallelism=2"},
                 {4, 2, ep + " ici_tensor_parallelism=2"}});
  const fs::path step = d.root / "saved" / "checkpoints" / "10";
  for (const char* f : {"params.0-of-2.safetensors", "params.1-of-2.safetensors"})
    EXPECT_TRUE(fs::exists(step / f)) << f;
}

// A launch refused before any work: `ranks` processes with `words`, one error on rank 0
// containing `message`, exit 2, no metrics written.
struct Refused {
  int ranks;
  const char* name;
  std::string words, message;
};
void expect_refused(const fs::path& root, const std::vector<Refused>& cases) {
  for (const Refused& c : cases) {
    SCOPED_TRACE(c.name);
    const test::MtResult r = mpirun(c.ranks, train_args(root, c.name, 1, c.words), 30);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(count(r.out, c.message), 1u) << r.out;
    EXPECT_FALSE(fs::exists(root / c.name / "metrics.jsonl"));
  }
}

// What the expert axis cannot divide, or cannot yet be combined with: one clear error on rank
// 0, exit 2, before any work.
TEST(DataParallel, AnExpertAxisThatCannotSplitIsOneError) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string ep2 = "dataset_type=synthetic ici_expert_parallelism=2 ";
  expect_refused(
      d.root,
      {{2, "dense", ep2 + "ici_data_parallelism=1", "but llama-test has none (num_experts 1)"},
       {3, "eight", "dataset_type=synthetic --model=mixtral-test ici_expert_parallelism=3",
        "but mixtral-test has 8 experts (num_experts), which 3 does not divide"},
       {2, "own", ep2 + "--model=deepseek3-test ici_data_parallelism=1",
        "but deepseek3-test (deepseek_v3 family) has none: its family computes its own "
        "experts"},
       {4, "six",
        ep2 + "--model=mixtral-test num_experts=6 ici_tensor_parallelism=2 "
              "ici_data_parallelism=1",
        "among 4 ranks, but mixtral-test has 6 experts (num_experts), which 4 does not divide"}});
}

// Each tensor rank saves its parts: saved by 2 tensor ranks, the checkpoint resumes under 1
// rank, 2 tensor ranks, 2 FSDP ranks (the split parts assembled, then divided anew) and 2 tensor
// x 2 FSDP ranks (each part's FSDP range read from the tensor rank's piece), and each continues
// as the straight run.
TEST(DataParallel, TensorParallelCheckpointsResumeOnAnyMesh) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string tp = "ici_tensor_parallelism=2 ici_data_parallelism=1";
  check_resumes(d.root, {1, 2, ""}, {2, 2, tp},
                {{1, 2, ""},
                 {2, 2, tp},
                 {2, 1, "ici_fsdp_parallelism=2 ici_data_parallelism=1"},
                 {4, 1, tp + " ici_fsdp_parallelism=2"}});
  const fs::path step = d.root / "saved" / "checkpoints" / "10";
  for (const char* f : {"params.0-of-2.safetensors", "params.1-of-2.safetensors"})
    EXPECT_TRUE(fs::exists(step / f)) << f;
  EXPECT_FALSE(fs::exists(step / "params.safetensors"));
}

// Heads the tensor axis does not divide (llama-test has 2 key/value heads), tensor parallelism
// beside shard_optimizer_over_data, and logical_axis_rules the blocks cannot compute with: one
// clear error on rank 0, exit 2, before any work.
TEST(DataParallel, ATensorAxisThatCannotSplitIsOneError) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string tp2 = "dataset_type=synthetic ici_tensor_parallelism=2 ici_data_parallelism=1 ";
  expect_refused(
      d.root, {{4, "tp", "dataset_type=synthetic ici_tensor_parallelism=4 ici_data_parallelism=1",
                "Tensor parallelism over 4 ranks divides the 'kv_heads' axis, but llama-test has 2 "
                "key/value heads (base_num_kv_heads), which 4 does not divide"},
               {2, "both", tp2 + "shard_optimizer_over_data=true",
                "shard_optimizer_over_data with tensor parallelism is not implemented"},
               // A vocabulary the tensor ranks do not divide.
               {2, "vocab",
                tp2 + "vocab_size=255 "
                      "logical_axis_rules=[heads:tensor,kv_heads:tensor,mlp:tensor,vocab:tensor]",
                "Tensor parallelism over 2 ranks divides the 'vocab' axis, but llama-test has 255 "
                "elements there (parameter embedding)"},
               // A logical axis the blocks cannot compute on in parts (the model dimension).
               {2, "embed", tp2 + "logical_axis_rules=[heads:tensor,embed:tensor]",
                "only heads, kv_heads, mlp, experts and vocab can be divided"},
               // Attention or MLP half divided: their output sums would count whole
               // projections once per rank (before: trained, 0.6-2.2% off one rank's losses).
               {2, "partial", tp2 + "logical_axis_rules=[heads:tensor,mlp:tensor]",
                "leaves 'kv_heads' off the tensor axis under tensor parallelism"},
               {2, "none", tp2 + "logical_axis_rules=[]",
                "leaves 'heads' off the tensor axis under tensor parallelism"}});
}

// 2-D and 3-D meshes: 2 fsdp x 2 tensor ranks (each tensor part divided again by FSDP) train as
// one rank with their batch, and so do 2 data x 2 fsdp x 2 tensor ranks under remat (8 ranks
// on 2 cores, 2 batches), within compare_runs' tolerances for the losses; the 2-D run's
// checkpoint resumes on one rank and continues as the straight run.
TEST(DataParallel, FsdpTimesTensorParallelTrainsAsOneRank) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string common = "dataset_type=synthetic learning_rate_schedule_steps=20 ";
  test::MtResult r = test::run_mt(train_args(d.root, "one", 2, common), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string mesh2 =
      "ici_fsdp_parallelism=2 ici_tensor_parallelism=2 ici_data_parallelism=1 ";
  r = mpirun(4, train_args(d.root, "fsdp_tp", 1, common + mesh2), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("parameters divided among the 2 ranks of each of 2 groups"),
            std::string::npos)
      << r.out;
  EXPECT_LE(max_loss_err(d.root / "fsdp_tp", d.root / "one"), 1e-6);
  EXPECT_LE(max_param_err(d.root / "fsdp_tp", d.root / "one"), kReorderedParams);
  r = test::run_mt(train_args(d.root, "one4", 4, common + "remat_policy=full"), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = mpirun(8,
             train_args(d.root, "cube", 1,
                        common + "remat_policy=full ici_fsdp_parallelism=2 "
                                 "ici_tensor_parallelism=2 ici_data_parallelism=2"),
             180);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_LE(max_loss_err(d.root / "cube", d.root / "one4"), 1e-6);
  // Saved by the 2-D mesh at step 10, resumed by one rank.
  r = mpirun(4, train_args(d.root, "resumed", 1, common + mesh2 + "steps=10 checkpoint_period=10"),
             120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_mt(train_args(d.root, "resumed", 2, common + "checkpoint_period=10"), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from step 10"), std::string::npos) << r.out;
  EXPECT_LE(max_loss_err(d.root / "resumed", d.root / "one"), 1e-6);
}

// FSDP (ici_fsdp_parallelism): each rank keeps 1/N of every parameter, its gradient and its
// moments, gathers a layer's weights when the layer runs and reduce-scatters the gradients in
// the backward. The gathers copy and the reduce-scatter adds in rank order as the all-reduce
// does, so the losses are plain data parallelism's; the parameters differ by no more than the
// gradient norm's f32 rounding (summed from the ranks' parts, as ZeRO-1 sums it) moves them.
// The device peak: under remat_policy=full (each layer's weights gathered again for its
// backward) it falls by half of the weights, gradients and moments, less what the gathers
// hold: the top parameters (embedding, head) whole for the step with their gradients, and a
// layer's while it runs (8 layers here, so the layers hold most of the parameters). Without
// remat the backward keeps every layer's gathered weights, so only the gradients' and the
// moments' halves go.
TEST(DataParallel, FsdpTrainsAsPlainDataParallelism) {
  MT_NEED_MPIRUN();
  Dir d;
  for (const std::string extra : {"", "remat_policy=full dtype=bfloat16 weight_dtype=bfloat16"}) {
    SCOPED_TRACE(extra);
    const std::string common = "dataset_type=synthetic base_num_decoder_layers=8 " + extra;
    test::MtResult r = mpirun(2, train_args(d.root, "plain", 2, common), 120);
    ASSERT_EQ(r.code, 0) << r.out;
    r = mpirun(
        2, train_args(d.root, "fsdp", 2, common + " ici_fsdp_parallelism=2 ici_data_parallelism=1"),
        120);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("FSDP over 2 ranks (communicator mpi): global batch 4 sequences; "
                         "parameters divided among all 2 ranks (ici_fsdp_parallelism x "
                         "dcn_fsdp_parallelism = 2)"),
              std::string::npos)
        << r.out;
    const std::vector<double> plain = losses(d.root / "plain"), fsdp = losses(d.root / "fsdp");
    ASSERT_EQ(plain.size(), 20u);
    ASSERT_EQ(fsdp.size(), 20u);
    for (size_t i = 0; i < 20; ++i)
      EXPECT_NEAR(fsdp[i], plain[i], 1e-6 * std::fabs(plain[i])) << "step " << i + 1;
    EXPECT_LE(max_param_err(d.root / "fsdp", d.root / "plain"), 1e-6);
    // Every step's collectives are timed (the gathers and reduce-scatters inside the step).
    std::ifstream f(d.root / "fsdp" / "metrics.jsonl");
    std::string line;
    while (std::getline(f, line)) {
      const size_t k = line.find("\"communication_ms\": ");
      ASSERT_NE(k, std::string::npos) << line;
      EXPECT_GT(std::stod(line.substr(k + 20)), 0.0) << line;
    }
    // What a rank of plain data parallelism holds per parameter: weights, f32 gradients, mu
    // (the weight dtype) and f32 nu, 16 bytes (f32 weights) or 12 (bf16), 4 or 6 times the
    // parameter file's bytes.
    const std::string a =
        file_bytes(d.root / "plain" / "checkpoints" / "20" / "params.safetensors");
    const double state_mb = static_cast<double>(a.size()) / 1e6 * (extra.empty() ? 4.0 : 6.0);
    const double saved = last_peak_mb(d.root / "plain") - last_peak_mb(d.root / "fsdp");
    // f32 without remat: 2 + 4 of 16 bytes a parameter go, less the top gathers; bf16 weights
    // under remat: half of 12.
    EXPECT_GE(saved, (extra.empty() ? 0.2 : 0.35) * state_mb) << saved << " MB of " << state_mb;
    EXPECT_LE(saved, (extra.empty() ? 0.3 : 0.5) * state_mb + 0.2)
        << saved << " MB of " << state_mb;
    fs::remove_all(d.root / "plain");
    fs::remove_all(d.root / "fsdp");
  }
}

// FSDP over 4 ranks with 2 micro-batches each, and a mesh of 2 data x 2 fsdp ranks (HSDP: each
// pair of ranks divides the parameters, the pairs hold copies whose parts' gradients are summed
// across them), train as one rank given the whole global batch (compare_runs' tolerances).
TEST(DataParallel, FsdpRanksTrainAsOneRankWithTheGlobalBatch) {
  MT_NEED_MPIRUN();
  Dir d;
  compare_runs(d.root, 4, 1, 2, "dataset_type=synthetic",
               "ici_fsdp_parallelism=4 ici_data_parallelism=1");
  for (const char* run : {"whole", "parts", "many"}) fs::remove_all(d.root / run);
  compare_runs(d.root, 4, 1, 1, "dataset_type=synthetic remat_policy=minimal",
               "ici_fsdp_parallelism=2 ici_data_parallelism=2", /*rank_order=*/false);
  const test::MtResult r = mpirun(
      4,
      train_args(d.root, "hsdp", 1,
                 "dataset_type=synthetic steps=2 ici_fsdp_parallelism=2 ici_data_parallelism=2"),
      60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("parameters divided among the 2 ranks of each of 2 groups "
                       "(ici_fsdp_parallelism x dcn_fsdp_parallelism = 2), each group holding a "
                       "copy (HSDP): 834.5 KiB of weights, gradients and moments on each rank "
                       "instead of 1.6 MiB"),
            std::string::npos)
      << r.out;
}

// An evaluation that reaches the eval set's end, where a rank's last batch is all padding rows:
// FSDP's ranks run it too (its forward gathers each layer's weights with the other ranks), so
// the job finishes with one rank's eval loss (before: the rank with targets waited forever).
TEST(DataParallel, FsdpEvaluatesTheEvalSetsPaddedEnd) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string data = test::source_dir() + "/data/";
  const std::string common =
      "vocab_size=8192 dataset_type=tokens dataset_path=" + data +
      "corpus.train.tokens eval_dataset_path=" + data +
      "corpus.eval.tokens steps=1 eval_interval=1 eval_steps=400 enable_checkpointing=false";
  auto eval_loss = [](const fs::path& run) {
    std::ifstream f(run / "metrics.jsonl");
    std::string line, all;
    while (std::getline(f, line)) all += line;
    const size_t k = all.find("\"eval_loss\": ");
    return k == std::string::npos ? -1.0 : std::stod(all.substr(k + 13));
  };
  // (2 rows a rank: the eval set's last global batch leaves rank 1 only padding.)
  test::MtResult r = test::run_mt(train_args(d.root, "one", 4, common), 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = mpirun(2, train_args(d.root, "fsdp", 2, common + " ici_fsdp_parallelism=2"), 60);
  ASSERT_EQ(r.code, 0) << r.out;
  const double one = eval_loss(d.root / "one"), two = eval_loss(d.root / "fsdp");
  ASSERT_GT(one, 0);
  EXPECT_NEAR(two, one, 1e-5 * one);
}

// A checkpoint of FSDP ranks holds every tensor whole: saved by 4 FSDP ranks, it resumes under
// 2 FSDP ranks and under 1 rank (the same global batch), and both continue as the straight run.
TEST(DataParallel, FsdpCheckpointsResumeOnAnyNumberOfRanks) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string fsdp = "ici_data_parallelism=1 ici_fsdp_parallelism=";
  // The saver checkpoints in the background every 3 steps (each published by a later step's
  // poll once all 4 ranks have written), then step 10, which the resumed runs start from.
  const std::vector<std::string> runs = check_resumes(
      d.root, {4, 1, fsdp + "4"}, {4, 1, fsdp + "4 async_checkpointing=true checkpoint_period=3"},
      {{1, 4, ""}, {2, 2, fsdp + "2"}, {4, 1, "ici_data_parallelism=2 ici_fsdp_parallelism=2"}});
  // Every rank wrote its own part of every tensor; none holds the state whole.
  const fs::path ckpts = d.root / "saved" / "checkpoints";
  for (const char* step : {"3", "6", "9", "10"})
    for (int r = 0; r < 4; ++r)
      for (const char* g : {"params.", "opt_m.", "opt_v."})
        EXPECT_TRUE(fs::exists(ckpts / step / (g + std::to_string(r) + "-of-4.safetensors")))
            << step << " " << g << r;
  // (The last resumes as HSDP: 2 groups of 2 FSDP ranks, each group reading its copy.)
  // The final parameters of the four agree (FSDP's norm adds the ranks' parts: f32 rounding).
  for (size_t k = 1; k < runs.size(); ++k)
    EXPECT_LE(max_param_err(d.root / runs[k], d.root / "straight"), 1e-5) << runs[k];
}

// load_full_state_path under several ranks (each rank reads its parts of the state:
// load_full_state_parts): a state saved at step 10 by 2 FSDP ranks, read into new run
// directories under FSDP, tensor parallelism and one rank (its whole-state reader), continues
// as the straight run did: losses of steps 11-20 within 1e-6, the run saying where it started.
TEST(DataParallel, FullStateLoadsOntoAnyMesh) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string common = resume_words();
  const std::string fsdp = "ici_data_parallelism=1 ici_fsdp_parallelism=2";
  test::MtResult r = launch(d.root, "straight", {1, 2, ""}, common);
  ASSERT_EQ(r.code, 0) << r.out;
  r = launch(d.root, "saved", {2, 1, fsdp}, common + " checkpoint_period=10 steps=10");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<double> want = losses(d.root / "straight");
  ASSERT_EQ(want.size(), 20u);
  const std::string from = (d.root / "saved" / "checkpoints").string();
  const std::vector<Launch> loaders{
      {2, 1, fsdp}, {2, 2, "ici_tensor_parallelism=2 ici_data_parallelism=1"}, {1, 2, ""}};
  for (size_t k = 0; k < loaders.size(); ++k) {
    const std::string name = "loaded" + std::to_string(k);
    r = launch(d.root, name, loaders[k], common + " load_full_state_path=" + from);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("full state from " + from), std::string::npos) << r.out;
    const std::vector<double> got = losses(d.root / name);
    ASSERT_EQ(got.size(), 10u) << name;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[10 + i], 1e-6 * std::fabs(want[10 + i]))
          << name << " step " << i + 11;
  }
}

// The memory plan's traffic (what a ring moves per rank and direction, summed over its
// collectives) is what the ranks' collectives measure (communication_bytes: the bytes a
// rank received in a step, median over the timed steps): within 1% for data parallelism,
// ZeRO-1, FSDP with and without remat, tensor parallelism, HSDP and data x tensor, on 2 and 4
// ranks (what is left over is the step's scalars: losses, counts, the norm); within 3% for
// expert parallelism on 2 and 4 expert ranks, alone, beside FSDP and beside data parallelism
// under remat (mixtral-test), where the plan takes the routing as even.
TEST(DataParallel, PlannedTrafficIsMeasured) {
  MT_NEED_MPIRUN();
  Dir d;
  // (A mesh's words may name the model, as the expert meshes do.)
  const std::vector<std::pair<int, std::string>> meshes = {
      {2, "ici_data_parallelism=2"},
      {2, "ici_data_parallelism=2 shard_optimizer_over_data=true"},
      {2, "ici_data_parallelism=1 ici_fsdp_parallelism=2"},
      {2, "ici_data_parallelism=1 ici_fsdp_parallelism=2 remat_policy=full"},
      {2, "ici_data_parallelism=1 ici_tensor_parallelism=2"},
      {4, "ici_data_parallelism=1 ici_fsdp_parallelism=4 gradient_accumulation_steps=2"},
      {4, "ici_data_parallelism=2 ici_fsdp_parallelism=2"},
      {4, "ici_data_parallelism=2 ici_tensor_parallelism=2"},
      {2, std::string("ici_data_parallelism=1 ici_tensor_parallelism=2") + kVocabRules},
      {2, "ici_data_parallelism=1 ici_tensor_parallelism=2 remat_policy=full"},
      // Latent attention is not split (only the MLPs sum), and a prediction depth's layer and
      // head run too.
      {2, std::string("--model=deepseek3-test mtp_num_layers=1 ici_data_parallelism=1 "
                      "ici_tensor_parallelism=2") +
              kVocabRules},
      {2, "--model=mixtral-test ici_data_parallelism=1 ici_expert_parallelism=2"},
      {4,
       "--model=mixtral-test ici_data_parallelism=1 ici_expert_parallelism=2 "
       "ici_fsdp_parallelism=2"},
      {4,
       "--model=mixtral-test ici_data_parallelism=2 ici_expert_parallelism=2 "
       "remat_policy=full"},
      {4, "--model=mixtral-test ici_data_parallelism=1 ici_expert_parallelism=4"},
      {4,
       "--model=mixtral-test ici_data_parallelism=1 ici_expert_parallelism=2 "
       "ici_tensor_parallelism=2"},
      {8,
       "--model=mixtral-test ici_data_parallelism=1 ici_expert_parallelism=2 "
       "ici_tensor_parallelism=2 ici_fsdp_parallelism=2 per_device_batch_size=2"}};
  for (const auto& [ranks, mesh] : meshes) {
    SCOPED_TRACE(mesh);
    const std::string words = "--model=llama-test per_device_batch_size=1 " + mesh;
    std::string model = "llama-test";
    std::vector<std::string> overrides = {"per_device_batch_size=1"};
    for (size_t at = 0; at < mesh.size();) {
      const size_t end = std::min(mesh.find(' ', at), mesh.size());
      const std::string word = mesh.substr(at, end - at);
      if (word.rfind("--model=", 0) == 0)
        model = word.substr(8);
      else
        overrides.push_back(word);
      at = end + 1;
    }
    const Plan plan = make_plan(test::model_config(model, overrides), test::plugins(),
                                *named_device("h100-80gb", false), PlanFor::train, false);
    ASSERT_TRUE(plan.collectives);
    const CollectivePlan& c = *plan.collectives;
    const double planned = c.ici_bytes + c.dcn_bytes + c.tensor_bytes + c.expert_bytes;
    const test::MtResult run =
        mpirun(ranks,
               "bench train " + words +
                   " steps=6 num_threads=1 base_output_directory=" + (d.root / "bench").string(),
               120);
    ASSERT_EQ(run.code, 0) << run.out;
    const size_t k = run.out.find("\"communication_bytes\": ");
    ASSERT_NE(k, std::string::npos) << run.out;
    const double measured = std::stod(run.out.substr(k + 23));
    std::printf("  %d ranks, %s: planned %.0f bytes a step, measured %.0f\n", ranks, mesh.c_str(),
                planned, measured);
    EXPECT_GT(planned, 0);
    // Expert parallelism's all-to-alls move what the routing sends off the rank, which the plan
    // takes as spread evenly (on these runs 0.3-1.1% off); the rest is exact but for the
    // scalars' sums.
    const double tolerance = mesh.find("expert") != std::string::npos ? 0.03 : 0.01;
    EXPECT_NEAR(measured, planned, tolerance * planned);
  }
}

TEST(DataParallel, RanksStartedWithDifferentConfigsAreRefused) {
  MT_NEED_MPIRUN();
  Dir d;
  // Rank 1 gets another learning rate through mt's own argument list.
  const test::MtResult r =
      mpirun(2, train_args(d.root, "differ", 2, "dataset_type=synthetic"), 30,
             "bash -c 'exec \"$0\" \"$@\" $([ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && echo "
             "learning_rate=1e-3)'");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(count(r.out, "the resolved config of rank(s) 1 differs from rank 0's"), 1u) << r.out;
}

TEST(DataParallel, ARankThatFailsEndsTheJob) {
  MT_NEED_MPIRUN();
  Dir d;
  // Rank 1's attention refuses an unknown kernel set at its first forward, while rank 0 waits
  // for it in the step's collectives.
  const auto t0 = std::chrono::steady_clock::now();
  const test::MtResult r =
      mpirun(2, train_args(d.root, "fails", 2, "dataset_type=synthetic steps=100000"), 30,
             "bash -c '[ \"$OMPI_COMM_WORLD_RANK\" = 1 ] && export MT_FLASH_KERNELS=bogus; exec "
             "\"$0\" \"$@\"'");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "the job hung: " << r.out;
  EXPECT_NE(r.out.find("error on rank 1 of 2: MT_FLASH_KERNELS=bogus"), std::string::npos) << r.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20);
}

std::map<int64_t, double> losses_by_step(const fs::path& run) {
  return test::losses_by_step(run.string());
}

// An mpirun prefix (see mpirun()) under which rank 1 sends itself `signal` (kill's option: -9,
// -TERM) once `run`'s metrics.jsonl holds `lines` records (exec keeps the shell's PID for mt).
std::string rank1_signals_itself(const fs::path& run, int lines, const std::string& signal) {
  return "bash -c 'if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then (while [ $(cat " +
         (run / "metrics.jsonl").string() + " 2>/dev/null | wc -l) -lt " + std::to_string(lines) +
         " ]; do sleep 0.05; done; kill " + signal + " $$) & fi; exec \"$0\" \"$@\"'";
}

// A rank killed (SIGKILL) in the middle of training: the job ends with an error instead of
// hanging in the step's collectives, the last complete checkpoint stays loadable, and a restart
// of the job resumes from it and continues exactly as a run that was never killed.
TEST(DataParallel, AKilledRankEndsTheJobAndTheRestartResumes) {
  MT_NEED_MPIRUN();
  // Plain data parallelism (rank 0 saves) and FSDP in the background (each rank its parts: a
  // kill mid-save leaves a temporary directory no reader takes, which a later save removes
  // once its writer is gone).
  for (const std::string mesh :
       {"", "ici_fsdp_parallelism=2 ici_data_parallelism=1 async_checkpointing=true"}) {
    SCOPED_TRACE(mesh);
    Dir d;
    const std::string common =
        "dataset_type=tokens vocab_size=8192 dataset_path=" + test::source_dir() +
        "/data/corpus.train.tokens checkpoint_period=2 eval_interval=-1 "
        "learning_rate_schedule_steps=1000 " +
        mesh;
    // Rank 1 kills itself with SIGKILL once rank 0 has logged 6 steps.
    const std::string killer = rank1_signals_itself(d.root / "killed", 6, "-9");
    const auto t0 = std::chrono::steady_clock::now();
    test::MtResult r =
        mpirun(2, train_args(d.root, "killed", 2, common + " steps=100000"), 60, killer);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.code, 124) << "the job hung: " << r.out;
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 45);
    // The newest complete checkpoint, then the same job restarted to 4 steps past it.
    const int64_t last =
        CheckpointManager(d.root / "killed" / "checkpoints", false, 0, test::cpu()).latest_step();
    ASSERT_GE(last, 2) << r.out;
    const std::string until = " steps=" + std::to_string(last + 4);
    r = mpirun(2, train_args(d.root, "killed", 2, common + until), 60);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("resumed from step"), std::string::npos) << r.out;
    EXPECT_EQ(
        CheckpointManager(d.root / "killed" / "checkpoints", false, 0, test::cpu()).latest_step(),
        last + 4);
    r = mpirun(2, train_args(d.root, "straight", 2, common + until), 60);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::map<int64_t, double> killed = losses_by_step(d.root / "killed"),
                                    straight = losses_by_step(d.root / "straight");
    EXPECT_EQ(straight.size(), static_cast<size_t>(last + 4));
    EXPECT_EQ(killed, straight);
    // metrics.jsonl holds each step once: the killed run's records past its checkpoint were
    // moved to metrics.discarded.jsonl (before: appended to again, those steps twice).
    EXPECT_EQ(losses(d.root / "killed").size(), static_cast<size_t>(last + 4));
  }
}

// SIGTERM to one rank only (a node's scheduler, `kill` of one process): every rank stops after
// the same step, the sharded checkpoint of that step is complete, each rank exits 143, and the
// same job resumes from it exactly as a straight run.
TEST(DataParallel, ASignalToOneRankStopsEveryRankAfterTheSameStep) {
  MT_NEED_MPIRUN();
  Dir d;
  const std::string common =
      "dataset_type=tokens vocab_size=8192 dataset_path=" + test::source_dir() +
      "/data/corpus.train.tokens checkpoint_period=1000 eval_interval=-1 "
      "learning_rate_schedule_steps=1000 ici_fsdp_parallelism=2 ici_data_parallelism=1 "
      "async_checkpointing=true";
  const std::string signaller = rank1_signals_itself(d.root / "stopped", 4, "-TERM");
  const auto t0 = std::chrono::steady_clock::now();
  test::MtResult r =
      mpirun(2, train_args(d.root, "stopped", 2, common + " steps=100000"), 60, signaller);
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.code, 124) << "the job hung: " << r.out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 45);
  const std::map<int64_t, double> stopped = losses_by_step(d.root / "stopped");
  ASSERT_GE(stopped.size(), 4u) << r.out;
  const int64_t last = stopped.rbegin()->first;
  EXPECT_EQ(static_cast<int64_t>(stopped.size()), last);
  EXPECT_NE(r.out.find("stopped by SIGTERM after step " + std::to_string(last)), std::string::npos)
      << r.out;
  EXPECT_EQ(count(r.out, "stopped by SIGTERM"), 1u) << r.out;
  EXPECT_EQ(
      CheckpointManager(d.root / "stopped" / "checkpoints", false, 0, test::cpu()).latest_step(),
      last);
  const std::string until = " steps=" + std::to_string(last + 3);
  r = mpirun(2, train_args(d.root, "stopped", 2, common + until), 60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from step " + std::to_string(last)), std::string::npos) << r.out;
  r = mpirun(2, train_args(d.root, "straight", 2, common + until), 60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(losses_by_step(d.root / "stopped"), losses_by_step(d.root / "straight"));
}

// Without mpirun: one rank, and a mesh of more devices is refused before any work.
TEST(DataParallel, OneRankRefusesAMeshOfTwo) {
  Dir d;
  const test::MtResult r = test::run_mt(
      train_args(d.root, "one", 2, "dataset_type=synthetic ici_data_parallelism=2"), 30);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has 2 devices but 1 rank runs (start more with mpirun -np N)"),
            std::string::npos)
      << r.out;
  // Sizes whose product wraps around int64: refused, not a division by zero (2^32 x 2^32 wrapped
  // to 0) or a run (7 x 7905747460161236407 wrapped to 1 and trained one rank with a 7x batch).
  for (const std::string mesh :
       {"ici_fsdp_parallelism=4294967296 ici_tensor_parallelism=4294967296",
        "ici_data_parallelism=1 ici_fsdp_parallelism=7 ici_tensor_parallelism=7905747460161236407",
        "ici_data_parallelism=1 ici_fsdp_parallelism=7 dcn_fsdp_parallelism=7905747460161236407",
        "ici_tensor_parallelism=4294967296"}) {
    SCOPED_TRACE(mesh);
    for (const std::string& cmd : {train_args(d.root, "wrap", 2, "dataset_type=synthetic " + mesh),
                                   "plan --model=llama-test " + mesh}) {
      const test::MtResult w = test::run_mt(cmd, 30);
      EXPECT_EQ(w.code, 2) << w.out;
      EXPECT_NE(w.out.find("devices, more than any run can have"), std::string::npos) << w.out;
    }
  }
  EXPECT_FALSE(fs::exists(d.root / "wrap" / "metrics.jsonl"));
  // logical_axis_rules are checked without tensor parallelism too (before: only with it).
  for (const std::string rules :
       {"[heads-tensor]", "[heads:nosuch]", "[bogus:tensor]", "[embed:fsdp]"}) {
    const test::MtResult w = test::run_mt(
        train_args(d.root, "rules", 2, "dataset_type=synthetic logical_axis_rules=" + rules), 30);
    EXPECT_EQ(w.code, 2) << rules << w.out;
    EXPECT_NE(w.out.find("logical_axis_rules"), std::string::npos) << rules << w.out;
  }
  EXPECT_EQ(test::run_mt(train_args(d.root, "rules", 2,
                                    "dataset_type=synthetic logical_axis_rules=[heads:tensor]"),
                         60)
                .code,
            0)
      << "an incomplete rule set is right without tensor parallelism";
}

// The data plugins' shards: rank r of N with batch b, concatenated in rank order, is one rank's
// batch of N x b, step after step, and a checkpointed position restores every rank.
std::unique_ptr<DatasetSource> source(const std::string& type, int batch, int rank, int ranks,
                                      std::vector<std::pair<std::string, std::string>> kv) {
  kv.push_back({"per_device_batch_size", std::to_string(batch)});
  kv.push_back({"max_target_length", "16"});
  kv.push_back({"vocab_size", "8192"});
  return test::plugins().dataset_factory(type)(config_from_pairs(kv), DataShard{rank, ranks},
                                               nullptr);
}

TEST(DataParallel, ShardsConcatenateToTheGlobalBatch) {
  const std::string tokens = test::source_dir() + "/data/corpus.train.tokens";
  for (const std::string type : {"synthetic", "tokens"}) {
    SCOPED_TRACE(type);
    const std::vector<std::pair<std::string, std::string>> extra =
        type == "tokens"
            ? std::vector<std::pair<std::string, std::string>>{{"dataset_path", tokens}}
            : std::vector<std::pair<std::string, std::string>>{};
    const int N = 3, b = 2;
    auto one = source(type, N * b, 0, 1, extra);
    std::vector<std::unique_ptr<DatasetSource>> ranks;
    for (int r = 0; r < N; ++r) ranks.push_back(source(type, b, r, N, extra));
    for (int step = 0; step < 4; ++step) {
      HostBatch whole;
      ASSERT_TRUE(one->next(whole, false));
      std::vector<int32_t> in, tg;
      for (auto& s : ranks) {
        HostBatch part;
        ASSERT_TRUE(s->next(part, false));
        in.insert(in.end(), part.inputs.begin(), part.inputs.end());
        tg.insert(tg.end(), part.targets.begin(), part.targets.end());
      }
      EXPECT_EQ(in, whole.inputs) << "step " << step;
      EXPECT_EQ(tg, whole.targets) << "step " << step;
    }
    // Every rank's state is the global position; restored on every rank, each continues with
    // its own share.
    for (auto& s : ranks) EXPECT_EQ(s->state(), ranks[0]->state());
    const std::string at = ranks[0]->state();
    for (int r = 0; r < N; ++r) {
      auto fresh = source(type, b, r, N, extra);
      fresh->restore(at);
      HostBatch x, y;
      fresh->next(x, false);
      ranks[static_cast<size_t>(r)]->next(y, false);
      EXPECT_EQ(x.inputs, y.inputs) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace mt
