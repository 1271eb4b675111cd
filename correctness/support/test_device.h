#pragma once
#include <torch/torch.h>

namespace strata::test {
/// The device this run of the suite tests (--device=...).
const torch::Device& device();
}  // namespace strata::test
