#pragma once
#include <torch/torch.h>

namespace strata::test {
/// The device this run of the suite tests (--device=...).
const torch::Device& device();
/// That device named n times, comma-separated (stages that share it).
inline std::string devices(int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += (i ? "," : "") + device().str();
  return out;
}
}  // namespace strata::test
