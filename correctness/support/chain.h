#pragma once
// Chain models: a user's own kind of block model, built from a small library of blocks, so the
// parity suite covers what the presets never have — buffers a forward updates (BatchNorm's running
// statistics) or only reads (a fixed table), frozen parameters, blocks without parameters, one
// parameter shared by any number of blocks anywhere in the chain, convolutions, and a linear head
// that can be split by columns. Inputs are [batch, in] floats, targets [batch] class indices.
#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace strata::correctness {

/// The block library, by the token a ChainSpec lists it under. Every block maps [N, width] to
/// [N, width]; the chain adds an input layer (in -> width) before them and a head after them.
///   lin           Linear(width, width)
///   act           GELU, no parameters
///   bn            BatchNorm1d(width) in training mode: running mean/var and a step counter (buffers)
///   conv<c>       the features as c channels of width/c, Conv1d(c, c, 3, padding 1), flattened back
///   table         x * scale + shift with scale and shift fixed buffers
///   frozen        Linear(width, width) whose weight is frozen (its bias trains)
///   frozen_block  Linear(width, width), all frozen
///   shared<g>     x W_g^T + b: W_g [width, width] is one parameter shared by every shared<g> block
struct ChainSpec {
  int64_t in_features = 4;
  int64_t width = 6;
  int64_t classes = 5;
  std::vector<std::string> blocks;  ///< between the input layer and the head

  /// Rejects unknown tokens and shapes that do not fit (conv<c> with c not dividing width), naming them.
  void validate() const;
  /// "chain(in=4 width=6 classes=5 blocks=lin,bn,shared0,act,shared0)"
  std::string to_string() const;
  static ChainSpec parse(const std::string& text);

  /// Input layer, blocks, head: the same spec and seed give the same model on any machine.
  models::BlockModel build(uint64_t seed) const;
  models::Batch make_batch(int64_t batch_size, uint64_t seed) const;
  /// True if some block's token starts with `prefix` ("bn", "shared", ...).
  bool has(const std::string& prefix) const;
  int64_t num_blocks() const { return static_cast<int64_t>(blocks.size()) + 2; }
};

}  // namespace strata::correctness
