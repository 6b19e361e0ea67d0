#include "collective_queue.h"

#include <chrono>
#include <stdexcept>
#include <utility>

namespace mt {

struct CollectiveQueue::State {
  std::mutex m;  // guards the rest, and every job's `in` and `out`
  std::condition_variable work, done;
  std::deque<std::pair<Ticket, Job>> jobs;
  Ticket submitted = 0, finished = 0;  // tickets are 1, 2, ...
  bool stop = false;
  bool in_collective = false;  // the thread is in a job's `collective` (without the lock)
  std::exception_ptr error;
  double waited = 0;
};

CollectiveQueue::CollectiveQueue() : s_(std::make_shared<State>()) {}

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard lock(s_->m);
    s_->stop = true;
  }
  s_->work.notify_all();
  if (!worker_.joinable()) return;
  if (std::uncaught_exceptions() > 0) {
    // A collective the other ranks complete returns within moments, and the thread then leaves
    // (no `out` runs once stopping): joined, it no longer touches the communicator or buffers
    // this unwinding is about to destroy. One the other ranks never join would wait forever:
    // after a grace period that thread is left behind (the state lives on with it, shared)
    // and the rank's failure aborts the job.
    std::unique_lock lock(s_->m);
    const bool left =
        s_->done.wait_for(lock, std::chrono::seconds(2), [&] { return !s_->in_collective; });
    lock.unlock();
    if (left)
      worker_.join();
    else
      worker_.detach();
  } else {
    worker_.join();
  }
}

CollectiveQueue::Ticket CollectiveQueue::submit(Job job) {
  if (!worker_.joinable()) worker_ = std::thread([s = s_] { run(*s); });
  Ticket t = 0;
  {
    std::lock_guard lock(s_->m);
    t = ++s_->submitted;
    s_->jobs.emplace_back(t, std::move(job));
  }
  s_->work.notify_one();
  return t;
}

void CollectiveQueue::wait(Ticket t) {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock lock(s_->m);
  s_->done.wait(lock, [&] { return s_->finished >= t || s_->error; });
  s_->waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s_->error) std::rethrow_exception(s_->error);
}

void CollectiveQueue::drain() {
  Ticket t = 0;
  {
    std::lock_guard lock(s_->m);
    t = s_->submitted;
  }
  wait(t);
}

double CollectiveQueue::take_wait_seconds() {
  std::lock_guard lock(s_->m);
  return std::exchange(s_->waited, 0.0);
}

void CollectiveQueue::run(State& s) {
  std::unique_lock lock(s.m);
  while (true) {
    s.work.wait(lock, [&] { return s.stop || !s.jobs.empty(); });
    if (s.stop || s.error) return;
    auto [ticket, job] = std::move(s.jobs.front());
    s.jobs.pop_front();
    try {
      if (job.in) job.in();
      s.in_collective = true;
      lock.unlock();
      if (job.collective) job.collective();
      lock.lock();
      s.in_collective = false;
      s.done.notify_all();
      if (s.stop) return;
      if (job.out) job.out();
    } catch (...) {
      if (!lock.owns_lock()) lock.lock();
      s.in_collective = false;
      s.error = std::current_exception();
    }
    s.finished = ticket;
    s.done.notify_all();
  }
}

}  // namespace mt
