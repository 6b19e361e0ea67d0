// CheckpointManager: mt's native checkpoints (issue 6, "Native checkpoints").
//
// Layout under the run's checkpoint directory (<base_output_directory>/<run_name>/checkpoints):
//
//   <dir>/<step>/params.safetensors   parameters, in their own dtypes
//   <dir>/<step>/opt_m.safetensors    Adam first moments   (absent for parameter-only checkpoints)
//   <dir>/<step>/opt_v.safetensors    Adam second moments  (absent for parameter-only checkpoints)
//   <dir>/<step>/metadata.json        format version, step, data iterator state, RNG state, the
//                                     resolved config YAML, each file's size and CRC-32C, and
//                                     "complete": true (written last)
//
// Atomicity: a checkpoint is written under <dir>/<step>.tmp-<pid>/, every file and that directory
// are fsynced, the directory is renamed to <dir>/<step>/ and <dir> is fsynced. A reader trusts
// only a <step> directory whose metadata says complete and whose files have the recorded sizes
// (latest_step) and checksums (restore). Leftover .tmp-<pid> directories of dead processes (a
// crash mid-save) are ignored by readers and removed by the next save. Saving a step that already
// exists swaps the directories atomically (renameat2 RENAME_EXCHANGE), so there is no moment at
// which the step is missing.
//
// Checksum: CRC-32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41, reflected, init and final
// xor 0xFFFFFFFF; crc32c("123456789") = 0xE3069283) of each whole file. A CRC detects every error
// burst of at most 32 bits, so any flipped byte is always detected; it uses the SSE4.2 crc32
// instruction in three interleaved lanes when the CPU has it (~9 GB/s), else a slicing-by-8
// table. metadata.json itself carries no checksum: damage to it shows as unparseable JSON, a
// missing "complete", or sizes and checksums that no longer match.
//
// Crash testing: with MT_CHECKPOINT_CRASH=after_params (or =before_rename) in the environment, a
// save _exit(137)s right after writing params.safetensors (or metadata.json) into its temporary
// directory, leaving what a kill -9 at that moment would.
//
// Async: save() copies every tensor to host buffers (the only time training is blocked; measured)
// and, when async, writes on a background thread. The next save(), wait(), restore() or the
// destructor waits for that write. A failure on the background thread is kept and rethrown as
// mt::Error (naming the path and the cause) by the next save() or wait(); the destructor, which
// cannot throw, prints it to stderr. A failed save removes its temporary directory and never
// touches existing checkpoints. Async mode keeps the host copy between saves (reused, so later
// snapshots pay no page faults): host memory of one full train state for the run's lifetime.
// Sync mode streams each tensor to its file and keeps nothing.
//
// Step numbers: TrainState::step is the number of optimizer steps completed when the state was
// taken; a resumed run continues at step + 1.
//
// Sharded checkpoints (format version 2; FSDP, tensor parallelism, ZeRO-1 over several ranks):
// every rank writes the parts of the state it holds, so no rank ever holds the whole state:
//
//   <dir>/<step>/params.<r>-of-<N>.safetensors   rank r's parts of the parameters (1-D tensors
//   <dir>/<step>/opt_m.<r>-of-<N>.safetensors    named as the parameters), one file per rank
//   <dir>/<step>/opt_v.<r>-of-<N>.safetensors    that holds a part no lower rank holds
//   <dir>/<step>/metadata.json                   as above, plus "shards": N and "tensors": each
//                                                tensor's whole shape, dtype, tensor-parallel
//                                                split and which file holds which elements
//
// A part no lower rank holds is written once (a replicated parameter by rank 0 only). Rank 0
// creates <step>.tmp-<its pid>/, every rank writes its files into it (in the background when
// async) and records their sizes and checksums; when all ranks are done (poll(), the next
// save, wait()) rank 0 writes the metadata and publishes the step exactly as above: a step is
// complete only when every rank's files are. The directory must be one file system all ranks
// see (as Orbax and PyTorch DCP require). Restoring reads, for each tensor, the elements this
// rank holds, on any mesh (another number of ranks, FSDP or tensor parallelism or neither):
// the files of the parts that overlap, or the whole tensor assembled on the host, one tensor at
// a time, when the tensor-parallel split differs. Version 1 checkpoints (one file per group)
// restore onto parts the same way, and restore() and load_parameters() read version 2 whole.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mt/backend.h"
#include "mt/checkpointer.h"
#include "mt/tensor.h"
#include "safetensors.h"

namespace mt {

class Communicator;

// A rank's part of one tensor of a sharded train state. The whole tensor of `shape` is divided
// into `parts` equal parts along dimension `dim` (tensor parallelism: the tensor seen as a
// matrix [rows, cols], cols the product of the dimensions from `dim` on, part t is the columns
// [t w, (t + 1) w), w = cols / parts; parts = 1: the whole tensor), and this rank holds the
// elements [begin, end) of part `part` flattened (FSDP's or ZeRO-1's range; all of it when
// unsharded) in `data` (end - begin elements, any shape).
struct TensorPart {
  Shape shape;
  int dim = -1, parts = 1, part = 0;
  int64_t begin = 0, end = 0;
  Tensor data;
};

// The train state as a rank holds it: [0] parameters, [1] first and [2] second moments (both
// empty: parameter-only), by name, and the state strings (rank 0's are saved).
struct ShardedTrainState {
  int64_t step = 0;
  std::map<std::string, TensorPart> tensors[3];
  std::string data_state, rng_state, config_yaml;
};

// CRC-32C of `n` bytes, continuing from `crc` (0 to start). crc32c(crc32c(0, a), b) = crc32c(ab).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
// The table-driven implementation crc32c() falls back to without SSE4.2; exposed for the tests.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);
// CRC-32C of a whole file; throws mt::Error naming the file when it cannot be read.
uint32_t crc32c_file(const std::filesystem::path& path);

class CheckpointManager final : public Checkpointer {
 public:
  // `checkpoint_dir` is created on the first save. `max_to_keep` = 0 keeps every checkpoint.
  // `backend` is synchronised before the host copies of a save. `comm`: the job's ranks, for
  // save_parts (every rank calls save_parts, poll and wait alike); null: one rank.
  CheckpointManager(std::filesystem::path checkpoint_dir, bool async, int max_to_keep,
                    Backend& backend, Communicator* comm = nullptr);
  // Waits for an in-flight write; an error nobody collected is printed to stderr.
  ~CheckpointManager() override;
  // The caller holds the run's lock (RunLock) on the directory above checkpoint_dir, so no other
  // process saves here: a save removes every earlier save's leftover temporary directory, not
  // only those of processes that are gone. Call before the first save.
  void claim_directory() { exclusive_ = true; }
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Waits for the previous write (rethrowing its error, in which case nothing new is started),
  // then snapshots `state` and writes it as step `state.step` (in the background when async).
  // state.opt_m and state.opt_v may both be empty: a parameter-only checkpoint.
  void save(const TrainState& state) override;
  // Blocks until every save started so far is durable; throws mt::Error if one failed (once).
  // After save_parts, a collective: every rank calls it.
  void wait() override;
  // Sharded saves (version 2), a collective: every rank passes its parts (the same names and
  // geometry on every rank but for part, begin and end). Waits for the previous save, then
  // writes this rank's files (in the background when async); the step is published by the
  // poll() or wait() that finds every rank's files written (sync: before returning). A failure
  // on any rank throws mt::Error on every rank, at the call that publishes, and removes what
  // the save wrote; existing checkpoints are never touched.
  void save_parts(const ShardedTrainState& state);
  // A collective while a sharded async save is in flight (every rank calls it once a step):
  // publishes the step when every rank's files are written; else returns at once.
  void poll();
  // Fills every tensor part in `state` from step `step` (version 1 or 2, written on any mesh),
  // converting dtypes; names and whole shapes must match. Moments are read only when
  // state.tensors[1] and [2] are not empty. Checks as restore(); touches no other rank.
  void restore_parts(int64_t step, ShardedTrainState& state);
  // Highest step whose metadata says complete and whose files exist with the recorded sizes, or
  // -1. Checksums are verified by restore(), not here, so listing stays fast at start-up.
  int64_t latest_step() const override;
  // Why each step directory above latest_step() is not used: incomplete metadata or a file of
  // the wrong size (a crash or an outside change; an interrupted save of mt's own never
  // publishes a step). One sentence each, ascending; empty when there is none.
  std::vector<std::string> skipped_newer_steps() const;
  // Verifies every file's checksum, then fills the tensors already in state.params (and
  // state.opt_m / state.opt_v unless they are empty: then the moments are not read) by name,
  // converting dtypes when the stored one differs; names and shapes must match exactly. Sets
  // step, data_state, rng_state and config_yaml. On any error nothing in `state` is modified
  // (except for a failure in the middle of copying, which only I/O errors can cause).
  void restore(int64_t step, TrainState& state) override;

  const std::filesystem::path& directory() const { return dir_; }
  // Complete steps (as latest_step judges them), ascending.
  std::vector<int64_t> complete_steps() const;
  // Seconds the last save() blocked its caller (waiting for the previous write + host copies;
  // in sync mode, the whole write), and the sum over all saves.
  double last_blocking_seconds() const { return last_blocking_s_; }
  double total_blocking_seconds() const { return total_blocking_s_; }
  // Duration of the last completed write (files, checksums, fsyncs, rename, retention) and the
  // bytes of the safetensors files it wrote: write throughput for the run's log. Valid after
  // wait().
  double last_write_seconds() const { return last_write_s_.load(); }
  size_t last_write_bytes() const { return last_write_bytes_.load(); }

 private:
  struct HostBuffer {
    std::unique_ptr<std::byte[]> data;
    size_t size = 0;
  };
  // What one save writes. Async: `host` points into buffers_. Sync: `live` holds the training
  // tensors themselves, streamed to the file one at a time (no second copy of the state).
  struct Snapshot {
    int64_t step = 0;
    std::vector<SafeTensorsEntry> host[3];                // params, opt_m, opt_v
    std::vector<std::pair<std::string, Tensor>> live[3];  // same, sync mode
    bool has_opt = false;
    std::string data_state, rng_state, config_yaml;
  };

  // A sharded save between its files and its publication.
  struct PendingShards;

  void join_worker() noexcept;
  void rethrow_pending();
  // `t`'s bytes in host buffer k of buffers_ (made or resized as needed).
  const std::byte* host_copy(size_t k, const Tensor& t);
  // Step `step`'s directory, after any write in flight; throws mt::Error when there is none.
  std::filesystem::path step_to_read(int64_t step);
  // Writes this rank's files of a sharded save; worker thread when async.
  void write_shards(PendingShards& pending);
  // Publishes the pending sharded save (rank 0) once every rank has written; a collective.
  void commit_shards();
  // Writes `snap` durably and applies retention; throws mt::Error naming the path and cause.
  // Runs on the worker thread when async.
  void write(const Snapshot& snap, bool live);

  std::filesystem::path dir_;
  bool async_;
  bool exclusive_ = false;  // claim_directory()
  int max_to_keep_;
  Backend& backend_;
  Communicator* comm_;

  // Host copies of the last async save, reused by the next one so that a steady state pays no
  // page faults; only touched by the worker while a write is in flight (save() joins first).
  std::vector<HostBuffer> buffers_;
  std::unique_ptr<Snapshot> snapshot_;  // the in-flight async save
  std::thread worker_;
  std::optional<std::string> pending_error_;  // set by the worker, read after join
  std::unique_ptr<PendingShards> shards_;     // the sharded save not yet published
  std::atomic<bool> worker_done_{false};      // the worker has finished (poll reads it)

  double last_blocking_s_ = 0, total_blocking_s_ = 0;
  // Written by the worker; atomic so the accessors may be polled while a write is in flight.
  std::atomic<double> last_write_s_{0};
  std::atomic<size_t> last_write_bytes_{0};
};

// Loads parameters for load_parameters_path: `path` is a step directory (holding metadata.json),
// a checkpoints directory or a run directory holding checkpoints/ (its latest complete step is
// used), or a bare .safetensors file (no checksum to verify). Fills the tensors already in
// `params` by name with the same checks and conversions as restore(); throws mt::Error naming
// the file on any problem.
void load_parameters(const std::filesystem::path& path, std::map<std::string, Tensor>& params);
// The same, and each tensor named in `streamed` (with its shape) read whole in f32 into a
// temporary on `backend`, handed to `take` and dropped before the next, so those are never held
// all at once (int8 weights quantized as they are read). The checkpoint must hold exactly
// `params` and `streamed`; its files are opened and verified once.
void load_parameters(const std::filesystem::path& path, std::map<std::string, Tensor>& params,
                     const std::map<std::string, Shape>& streamed, Backend& backend,
                     const std::function<void(const std::string&, const Tensor&)>& take);

// The resolved config (YAML, as mt run wrote it) of the checkpoint `path` names as
// load_parameters_path takes it; "" for a bare .safetensors file, a checkpoint written without
// one, or a path that names no readable checkpoint (loading it says why).
std::string checkpoint_config_yaml(const std::filesystem::path& path);

// Restores a full train state for load_full_state_path: `path` as for load_parameters (but not a
// bare file); the same checks and semantics as CheckpointManager::restore.
void load_full_state(const std::filesystem::path& path, TrainState& state);

// The same for a rank's parts (as restore_parts): load_full_state_path, and load_parameters_path
// (state.tensors[0] only, a bare .safetensors file too) for sharded runs.
void load_full_state_parts(const std::filesystem::path& path, ShardedTrainState& state);
// Every tensor of one group ("params", "opt_m" or "opt_v") of the checkpoint at `path` (as for
// load_full_state), whole, in its stored dtype, on `backend`: a checkpoint of any version read
// as one rank sees it (tests, tools).
std::map<std::string, Tensor> load_checkpoint_tensors(const std::filesystem::path& path,
                                                      const std::string& group, Backend& backend);
void load_parameter_parts(const std::filesystem::path& path, ShardedTrainState& state);

}  // namespace mt
