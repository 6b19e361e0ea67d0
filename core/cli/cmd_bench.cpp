// mt bench: end-to-end throughput as one JSON object.
#include "cli.h"
#include "mt/error.h"

namespace mt::cli {

int cmd_bench(const Args& args) {
  throw Error("`mt bench` is not implemented yet (it arrives with the training and inference "
              "performance work).");
}

}  // namespace mt::cli
