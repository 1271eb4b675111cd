#pragma once
// Sizes of a model from its config alone, without building it (a preset of billions of parameters
// can be listed on any machine).
#include <cstdint>

#include "models/model.h"

namespace strata::models {

/// Parameters the model of `config` has (a tied one once), counted from its architecture: equal to
/// build_model(config, seed).parameter_count() for every preset kind; an Error for `custom`.
int64_t parameter_count(const ModelConfig& config);

}  // namespace strata::models
