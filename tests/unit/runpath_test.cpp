// The library search paths baked into the build tree's binaries (issue 24, item 1): an empty or
// relative RUNPATH entry makes the dynamic loader search the current directory, so a library
// dropped into, say, a downloaded model directory would run its code inside mt.
#include <elf.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

struct DynamicInfo {
  bool elf = false;
  std::vector<std::string> needed;
  std::vector<std::string> runpaths;  // DT_RUNPATH and DT_RPATH strings, unsplit
};

// The dynamic section of a 64-bit little-endian ELF file, read through its section headers.
DynamicInfo read_dynamic(const fs::path& p) {
  DynamicInfo info;
  std::ifstream f(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (bytes.size() < sizeof(Elf64_Ehdr) || std::memcmp(bytes.data(), ELFMAG, SELFMAG) != 0 ||
      bytes[EI_CLASS] != ELFCLASS64)
    return info;
  info.elf = true;
  Elf64_Ehdr eh;
  std::memcpy(&eh, bytes.data(), sizeof eh);
  auto section = [&](size_t i) {
    Elf64_Shdr sh{};
    const size_t off = eh.e_shoff + i * eh.e_shentsize;
    if (i < eh.e_shnum && off + sizeof sh <= bytes.size())
      std::memcpy(&sh, bytes.data() + off, sizeof sh);
    return sh;
  };
  for (size_t i = 0; i < eh.e_shnum; ++i) {
    const Elf64_Shdr dyn = section(i);
    if (dyn.sh_type != SHT_DYNAMIC) continue;
    const Elf64_Shdr str = section(dyn.sh_link);
    auto string_at = [&](uint64_t o) {
      const size_t at = str.sh_offset + o;
      return at < bytes.size() ? std::string(bytes.c_str() + at) : std::string();
    };
    for (size_t off = dyn.sh_offset; off + sizeof(Elf64_Dyn) <= dyn.sh_offset + dyn.sh_size &&
                                     off + sizeof(Elf64_Dyn) <= bytes.size();
         off += sizeof(Elf64_Dyn)) {
      Elf64_Dyn d;
      std::memcpy(&d, bytes.data() + off, sizeof d);
      if (d.d_tag == DT_NEEDED) info.needed.push_back(string_at(d.d_un.d_val));
      if (d.d_tag == DT_RUNPATH || d.d_tag == DT_RPATH)
        info.runpaths.push_back(string_at(d.d_un.d_val));
    }
  }
  return info;
}

// Every ELF file the build made: the CLI, the core, the plugins, the test programs.
std::vector<fs::path> built_binaries() {
  std::vector<fs::path> out;
  const fs::path build = test::build_dir();
  for (const char* sub : {"bin", "lib", "tests", "bench"}) {
    std::error_code ec;
    if (!fs::is_directory(build / sub, ec)) continue;
    for (auto it = fs::recursive_directory_iterator(build / sub, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_symlink() || !it->is_regular_file()) continue;
      if (it->path().string().find("CMakeFiles") != std::string::npos) continue;
      if (read_dynamic(it->path()).elf) out.push_back(it->path());
    }
  }
  return out;
}

TEST(Runpath, NoBinaryHasAnEmptyOrRelativeEntry) {
  const auto bins = built_binaries();
  ASSERT_GE(bins.size(), 5u) << "found too few binaries under " << test::build_dir();
  bool saw_mt = false;
  for (const auto& b : bins) {
    saw_mt |= b.filename() == "mt";
    for (const std::string& rp : read_dynamic(b).runpaths) {
      std::vector<std::string> entries;
      std::stringstream ss(rp);
      for (std::string e; std::getline(ss, e, ':');) entries.push_back(e);
      if (!rp.empty() && rp.back() == ':') entries.emplace_back();  // getline drops a last ""
      for (const auto& e : entries)
        EXPECT_TRUE(!e.empty() && (e[0] == '/' || e.rfind("$ORIGIN", 0) == 0))
            << b << " has RUNPATH '" << rp << "' with the entry '" << e
            << "': empty and relative entries make the loader search the current directory";
    }
  }
  EXPECT_TRUE(saw_mt);
}

// The reproducer: a library under the name of every library mt needs (libfmt.so.9, ...) in the
// directory mt is started from; its constructor would print and exit 99.
TEST(Runpath, MtIgnoresLibrariesInTheCurrentDirectory) {
  const fs::path dir = fs::temp_directory_path() / ("mt_runpath_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path intruder =
      fs::path(test::build_dir()) / "tests" / "deps" / "libmt_test_intruder.so";
  ASSERT_TRUE(fs::exists(intruder)) << intruder;
  const DynamicInfo mt = read_dynamic(test::mt_exe());
  ASSERT_FALSE(mt.needed.empty());
  for (const auto& lib : mt.needed)
    fs::copy_file(intruder, dir / lib, fs::copy_options::overwrite_existing);
  std::string out;
  const int code =
      test::run_command("cd '" + dir.string() + "' && " + test::mt_exe() + " --help", out);
  EXPECT_EQ(out.find("INTRUDER"), std::string::npos) << out;
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("Usage: mt"), std::string::npos) << out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace mt
