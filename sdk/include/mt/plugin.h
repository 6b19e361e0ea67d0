// Declaring a plugin. A plugin is a shared object that exports exactly one entry, made by
// MT_PLUGIN, which the loader finds through Boost.DLL:
//
//   static void register_all(mt::Registry& r) { r.add_backend("cpu", ...); }
//   MT_PLUGIN(mt::PluginKind::backend, "cpu", "0.1.0", register_all, nullptr)
//
// The loader reads `abi` before touching anything else and refuses a plugin built against
// another MT_ABI_VERSION. `probe`, when given, runs before `register_fn`: it returns nullptr
// when the plugin can work on this machine, or a sentence saying why not (no driver, no device).
#pragma once

#include <boost/dll/alias.hpp>
#include <cstdint>

#include "mt/registry.h"
#include "mt/version.h"

namespace mt {

namespace PluginKind {
inline constexpr const char* backend = "backend";
inline constexpr const char* model = "model";
inline constexpr const char* data = "data";
inline constexpr const char* comm = "comm";  // communicators (mt/comm.h)
}  // namespace PluginKind

// Plain C layout: stable across ABI versions so the loader can always read `abi` first.
struct PluginInfo {
  uint32_t abi;
  const char* kind;     // PluginKind::*
  const char* name;     // "cpu", "llama", "text"
  const char* version;  // the plugin's own version
  void (*register_fn)(Registry&);
  const char* (*probe)();
};

using PluginEntry = const PluginInfo*();

}  // namespace mt

// The exported symbol's name; part of the ABI.
#define MT_PLUGIN_ENTRY_SYMBOL mt_plugin_entry

#define MT_PLUGIN(kind_, name_, version_, register_fn_, probe_fn_)                     \
  namespace mt_plugin_detail {                                                         \
  static const ::mt::PluginInfo* entry() {                                             \
    static const ::mt::PluginInfo info{MT_ABI_VERSION, kind_, name_, version_,         \
                                       register_fn_, probe_fn_};                       \
    return &info;                                                                      \
  }                                                                                    \
  }                                                                                    \
  BOOST_DLL_ALIAS(mt_plugin_detail::entry, mt_plugin_entry)
