// dataset_type=tokens: pre-tokenized flat binary files (token_file.h), memory-mapped.
//
// Rows, order, eval split, sharding, prefetch and state: see ../common/row_source.h.
#include <memory>
#include <string>

#include "../common/row_source.h"
#include "mt/config.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/plugin.h"
#include "token_file.h"

namespace {

std::unique_ptr<mt::DatasetSource> make_tokens_source(const mt::Config& cfg,
                                                      const mt::DataShard& shard) {
  // The ids are the file's, bos and eos included as mt tokenize wrote them: add_bos and add_eos
  // set for this run would change nothing (before: taken silently).
  for (const char* key : {"add_bos", "add_eos"}) {
    if (!cfg.has(key) || cfg.get_bool(key)) continue;  // true: as mt tokenize writes by default
    const std::string from = cfg.origin(key);
    if (from.find("configs/base.yml") == std::string::npos &&
        from.find("configs/models/") == std::string::npos)
      cfg.reject(key,
                 "has no effect on dataset_type=tokens: a tokens file holds the ids mt "
                 "tokenize wrote, with the bos and eos ids its own add_bos and add_eos "
                 "chose. Set it when tokenizing, or drop it here.");
  }
  const auto st = mt_data::RowSource::read_settings(cfg, shard, "tokens");
  const std::string path = mt_data::string_or(cfg, "dataset_path", "");
  if (path.empty())
    throw mt::UsageError(
        "dataset_type=tokens needs dataset_path: a .tokens file, a comma-separated list, a "
        "directory or a glob");
  auto corpus = std::make_shared<const mt_tokens::Corpus>(
      mt_tokens::expand_paths(path, "dataset_path"), st.vocab);
  std::shared_ptr<const mt_tokens::Corpus> eval;
  const std::string eval_path = mt_data::string_or(cfg, "eval_dataset_path", "");
  if (!eval_path.empty())
    eval = std::make_shared<const mt_tokens::Corpus>(
        mt_tokens::expand_paths(eval_path, "eval_dataset_path"), st.vocab);
  return std::make_unique<mt_data::RowSource>(cfg, shard, "tokens", corpus, eval);
}

void register_all(mt::Registry& r) {
  r.add_dataset("tokens",
                [](const mt::Config& cfg, const mt::DataShard& shard,
                   const mt::Tokenizer*) -> std::unique_ptr<mt::DatasetSource> {
                  return make_tokens_source(cfg, shard);
                });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::data, "tokens", "0.1.0", register_all, nullptr)
