#include "checkpoint_manager.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string_view>
#include <system_error>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "file_util.h"
#include "json.h"
#include "mt/error.h"
#include "mt/version.h"
#include "progress.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kFormat = "mt-checkpoint";
constexpr int64_t kFormatVersion = 1;
constexpr const char* kMetadataName = "metadata.json";
// Index i of TrainState's maps (params, opt_m, opt_v) is stored in file kFileNames[i].
constexpr const char* kFileNames[3] = {"params.safetensors", "opt_m.safetensors",
                                       "opt_v.safetensors"};
// Metadata holds a config and two small state strings; anything bigger is not ours.
constexpr uintmax_t kMaxMetadataBytes = uintmax_t{256} << 20;
// The metadata nests three levels; the bound only protects the parser's stack from hostile input.
constexpr int kMaxMetadataDepth = 32;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- CRC-32C --------------------------------------------------------------------------------
// Reflected Castagnoli polynomial. Tables for slicing-by-8, built at compile time.
constexpr uint32_t kCrcPoly = 0x82F63B78u;

struct CrcTables {
  uint32_t t[8][256];
};

constexpr CrcTables make_crc_tables() {
  CrcTables r{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kCrcPoly & (0u - (c & 1u)));
    r.t[0][i] = c;
  }
  for (int s = 1; s < 8; ++s)
    for (int i = 0; i < 256; ++i) r.t[s][i] = (r.t[s - 1][i] >> 8) ^ r.t[0][r.t[s - 1][i] & 0xffu];
  return r;
}

constexpr CrcTables kCrc = make_crc_tables();

// `c` is the internal (pre-inverted) register in both implementations.
uint32_t crc32c_sw(uint32_t c, const unsigned char* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = (c >> 8) ^ kCrc.t[0][(c ^ *p++) & 0xffu];
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    if constexpr (std::endian::native == std::endian::big) w = __builtin_bswap64(w);
    w ^= c;
    c = kCrc.t[7][w & 0xff] ^ kCrc.t[6][(w >> 8) & 0xff] ^ kCrc.t[5][(w >> 16) & 0xff] ^
        kCrc.t[4][(w >> 24) & 0xff] ^ kCrc.t[3][(w >> 32) & 0xff] ^ kCrc.t[2][(w >> 40) & 0xff] ^
        kCrc.t[1][(w >> 48) & 0xff] ^ kCrc.t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ kCrc.t[0][(c ^ *p++) & 0xffu];
  return c;
}

// a * b mod P for polynomials in the reflected representation (bit 31 holds x^0). Multiplying a
// CRC register by x^(8n) mod P is what appending n zero bytes does to it, which lets CRCs of
// consecutive pieces, computed independently, be combined.
constexpr uint32_t gf2_mulmod(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int k = 0; k < 32; ++k) {
    if (a & (0x80000000u >> k)) p ^= b;
    b = (b >> 1) ^ (kCrcPoly & (0u - (b & 1u)));  // b *= x
  }
  return p;
}

constexpr uint32_t x_pow_mod(uint64_t e) {
  uint32_t r = 0x80000000u, base = 0x40000000u;  // x^0, x^1
  for (; e != 0; e >>= 1) {
    if (e & 1) r = gf2_mulmod(r, base);
    base = gf2_mulmod(base, base);
  }
  return r;
}

#if defined(__x86_64__)
// The crc32 instruction has a latency of 3 cycles but issues every cycle: three independent
// lanes over consecutive blocks keep it busy, and are combined with the shift above.
constexpr size_t kCrcLane = 4096;
constexpr uint32_t kCrcLaneShift = x_pow_mod(8 * kCrcLane);

// The SSE4.2 crc32 instruction computes exactly CRC-32C, 8 bytes per instruction.
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(uint32_t c, const unsigned char* p, size_t n) {
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(c, *p++);
    --n;
  }
  while (n >= 3 * kCrcLane) {
    uint64_t a = c, b = 0, d = 0;
    for (size_t i = 0; i < kCrcLane; i += 8) {
      uint64_t wa, wb, wd;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kCrcLane + i, 8);
      std::memcpy(&wd, p + 2 * kCrcLane + i, 8);
      a = _mm_crc32_u64(a, wa);
      b = _mm_crc32_u64(b, wb);
      d = _mm_crc32_u64(d, wd);
    }
    uint32_t ab = gf2_mulmod(static_cast<uint32_t>(a), kCrcLaneShift) ^ static_cast<uint32_t>(b);
    c = gf2_mulmod(ab, kCrcLaneShift) ^ static_cast<uint32_t>(d);
    p += 3 * kCrcLane;
    n -= 3 * kCrcLane;
  }
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

// ---- small file helpers ---------------------------------------------------------------------
[[noreturn]] void errno_error(const std::string& what, const fs::path& p) {
  throw Error(what + " " + quoted(p) + ": " + std::strerror(errno));
}

void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) errno_error("cannot open for fsync", p);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) {
    errno = err;
    errno_error("fsync failed for", p);
  }
}

// Creates `p` (which must not exist), writes `text`, fsyncs; removes it again on failure.
void write_file_durable(const fs::path& p, std::string_view text) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) errno_error("cannot create", p);
  auto fail = [&](const char* what) {
    int err = errno;
    ::close(fd);
    ::unlink(p.c_str());
    errno = err;
    errno_error(what, p);
  };
  if (!write_all(fd, text.data(), text.size())) fail("write failed for");
  if (::fsync(fd) != 0) fail("fsync failed for");
  if (::close(fd) != 0) {
    ::unlink(p.c_str());
    errno_error("close failed for", p);
  }
}

// ---- metadata -------------------------------------------------------------------------------
struct FileRecord {
  std::string name;
  uint64_t size = 0;
  uint32_t crc = 0;
};

struct Metadata {
  int64_t version = kFormatVersion;
  int64_t step = 0;
  bool complete = false;
  std::vector<FileRecord> files;
  std::string data_state, rng_state, config_yaml;

  const FileRecord* file(std::string_view name) const {
    for (const auto& f : files)
      if (f.name == name) return &f;
    return nullptr;
  }
};

std::string crc_hex(uint32_t crc) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

std::string metadata_json(const Metadata& md) {
  std::string o = "{\n  \"format\": " + json::quote(kFormat);
  o += ",\n  \"version\": " + std::to_string(md.version);
  o += ",\n  \"written_by\": \"mt " MT_VERSION_STRING "\"";
  o += ",\n  \"step\": " + std::to_string(md.step);
  o += ",\n  \"checksum\": \"crc32c\",\n  \"files\": {";
  for (size_t i = 0; i < md.files.size(); ++i) {
    o += i ? ",\n    " : "\n    ";
    o += json::quote(md.files[i].name);
    o += ": {\"size\": " + std::to_string(md.files[i].size) + ", \"crc32c\": \"" +
         crc_hex(md.files[i].crc) + "\"}";
  }
  o += "\n  },\n  \"data_state\": " + json::quote(md.data_state);
  o += ",\n  \"rng_state\": " + json::quote(md.rng_state);
  o += ",\n  \"config_yaml\": " + json::quote(md.config_yaml);
  // Last, so a reader that somehow sees a partial file sees no "complete".
  o += ",\n  \"complete\": ";
  o += md.complete ? "true" : "false";
  o += "\n}\n";
  return o;
}

// Reads and validates <step_dir>/metadata.json; throws mt::Error naming the file.
Metadata read_metadata(const fs::path& step_dir) {
  fs::path p = step_dir / kMetadataName;
  auto bad = [&](const std::string& what) -> Error { return Error(quoted(p) + ": " + what); };
  std::error_code ec;
  uintmax_t size = fs::file_size(p, ec);
  if (ec) throw bad("cannot read the checkpoint metadata: " + ec.message());
  if (size > kMaxMetadataBytes) throw bad("metadata file is implausibly large");
  std::string text;
  switch (read_all(p, text)) {
    case ReadStatus::ok:
      break;
    case ReadStatus::open_failed:
      throw bad("cannot open the checkpoint metadata");
    case ReadStatus::read_failed:
      throw bad("short read");
  }
  if (text.size() < size) throw bad("short read");
  text.resize(static_cast<size_t>(size));  // what the size check above vetted, should it grow

  json::Value j;
  try {
    j = json::parse(text, kMaxMetadataDepth);
  } catch (const json::ParseError& e) {
    throw Error("invalid JSON in " + quoted(p) + " at byte " + std::to_string(e.offset) + ": " +
                e.what);
  }
  if (!j.is_object()) throw bad("not a JSON object");
  auto str = [&](const char* key, bool required) -> std::string {
    const json::Value* v = j.find(key);
    if (!v) {
      if (required) throw bad(std::string("missing \"") + key + "\"");
      return {};
    }
    if (!v->is_string()) throw bad(std::string("\"") + key + "\" is not a string");
    return v->str;
  };
  auto integer = [&](const json::Value* v, const std::string& key) -> int64_t {
    if (!v || v->kind != json::Value::Kind::number)
      throw bad("missing or non-numeric \"" + key + "\"");
    if (!v->is_int) throw bad("\"" + key + "\" is not an integer: " + v->str);
    return v->integer;
  };
  if (str("format", true) != kFormat) throw bad("not an mt checkpoint (\"format\" differs)");
  Metadata md;
  md.version = integer(j.find("version"), "version");
  if (md.version > kFormatVersion)
    throw bad("written by a newer mt (format version " + std::to_string(md.version) +
              "; this build reads up to " + std::to_string(kFormatVersion) + ")");
  md.step = integer(j.find("step"), "step");
  std::string checksum = str("checksum", true);
  if (checksum != "crc32c") throw bad("unknown checksum \"" + checksum + "\"");
  const json::Value* files = j.find("files");
  if (!files || !files->is_object()) throw bad("missing \"files\" object");
  for (const auto& member : files->members) {
    // Named, not a structured binding: clang before 16 cannot capture those in a lambda.
    const std::string& name = member.first;
    const json::Value& rec = member.second;
    // Only our own file names: a path from the metadata must never leave the step directory.
    if (std::find_if(std::begin(kFileNames), std::end(kFileNames),
                     [&](const char* k) { return name == k; }) == std::end(kFileNames))
      throw bad("unexpected file name \"" + name + "\"");
    FileRecord fr;
    fr.name = name;
    int64_t sz = integer(rec.find("size"), name + ".size");
    if (sz < 0) throw bad("negative size for " + name);
    fr.size = static_cast<uint64_t>(sz);
    const json::Value* crc = rec.find("crc32c");
    if (!crc || !crc->is_string() || crc->str.size() != 8)
      throw bad("missing or malformed crc32c for " + name);
    auto r = std::from_chars(crc->str.data(), crc->str.data() + 8, fr.crc, 16);
    if (r.ec != std::errc() || r.ptr != crc->str.data() + 8)
      throw bad("malformed crc32c for " + name);
    md.files.push_back(std::move(fr));
  }
  if (!md.file(kFileNames[0])) throw bad("no params.safetensors recorded");
  if ((md.file(kFileNames[1]) != nullptr) != (md.file(kFileNames[2]) != nullptr))
    throw bad("only one of opt_m and opt_v is recorded");
  md.data_state = str("data_state", false);
  md.rng_state = str("rng_state", false);
  md.config_yaml = str("config_yaml", false);
  const json::Value* complete = j.find("complete");
  md.complete = complete && complete->kind == json::Value::Kind::boolean && complete->boolean;
  return md;
}

// ---- directory listing ----------------------------------------------------------------------
// "123" -> 123; anything else (".tmp-" names, other files, overflow) -> nullopt.
std::optional<int64_t> parse_step(std::string_view name) {
  if (name.empty() || name.size() > 18) return std::nullopt;
  int64_t v = 0;
  auto r = std::from_chars(name.data(), name.data() + name.size(), v);
  if (r.ec != std::errc() || r.ptr != name.data() + name.size() || v < 0) return std::nullopt;
  if (std::to_string(v) != name) return std::nullopt;  // "007" is not ours
  return v;
}

// "" when complete, with every recorded file present at the recorded size; else why not. No
// checksums (fast).
std::string why_incomplete(const fs::path& step_dir, int64_t step) {
  try {
    Metadata md = read_metadata(step_dir);
    if (!md.complete) return quoted(step_dir / kMetadataName) + " does not say \"complete\": true";
    if (md.step != step)
      return quoted(step_dir / kMetadataName) + " records step " + std::to_string(md.step);
    for (const auto& f : md.files) {
      std::error_code ec;
      uintmax_t sz = fs::file_size(step_dir / f.name, ec);
      if (ec) return quoted(step_dir / f.name) + " cannot be read: " + ec.message();
      if (sz != f.size)
        return quoted(step_dir / f.name) + " is " + std::to_string(sz) +
               " bytes but the metadata records " + std::to_string(f.size) + " (truncated?)";
    }
    return {};
  } catch (const std::exception& e) {
    std::string why = e.what();
    return why.empty() ? "unreadable metadata" : why;
  }
}

// Entries of `dir` (none when it cannot be listed). Collected first, so that callers may delete
// while they walk, and a concurrent change cannot end the listing with an exception.
std::vector<fs::directory_entry> entries(const fs::path& dir) {
  std::vector<fs::directory_entry> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) out.push_back(*it);
  return out;
}

std::vector<int64_t> list_complete_steps(const fs::path& dir) {
  std::vector<int64_t> steps;
  for (const auto& e : entries(dir)) {
    std::error_code ec;
    if (!e.is_directory(ec)) continue;
    auto step = parse_step(e.path().filename().string());
    if (step && why_incomplete(e.path(), *step).empty()) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

// Removes "<step>.tmp-<pid>" and "<step>.old-<pid>" directories left by crashed processes (and
// by earlier failed saves of this one, which never has two writes in flight). Another live
// process's directories are left alone. Best effort: a leftover is harmless to readers.
void remove_stale(const fs::path& dir) {
  for (const auto& e : entries(dir)) {
    std::string name = e.path().filename().string();
    size_t dot = name.find('.');
    if (dot == std::string::npos || !parse_step(name.substr(0, dot))) continue;
    std::string_view rest = std::string_view(name).substr(dot);
    if (rest.substr(0, 5) != ".tmp-" && rest.substr(0, 5) != ".old-") continue;
    long pid = 0;
    std::string_view num = rest.substr(5);
    auto r = std::from_chars(num.data(), num.data() + num.size(), pid);
    if (r.ec != std::errc() || r.ptr != num.data() + num.size() || pid <= 0) continue;
    bool dead = ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
    std::error_code ec;
    if (pid == ::getpid() || dead) fs::remove_all(e.path(), ec);
  }
}

// Moves the finished `tmp` directory to `final`, atomically replacing an existing one.
void publish(const fs::path& tmp, const fs::path& final_dir, const fs::path& old) {
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_NOREPLACE) == 0)
    return;
  if (errno == EEXIST || errno == ENOTEMPTY) {
    // The step exists (a resumed run saving the same step again): swap, then drop the old one,
    // which now sits at `tmp`. There is never a moment without a complete <step>.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
      return;
    }
  }
  if (errno != EINVAL && errno != ENOSYS) errno_error("cannot rename to", final_dir);
  // The file system lacks renameat2's flags: two renames, the old one kept until the new one is
  // in place.
  std::error_code ec;
  bool existed = fs::exists(final_dir, ec);
  if (existed && ::rename(final_dir.c_str(), old.c_str()) != 0)
    errno_error("cannot move aside", final_dir);
  if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    int err = errno;
    if (existed) ::rename(old.c_str(), final_dir.c_str());
    errno = err;
    errno_error("cannot rename to", final_dir);
  }
  if (existed) fs::remove_all(old, ec);
}

// Deletes a checkpoint: renamed away first, so a crash mid-way leaves no half-deleted <step>.
void delete_checkpoint(const fs::path& dir, int64_t step) {
  fs::path from = dir / std::to_string(step);
  fs::path to = dir / (std::to_string(step) + ".old-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(to, ec);
  if (::rename(from.c_str(), to.c_str()) != 0) errno_error("cannot delete old checkpoint", from);
  fs::remove_all(to, ec);
  if (ec) throw Error("cannot delete old checkpoint " + quoted(to) + ": " + ec.message());
}

// Fault injection for crash tests (the kill -9 of issue 6): MT_CHECKPOINT_CRASH=<point> ends
// the process at once, as SIGKILL would, when a save reaches that point.
void crash_point(const char* point) {
  const char* want = std::getenv("MT_CHECKPOINT_CRASH");
  if (want && std::strcmp(want, point) == 0) {
    std::fprintf(stderr, "mt: MT_CHECKPOINT_CRASH=%s: exiting mid-save\n", point);
    ::_exit(137);
  }
}

// ---- restoring ------------------------------------------------------------------------------
std::string name_list(const std::vector<std::string>& names) {
  std::string s;
  size_t shown = std::min<size_t>(names.size(), 12);
  for (size_t i = 0; i < shown; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > shown) s += " and " + std::to_string(names.size() - shown) + " more";
  return s;
}

// Every problem between `file` and the tensors expected of it, or "" when they match.
std::string match_problems(const SafeTensorsFile& file, const std::map<std::string, Tensor>& want) {
  std::vector<std::string> missing, extra, problems;
  for (const auto& [name, t] : want) {
    if (!file.contains(name)) {
      missing.push_back(name);
      continue;
    }
    const SafeTensorInfo& info = file.info(name);
    if (info.shape != t.shape())
      problems.push_back("tensor '" + name + "' has shape " + shape_str(info.shape) +
                         " in the file but " + shape_str(t.shape()) + " in the model");
    auto dt = dtype_from_safetensors(info.dtype);
    if (!dt || is_float(*dt) != is_float(t.dtype()))
      problems.push_back("tensor '" + name + "' is stored as " + info.dtype +
                         ", which cannot be converted to " + dtype_name(t.dtype()));
  }
  for (const auto& name : file.names())
    if (!want.count(name)) extra.push_back(name);
  std::string msg;
  auto add = [&](const std::string& s) { msg += (msg.empty() ? "" : "; ") + s; };
  if (!missing.empty())
    add("missing tensors (the model has them, the file does not): " + name_list(missing));
  if (!extra.empty())
    add("unexpected tensors (the file has them, the model does not): " + name_list(extra));
  for (const auto& p : problems) add(p);
  return msg;
}

// " The previous complete checkpoint is step N ..." for the checkpoint directory above
// `step_dir`, or "" when there is none.
std::string previous_hint(const fs::path& step_dir, int64_t step) {
  std::vector<int64_t> steps = list_complete_steps(step_dir.parent_path());
  int64_t prev = -1;
  for (int64_t s : steps)
    if (s < step) prev = s;
  if (prev < 0) return " There is no earlier complete checkpoint in that directory.";
  return " The previous complete checkpoint is step " + std::to_string(prev) + " (" +
         quoted(step_dir.parent_path() / std::to_string(prev)) +
         "); move or delete the corrupt one to resume from it.";
}

// Verifies and loads the files of one step directory into `targets[i]` (null: not read).
// Everything is checked before any tensor is written, so a bad checkpoint leaves the targets as
// they were.
Metadata load_step(fs::path step_dir, std::map<std::string, Tensor>* const targets[3]) {
  if (step_dir.filename().empty()) step_dir = step_dir.parent_path();  // ".../5/"
  auto step = parse_step(step_dir.filename().string());
  int64_t step_num = step ? *step : -1;
  auto corrupt = [&](const std::string& what) {
    return Error("Checkpoint " + quoted(step_dir) + " (step " + std::to_string(step_num) +
                 ") is corrupt: " + what + "." + previous_hint(step_dir, step_num));
  };
  Metadata md;
  try {
    md = read_metadata(step_dir);
  } catch (const Error& e) {
    throw corrupt(e.what());
  }
  if (!step) step_num = md.step;
  if (!md.complete)
    throw corrupt(quoted(step_dir / kMetadataName) +
                  " does not say \"complete\": true (an interrupted save?)");
  if (step && md.step != *step)
    throw corrupt(quoted(step_dir / kMetadataName) + " records step " + std::to_string(md.step));

  std::vector<std::pair<SafeTensorsFile, int>> open;
  for (int i = 0; i < 3; ++i) {
    if (!targets[i]) continue;
    const FileRecord* rec = md.file(kFileNames[i]);
    if (!rec) {
      throw Error("Checkpoint " + quoted(step_dir) +
                  " is parameter-only: it holds no optimizer moments (" + kFileNames[i] +
                  "), but the train state asks for them. Load it with load_parameters_path "
                  "instead to start a fresh optimizer.");
    }
    fs::path p = step_dir / rec->name;
    std::error_code ec;
    uintmax_t size = fs::file_size(p, ec);
    if (ec) throw corrupt(quoted(p) + " cannot be read: " + ec.message());
    if (size != rec->size)
      throw corrupt(quoted(p) + " is " + std::to_string(size) + " bytes but the metadata records " +
                    std::to_string(rec->size) + " (truncated or overwritten)");
    uint32_t crc = crc32c_file(p);
    if (crc != rec->crc)
      throw corrupt(quoted(p) + " has CRC-32C " + crc_hex(crc) + " but the metadata records " +
                    crc_hex(rec->crc) + " (the file's bytes changed after it was written)");
    open.emplace_back(SafeTensorsFile(p), i);
  }
  for (const auto& [file, i] : open) {
    std::string problems = match_problems(file, *targets[i]);
    if (!problems.empty())
      throw UsageError("Checkpoint file " + quoted(file.path()) + " does not match the model: " +
                       problems + ". Was it written with a different model config?");
  }
  for (const auto& [file, i] : open)
    for (auto& [name, t] : *targets[i]) load_into(file, name, t);
  return md;
}

// restore()'s targets: the moments only when the state holds them.
void restore_into(const fs::path& step_dir, TrainState& state) {
  std::map<std::string, Tensor>* targets[3] = {&state.params, nullptr, nullptr};
  if (!state.opt_m.empty() || !state.opt_v.empty()) {
    targets[1] = &state.opt_m;
    targets[2] = &state.opt_v;
  }
  Metadata md = load_step(step_dir, targets);
  state.step = md.step;
  state.data_state = std::move(md.data_state);
  state.rng_state = std::move(md.rng_state);
  state.config_yaml = std::move(md.config_yaml);
}

// A step directory (holding metadata.json) as is; a checkpoints directory, or a run directory
// holding checkpoints/, by its latest complete step. `key` names the setting in errors.
fs::path resolve_step_dir(const fs::path& path, const char* key) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    throw Error(std::string(key) + " " + quoted(path) + " does not exist or is not a directory.");
  if (fs::exists(path / kMetadataName, ec)) return path;
  fs::path ckpts = path;
  if (fs::is_directory(path / "checkpoints", ec)) ckpts = path / "checkpoints";
  std::vector<int64_t> steps = list_complete_steps(ckpts);
  if (steps.empty())
    throw Error(std::string(key) + " " + quoted(path) +
                " holds no complete checkpoint (expected <step>/metadata.json, or a "
                "checkpoints/ directory of them).");
  return ckpts / std::to_string(steps.back());
}

}  // namespace

// ---- public ---------------------------------------------------------------------------------
uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (cpu_has_sse42()) return ~crc32c_hw(~crc, p, n);
#endif
  return ~crc32c_sw(~crc, p, n);
}

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t n) {
  return ~crc32c_sw(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_file(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) errno_error("cannot open", path);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  constexpr size_t kChunk = size_t{4} << 20;
  auto buf = std::make_unique_for_overwrite<unsigned char[]>(kChunk);
  uint32_t crc = 0;
  while (true) {
    ssize_t r = ::read(fd, buf.get(), kChunk);
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      errno = err;
      errno_error("cannot read", path);
    }
    if (r == 0) break;
    crc = crc32c(crc, buf.get(), static_cast<size_t>(r));
  }
  ::close(fd);
  return crc;
}

CheckpointManager::CheckpointManager(fs::path checkpoint_dir, bool async, int max_to_keep,
                                     Backend& backend)
    : dir_(std::move(checkpoint_dir)),
      async_(async),
      max_to_keep_(std::max(0, max_to_keep)),
      backend_(backend) {}

CheckpointManager::~CheckpointManager() {
  join_worker();
  if (pending_error_)
    std::fprintf(stderr, "mt: a checkpoint save failed and was never reported: %s\n",
                 pending_error_->c_str());
}

void CheckpointManager::join_worker() noexcept {
  if (worker_.joinable()) worker_.join();
  snapshot_.reset();
}

void CheckpointManager::rethrow_pending() {
  if (!pending_error_) return;
  std::string msg = std::move(*pending_error_);
  pending_error_.reset();
  throw Error(msg);
}

void CheckpointManager::wait() {
  join_worker();
  rethrow_pending();
}

std::vector<int64_t> CheckpointManager::complete_steps() const {
  return list_complete_steps(dir_);
}

std::vector<std::string> CheckpointManager::skipped_newer_steps() const {
  const int64_t latest = latest_step();
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& e : entries(dir_)) {
    std::error_code ec;
    if (!e.is_directory(ec)) continue;
    auto step = parse_step(e.path().filename().string());
    if (!step || *step <= latest) continue;
    std::string why = why_incomplete(e.path(), *step);
    if (!why.empty())
      found.emplace_back(*step, "checkpoint step " + std::to_string(*step) + " in " + quoted(dir_) +
                                    " is skipped: " + why);
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [step, msg] : found) out.push_back(std::move(msg));
  return out;
}

int64_t CheckpointManager::latest_step() const {
  std::vector<int64_t> steps = complete_steps();
  return steps.empty() ? -1 : steps.back();
}

void CheckpointManager::save(const TrainState& state) {
  Clock::time_point t0 = Clock::now();
  wait();
  if (state.step < 0)
    throw Error("cannot save a checkpoint for negative step " + std::to_string(state.step));
  if (state.opt_m.empty() != state.opt_v.empty())
    throw Error("cannot save a checkpoint with only one of the Adam moments (opt_m has " +
                std::to_string(state.opt_m.size()) + " tensors, opt_v " +
                std::to_string(state.opt_v.size()) + ")");
  const std::map<std::string, Tensor>* maps[3] = {&state.params, &state.opt_m, &state.opt_v};
  for (const auto* m : maps)
    for (const auto& [name, t] : *m)
      if (!t.defined()) throw Error("cannot save a checkpoint: tensor '" + name + "' is undefined");

  auto snap = std::make_unique<Snapshot>();
  snap->step = state.step;
  snap->has_opt = !state.opt_m.empty();
  snap->data_state = state.data_state;
  snap->rng_state = state.rng_state;
  snap->config_yaml = state.config_yaml;
  // Kernels may still be writing the tensors on an asynchronous device.
  backend_.synchronize();
  if (!async_) {
    for (int i = 0; i < 3; ++i)
      for (const auto& [name, t] : *maps[i]) snap->live[i].emplace_back(name, t);
    try {
      write(*snap, true);
    } catch (...) {
      last_blocking_s_ = seconds_since(t0);
      total_blocking_s_ += last_blocking_s_;
      throw;
    }
  } else {
    // The copy blocks training: a terminal shows its progress when it lasts (a large model).
    double total = 0;
    for (const auto* m : maps)
      for (const auto& [name, t] : *m) total += static_cast<double>(t.nbytes());
    Progress shown("checkpoint of step " + std::to_string(state.step) + ": copying to host memory",
                   total, "B", true);
    size_t k = 0;
    for (int i = 0; i < 3; ++i) {
      for (const auto& [name, t] : *maps[i]) {
        size_t n = t.nbytes();
        shown.add(static_cast<double>(n));
        if (k == buffers_.size()) buffers_.emplace_back();
        HostBuffer& b = buffers_[k++];
        if (b.size != n || !b.data) {
          b.data = std::make_unique_for_overwrite<std::byte[]>(std::max<size_t>(n, 1));
          b.size = n;
        }
        if (n > 0) t.backend()->copy_to_host(t, b.data.get());
        snap->host[i].emplace_back(name, t.dtype(), t.shape(), b.data.get());
      }
    }
    buffers_.resize(k);  // a smaller state than last time: release the rest
    snapshot_ = std::move(snap);
    try {
      worker_ = std::thread([this] {
        try {
          write(*snapshot_, false);
        } catch (const std::exception& e) {
          pending_error_ = e.what();
        } catch (...) {
          pending_error_ = "checkpoint save of step " + std::to_string(snapshot_->step) +
                           " failed with an unknown exception";
        }
      });
    } catch (const std::system_error&) {
      // No thread to be had: write in the caller instead of losing the checkpoint.
      write(*snapshot_, false);
    }
  }
  last_blocking_s_ = seconds_since(t0);
  total_blocking_s_ += last_blocking_s_;
}

void CheckpointManager::write(const Snapshot& snap, bool live) {
  Clock::time_point t0 = Clock::now();
  const std::string step_name = std::to_string(snap.step);
  const std::string pid = std::to_string(::getpid());
  const fs::path final_dir = dir_ / step_name;
  const fs::path tmp = dir_ / (step_name + ".tmp-" + pid);
  try {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec)
      throw Error("cannot create the checkpoint directory " + quoted(dir_) + ": " + ec.message());
    remove_stale(dir_);
    if (::mkdir(tmp.c_str(), 0755) != 0) errno_error("cannot create", tmp);
    // From here on a failure removes everything this save wrote, and only that.
    struct TmpGuard {
      const fs::path& p;
      bool armed = true;
      ~TmpGuard() {
        std::error_code e;
        if (armed) fs::remove_all(p, e);
      }
    } guard{tmp};

    Metadata md;
    md.step = snap.step;
    md.data_state = snap.data_state;
    md.rng_state = snap.rng_state;
    md.config_yaml = snap.config_yaml;
    size_t bytes = 0;
    for (int i = 0; i < 3; ++i) {
      if (i > 0 && !snap.has_opt) break;
      fs::path p = tmp / kFileNames[i];
      // Both writers fsync the file and the directory before returning.
      if (live)
        save_tensors(p, snap.live[i]);
      else
        write_safetensors(p, snap.host[i]);
      FileRecord rec;
      rec.name = kFileNames[i];
      rec.size = fs::file_size(p);
      // Read back rather than computed while writing: it checks the bytes the file system holds
      // (from the page cache, so it costs a memory pass, not a disk read).
      rec.crc = crc32c_file(p);
      bytes += rec.size;
      md.files.push_back(std::move(rec));
      if (i == 0) crash_point("after_params");
    }
    md.complete = true;
    write_file_durable(tmp / kMetadataName, metadata_json(md));
    fsync_path(tmp, true);
    crash_point("before_rename");
    publish(tmp, final_dir, dir_ / (step_name + ".old-" + pid));
    guard.armed = false;
    fsync_path(dir_, true);
    last_write_bytes_ = bytes;
  } catch (const std::exception& e) {
    std::string cause = e.what();
    if (!cause.empty() && cause.back() == '.') cause.pop_back();
    throw Error("Saving checkpoint step " + step_name + " to " + quoted(final_dir) +
                " failed: " + cause + ". Existing checkpoints were not modified.");
  }

  if (max_to_keep_ > 0) {
    std::vector<int64_t> steps = list_complete_steps(dir_);
    // The step just written always stays, even when an older run left higher steps around.
    steps.erase(std::remove(steps.begin(), steps.end(), snap.step), steps.end());
    size_t keep_others = static_cast<size_t>(max_to_keep_ - 1);
    try {
      for (size_t i = 0; i + keep_others < steps.size(); ++i) delete_checkpoint(dir_, steps[i]);
      fsync_path(dir_, true);
    } catch (const std::exception& e) {
      throw Error("Checkpoint step " + step_name + " was saved to " + quoted(final_dir) +
                  ", but deleting older checkpoints (max_num_checkpoints_to_keep=" +
                  std::to_string(max_to_keep_) + ") failed: " + e.what());
    }
  }
  last_write_s_ = seconds_since(t0);
}

void CheckpointManager::restore(int64_t step, TrainState& state) {
  // A write in flight may be the step asked for; its error, if any, stays for wait().
  join_worker();
  fs::path step_dir = dir_ / std::to_string(step);
  std::error_code ec;
  if (!fs::is_directory(step_dir, ec))
    throw Error("There is no checkpoint for step " + std::to_string(step) + " in " + quoted(dir_) +
                ".");
  restore_into(step_dir, state);
}

void load_full_state(const fs::path& path, TrainState& state) {
  restore_into(resolve_step_dir(path, "load_full_state_path"), state);
}

void load_parameters(const fs::path& path, std::map<std::string, Tensor>& params) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    if (path.extension() != ".safetensors")
      throw Error("load_parameters_path " + quoted(path) +
                  " is a file but not a .safetensors file; give a checkpoint step directory, a "
                  "checkpoints directory or a .safetensors file.");
    SafeTensorsFile file(path);
    std::string problems = match_problems(file, params);
    if (!problems.empty())
      throw UsageError("Parameter file " + quoted(path) + " does not match the model: " + problems +
                       ". Was it written with a different model config?");
    for (auto& [name, t] : params) load_into(file, name, t);
    return;
  }
  std::map<std::string, Tensor>* targets[3] = {&params, nullptr, nullptr};
  load_step(resolve_step_dir(path, "load_parameters_path"), targets);
}

}  // namespace mt
