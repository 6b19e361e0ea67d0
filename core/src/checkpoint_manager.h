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
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "mt/backend.h"
#include "mt/checkpointer.h"
#include "mt/tensor.h"
#include "safetensors.h"

namespace mt {

// CRC-32C of `n` bytes, continuing from `crc` (0 to start). crc32c(crc32c(0, a), b) = crc32c(ab).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);
// The table-driven implementation crc32c() falls back to without SSE4.2; exposed for the tests.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n);
// CRC-32C of a whole file; throws mt::Error naming the file when it cannot be read.
uint32_t crc32c_file(const std::filesystem::path& path);

class CheckpointManager final : public Checkpointer {
 public:
  // `checkpoint_dir` is created on the first save. `max_to_keep` = 0 keeps every checkpoint.
  // `backend` is synchronised before the host copies of a save.
  CheckpointManager(std::filesystem::path checkpoint_dir, bool async, int max_to_keep,
                    Backend& backend);
  // Waits for an in-flight write; an error nobody collected is printed to stderr.
  ~CheckpointManager() override;
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Waits for the previous write (rethrowing its error, in which case nothing new is started),
  // then snapshots `state` and writes it as step `state.step` (in the background when async).
  // state.opt_m and state.opt_v may both be empty: a parameter-only checkpoint.
  void save(const TrainState& state) override;
  // Blocks until every save started so far is durable; throws mt::Error if one failed (once).
  void wait() override;
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

  void join_worker() noexcept;
  void rethrow_pending();
  // Writes `snap` durably and applies retention; throws mt::Error naming the path and cause.
  // Runs on the worker thread when async.
  void write(const Snapshot& snap, bool live);

  std::filesystem::path dir_;
  bool async_;
  int max_to_keep_;
  Backend& backend_;

  // Host copies of the last async save, reused by the next one so that a steady state pays no
  // page faults; only touched by the worker while a write is in flight (save() joins first).
  std::vector<HostBuffer> buffers_;
  std::unique_ptr<Snapshot> snapshot_;  // the in-flight async save
  std::thread worker_;
  std::optional<std::string> pending_error_;  // set by the worker, read after join

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

// Restores a full train state for load_full_state_path: `path` as for load_parameters (but not a
// bare file); the same checks and semantics as CheckpointManager::restore.
void load_full_state(const std::filesystem::path& path, TrainState& state);

}  // namespace mt
