// Fuzzes the config loader with the input as the user's --config file, layered over the
// shipped configs/base.yml and the model it names (or the default model). Any file resolves or
// is refused with mt::Error (malformed YAML, unknown keys, wrong types, bounds); besides crashes,
// hangs and sanitizer reports, a finding is a resolved config whose YAML (what `mt config`
// prints and a run saves) does not load again as a --config file to the same config.
#include <cstddef>
#include <cstdint>
#include <string>

#include "config_loader.h"
#include "fuzz_support.h"
#include "mt/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static mt::fuzz::MemFile user("fuzz_config.yml"), again("fuzz_resolved.yml");
  mt::ConfigRequest req;
  req.configs_dir = MT_FUZZ_CONFIGS_DIR;
  req.config_file = user.write(data, size);
  mt::Config config;
  try {
    config = mt::load_config(req);
  } catch (const mt::Error&) {
    return 0;  // refused with one paragraph naming the key and where: expected
  }
  const std::string yaml = config.to_yaml();
  (void)config.to_yaml(true);
  req.config_file = again.write(yaml.data(), yaml.size());
  try {
    if (mt::load_config(req).to_yaml() != yaml)
      mt::fuzz::finding("the resolved config loads again as a different config:\n" + yaml);
  } catch (const mt::Error& e) {
    mt::fuzz::finding(std::string("the resolved config does not load again: ") + e.what() + "\n" +
                      yaml);
  }
  return 0;
}
