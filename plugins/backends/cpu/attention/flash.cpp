// flash attention: placeholder (not implemented yet).
#include "cpu_backend.h"
#include "mt/attention.h"

namespace mt::cpu {
std::unique_ptr<AttentionKernel> make_flash_attention(Backend& b) { return nullptr; }
}  // namespace mt::cpu
