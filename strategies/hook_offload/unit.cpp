#include "strategies/hook_offload/unit.h"

#include "models/threads.h"

namespace strata::hook_offload {

void add_rows(const torch::Tensor& grad, const torch::Tensor& values, const torch::Tensor& touched) {
  const int64_t n = touched.numel(), cols = values.size(1);
  float* g = grad.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  const int64_t* row = touched.data_ptr<int64_t>();
  // Distinct rows: the chunks never write the same element.
  parallel_row_spans(n * cols, row, cols, [&](int64_t item, int64_t element, int64_t length) {
    for (int64_t k = 0; k < length; ++k) g[element + k] += v[item + k];
  });
}

}  // namespace strata::hook_offload
