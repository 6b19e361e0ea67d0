// communicator=nccl on a GPU (label `gpu`). One GPU allows world size 1 only: these tests check
// the plugin's wiring (MPI bootstrap, NCCL init on the cuda backend's GPU, every collective on
// device and host memory, a training run through it); the multi-rank numerics are the MPI tests'
// (data_parallel_test). Where the plugin was not built (no NCCL or CUDA toolkit) or declines (no
// driver, no device), every test skips and says why; any other failure fails.
#include <gtest/gtest.h>

#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "config_impl.h"
#include "mt/backend.h"
#include "mt/comm.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// Why the nccl plugin cannot run here (empty: it can), or, in `error`, why it failed otherwise.
struct NcclPlugin {
  std::string skip, error;
};
const NcclPlugin& nccl_plugin() {
  static const NcclPlugin state = [] {
    const test::DevicePlugins d =
        test::device_plugins({{"comm", "nccl"}, {"backend", "cuda"}}, "libmt_comm_nccl.so",
                             "no NCCL, MPI or CUDA toolkit");
    return NcclPlugin{d.skip, d.error};
  }();
  return state;
}

#define MT_NEED_NCCL()                                                                           \
  if (!nccl_plugin().error.empty()) FAIL() << "the nccl plugin failed: " << nccl_plugin().error; \
  if (!nccl_plugin().skip.empty()) GTEST_SKIP() << nccl_plugin().skip

void expect_a_split_group_runs(Communicator& comm);

// One communicator per process (MPI starts once: the communicator that started it finalizes it,
// and a second one would find it finalized): every collective of world size 1 on device tensors
// and host buffers leaves the values as they were, and a split group's run too.
TEST(GpuNccl, EveryCollectiveAndASplitGroupRunOnOneGpu) {
  MT_NEED_NCCL();
  const Config cfg = config_from_pairs({});
  std::unique_ptr<Communicator> comm = test::plugins().make_communicator("nccl", cfg);
  ASSERT_EQ(comm->name(), "nccl");
  ASSERT_EQ(comm->size(), 1);
  ASSERT_EQ(comm->rank(), 0);
  std::unique_ptr<Backend> be = test::plugins().make_backend("cuda", cfg);
  const std::vector<float> v = {1.5f, -2.f, 3.25f, 0.f, 7.f};
  Tensor a = test::from_vector(*be, {5}, v);
  Tensor h = be->empty({5}, DType::bf16);
  be->cast(a, h);
  std::vector<Tensor*> ts = {&a, &h};
  comm->all_reduce_sum(*be, ts);
  EXPECT_EQ(test::to_vector(a), v);
  Tensor back = be->empty({5}, DType::f32);
  be->cast(h, back);
  EXPECT_EQ(test::to_vector(back), v);
  std::vector<float> f = v;
  comm->all_reduce_sum(f.data(), f.size());
  EXPECT_EQ(f, v);
  std::vector<double> d = {0.25, -1e300, 3.0};
  const std::vector<double> d0 = d;
  comm->all_reduce_sum(d.data(), d.size());
  EXPECT_EQ(d, d0);
  comm->reduce_scatter_sum(f.data(), f.size());
  EXPECT_EQ(f, v);
  comm->all_gather(f.data(), f.size());
  EXPECT_EQ(f, v);
  int64_t step = 42;
  comm->broadcast(&step, sizeof step, 0);
  EXPECT_EQ(step, 42);
  comm->barrier();
  expect_a_split_group_runs(*comm);
}

// split (ncclCommSplit beside MPI_Comm_split), on the one communicator of this process: the group
// of one rank is a communicator of its own whose collectives run, and the world's still run after
// the group is gone.
void expect_a_split_group_runs(Communicator& comm) {
  SCOPED_TRACE("split");
  const Config cfg = config_from_pairs({});
  const std::vector<float> v = {0.5f, -4.f, 9.f};
  {
    std::unique_ptr<Communicator> group = comm.split(/*color=*/0, /*key=*/0);
    ASSERT_TRUE(group);
    EXPECT_EQ(group->name(), "nccl");
    EXPECT_EQ(group->size(), 1);
    EXPECT_EQ(group->rank(), 0);
    std::vector<float> f = v;
    group->all_reduce_sum(f.data(), f.size());
    EXPECT_EQ(f, v);
    group->reduce_scatter_sum(f.data(), f.size());
    group->all_gather(f.data(), f.size());
    EXPECT_EQ(f, v);
    std::unique_ptr<Backend> be = test::plugins().make_backend("cuda", cfg);
    Tensor a = test::from_vector(*be, {3}, v);
    std::vector<Tensor*> ts = {&a};
    group->all_reduce_sum(*be, ts);
    EXPECT_EQ(test::to_vector(a), v);
    group->barrier();
  }
  std::vector<float> f = v;
  comm.all_reduce_sum(f.data(), f.size());
  EXPECT_EQ(f, v);
}

// mt run with communicator=nccl trains as communicator=local (one rank: the same steps).
TEST(GpuNccl, TrainingThroughNcclEqualsLocal) {
  MT_NEED_NCCL();
  const fs::path dir = fs::temp_directory_path() / "mt_gpu_nccl";
  fs::remove_all(dir);
  auto losses = [&](const std::string& comm) {
    const test::MtResult r = test::run_mt(
        "run --model=llama-test backend=cuda dataset_type=synthetic steps=5 "
        "enable_checkpointing=false enable_tensorboard=false eval_interval=-1 "
        "base_output_directory=" +
            dir.string() + " run_name=" + comm + " communicator=" + comm,
        300);
    EXPECT_EQ(r.code, 0) << r.out;
    std::vector<double> l;
    std::ifstream m(dir / comm / "metrics.jsonl");
    std::string line;
    while (std::getline(m, line))
      if (const size_t k = line.find("\"loss\": "); k != std::string::npos)
        l.push_back(std::stod(line.substr(k + 8)));
    return l;
  };
  const std::vector<double> local = losses("local"), nccl = losses("nccl");
  EXPECT_EQ(local.size(), 5u);
  EXPECT_EQ(nccl, local);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt
