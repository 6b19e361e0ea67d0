// TokenStream: a split's corpus as one sequence of ids with document starts marked; what
// RowSource (row_source.h) cuts rows from.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mt_data {

// The corpus of a split as one stream of ids.
class TokenStream {
 public:
  virtual ~TokenStream() = default;
  virtual uint64_t size() const = 0;
  // Copies ids [begin, begin + n) to `ids` and marks in `doc_start` which of them begin a
  // document. May throw mt::Error (a bad id, naming where it is).
  virtual void read(uint64_t begin, uint64_t n, int32_t* ids, uint8_t* doc_start) const = 0;
  // Every document as [begin, end) in the stream (for packing=false).
  virtual std::vector<std::pair<uint64_t, uint64_t>> documents() const = 0;
  virtual std::string describe() const = 0;  // the files, for messages
};

}  // namespace mt_data
