#pragma once
// Shared by the benchmark binaries: the parity check every cell runs before it times anything.
#include "correctness/support/parity.h"
#include "models/model.h"

namespace strata::bench {

/// The tiny preset of the same model kind: parity is checked there, where it is cheap.
inline const models::ModelConfig& parity_model_for(const models::ModelConfig& config) {
  switch (config.kind) {
    case models::ModelKind::gpt: return models::preset("gpt-tiny").config;
    case models::ModelKind::bert: return models::preset("bert-tiny").config;
    case models::ModelKind::mlp: break;
  }
  return models::preset("mlp-tiny").config;
}

/// Parity of `strategy` (with `options`) on the tiny model of `config`'s kind, in full fp32.
inline correctness::ParityResult check_before_timing(const std::string& strategy, const models::ModelConfig& config,
                                                     const std::map<std::string, std::string>& options,
                                                     const torch::Device& device) {
  correctness::ParityCase small;
  small.model = parity_model_for(config);
  small.options = options;
  const bool tf32 = at::globalContext().allowTF32CuBLAS();
  at::globalContext().setAllowTF32CuBLAS(false);
  auto result = correctness::check_parity(strategy, small, device);
  at::globalContext().setAllowTF32CuBLAS(tf32);
  return result;
}

}  // namespace strata::bench
