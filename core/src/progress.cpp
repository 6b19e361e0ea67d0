#include "progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <utility>

namespace mt {

namespace {
double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}
}  // namespace

Progress::Progress(std::string what, double total, std::string unit, bool enabled, std::FILE* out)
    : what_(std::move(what)),
      unit_(std::move(unit)),
      total_(total),
      enabled_(enabled && total > 0 && terminal(out)),
      out_(out),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

Progress::~Progress() {
  finish();
}

bool Progress::terminal(std::FILE* f) {
  return f && isatty(fileno(f));
}

std::string Progress::amount(double v) const {
  if (unit_ != "B") return fmt::format("{:.0f}", v);
  if (v >= 1e9) return fmt::format("{:.2f} GB", v / 1e9);
  return fmt::format("{:.1f} MB", v / 1e6);
}

void Progress::update(double done) {
  done_ = done;
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  // A phase shorter than a second shows nothing; then at most ten redraws a second.
  if (seconds(now - start_) < 1.0 || (drawn_ && seconds(now - last_draw_) < 0.1)) return;
  drawn_ = true;
  last_draw_ = now;
  const double elapsed = seconds(now - start_);
  const double frac = done_ / total_;
  const std::string eta =
      frac > 0 && frac < 1 ? fmt::format(", ETA {:.0f} s", elapsed * (1 - frac) / frac) : "";
  const std::string of = unit_ == "B"
                             ? fmt::format("{} of {}", amount(done_), amount(total_))
                             : fmt::format("{}/{} {}", amount(done_), amount(total_), unit_);
  std::fprintf(out_, "\r%s: %3.0f%% (%s%s)   ", what_.c_str(), 100 * frac, of.c_str(), eta.c_str());
  std::fflush(out_);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  if (!enabled_ || !drawn_) return;
  const double elapsed = seconds(std::chrono::steady_clock::now() - start_);
  const std::string rate =
      unit_ == "B" && elapsed > 0 ? fmt::format(", {}/s", amount(done_ / elapsed)) : std::string();
  std::fprintf(out_, "\r%s: done in %.1f s (%s%s)%*s\n", what_.c_str(), elapsed,
               amount(done_).c_str(), unit_ == "B" ? rate.c_str() : (" " + unit_).c_str(), 20, "");
  std::fflush(out_);
}

}  // namespace mt
