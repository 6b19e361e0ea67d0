// A training run's graceful stop on SIGINT or SIGTERM (Ctrl-C, `kill`, mpirun passing on its own
// interrupt, a scheduler's preemption notice such as Slurm's SIGTERM before SIGKILL): `mt run`
// watches for them while it trains, finishes the step under way, saves a checkpoint of it and
// exits with 128 + the signal's number; a second signal of either kind, a second or more after
// the first, ends the process at once (its default action: sooner, it is taken for the same
// request delivered twice, as timeout(1) does). A signal the process was started ignoring stays
// ignored.
//
// The one piece of process-wide mutable state outside the plugin registry: a signal handler can
// only hand its news to the program through static storage (a lock-free atomic).
#pragma once

#include <signal.h>

namespace mt {

// Watches SIGINT and SIGTERM for its life, restoring the handlers it replaced when it goes.
// `announce`: the handler writes one line to stderr when the first signal arrives (rank 0 only,
// so a job's ranks say it once). One at a time.
class StopOnSignals {
 public:
  explicit StopOnSignals(bool announce);
  ~StopOnSignals();
  StopOnSignals(const StopOnSignals&) = delete;
  StopOnSignals& operator=(const StopOnSignals&) = delete;

 private:
  struct sigaction old_int_ {
  }, old_term_{}, old_hup_{}, old_pipe_{};
};

// Whether a StopOnSignals is alive (the trainer then checks for a stop after every step).
bool watching_stop_signals();
// The first signal received while watching (SIGINT or SIGTERM), 0 while none has been.
int stop_signal();

}  // namespace mt
