#include "checkpoint_manager.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string_view>
#include <system_error>
#include <tuple>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "file_util.h"
#include "json.h"
#include "mt/comm.h"
#include "mt/error.h"
#include "mt/version.h"
#include "progress.h"
#include "tensor_split.h"

namespace mt {
namespace {

// The worker's failure, kept for the caller: the message, or, when even copying it fails
// (out of memory), a short one that needs no allocation (an exception leaving the worker
// thread would be std::terminate).
void keep_error(std::optional<std::string>& slot, const char* what) noexcept {
  try {
    slot = what;
  } catch (...) {
    slot.emplace("out of memory");  // short: no allocation
  }
}

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kFormat = "mt-checkpoint";
// Version 1: whole tensors, one file per group. Version 2: sharded (the ranks' parts).
constexpr int64_t kFormatVersion = 2;
constexpr const char* kMetadataName = "metadata.json";
// Index i of TrainState's maps (params, opt_m, opt_v) is stored in file kFileNames[i].
constexpr const char* kFileNames[3] = {"params.safetensors", "opt_m.safetensors",
                                       "opt_v.safetensors"};
// Version 2: group i of rank r of N is in "<kGroupNames[i]>.<r>-of-<N>.safetensors".
constexpr const char* kGroupNames[3] = {"params", "opt_m", "opt_v"};
// More ranks than any job has; bounds what a hostile metadata file can make a reader allocate.
constexpr int64_t kMaxShards = int64_t{1} << 24;
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

// ---- sharded layout -------------------------------------------------------------------------
// Version 2: the elements [begin, end) of a tensor's part `part` (flattened), in the file of
// rank `rank`.
struct Piece {
  int rank = 0, part = 0;
  int64_t begin = 0, end = 0;
};

// A tensor as a checkpoint holds it: its whole shape and dtype, its tensor-parallel split
// (TensorPart's geometry) and the pieces that tile its parts.
struct StoredTensor {
  Shape shape;
  std::string dtype;  // safetensors string
  int dim = -1, parts = 1;
  std::vector<Piece> pieces;
};

using Layout = std::map<std::string, StoredTensor>;

std::string shard_file_name(int group, int64_t rank, int64_t shards) {
  return std::string(kGroupNames[group]) + "." + std::to_string(rank) + "-of-" +
         std::to_string(shards) + ".safetensors";
}

// "" when `t`'s geometry is sound and its pieces (in files of ranks below `shards`) tile each
// of its parts exactly once; else what is wrong.
std::string tiling_problem(const StoredTensor& t, int64_t shards) {
  int64_t n = 1;
  for (int64_t d : t.shape) {
    if (d < 0) return "a negative dimension";
    if (d > 0 && n > (int64_t{1} << 53) / d) return "more elements than any tensor has";
    n *= d;
  }
  if (t.parts < 1) return "parts below 1";
  if (t.parts > 1) {
    if (t.dim < 0 || static_cast<size_t>(t.dim) >= t.shape.size())
      return "split along dimension " + std::to_string(t.dim) + " of a " +
             std::to_string(t.shape.size()) + "-D tensor";
    if (t.shape[static_cast<size_t>(t.dim)] % t.parts != 0)
      return "dimension " + std::to_string(t.dim) + " not divisible into " +
             std::to_string(t.parts) + " parts";
  }
  const int64_t part_numel = n / t.parts;
  std::vector<Piece> ps = t.pieces;
  std::sort(ps.begin(), ps.end(), [](const Piece& a, const Piece& b) {
    return a.part != b.part ? a.part < b.part : a.begin < b.begin;
  });
  int part = 0;
  int64_t next = 0;  // the first element of `part` no piece has covered yet
  for (const Piece& p : ps) {
    if (p.rank < 0 || p.rank >= shards)
      return "a piece in the file of rank " + std::to_string(p.rank);
    if (p.part < 0 || p.part >= t.parts) return "a piece of part " + std::to_string(p.part);
    if (p.begin >= p.end || p.end > part_numel) return "a piece outside its part";
    while (part < p.part) {
      if (next != part_numel) return "part " + std::to_string(part) + " not covered";
      ++part;
      next = 0;
    }
    if (p.begin != next)
      return "part " + std::to_string(part) + (p.begin < next ? " covered twice" : " has a gap");
    next = p.end;
  }
  for (; part < t.parts; ++part, next = 0)
    if (next != part_numel && part_numel > 0)
      return "part " + std::to_string(part) + " not covered";
  return {};
}

// "123" -> 123; anything else (".tmp-" names, other files, overflow) -> nullopt.
std::optional<int64_t> parse_step(std::string_view name) {
  if (name.empty() || name.size() > 18) return std::nullopt;
  int64_t v = 0;
  auto r = std::from_chars(name.data(), name.data() + name.size(), v);
  if (r.ec != std::errc() || r.ptr != name.data() + name.size() || v < 0) return std::nullopt;
  if (std::to_string(v) != name) return std::nullopt;  // "007" is not ours
  return v;
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
  // Version 2: the ranks that wrote, and each group's tensors (has[i]: group i is present).
  int64_t shards = 0;
  Layout tensors[3];
  bool has[3] = {};

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
  o += "\n  }";
  if (md.shards > 0) {
    o += ",\n  \"shards\": " + std::to_string(md.shards) + ",\n  \"tensors\": {";
    bool first_group = true;
    for (int g = 0; g < 3; ++g) {
      if (!md.has[g]) continue;
      o += first_group ? "\n    " : ",\n    ";
      first_group = false;
      o += json::quote(kGroupNames[g]) + ": {";
      bool first = true;
      for (const auto& [name, t] : md.tensors[g]) {
        o += first ? "\n      " : ",\n      ";
        first = false;
        o += json::quote(name) + ": {\"shape\": [";
        for (size_t d = 0; d < t.shape.size(); ++d)
          o += (d ? ", " : "") + std::to_string(t.shape[d]);
        o += "], \"dtype\": " + json::quote(t.dtype) + ", \"dim\": " + std::to_string(t.dim) +
             ", \"parts\": " + std::to_string(t.parts) + ", \"pieces\": [";
        for (size_t i = 0; i < t.pieces.size(); ++i) {
          const Piece& p = t.pieces[i];
          o += (i ? ", [" : "[") + std::to_string(p.rank) + ", " + std::to_string(p.part) + ", " +
               std::to_string(p.begin) + ", " + std::to_string(p.end) + "]";
        }
        o += "]}";
      }
      o += "\n    }";
    }
    o += "\n  }";
  }
  o += ",\n  \"data_state\": " + json::quote(md.data_state);
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
  if (const json::Value* shards = j.find("shards")) {
    md.shards = integer(shards, "shards");
    if (md.shards < 1 || md.shards > kMaxShards)
      throw bad("\"shards\" is " + std::to_string(md.shards));
  }
  const json::Value* files = j.find("files");
  if (!files || !files->is_object()) throw bad("missing \"files\" object");
  for (const auto& member : files->members) {
    // Named, not a structured binding: clang before 16 cannot capture those in a lambda.
    const std::string& name = member.first;
    const json::Value& rec = member.second;
    // Only our own file names: a path from the metadata must never leave the step directory.
    bool ours = false;
    if (md.shards == 0) {
      ours = std::find_if(std::begin(kFileNames), std::end(kFileNames),
                          [&](const char* k) { return name == k; }) != std::end(kFileNames);
    } else {  // "<group>.<r>-of-<N>.safetensors", r < N = shards
      const size_t dot = name.find('.'), of = name.find("-of-");
      if (dot != std::string::npos && of != std::string::npos && of > dot) {
        const auto r = parse_step(std::string_view(name).substr(dot + 1, of - dot - 1));
        for (int g = 0; g < 3 && r && !ours; ++g)
          ours = *r < md.shards && name == shard_file_name(g, *r, md.shards);
      }
    }
    if (!ours) throw bad("unexpected file name \"" + name + "\"");
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
  if (md.shards == 0) {
    if (!md.file(kFileNames[0])) throw bad("no params.safetensors recorded");
    if ((md.file(kFileNames[1]) != nullptr) != (md.file(kFileNames[2]) != nullptr))
      throw bad("only one of opt_m and opt_v is recorded");
  } else {
    const json::Value* tensors = j.find("tensors");
    if (!tensors || !tensors->is_object()) throw bad("missing \"tensors\" object");
    for (const auto& group : tensors->members) {
      const auto* g = std::find_if(std::begin(kGroupNames), std::end(kGroupNames),
                                   [&](const char* k) { return group.first == k; });
      if (g == std::end(kGroupNames)) throw bad("unexpected group \"" + group.first + "\"");
      const auto gi = static_cast<int>(g - std::begin(kGroupNames));
      if (!group.second.is_object()) throw bad("\"" + group.first + "\" is not an object");
      md.has[gi] = true;
      for (const auto& member : group.second.members) {
        const std::string& name = member.first;
        const json::Value& v = member.second;
        const std::string where = group.first + "." + name;
        StoredTensor t;
        const json::Value* shape = v.find("shape");
        if (!shape || !shape->is_array()) throw bad("missing shape for " + where);
        for (const auto& d : shape->items) t.shape.push_back(integer(&d, where + ".shape"));
        const json::Value* dt = v.find("dtype");
        if (!dt || !dt->is_string() || !dtype_from_safetensors(dt->str) ||
            !is_float(*dtype_from_safetensors(dt->str)))
          throw bad("missing or non-floating dtype for " + where);
        t.dtype = dt->str;
        const int64_t dim = integer(v.find("dim"), where + ".dim"),
                      parts = integer(v.find("parts"), where + ".parts");
        if (dim < -1 || dim > 64 || parts < 1 || parts > kMaxShards)
          throw bad("implausible split of " + where);
        t.dim = static_cast<int>(dim);
        t.parts = static_cast<int>(parts);
        const json::Value* pieces = v.find("pieces");
        if (!pieces || !pieces->is_array()) throw bad("missing pieces for " + where);
        for (const auto& pv : pieces->items) {
          if (!pv.is_array() || pv.items.size() != 4) throw bad("malformed piece of " + where);
          Piece p;
          const int64_t r = integer(&pv.items[0], where + ".pieces"),
                        part = integer(&pv.items[1], where + ".pieces");
          if (r < 0 || r >= md.shards || part < 0 || part >= t.parts)
            throw bad("a piece of " + where + " names rank " + std::to_string(r) + " part " +
                      std::to_string(part));
          p.rank = static_cast<int>(r);
          p.part = static_cast<int>(part);
          p.begin = integer(&pv.items[2], where + ".pieces");
          p.end = integer(&pv.items[3], where + ".pieces");
          if (!md.file(shard_file_name(gi, r, md.shards)))
            throw bad("a piece of " + where + " is in " + shard_file_name(gi, r, md.shards) +
                      ", which \"files\" does not list");
          t.pieces.push_back(p);
        }
        const std::string problem = tiling_problem(t, md.shards);
        if (!problem.empty()) throw bad("the pieces of " + where + ": " + problem);
        md.tensors[gi].emplace(name, std::move(t));
      }
    }
    if (!md.has[0]) throw bad("no params recorded in \"tensors\"");
    if (md.has[1] != md.has[2]) throw bad("only one of opt_m and opt_v is recorded");
  }
  md.data_state = str("data_state", false);
  md.rng_state = str("rng_state", false);
  md.config_yaml = str("config_yaml", false);
  const json::Value* complete = j.find("complete");
  md.complete = complete && complete->kind == json::Value::Kind::boolean && complete->boolean;
  return md;
}

// ---- directory listing ----------------------------------------------------------------------
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
// process's directories are left alone, unless `exclusive` (the caller holds the run's lock, so
// no other process writes here: a leftover whose pid now names an unrelated process, after a
// reboot or pid reuse, is stale too, and was kept forever). Best effort: a leftover is harmless
// to readers.
void remove_stale(const fs::path& dir, bool exclusive) {
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
    if (exclusive || pid == ::getpid() || dead) fs::remove_all(e.path(), ec);
  }
}

// Creates the checkpoint directory `dir` if needed, removes dead processes' leftovers from it and
// makes a save's temporary directory `tmp` in it.
void make_tmp_dir(const fs::path& dir, const fs::path& tmp, bool exclusive) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error("cannot create the checkpoint directory " + quoted(dir) + ": " + ec.message());
  remove_stale(dir, exclusive);
  if (::mkdir(tmp.c_str(), 0755) != 0) errno_error("cannot create", tmp);
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

// Where a restore reads its tensors: the files of a step directory whose metadata `md` says
// where each piece is (version 2) or which holds whole tensors (version 1), or a bare
// .safetensors file (`md` null: no checksums). Files are opened at their first use, after
// their size and checksum are verified.
class PartSource {
 public:
  using Corrupt = std::function<Error(const std::string&)>;
  PartSource(fs::path dir, const Metadata* md, std::string bare, Corrupt corrupt)
      : dir_(std::move(dir)), md_(md), bare_(std::move(bare)), corrupt_(std::move(corrupt)) {}

  bool sharded() const { return md_ && md_->shards > 0; }
  const Metadata* metadata() const { return md_; }
  bool has(int g) const {
    if (!md_) return g == 0;
    return sharded() ? md_->has[g] : md_->file(kFileNames[g]) != nullptr;
  }
  // Group g's tensors; version 1 and bare files: each whole, from the file's header.
  const Layout& layout(int g) {
    if (sharded()) return md_->tensors[g];
    Layout& l = whole_[g];
    if (l.empty())
      for (const auto& name : file(whole_file(g)).names()) {
        const SafeTensorInfo& info = file(whole_file(g)).info(name);
        StoredTensor t{info.shape, info.dtype, -1, 1, {}};
        if (info.numel() > 0) t.pieces.push_back({0, 0, 0, info.numel()});
        l.emplace(name, std::move(t));
      }
    return l;
  }
  std::string file_name(int g, const Piece& p) const {
    return sharded() ? shard_file_name(g, p.rank, md_->shards) : whole_file(g);
  }
  std::string file_path(int g) const { return (dir_ / whole_file(g)).string(); }
  const SafeTensorsFile& file(const std::string& name) {
    if (auto it = open_.find(name); it != open_.end()) return it->second;
    const fs::path p = dir_ / name;
    if (md_) {
      const FileRecord* rec = md_->file(name);
      std::error_code ec;
      const uintmax_t size = fs::file_size(p, ec);
      if (ec) throw corrupt_(quoted(p) + " cannot be read: " + ec.message());
      if (size != rec->size)
        throw corrupt_(quoted(p) + " is " + std::to_string(size) +
                       " bytes but the metadata records " + std::to_string(rec->size) +
                       " (truncated or overwritten)");
      const uint32_t crc = crc32c_file(p);
      if (crc != rec->crc)
        throw corrupt_(quoted(p) + " has CRC-32C " + crc_hex(crc) + " but the metadata records " +
                       crc_hex(rec->crc) + " (the file's bytes changed after it was written)");
    }
    return open_.emplace(name, SafeTensorsFile(p)).first->second;
  }
  Error corrupt(const std::string& what) const { return corrupt_(what); }

 private:
  std::string whole_file(int g) const { return md_ ? kFileNames[g] : bare_; }

  fs::path dir_;
  const Metadata* md_;
  std::string bare_;
  Corrupt corrupt_;
  Layout whole_[3];
  std::map<std::string, SafeTensorsFile> open_;
};

// The end of a "does not match the model" message: the model the checkpoint's run had (its
// metadata's config), and how to ask for it.
std::string written_with(const Metadata* md) {
  const std::string fallback = "Was it written with a different model config?";
  if (!md || md->config_yaml.empty()) return fallback;
  YAML::Node saved;
  try {
    saved = YAML::Load(md->config_yaml);
  } catch (const YAML::Exception&) {
    return fallback;
  }
  if (!saved.IsMap()) return fallback;
  auto scalar = [&](const char* key) {
    const YAML::Node n = saved[key];
    return n && n.IsScalar() ? n.Scalar() : std::string();
  };
  const std::string model = scalar("model_name");
  const std::string block = scalar("decoder_block");
  if (!model.empty())
    return "It was written by a run of model_name=" + model + " (decoder_block " + block +
           "): give --model=" + model +
           " with the run's model settings, or leave the model out (mt decode, mt score and mt "
           "convert --to=hf then take the checkpoint's).";
  if (!block.empty())
    return "It was written by a run of decoder_block=" + block +
           " with no named model: give that run's model settings (its config.yml), or leave the "
           "model out (mt decode, mt score and mt convert --to=hf then take the checkpoint's).";
  return fallback;
}

// Fills the parts in `targets[g]` (null: group g is not read) from `src`. Every name, shape,
// file and piece is checked before the first tensor is written, so a checkpoint that does not
// fit leaves the targets as they were. A part whose tensor-parallel split is the stored one
// reads only the pieces that overlap it; another split assembles the whole tensor on the host
// (one tensor at a time) and cuts the part from it. Names in `elsewhere` are the caller's to
// read by other reads of the same source: present in the checkpoint, they are not unexpected.
void read_parts(PartSource& src, const fs::path& where,
                std::map<std::string, TensorPart>* const targets[3],
                const std::set<std::string>* elsewhere = nullptr) {
  struct Read {
    TensorPart* want;
    const StoredTensor* stored;
    bool direct;  // the same split: the overlapping pieces straight into the part
    std::vector<std::pair<const Piece*, const SafeTensorInfo*>> pieces;
  };
  std::vector<Read> reads;
  for (int g = 0; g < 3; ++g) {
    if (!targets[g]) continue;
    if (!src.has(g))
      throw Error("Checkpoint " + quoted(where) +
                  " is parameter-only: it holds no optimizer moments (" + kGroupNames[g] +
                  "), but the train state asks for them. Load it with load_parameters_path "
                  "instead to start a fresh optimizer.");
    const Layout& layout = src.layout(g);
    std::vector<std::string> missing, extra, problems;
    for (auto& [name, want] : *targets[g]) {
      const auto it = layout.find(name);
      if (it == layout.end()) {
        missing.push_back(name);
        continue;
      }
      const StoredTensor& t = it->second;
      if (t.shape != want.shape) {
        problems.push_back("tensor '" + name + "' has shape " + shape_str(t.shape) +
                           " in the checkpoint but " + shape_str(want.shape) + " in the model");
        continue;
      }
      // Floating tensors of any width convert (F16 and F64 too, as the Hugging Face reader's).
      if (!safetensors_dtype_is_float(t.dtype) || !is_float(want.data.dtype())) {
        problems.push_back("tensor '" + name + "' is stored as " + t.dtype +
                           ", not a floating type that converts to " +
                           dtype_name(want.data.dtype()) + " (F16, BF16, F32 or F64)");
        continue;
      }
      MT_CHECK(want.end - want.begin == want.data.numel() && want.begin >= 0 &&
                   want.end * want.parts <= shape_numel(want.shape),
               "the part of '" + name + "' to restore is not a part of it");
      Read r{&want, &t, t.parts == want.parts && (t.parts == 1 || t.dim == want.dim), {}};
      for (const Piece& p : t.pieces) {
        if (r.direct && (p.part != want.part || p.end <= want.begin || p.begin >= want.end))
          continue;
        const std::string file = src.file_name(g, p);
        const SafeTensorsFile& f = src.file(file);
        if (!f.contains(name))
          throw src.corrupt(quoted(f.path()) + " lacks tensor '" + name +
                            "', which the metadata places there");
        const SafeTensorInfo& info = f.info(name);
        if (info.dtype != t.dtype || info.numel() != p.end - p.begin)
          throw src.corrupt(quoted(f.path()) + " holds tensor '" + name + "' as " + info.dtype +
                            " " + shape_str(info.shape) + ", not the " +
                            std::to_string(p.end - p.begin) + " " + t.dtype +
                            " elements the metadata records");
        r.pieces.emplace_back(&p, &info);
      }
      reads.push_back(std::move(r));
    }
    for (const auto& [name, t] : layout)
      if (!targets[g]->count(name) && !(elsewhere && elsewhere->count(name))) extra.push_back(name);
    std::string msg;
    auto add = [&](const std::string& s) { msg += (msg.empty() ? "" : "; ") + s; };
    if (!missing.empty())
      add("missing tensors (the model has them, the checkpoint does not): " + name_list(missing));
    if (!extra.empty())
      add("unexpected tensors (the checkpoint has them, the model does not): " + name_list(extra));
    // The first few shape or dtype differences: a model of another width differs in every
    // tensor, and one line of them all ran to kilobytes.
    // The model's own tensors (embeddings, final norm, head) first, then the layers'.
    std::stable_partition(problems.begin(), problems.end(), [](const std::string& p) {
      return p.find("'layers.") == std::string::npos && p.find("'mtp.") == std::string::npos;
    });
    constexpr size_t kShownProblems = 6;
    for (size_t i = 0; i < std::min(problems.size(), kShownProblems); ++i) add(problems[i]);
    if (problems.size() > kShownProblems)
      add("and " + std::to_string(problems.size() - kShownProblems) + " more tensors differ");
    // One file a group (version 1, a bare file): that file is named.
    if (!msg.empty())
      throw UsageError("Checkpoint " + quoted(src.sharded() ? where : fs::path(src.file_path(g))) +
                       " does not match the model's " +
                       (g == 0   ? "parameters"
                        : g == 1 ? "first moments"
                                 : "second moments") +
                       ": " + msg + ". " + written_with(src.metadata()));
  }

  for (const Read& r : reads) {
    const TensorPart& want = *r.want;
    const StoredTensor& t = *r.stored;
    const size_t elem = safetensors_dtype_size(t.dtype);
    const int64_t n = want.end - want.begin;
    if (n == 0) continue;
    Tensor dst = want.data;
    const bool same_dtype = dtype_from_safetensors(t.dtype) == dst.dtype();
    if (r.direct && same_dtype && r.pieces.size() == 1 && r.pieces[0].first->begin == want.begin &&
        r.pieces[0].first->end == want.end) {  // one piece is the part: straight from the file
      dst.backend()->copy_from_host(dst, r.pieces[0].second->data);
      release_pages(*r.pieces[0].second);
      continue;
    }
    std::vector<std::byte> buf(static_cast<size_t>(n) * elem);
    if (r.direct) {
      for (const auto& [p, info] : r.pieces) {
        const int64_t lo = std::max(p->begin, want.begin), hi = std::min(p->end, want.end);
        std::memcpy(buf.data() + (lo - want.begin) * elem, info->data + (lo - p->begin) * elem,
                    static_cast<size_t>(hi - lo) * elem);
      }
    } else {
      std::vector<std::byte> whole(static_cast<size_t>(shape_numel(t.shape)) * elem);
      const Split from = split_of(t.shape, t.dim, t.parts);
      // (Named, not a structured binding: clang before 16 cannot capture one in the lambda.)
      for (const auto& piece : r.pieces) {
        const auto& p = piece.first;
        const auto& info = piece.second;
        for_each_run(from, p->part, p->begin, p->end, [&](int64_t w, int64_t j, int64_t k) {
          std::memcpy(whole.data() + w * elem, info->data + (j - p->begin) * elem,
                      static_cast<size_t>(k) * elem);
        });
      }
      const Split to = split_of(want.shape, want.dim, want.parts);
      for_each_run(to, want.part, want.begin, want.end, [&](int64_t w, int64_t j, int64_t k) {
        std::memcpy(buf.data() + (j - want.begin) * elem, whole.data() + w * elem,
                    static_cast<size_t>(k) * elem);
      });
    }
    for (const auto& piece : r.pieces) release_pages(*piece.second);
    if (same_dtype) {
      dst.backend()->copy_from_host(dst, buf.data());
    } else {
      std::vector<std::byte> converted(dst.nbytes());
      convert_float_elements(t.dtype, buf.data(), dst.dtype(), converted.data(),
                             static_cast<size_t>(n));
      dst.backend()->copy_from_host(dst, converted.data());
    }
  }
}

// The metadata of a step directory, checked to be complete and of its step; errors name the
// directory as corrupt and the previous complete step.
struct StepDir {
  fs::path dir;
  int64_t step = -1;
  Metadata md;
  Error corrupt(const std::string& what) const {
    return Error("Checkpoint " + quoted(dir) + " (step " + std::to_string(step) +
                 ") is corrupt: " + what + "." + previous_hint(dir, step));
  }
};

StepDir open_step(fs::path step_dir) {
  if (step_dir.filename().empty()) step_dir = step_dir.parent_path();  // ".../5/"
  StepDir sd;
  sd.dir = step_dir;
  auto step = parse_step(step_dir.filename().string());
  sd.step = step ? *step : -1;
  try {
    sd.md = read_metadata(step_dir);
  } catch (const Error& e) {
    throw sd.corrupt(e.what());
  }
  if (!step) sd.step = sd.md.step;
  if (!sd.md.complete)
    throw sd.corrupt(quoted(step_dir / kMetadataName) +
                     " does not say \"complete\": true (an interrupted save?)");
  if (step && sd.md.step != *step)
    throw sd.corrupt(quoted(step_dir / kMetadataName) + " records step " +
                     std::to_string(sd.md.step));
  return sd;
}

// A step directory's tensors into the parts of `targets` (any version).
Metadata load_step_parts(const fs::path& step_dir,
                         std::map<std::string, TensorPart>* const targets[3]) {
  StepDir sd = open_step(step_dir);
  PartSource src(sd.dir, &sd.md, {}, [&](const std::string& w) { return sd.corrupt(w); });
  read_parts(src, sd.dir, targets);
  return std::move(sd.md);
}

// Whole tensors as parts of themselves.
std::map<std::string, TensorPart> whole_parts(const std::map<std::string, Tensor>& tensors) {
  std::map<std::string, TensorPart> parts;
  for (const auto& [name, t] : tensors)
    parts[name] = TensorPart{t.shape(), -1, 1, 0, 0, t.numel(), t};
  return parts;
}

// Verifies and loads the files of one step directory (either version) into the whole tensors
// of `targets[i]` (null: not read). Everything is checked before any tensor is written, so a
// bad checkpoint leaves the targets as they were.
Metadata load_step(const fs::path& step_dir, std::map<std::string, Tensor>* const targets[3]) {
  std::map<std::string, TensorPart> parts[3];
  std::map<std::string, TensorPart>* part_targets[3] = {};
  for (int i = 0; i < 3; ++i)
    if (targets[i]) {
      parts[i] = whole_parts(*targets[i]);
      part_targets[i] = &parts[i];
    }
  return load_step_parts(step_dir, part_targets);
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
    throw UsageError(std::string(key) + " " + quoted(path) +
                     " does not exist or is not a directory.");
  if (fs::exists(path / kMetadataName, ec)) return path;
  fs::path ckpts = path;
  if (fs::is_directory(path / "checkpoints", ec)) ckpts = path / "checkpoints";
  std::vector<int64_t> steps = list_complete_steps(ckpts);
  if (steps.empty()) {
    // The newest step directory there, and what it lacks (a truncated or half-written save
    // read like an empty directory).
    int64_t newest = -1;
    for (const auto& e : entries(ckpts)) {
      std::error_code dir_ec;
      const auto step = parse_step(e.path().filename().string());
      if (e.is_directory(dir_ec) && step && *step > newest) newest = *step;
    }
    throw UsageError(
        std::string(key) + " " + quoted(path) + " holds no complete checkpoint" +
        (newest >= 0 ? ": its newest step directory, " + quoted(ckpts / std::to_string(newest)) +
                           ", is not complete (" +
                           why_incomplete(ckpts / std::to_string(newest), newest) + ")."
                     : " (expected <step>/metadata.json, or a checkpoints/ directory of them)."));
  }
  return ckpts / std::to_string(steps.back());
}

// max_num_checkpoints_to_keep: deletes the oldest complete steps beyond `max_to_keep` (0: keeps
// all); the step just written always stays, even when an older run left higher steps around.
void apply_retention(const fs::path& dir, int max_to_keep, int64_t step) {
  if (max_to_keep <= 0) return;
  std::vector<int64_t> steps = list_complete_steps(dir);
  steps.erase(std::remove(steps.begin(), steps.end(), step), steps.end());
  size_t keep_others = static_cast<size_t>(max_to_keep - 1);
  try {
    for (size_t i = 0; i + keep_others < steps.size(); ++i) delete_checkpoint(dir, steps[i]);
    fsync_path(dir, true);
  } catch (const std::exception& e) {
    throw Error("Checkpoint step " + std::to_string(step) + " was saved to " +
                quoted(dir / std::to_string(step)) +
                ", but deleting older checkpoints (max_num_checkpoints_to_keep=" +
                std::to_string(max_to_keep) + ") failed: " + e.what());
  }
}

// A step directory's state into a rank's parts (restore_parts, load_full_state_parts).
void restore_parts_from(const fs::path& step_dir, ShardedTrainState& state);

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

// A sharded save between its files and its publication: what rank 0 puts in the metadata, and
// this rank's files.
struct CheckpointManager::PendingShards {
  int64_t step = 0;
  int rank = 0, shards = 1;
  fs::path tmp, final_dir, old;
  Metadata md;  // rank 0 adds the files' records at the commit
  // The pieces this rank writes (no lower rank holds them): live tensors (sync) or host copies.
  std::vector<std::pair<std::string, Tensor>> live[3];
  std::vector<SafeTensorsEntry> host[3];
  bool from_host = false;
  // Written by write_shards: each file's size and checksum.
  bool wrote[3] = {};
  uint64_t size[3] = {};
  uint32_t crc[3] = {};
  Clock::time_point t0;
};

CheckpointManager::CheckpointManager(fs::path checkpoint_dir, bool async, int max_to_keep,
                                     Backend& backend, Communicator* comm)
    : dir_(std::move(checkpoint_dir)),
      async_(async),
      max_to_keep_(std::max(0, max_to_keep)),
      backend_(backend),
      comm_(comm) {}

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
  if (shards_) {
    commit_shards();
    return;
  }
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

const std::byte* CheckpointManager::host_copy(size_t k, const Tensor& t) {
  const size_t n = t.nbytes();
  if (k == buffers_.size()) buffers_.emplace_back();
  HostBuffer& b = buffers_[k];
  if (b.size != n || !b.data) {
    b.data = std::make_unique_for_overwrite<std::byte[]>(std::max<size_t>(n, 1));
    b.size = n;
  }
  if (n > 0) t.backend()->copy_to_host(t, b.data.get());
  return b.data.get();
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
        shown.add(static_cast<double>(t.nbytes()));
        snap->host[i].emplace_back(name, t.dtype(), t.shape(), host_copy(k++, t));
      }
    }
    buffers_.resize(k);  // a smaller state than last time: release the rest
    snapshot_ = std::move(snap);
    try {
      worker_ = std::thread([this] {
        try {
          write(*snapshot_, false);
        } catch (const std::exception& e) {
          keep_error(pending_error_, e.what());
        } catch (...) {
          keep_error(pending_error_, "the checkpoint save failed with an unknown exception");
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
    make_tmp_dir(dir_, tmp, exclusive_);
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

  apply_retention(dir_, max_to_keep_, snap.step);
  last_write_s_ = seconds_since(t0);
}

fs::path CheckpointManager::step_to_read(int64_t step) {
  // A write in flight may be the step asked for; its error, if any, stays for wait().
  join_worker();
  fs::path step_dir = dir_ / std::to_string(step);
  std::error_code ec;
  if (!fs::is_directory(step_dir, ec))
    throw Error("There is no checkpoint for step " + std::to_string(step) + " in " + quoted(dir_) +
                ".");
  return step_dir;
}

void CheckpointManager::restore(int64_t step, TrainState& state) {
  restore_into(step_to_read(step), state);
}

void CheckpointManager::save_parts(const ShardedTrainState& state) {
  const Clock::time_point t0 = Clock::now();
  wait();
  MT_CHECK(comm_ != nullptr, "CheckpointManager::save_parts needs the job's communicator");
  if (state.step < 0)
    throw Error("cannot save a checkpoint for negative step " + std::to_string(state.step));
  if (state.tensors[1].size() != state.tensors[2].size())
    throw Error("cannot save a checkpoint with only one of the Adam moments");
  const int me = comm_->rank(), ranks = comm_->size();
  size_t count = 0;
  for (const auto& group : state.tensors)
    for (const auto& [name, t] : group) {
      if (!t.data.defined() || t.data.numel() != t.end - t.begin || t.begin < 0 || t.parts < 1)
        throw Error("cannot save a checkpoint: the part of tensor '" + name +
                    "' is undefined or not the size its range says");
      ++count;
    }
  // Every rank's (part, begin, end) of every tensor, to find who writes what (the lowest rank
  // holding a piece) and for rank 0's metadata.
  std::vector<double> table(static_cast<size_t>(ranks) * count * 3, 0.0);
  {
    size_t k = static_cast<size_t>(me) * count * 3;
    for (const auto& group : state.tensors)
      for (const auto& [name, t] : group) {
        table[k++] = t.part;
        table[k++] = static_cast<double>(t.begin);
        table[k++] = static_cast<double>(t.end);
      }
  }
  comm_->all_reduce_sum(table.data(), table.size());

  auto pending = std::make_unique<PendingShards>();
  PendingShards& p = *pending;
  p.t0 = t0;
  p.step = state.step;
  p.rank = me;
  p.shards = ranks;
  p.md.version = 2;
  p.md.step = state.step;
  p.md.shards = ranks;
  p.md.data_state = state.data_state;
  p.md.rng_state = state.rng_state;
  p.md.config_yaml = state.config_yaml;
  size_t k = 0;
  for (int g = 0; g < 3; ++g) {
    p.md.has[g] = g == 0 || !state.tensors[g].empty();
    for (const auto& [name, t] : state.tensors[g]) {
      StoredTensor st{
          t.shape, safetensors_dtype_name(t.data.dtype()), t.parts > 1 ? t.dim : -1, t.parts, {}};
      std::map<std::tuple<int64_t, int64_t, int64_t>, int> first;  // a piece's lowest rank
      for (int r = 0; r < ranks; ++r) {
        const double* row = table.data() + (static_cast<size_t>(r) * count + k) * 3;
        const auto part = static_cast<int64_t>(row[0]), b = static_cast<int64_t>(row[1]),
                   e = static_cast<int64_t>(row[2]);
        if (b < e) first.emplace(std::tuple{part, b, e}, r);
      }
      for (const auto& [piece, r] : first)
        st.pieces.push_back(
            {r, static_cast<int>(std::get<0>(piece)), std::get<1>(piece), std::get<2>(piece)});
      const std::string problem = tiling_problem(st, ranks);
      if (!problem.empty())
        throw Error("cannot save a checkpoint: the ranks' parts of tensor '" + name +
                    "' do not make it whole (" + problem + ")");
      if (t.begin < t.end && first.at(std::tuple{int64_t{t.part}, t.begin, t.end}) == me)
        p.live[g].emplace_back(name, t.data.view({t.end - t.begin}));
      p.md.tensors[g].emplace(name, std::move(st));
      ++k;
    }
  }

  // Rank 0 makes the directory every rank writes into, named after its pid.
  const std::string step_name = std::to_string(state.step);
  double made[2] = {0, 0};  // made, rank 0's pid
  std::string why;
  if (me == 0) {
    try {
      make_tmp_dir(dir_, dir_ / (step_name + ".tmp-" + std::to_string(::getpid())), exclusive_);
      made[0] = 1;
      made[1] = ::getpid();
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  comm_->broadcast(made, sizeof made, 0);
  p.final_dir = dir_ / step_name;
  if (made[0] == 0)
    throw Error("Saving checkpoint step " + step_name + " to " + quoted(p.final_dir) +
                " failed: " + (me == 0 ? why : "rank 0 could not create its directory") +
                ". Existing checkpoints were not modified.");
  const std::string pid0 = std::to_string(static_cast<int64_t>(made[1]));
  p.tmp = dir_ / (step_name + ".tmp-" + pid0);
  p.old = dir_ / (step_name + ".old-" + pid0);

  // Kernels may still be writing the tensors on an asynchronous device.
  backend_.synchronize();
  worker_done_ = false;
  if (!async_) {
    shards_ = std::move(pending);
    try {
      write_shards(*shards_);
    } catch (const std::exception& e) {
      pending_error_ = e.what();
    }
    worker_done_ = true;
    last_blocking_s_ = seconds_since(t0);
    total_blocking_s_ += last_blocking_s_;
    commit_shards();
    return;
  }
  size_t b = 0;
  for (int g = 0; g < 3; ++g) {
    for (auto& [name, t] : p.live[g])
      p.host[g].emplace_back(name, t.dtype(), t.shape(), host_copy(b++, t));
    p.live[g].clear();
  }
  buffers_.resize(b);
  p.from_host = true;
  shards_ = std::move(pending);
  auto work = [this] {
    try {
      write_shards(*shards_);
    } catch (const std::exception& e) {
      keep_error(pending_error_, e.what());
    } catch (...) {
      keep_error(pending_error_, "the checkpoint save failed with an unknown exception");
    }
    worker_done_ = true;
  };
  try {
    worker_ = std::thread(work);
  } catch (const std::system_error&) {
    work();  // no thread to be had: write in the caller instead of losing the checkpoint
  }
  last_blocking_s_ = seconds_since(t0);
  total_blocking_s_ += last_blocking_s_;
}

void CheckpointManager::write_shards(PendingShards& p) {
  for (int g = 0; g < 3; ++g) {
    if (p.live[g].empty() && p.host[g].empty()) continue;
    const fs::path path = p.tmp / shard_file_name(g, p.rank, p.shards);
    try {
      if (p.from_host)
        write_safetensors(path, p.host[g]);
      else
        save_tensors(path, p.live[g]);
      p.size[g] = fs::file_size(path);
      p.crc[g] = crc32c_file(path);  // read back: the bytes the file system holds
      p.wrote[g] = true;
    } catch (const std::exception& e) {
      throw Error("rank " + std::to_string(p.rank) + " could not write " + quoted(path) + ": " +
                  e.what());
    }
    if (g == 0) crash_point("after_params");
  }
}

void CheckpointManager::commit_shards() {
  if (worker_.joinable()) worker_.join();
  PendingShards& p = *shards_;
  const int ranks = p.shards, me = p.rank;
  // Per rank: failed, then each group's (written, size, checksum).
  constexpr size_t kRow = 10;
  std::vector<double> rows(static_cast<size_t>(ranks) * kRow, 0.0);
  double* mine = rows.data() + static_cast<size_t>(me) * kRow;
  mine[0] = pending_error_ ? 1 : 0;
  for (int g = 0; g < 3; ++g) {
    mine[1 + 3 * g] = p.wrote[g] ? 1 : 0;
    mine[2 + 3 * g] = static_cast<double>(p.size[g]);
    mine[3 + 3 * g] = p.crc[g];
  }
  comm_->all_reduce_sum(rows.data(), rows.size());
  const std::string step_name = std::to_string(p.step);
  std::string error;
  if (me == 0) {
    std::vector<std::string> failed;
    for (int r = 1; r < ranks; ++r)
      if (rows[static_cast<size_t>(r) * kRow] != 0) failed.push_back(std::to_string(r));
    bool published = false;
    try {
      if (pending_error_) throw Error(*pending_error_);
      if (!failed.empty()) {
        std::string list;
        for (size_t i = 0; i < failed.size(); ++i)
          list += (i == 0 ? "" : i + 1 == failed.size() ? " and " : ", ") + failed[i];
        throw Error("rank" + std::string(failed.size() > 1 ? "s " : " ") + list +
                    " could not write " + (failed.size() > 1 ? "their" : "its") +
                    " files (each printed why)");
      }
      Metadata& md = p.md;
      size_t bytes = 0;
      for (int g = 0; g < 3; ++g) {
        for (int r = 0; r < ranks; ++r) {
          const double* row = rows.data() + static_cast<size_t>(r) * kRow;
          if (row[1 + 3 * g] == 0) continue;
          FileRecord rec;
          rec.name = shard_file_name(g, r, ranks);
          rec.size = static_cast<uint64_t>(row[2 + 3 * g]);
          rec.crc = static_cast<uint32_t>(row[3 + 3 * g]);
          bytes += rec.size;
          md.files.push_back(std::move(rec));
        }
      }
      md.complete = true;
      write_file_durable(p.tmp / kMetadataName, metadata_json(md));
      fsync_path(p.tmp, true);
      crash_point("before_rename");
      publish(p.tmp, p.final_dir, p.old);
      published = true;
      fsync_path(dir_, true);
      last_write_bytes_ = bytes;
      apply_retention(dir_, max_to_keep_, p.step);
    } catch (const std::exception& e) {
      std::string cause = e.what();
      if (!cause.empty() && cause.back() == '.') cause.pop_back();
      error = published ? cause + "."
                        : "Saving checkpoint step " + step_name + " to " + quoted(p.final_dir) +
                              " failed: " + cause + ". Existing checkpoints were not modified.";
    }
    std::error_code ec;
    if (!published) fs::remove_all(p.tmp, ec);
  } else if (pending_error_) {
    std::fprintf(stderr, "mt: rank %d: %s\n", me, pending_error_->c_str());
  }
  double ok = error.empty() ? 1 : 0;
  comm_->broadcast(&ok, sizeof ok, 0);
  last_write_s_ = seconds_since(p.t0);
  shards_.reset();
  pending_error_.reset();
  if (ok != 0) return;
  if (me == 0) throw Error(error);
  throw Error("Saving checkpoint step " + step_name +
              " failed; rank 0 names the cause. Existing checkpoints were not modified.");
}

void CheckpointManager::poll() {
  if (!shards_) return;
  double done = worker_done_ ? 1 : 0;
  comm_->all_reduce_sum(&done, 1);
  if (done == comm_->size()) commit_shards();
}

void CheckpointManager::restore_parts(int64_t step, ShardedTrainState& state) {
  restore_parts_from(step_to_read(step), state);
}

void load_full_state_parts(const fs::path& path, ShardedTrainState& state) {
  restore_parts_from(resolve_step_dir(path, "load_full_state_path"), state);
}

namespace {

void restore_parts_from(const fs::path& step_dir, ShardedTrainState& state) {
  std::map<std::string, TensorPart>* targets[3] = {&state.tensors[0], nullptr, nullptr};
  if (!state.tensors[1].empty() || !state.tensors[2].empty()) {
    targets[1] = &state.tensors[1];
    targets[2] = &state.tensors[2];
  }
  Metadata md = load_step_parts(step_dir, targets);
  state.step = md.step;
  state.data_state = std::move(md.data_state);
  state.rng_state = std::move(md.rng_state);
  state.config_yaml = std::move(md.config_yaml);
}

}  // namespace

std::map<std::string, Tensor> load_checkpoint_tensors(const fs::path& path,
                                                      const std::string& group, Backend& backend) {
  const auto* it = std::find(std::begin(kGroupNames), std::end(kGroupNames), group);
  MT_CHECK(it != std::end(kGroupNames), "no checkpoint group '" + group + "'");
  const auto g = static_cast<int>(it - std::begin(kGroupNames));
  StepDir sd = open_step(resolve_step_dir(path, "checkpoint"));
  PartSource src(sd.dir, &sd.md, {}, [&](const std::string& w) { return sd.corrupt(w); });
  if (!src.has(g)) throw Error("Checkpoint " + quoted(sd.dir) + " holds no " + group + ".");
  std::map<std::string, TensorPart> parts;
  std::map<std::string, Tensor> out;
  for (const auto& [name, t] : src.layout(g)) {
    // A dtype mt has no tensor for (F16, F64, from files mt did not write) is read as f32.
    Tensor x = backend.empty(t.shape, dtype_from_safetensors(t.dtype).value_or(DType::f32));
    parts[name] = TensorPart{t.shape, -1, 1, 0, 0, x.numel(), x};
    out[name] = x;
  }
  std::map<std::string, TensorPart>* targets[3] = {};
  targets[g] = &parts;
  read_parts(src, sd.dir, targets);
  return out;
}

namespace {

// The source of load_parameters_path (a bare .safetensors file, or a step directory's files)
// for `read(src, where)`, which may read it several times: each file is opened, and a step's
// checksum verified, once.
template <class Read>
void with_parameter_source(const fs::path& path, const Read& read) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    if (path.extension() != ".safetensors")
      throw Error("load_parameters_path " + quoted(path) +
                  " is a file but not a .safetensors file; give a checkpoint step directory, a "
                  "checkpoints directory or a .safetensors file.");
    PartSource src(path.parent_path(), nullptr, path.filename().string(),
                   [&](const std::string& w) { return Error(quoted(path) + ": " + w); });
    read(src, path);
    return;
  }
  StepDir sd = open_step(resolve_step_dir(path, "load_parameters_path"));
  PartSource src(sd.dir, &sd.md, {}, [&](const std::string& w) { return sd.corrupt(w); });
  read(src, sd.dir);
}

}  // namespace

void load_parameter_parts(const fs::path& path, ShardedTrainState& state) {
  std::map<std::string, TensorPart>* targets[3] = {&state.tensors[0], nullptr, nullptr};
  with_parameter_source(
      path, [&](PartSource& src, const fs::path& where) { read_parts(src, where, targets); });
}

std::string checkpoint_config_yaml(const fs::path& path) {
  try {
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) return "";
    return read_metadata(resolve_step_dir(path, "load_parameters_path")).config_yaml;
  } catch (const std::exception&) {
    return "";
  }
}

void load_full_state(const fs::path& path, TrainState& state) {
  restore_into(resolve_step_dir(path, "load_full_state_path"), state);
}

void load_parameters(const fs::path& path, std::map<std::string, Tensor>& params) {
  ShardedTrainState whole;
  whole.tensors[0] = whole_parts(params);
  load_parameter_parts(path, whole);
}

void load_parameters(const fs::path& path, std::map<std::string, Tensor>& params,
                     const std::map<std::string, Shape>& streamed, Backend& backend,
                     const std::function<void(const std::string&, const Tensor&)>& take) {
  std::map<std::string, TensorPart> whole = whole_parts(params);
  std::set<std::string> others;  // beside the tensors of one read: the rest are not extra
  for (const auto& [name, shape] : streamed) others.insert(name);
  with_parameter_source(path, [&](PartSource& src, const fs::path& where) {
    std::map<std::string, TensorPart>* targets[3] = {&whole, nullptr, nullptr};
    read_parts(src, where, targets, &others);
    for (const auto& [name, t] : params) others.insert(name);
    for (const auto& [name, shape] : streamed) {
      std::map<std::string, Tensor> one = {{name, backend.empty(shape, DType::f32)}};
      std::map<std::string, TensorPart> part = whole_parts(one);
      targets[0] = &part;
      others.erase(name);
      read_parts(src, where, targets, &others);
      others.insert(name);
      take(name, one.begin()->second);
    }
  });
}

}  // namespace mt
