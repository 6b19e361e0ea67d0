// mt SDK version and plugin ABI version.
//
// MT_ABI_VERSION changes whenever a class or struct a plugin sees changes layout or a virtual
// function is added, removed or reordered: the loader refuses a plugin built for another one.
// MT_OPSET_VERSION (backend.h) counts changes to the op set a backend implements (kernels added
// or their contracts changed); a plugin of an older op set still loads when the ABI matches.
#pragma once

#define MT_VERSION_MAJOR 0
#define MT_VERSION_MINOR 1
#define MT_VERSION_PATCH 0
#define MT_VERSION_STRING "0.1.0"
// 2: Backend::sum_squares_each; 3: Backend::scatter_rows, GradNode::cast_of; 4: SDK v2's family
// contract (Params by name, LayerOutput with auxiliary losses, CacheSpec, Model::flops_per_token,
// stacked and sliced HfName, ModelFamily::config_schema); 5: the Backend's ops declared from
// mt/ops.def (composed ops with defaults, Backend::supports, the list's order), and
// Graph::ExpertOrder::routed with token dropping's sort_by_expert; 6: Model::embed_at (token
// embeddings with their positions, for learned absolute position tables); 7: LayerOutput::stats
// (LayerStat, non-differentiable per-layer statistics) and DecoderLayer::after_step (updates
// after the optimizer step: DeepSeek-V3's routed_bias_update_rate); 8: Backend::fill_random
// (RandomFill, counter-based parameter initialisation; op set 4), MemoryStats::bytes_limit, and
// Model's multi-token prediction (mtp_depths, mtp_loss_scale, mtp_parameters, mtp_layer,
// mtp_combine), and the Communicator plugin kind (mt/comm.h, Registry::add_communicator); 9:
// KVCache::derived (tensors a layer derives from its weights once per decoder) and
// blocks::MlaSpec::naive_cache; 10: Communicator::reduce_scatter_sum and all_gather in place
// over shard_range's parts (sharded optimizer state); 11: Communicator::split and bytes_received,
// ParamSpec::axes, Graph's tensor-group ops; 12: Communicator::serialized_threads; 13:
// ParamSpec::projection, Params' transposed and int8 projection weights, Graph::project and
// Backend::matmul_q8 (op set 5); 14: Graph's expert-group ops (expert_gather,
// expert_scatter_sum; Graph's groups in one member), KVCache::scales and
// Backend::scatter_rows_q8 / dequantize_rows_q8 (op set 6: the int8 KV cache); 15:
// Communicator::all_to_all and Graph's expert_exchange / expert_gather_counts in place of
// expert_gather / expert_scatter_sum (expert parallelism's all-to-all dispatch); 16:
// Graph::grouped_project (expert weights [E, K, N] stored transposed or as int8 rows for
// inference, as ParamSpec::projection allows) and mt::cpu_threads (mt/config.h); 17:
// Graph::wants_aux (a layer may leave out auxiliary losses no one reads), Backend's
// grouped_matmul_q8 (op set 7) and blocks::moe_expert_mlp; 18: Backend::split_columns and
// scatter_rows_each (op set 8); 19: Registry::add_dataset_keys (a data plugin's own config keys)
// and mt::hf_derived_head_dim; 20: ParamSpec::table, Params::dtype, Graph::embedding of a
// Params' table and Backend::embedding_q8_forward (op set 9: a tied table as int8 rows); 21:
// Backend::release_cached_memory; 22: int8 rows (mt/q8.h) carry f16 scales, K + K / 16 bytes a
// row (were f32, K + K / 8): a plugin built before reads them wrong, so it is refused.
#define MT_ABI_VERSION 22u
