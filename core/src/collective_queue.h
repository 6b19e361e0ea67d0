// CollectiveQueue: one thread that runs a rank's collectives in the order they are submitted,
// so that communication overlaps the training thread's compute (data parallelism's gradient
// sums during the backward, FSDP's gathers of the next layer and reduce-scatters of the last).
//
// Every rank submits the same collectives in the same order (they come from the same model
// code), so the queues' threads meet in each collective as the training threads would. While a
// queue has work, the training thread makes no collective on the same communicators itself:
// one thread at a time uses them (Communicator::serialized_threads, MPI_THREAD_SERIALIZED).
//
// A job has three parts: `in` copies its inputs from tensors to host memory, `collective` runs
// the collective on that memory, `out` copies the results back into tensors. `in` and `out`
// run under the queue's lock, and once the queue is being destroyed while an exception unwinds
// (this rank failed; the job is about to be aborted) no `out` runs; the thread is joined once
// it leaves the collective under way (the other ranks completing it), or, when it is still in
// one after 2 s (one the other ranks never join), left behind instead.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace mt {

class CollectiveQueue {
 public:
  struct Job {
    std::function<void()> in, collective, out;  // any may be empty
  };
  using Ticket = uint64_t;

  CollectiveQueue();
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Queues `job` after every job submitted before it; the ticket names it for wait().
  Ticket submit(Job job);
  // Blocks until job `t` (and so every job before it) has run; rethrows the first failure of
  // any job so far (a failed job stops the queue: later jobs do not run).
  void wait(Ticket t);
  // wait() for every job submitted so far.
  void drain();
  // Seconds the callers of wait() and drain() spent blocked since the last call (exposed
  // communication), then reset.
  double take_wait_seconds();

 private:
  struct State;
  static void run(State& s);
  std::shared_ptr<State> s_;
  std::thread worker_;
};

}  // namespace mt
