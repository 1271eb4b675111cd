#pragma once
// Sizes of a model from its config alone, without building it (a preset of billions of parameters
// can be listed on any machine).
#include <cstdint>
#include <vector>

#include "models/model.h"

namespace strata::models {

/// Parameters the model of `config` has (a tied one once), counted from its architecture: equal to
/// build_model(config, seed).parameter_count() for every preset kind; an Error for `custom`.
int64_t parameter_count(const ModelConfig& config);

/// One block of a preset kind's model, from its config: what a memory model needs.
struct BlockSizes {
  int64_t own_params = 0;         ///< parameters this block alone uses
  bool uses_shared = false;       ///< it uses the tied matrix (gpt's token table, tied)
  int64_t activation_bytes = 0;   ///< Block::activation_bytes(1): what its forward keeps per sample, fp32
  int64_t input_elements = 0;     ///< elements of its input per sample (a recompute saves the input)
  bool integer_input = false;     ///< the input is token ids (int64), not activations
};
struct ModelSizes {
  std::vector<BlockSizes> blocks;
  int64_t shared_params = 0;  ///< the tied matrix, counted once (0 when untied)
  int64_t largest_tensor = 0;  ///< elements of the largest parameter tensor
  int64_t parameters() const;
};
/// The blocks of the model of `config` with their sizes, without building it: equal to the built
/// model's blocks (test_capacity checks every small preset kind); an Error for `custom` and `mlp`.
ModelSizes model_sizes(const ModelConfig& config);

}  // namespace strata::models
