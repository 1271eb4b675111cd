#pragma once
// Internal to models/: one builder per model kind.
#include "models/model.h"

namespace strata::models::detail {
std::vector<std::shared_ptr<Block>> build_mlp_blocks(const ModelConfig& config);
std::vector<std::shared_ptr<Block>> build_gpt_blocks(const ModelConfig& config);
std::vector<std::shared_ptr<Block>> build_bert_blocks(const ModelConfig& config);
}  // namespace strata::models::detail
