#include "models/sizes.h"

#include <algorithm>

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

int64_t ModelSizes::parameters() const {
  int64_t n = shared_params;
  for (const auto& b : blocks) n += b.own_params;
  return n;
}

ModelSizes model_sizes(const ModelConfig& c) {
  const int64_t d = c.width, T = c.seq_len, V = c.vocab;
  // As models/transformer.h, gpt.cpp and bert.cpp count a block's saved activations.
  const BlockSizes transformer{12 * d * d + 13 * d, false, T * d * 16 * 4, T * d, false};
  ModelSizes out;
  out.largest_tensor = std::max(V * d, 4 * d * d);  // the token table, or a block's widest product
  if (c.kind == ModelKind::bert) out.largest_tensor = std::max(out.largest_tensor, c.classes * d);
  switch (c.kind) {
    case ModelKind::gpt:
      out.shared_params = c.tied ? V * d : 0;
      out.blocks.push_back({c.tied ? 0 : V * d, c.tied, T * d * 4, T, true});  // the token table
      for (int64_t l = 0; l < c.depth; ++l) out.blocks.push_back(transformer);
      out.blocks.push_back({2 * d + (c.tied ? 0 : V * d), c.tied, T * (d + 3 * V) * 4, T * d, false});  // norm, head
      return out;
    case ModelKind::bert:
      out.blocks.push_back({V * d + T * d + 2 * d, false, T * d * 2 * 4, T, true});  // tables and their norm
      for (int64_t l = 0; l < c.depth; ++l) out.blocks.push_back(transformer);
      out.blocks.push_back({d * d + d, false, 0, T * d, false});                          // pooler
      out.blocks.push_back({c.classes * d + c.classes, false, c.classes * 3 * 4, d, false});  // classifier
      return out;
    case ModelKind::mlp:
    case ModelKind::custom: break;
  }
  STRATA_FAIL("model_sizes: modelled for gpt and bert presets, not for " << c.to_string());
}

}  // namespace strata::models
