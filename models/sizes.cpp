#include "models/sizes.h"

#include "models/check.h"

namespace strata::models {

int64_t parameter_count(const ModelConfig& c) {
  const int64_t d = c.width, L = c.depth;
  const int64_t block = 12 * d * d + 13 * d;  // pre-norm transformer block: qkv, proj, fc1, fc2, two norms
  switch (c.kind) {
    case ModelKind::mlp:  // input layer, hidden layers, output bias (+ weight unless tied to the input's)
      return c.in_features * d + d + (L - 1) * (d * d + d) + c.classes + (c.tied ? 0 : c.classes * d);
    case ModelKind::gpt:  // token table, blocks, final norm, head (the token table when tied)
      return c.vocab * d + L * block + 2 * d + (c.tied ? 0 : c.vocab * d);
    case ModelKind::bert:  // token and position tables and their norm, blocks, pooler, classifier
      return c.vocab * d + c.seq_len * d + 2 * d + L * block + d * d + d + c.classes * d + c.classes;
    case ModelKind::custom: break;
  }
  STRATA_FAIL("parameter_count: a custom model's size is its blocks'; build it and ask BlockModel::parameter_count()");
}

}  // namespace strata::models
