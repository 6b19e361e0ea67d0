// Fuzzes the safetensors reader (checkpoints, Hugging Face weights). Any file opens or is
// refused with mt::Error; besides crashes, hangs and sanitizer reports, a finding is a file that
// opens while breaking what safetensors.h promises of a validated file:
// - names() is sorted, unique, and each name's info() is the tensor of that name;
// - each tensor's bytes match its dtype and shape, and the tensors tile the data section
//   exactly (their sizes add up to the file size less the 8-byte length and the header);
// - every byte of every tensor is readable (all of them are read: a pointer past the mapping
//   faults).
// Loading onto a backend (the dtype conversions) is left out: it needs a Backend.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "fuzz_support.h"
#include "mt/error.h"
#include "safetensors.h"

namespace {

using mt::fuzz::finding;

// Where the tensor bytes are summed, so that reading them is not optimised away.
volatile unsigned g_sink;

void check(const mt::SafeTensorsFile& f, const uint8_t* data, size_t size) {
  uint64_t header = 0;  // the reader accepted the file, so it has these 8 bytes
  for (int i = 7; i >= 0; --i) header = (header << 8) | data[i];
  const uint64_t data_section = size - 8 - header;
  if (f.file_size() != size) finding("file_size() is not the file's size");
  if (f.size() != f.names().size()) finding("size() is not the number of names");
  uint64_t total = 0;
  unsigned sum = 0;
  for (size_t i = 0; i < f.names().size(); ++i) {
    const std::string& name = f.names()[i];
    if (i && !(f.names()[i - 1] < name)) finding("names() not sorted and unique at '" + name + "'");
    if (!f.contains(name)) finding("contains() misses '" + name + "'");
    const mt::SafeTensorInfo& t = f.info(name);
    if (t.name != name) finding("info('" + name + "') is the tensor '" + t.name + "'");
    if (t.begin > t.end || t.end > data_section)
      finding("tensor '" + name + "': offsets outside the data section");
    const size_t elem = mt::safetensors_dtype_size(t.dtype);
    if (elem == 0) finding("tensor '" + name + "': accepted unknown dtype '" + t.dtype + "'");
    // numel() throws for a count beyond int64, which an accepted file must not have.
    if (static_cast<uint64_t>(t.numel()) * elem != t.nbytes())
      finding("tensor '" + name + "': " + std::to_string(t.nbytes()) + " bytes for " +
              std::to_string(t.numel()) + " elements of " + t.dtype);
    total += t.nbytes();
    for (size_t b = 0; b < t.nbytes(); ++b) sum += static_cast<unsigned char>(t.data[b]);
  }
  if (total != data_section)
    finding("tensors cover " + std::to_string(total) + " bytes of a data section of " +
            std::to_string(data_section));
  for (const auto& [key, value] : f.metadata())
    sum += static_cast<unsigned>(key.size() + value.size());
  g_sink = sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static mt::fuzz::MemFile file("fuzz.safetensors");
  const std::string& path = file.write(data, size);
  std::optional<mt::SafeTensorsFile> f;
  try {
    f.emplace(path);
  } catch (const mt::Error&) {
    return 0;  // refused, with a message naming the file: expected for most inputs
  }
  try {
    check(*f, data, size);
  } catch (const mt::Error& e) {
    finding(std::string("a file that opened fails a later call: ") + e.what());
  }
  return 0;
}
