// communicator=mpi: collectives over MPI (OpenMPI) on host memory.
//
// Sums are ours, not MPI_SUM's: MPI leaves the order of a reduction to the implementation (and
// OpenMPI's choice depends on message size and rank count), so results could differ from one
// job shape to another. all_reduce_sum is a reduce-scatter and an all-gather built from
// MPI_Alltoallv and MPI_Allgatherv: rank r owns the r-th slice, receives every rank's copy of it
// and adds them in rank order (((x_0 + x_1) + x_2) + ...), then every rank gathers the owners'
// slices. The traffic is a ring all-reduce's (2 (N - 1) / N of the buffer per rank) and every rank
// ends with the same bits, whatever the timing.
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/comm.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/plugin.h"

namespace {

void check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw mt::Error(std::string("mpi: ") + what +
                  " failed: " + std::string(msg, static_cast<size_t>(len)));
}

template <class T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}

class MpiCommunicator final : public mt::Communicator {
 public:
  MpiCommunicator() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      throw mt::Error(
          "mpi communicator: MPI was already finalized in this process (by the communicator that "
          "started it, when it was destroyed), and MPI cannot start twice in one process: make "
          "one communicator per process and keep it for the run.");
    int provided = MPI_THREAD_SINGLE;
    if (!initialised) {
      // One thread at a time calls MPI: the training thread, or the thread that sums data
      // parallelism's gradients during the backward (oneTBB workers and the checkpoint writer
      // never do).
      check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
      owns_ = true;
    } else {
      MPI_Query_thread(&provided);
    }
    serialized_ = provided >= MPI_THREAD_SERIALIZED;
    // Errors come back as codes, which check() turns into mt::Error with MPI's sentence.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    attach(MPI_COMM_WORLD);
  }
  // A group of the world's ranks (split); the world's communicator outlives it.
  MpiCommunicator(MPI_Comm group, bool serialized) : split_(true), serialized_(serialized) {
    attach(group);
  }
  ~MpiCommunicator() override {
    // Not while an exception unwinds: MPI_Finalize waits for the other ranks, which may be
    // blocked in a collective this rank will never join (the caller aborts the job instead).
    if (std::uncaught_exceptions() != 0) return;
    if (split_) MPI_Comm_free(&comm_);
    if (owns_) MPI_Finalize();
  }

  std::unique_ptr<mt::Communicator> split(int color, int key) override {
    MPI_Comm group = MPI_COMM_NULL;
    check(MPI_Comm_split(comm_, color, key, &group), "MPI_Comm_split");
    MPI_Comm_set_errhandler(group, MPI_ERRORS_RETURN);
    return std::make_unique<MpiCommunicator>(group, serialized_);
  }

  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* data, size_t n) override { reduce(data, n); }
  void all_reduce_sum(double* data, size_t n) override { reduce(data, n); }

  // A buffer of at most kIntMax elements whose parts fit one round goes straight to MPI; larger
  // ones in rounds of at most round_elems() elements of each rank's part, packed into one
  // contiguous buffer per round (MPI counts and displacements are int; parts may be larger).
  void reduce_scatter_sum(float* data, size_t n) override {
    if (size_ == 1 || n == 0) return;
    const auto N = static_cast<size_t>(size_);
    const auto me = static_cast<size_t>(rank_);
    std::vector<int> counts(N), displs(N), rcounts(N), rdispls(N);
    std::vector<float> send, got;
    const bool direct = rounds(n) == 1 && n <= kIntMax;  // straight from `data`, no packing
    for (size_t k = 0; k < rounds(n); ++k) {
      const size_t total = layout(n, k, direct, counts, displs);
      if (!direct) {
        send.resize(total);
        for (size_t r = 0; r < N; ++r)
          std::copy_n(data + round_of(n, r, k).first, counts[r], send.data() + displs[r]);
      }
      const auto [lo, hi] = round_of(n, me, k);
      const size_t mine = hi - lo;
      got.resize(mine * N);
      for (size_t r = 0; r < N; ++r) {
        rcounts[r] = static_cast<int>(mine);
        rdispls[r] = static_cast<int>(r * mine);
      }
      check(MPI_Alltoallv(direct ? data : send.data(), counts.data(), displs.data(), MPI_FLOAT,
                          got.data(), rcounts.data(), rdispls.data(), MPI_FLOAT, comm_),
            "MPI_Alltoallv");
      received_ += static_cast<double>(mine * (N - 1) * sizeof(float));
      add_in_rank_order(got.data(), mine, data + lo);
    }
  }

  void all_gather(float* data, size_t n) override {
    if (size_ == 1 || n == 0) return;
    const auto N = static_cast<size_t>(size_);
    {
      const auto [lo, hi] = mt::shard_range(n, rank_, size_);
      received_ += static_cast<double>((n - (hi - lo)) * sizeof(float));
    }
    std::vector<int> counts(N), displs(N);
    if (rounds(n) == 1 && n <= kIntMax) {  // in place, no packing
      layout(n, 0, true, counts, displs);
      check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, counts.data(), displs.data(),
                           MPI_FLOAT, comm_),
            "MPI_Allgatherv");
      return;
    }
    std::vector<float> got;
    for (size_t k = 0; k < rounds(n); ++k) {
      got.resize(layout(n, k, false, counts, displs));
      const auto [lo, hi] = round_of(n, static_cast<size_t>(rank_), k);
      check(MPI_Allgatherv(data + lo, static_cast<int>(hi - lo), MPI_FLOAT, got.data(),
                           counts.data(), displs.data(), MPI_FLOAT, comm_),
            "MPI_Allgatherv");
      for (size_t r = 0; r < N; ++r)
        std::copy_n(got.data() + displs[r], counts[r], data + round_of(n, r, k).first);
    }
  }

  // Counts and displacements are in rows (one contiguous MPI type of `row` floats), so a
  // rank's rows fit MPI's int counts for any row a model has.
  void all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                  const std::vector<size_t>& recv_rows, size_t row) override {
    const auto N = static_cast<size_t>(size_);
    if (send_rows.size() != N || recv_rows.size() != N)
      throw mt::Error("mpi: all_to_all takes one count per rank (" + std::to_string(N) + "), got " +
                      std::to_string(send_rows.size()) + " and " +
                      std::to_string(recv_rows.size()));
    if (row == 0) return;
    if (row > kIntMax)
      throw mt::Error("mpi: all_to_all rows of " + std::to_string(row) + " floats");
    std::vector<int> sc(N), sd(N), rc(N), rd(N);
    size_t s_at = 0, r_at = 0;
    for (size_t r = 0; r < N; ++r) {
      if (s_at + send_rows[r] > kIntMax || r_at + recv_rows[r] > kIntMax)
        throw mt::Error("mpi: all_to_all of more than 2^31 rows");
      sc[r] = static_cast<int>(send_rows[r]);
      sd[r] = static_cast<int>(s_at);
      rc[r] = static_cast<int>(recv_rows[r]);
      rd[r] = static_cast<int>(r_at);
      s_at += send_rows[r];
      r_at += recv_rows[r];
      if (r != static_cast<size_t>(rank_))
        received_ += static_cast<double>(recv_rows[r] * row * sizeof(float));
    }
    MPI_Datatype t = MPI_DATATYPE_NULL;
    check(MPI_Type_contiguous(static_cast<int>(row), MPI_FLOAT, &t), "MPI_Type_contiguous");
    check(MPI_Type_commit(&t), "MPI_Type_commit");
    // (MPI wants valid buffers even for empty parts.)
    float no_send = 0.f, no_recv = 0.f;
    const int rc_ = MPI_Alltoallv(s_at ? send : &no_send, sc.data(), sd.data(), t,
                                  r_at ? recv : &no_recv, rc.data(), rd.data(), t, comm_);
    MPI_Type_free(&t);
    check(rc_, "MPI_Alltoallv");
  }

  void broadcast(void* data, size_t bytes, int root) override {
    auto* p = static_cast<char*>(data);
    while (bytes > 0) {  // MPI counts are int
      const size_t part = std::min<size_t>(bytes, 1u << 30);
      check(MPI_Bcast(p, static_cast<int>(part), MPI_BYTE, root, comm_), "MPI_Bcast");
      if (rank_ != root) received_ += static_cast<double>(part);
      p += part;
      bytes -= part;
    }
  }

  void barrier() override { check(MPI_Barrier(comm_), "MPI_Barrier"); }
  bool serialized_threads() const override { return serialized_; }
  double bytes_received() const override { return received_; }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  template <class T>
  void reduce(T* data, size_t n) {
    if (size_ == 1 || n == 0) return;
    const auto N = static_cast<size_t>(size_);
    // Slices of the buffer in chunks of at most 2^28 elements (MPI counts are int).
    const size_t chunk = size_t{1} << 28;
    for (size_t base = 0; base < n; base += chunk) {
      const size_t len = std::min(chunk, n - base);
      T* buf = data + base;
      std::vector<int> counts(N), displs(N);
      for (size_t r = 0; r < N; ++r) {
        const size_t lo = len * r / N, hi = len * (r + 1) / N;
        counts[r] = static_cast<int>(hi - lo);
        displs[r] = static_cast<int>(lo);
      }
      const auto me = static_cast<size_t>(rank_);
      const auto mine = static_cast<size_t>(counts[me]);
      // Every rank's copy of my slice, rank after rank.
      recv_.resize(mine * N * sizeof(T));
      T* got = reinterpret_cast<T*>(recv_.data());
      std::vector<int> rcounts(N, counts[me]), rdispls(N);
      for (size_t r = 0; r < N; ++r) rdispls[r] = static_cast<int>(r * mine);
      check(MPI_Alltoallv(buf, counts.data(), displs.data(), mpi_type<T>(), got, rcounts.data(),
                          rdispls.data(), mpi_type<T>(), comm_),
            "MPI_Alltoallv");
      add_in_rank_order(got, mine, buf + displs[me]);
      check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts.data(), displs.data(),
                           mpi_type<T>(), comm_),
            "MPI_Allgatherv");
      received_ += static_cast<double>((mine * (N - 1) + (len - mine)) * sizeof(T));
    }
  }

  // Elements of one rank's part per round of reduce_scatter_sum and all_gather: a round's
  // packed buffer (N parts) stays within 2^30 elements, inside MPI's int counts.
  // MT_MPI_ROUND_ELEMENTS sets a smaller round, so the tests cover several rounds on small
  // models.
  static constexpr size_t kIntMax = 2147483647;
  size_t round_elems() const {
    const size_t cap = std::max<size_t>(1, (size_t{1} << 30) / static_cast<size_t>(size_));
    return round_override_ > 0 ? std::min(cap, round_override_) : cap;
  }
  size_t longest_part(size_t n) const {
    size_t m = 0;
    for (int r = 0; r < size_; ++r) {
      const auto [lo, hi] = mt::shard_range(n, r, size_);
      m = std::max(m, hi - lo);
    }
    return m;
  }
  size_t rounds(size_t n) const { return (longest_part(n) + round_elems() - 1) / round_elems(); }
  // Each rank's count in round k, and its displacement: in `data` (direct) or packed one after
  // another; returns the round's total.
  size_t layout(size_t n, size_t k, bool direct, std::vector<int>& counts,
                std::vector<int>& displs) const {
    size_t total = 0;
    for (size_t r = 0; r < counts.size(); ++r) {
      const auto [lo, hi] = round_of(n, r, k);
      counts[r] = static_cast<int>(hi - lo);
      displs[r] = static_cast<int>(direct ? lo : total);
      total += hi - lo;
    }
    return total;
  }
  // out[i] = got[i] + got[mine + i] + ... : every rank's copy of this rank's part, in rank
  // order (((x_0 + x_1) + x_2) + ...), the same bits whatever the timing.
  template <class T>
  void add_in_rank_order(const T* got, size_t mine, T* out) const {
    const auto N = static_cast<size_t>(size_);
    for (size_t i = 0; i < mine; ++i) {
      T s = got[i];
      for (size_t r = 1; r < N; ++r) s += got[r * mine + i];
      out[i] = s;
    }
  }
  // Rank r's elements in round k: [lo, hi) of `data`, possibly empty.
  std::pair<size_t, size_t> round_of(size_t n, size_t r, size_t k) const {
    const auto [lo, hi] = mt::shard_range(n, static_cast<int>(r), size_);
    const size_t a = std::min(hi, lo + k * round_elems()), b = std::min(hi, a + round_elems());
    return {a, b};
  }

  void attach(MPI_Comm c) {
    comm_ = c;
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (const char* r = std::getenv("MT_MPI_ROUND_ELEMENTS"); r && *r)
      round_override_ = static_cast<size_t>(std::max(0LL, std::atoll(r)));
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  size_t round_override_ = 0;
  bool owns_ = false, split_ = false, serialized_ = false;
  double received_ = 0;
  std::vector<char> recv_;
};

void register_all(mt::Registry& r) {
  r.add_communicator("mpi", [](const mt::Config&) -> std::unique_ptr<mt::Communicator> {
    return std::make_unique<MpiCommunicator>();
  });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::comm, "mpi", "0.1.0", register_all, nullptr)
