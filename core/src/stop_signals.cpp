#include "stop_signals.h"

#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>

#include "mt/error.h"

namespace mt {
namespace {

static_assert(std::atomic<int>::is_always_lock_free && std::atomic<bool>::is_always_lock_free &&
                  std::atomic<int64_t>::is_always_lock_free,
              "a signal handler may only touch lock-free atomics");
std::atomic<int> g_signal{0};
std::atomic<bool> g_watching{false}, g_announce{false};
std::atomic<int64_t> g_first_ns{0};  // when the first signal came (CLOCK_MONOTONIC)

int64_t now_ns() {  // clock_gettime is async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

extern "C" void on_stop_signal(int sig) {
  // The interrupted thread's errno stays as it was: the write below fails with EPIPE when stderr
  // is a pipe whose reader has gone (Ctrl-C also ends `| tee`), and code that just made a system
  // call reads errno next (a rename's EEXIST, EINTR retries, strerror in messages).
  const int saved_errno = errno;
  struct RestoreErrno {
    int value;
    ~RestoreErrno() { errno = value; }
  } restore{saved_errno};
  int none = 0;
  if (!g_signal.compare_exchange_strong(none, sig)) {
    // The same request delivered twice (timeout(1) signals its child and then its process
    // group) is one request: only a signal a second or more after the first forces the stop.
    // (0: the first one's handler, on another thread, has not stored its time yet.)
    const int64_t first = g_first_ns.load();
    if (first == 0 || now_ns() - first < 1000000000) return;
    // A second signal, of either kind: its default action, once this handler returns (the
    // signal is blocked while its handler runs). sigaction and raise are async-signal-safe.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
    raise(sig);
    return;
  }
  g_first_ns.store(now_ns());
  if (!g_announce.load()) return;
  // write(2) is async-signal-safe; printf is not.
  const char* msg =
      sig == SIGINT   ? "\nmt run: interrupted (SIGINT): finishing the step under way and saving a "
                        "checkpoint of it; interrupt again to stop at once, without one.\n"
      : sig == SIGHUP ? "\nmt run: SIGHUP received (the terminal closed): finishing the step "
                        "under way and saving a checkpoint of it; a second SIGHUP stops at once, "
                        "without one.\n"
                      : "\nmt run: SIGTERM received: finishing the step under way and saving a "
                        "checkpoint of it; a second SIGTERM stops at once, without one.\n";
  ssize_t ignored = write(STDERR_FILENO, msg, std::strlen(msg));
  (void)ignored;
}

}  // namespace

StopOnSignals::StopOnSignals(bool announce) {
  if (g_watching.exchange(true))
    throw Error("Internal: a second StopOnSignals while one is alive.");
  g_signal.store(0);
  g_first_ns.store(0);
  g_announce.store(announce);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  // A signal the process was started ignoring (SIGINT for a shell's background job, nohup)
  // stays ignored.
  // SIGHUP (a closed terminal, a dropped ssh session) too: its default ended the run without
  // a checkpoint.
  for (auto [sig, old] : {std::pair{SIGINT, &old_int_}, std::pair{SIGTERM, &old_term_},
                          std::pair{SIGHUP, &old_hup_}}) {
    sigaction(sig, nullptr, old);
    if (old->sa_handler != SIG_IGN) sigaction(sig, &sa, nullptr);
  }
  // A reader of the run's output that goes away (`mt run | head`, a dying tee) must not end
  // the training: writes to it fail instead (mt then says so at the end).
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  sigaction(SIGPIPE, &ign, &old_pipe_);
}

StopOnSignals::~StopOnSignals() {
  // What the run printed last goes out while a gone reader still fails the write (mt says so
  // at the end) rather than killing mt by SIGPIPE with no word (`mt run | head -1`: exit 141).
  std::fflush(stdout);
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGHUP, &old_hup_, nullptr);
  sigaction(SIGPIPE, &old_pipe_, nullptr);
  g_watching.store(false);
  g_signal.store(0);
}

bool watching_stop_signals() {
  return g_watching.load();
}

int stop_signal() {
  return g_signal.load();
}

}  // namespace mt
