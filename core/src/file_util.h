// Whole-file reads and file names in messages, shared by the core's file readers (tokenizers,
// safetensors, checkpoints) so that each does not carry its own copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "mt/io.h"

namespace mt {

// `p` in single quotes, the way the core's error messages name a file.
std::string quoted(const std::filesystem::path& p);

enum class ReadStatus { ok, open_failed, read_failed };

// Replaces `out` with every byte of `path`. Existence, type and size checks are the caller's,
// because each reader words those errors its own way. After open_failed, errno says why.
ReadStatus read_all(const std::filesystem::path& path, std::string& out);

// Writes all `n` bytes to `fd`, resuming after short writes and EINTR. False on an error, with
// errno saying why; the caller words the error and cleans up.
bool write_all(int fd, const void* data, size_t n);

}  // namespace mt
