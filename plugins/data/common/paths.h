// Expands a dataset_path value into files, for the file-based data plugins.
#pragma once

#include <glob.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "mt/error.h"

namespace mt_data {

inline std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\n");
  if (a == std::string::npos) return "";
  const size_t b = s.find_last_not_of(" \t\n");
  return s.substr(a, b - a + 1);
}

// spec: a file, a directory (its files with one of `dir_exts`, sorted), a comma-separated list,
// or glob patterns. A path that exists is taken as it is: a name holding a comma is not a list,
// and one holding [ ] * ? not a pattern (before: "data[1].jsonl" read data1.jsonl, silently).
// `noun` names a file in messages ("tokens file"). Throws mt::UsageError naming `key` when
// something matches nothing. Plain files are returned unchecked: their reader says when one is
// missing.
inline std::vector<std::string> expand_paths(const std::string& spec, const std::string& key,
                                             const std::vector<std::string>& dir_exts,
                                             const std::string& noun) {
  namespace fs = std::filesystem;
  std::vector<std::string> out, items;
  std::error_code ec;
  if (fs::exists(trim(spec), ec)) {
    items.push_back(trim(spec));
  } else {
    for (size_t pos = 0; pos <= spec.size();) {
      size_t comma = spec.find(',', pos);
      if (comma == std::string::npos) comma = spec.size();
      items.push_back(trim(spec.substr(pos, comma - pos)));
      pos = comma + 1;
    }
  }
  for (const std::string& item : items) {
    if (item.empty()) continue;
    if (fs::is_directory(item, ec)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(item, ec))
        if (std::find(dir_exts.begin(), dir_exts.end(), e.path().extension().string()) !=
            dir_exts.end())
          found.push_back(e.path().string());
      if (found.empty()) {
        std::string exts;
        for (const auto& x : dir_exts) exts += (exts.empty() ? "" : " or ") + x;
        throw mt::UsageError(key + "=" + spec + ": directory " + item + " holds no " + exts +
                             " files");
      }
      std::sort(found.begin(), found.end());
      out.insert(out.end(), found.begin(), found.end());
    } else if (item.find_first_of("*?[") != std::string::npos && !fs::exists(item, ec)) {
      glob_t g{};
      const int rc = ::glob(item.c_str(), 0, nullptr, &g);
      // glob_t owns C allocations: release them on every path.
      std::unique_ptr<glob_t, void (*)(glob_t*)> guard(&g, ::globfree);
      if (rc != 0 || g.gl_pathc == 0)
        throw mt::UsageError(key + "=" + spec + ": pattern " + item + " matches no file");
      for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
    } else {
      out.push_back(item);
    }
  }
  if (out.empty()) throw mt::UsageError(key + " is empty: set it to a " + noun + ", list or glob");
  return out;
}

}  // namespace mt_data
