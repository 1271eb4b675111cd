#pragma once
// Block models: an ordered list of blocks plus a loss, built deterministically from a config and a
// seed. Single-device code only: no model knows which strategy runs it.
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace strata::models {

/// The reference models, and `custom` for a model built from a user's own blocks with
/// BlockModel(config, blocks), whose config fields then describe nothing.
enum class ModelKind { mlp, gpt, bert, custom };

/// Targets equal to this are left out of the loss and of its mean (as PyTorch's cross_entropy).
inline constexpr int64_t kIgnoreIndex = -100;

/// Name <-> kind ("mlp", "gpt", "bert", "custom"); an unknown name is an Error that lists the known ones.
std::string to_string(ModelKind kind);
ModelKind parse_model_kind(const std::string& name);

/// Every model is described by this one struct; fields a kind does not use are ignored by it.
struct ModelConfig {
  ModelKind kind = ModelKind::gpt;
  int64_t depth = 2;        ///< mlp: hidden blocks; gpt/bert: transformer blocks
  int64_t width = 32;       ///< hidden size
  int64_t heads = 4;        ///< gpt/bert: attention heads (must divide width)
  int64_t vocab = 64;       ///< gpt/bert: token vocabulary
  int64_t seq_len = 8;      ///< gpt/bert: tokens per sample
  int64_t classes = 10;     ///< mlp/bert: output classes
  int64_t in_features = 8;  ///< mlp: input features
  bool tied = true;         ///< gpt: LM head tied to the token embedding; mlp: output layer tied to the input layer

  /// Rejects invalid values with an Error naming the value and what would be valid.
  void validate() const;
  /// One line, e.g. "gpt(depth=2 width=32 heads=4 vocab=64 seq_len=8 tied=1)".
  std::string to_string() const;
  /// The inverse of to_string(): every field the kind uses must be given; an Error names what is
  /// missing, unknown or malformed.
  static ModelConfig parse(const std::string& text);
};

/// One unit a strategy places, offloads, shards or stages.
class Block : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  /// Estimate of the bytes this block keeps for backward (its saved activations, and for a head
  /// the loss's logits and their gradient) for a batch of `batch` samples; used to balance stages.
  virtual int64_t activation_bytes(int64_t batch) const { return 0; }
};

/// While alive on a thread, forwards on that thread run only for their autograd graph: the caller
/// (a recompute in backward) takes gradients from the graph and never reads the output's values, so
/// a block may skip work whose result only the output holds (the transformer skips its last matrix
/// product, as PyTorch's checkpoint stops recomputing once every tensor backward needs exists).
class GraphOnlyForward {
 public:
  GraphOnlyForward();
  ~GraphOnlyForward();
  GraphOnlyForward(const GraphOnlyForward&) = delete;
  GraphOnlyForward& operator=(const GraphOnlyForward&) = delete;
  /// True inside a GraphOnlyForward on this thread.
  static bool active();

 private:
  bool was_;
};

/// x W^T + b through the fused kernel (the bias added by the matrix product, over inputs of any
/// rank): LibTorch's nn::Linear adds the bias in a kernel of its own for inputs above two dimensions.
torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x);

/// linear(layer, x) whose output only carries a graph: its values are left unset (no matrix
/// product) and its backward is the linear map's. Inside a GraphOnlyForward, for a last layer whose
/// output feeds nothing that backward needs the value of (a residual sum that ends the block).
torch::Tensor linear_graph_only(const torch::nn::Linear& layer, const torch::Tensor& x);

/// A last block whose output is a linear map of features: logits = features(x) weight^T + bias,
/// with weight [classes, features]. Strategies may split such a head by output columns.
class LinearHead {
 public:
  virtual ~LinearHead() = default;
  virtual torch::Tensor features(const torch::Tensor& x) = 0;
  virtual torch::Tensor weight() const = 0;  ///< [classes, features]
  virtual torch::Tensor bias() const = 0;    ///< [classes], or undefined
};

/// A parameter (or buffer) under its canonical name: the first name it gets walking blocks in order.
struct NamedParameter {
  std::string name;
  torch::Tensor tensor;
  int64_t owner_block;  ///< first block that uses it
};
using NamedBuffer = NamedParameter;

/// Input and target of one batch, on the host.
struct Batch {
  torch::Tensor input;
  torch::Tensor target;
  int64_t size() const { return input.size(0); }
};

class BlockModel {
 public:
  BlockModel(ModelConfig config, std::vector<std::shared_ptr<Block>> blocks);

  const ModelConfig& config() const { return config_; }
  const std::vector<std::shared_ptr<Block>>& blocks() const { return blocks_; }
  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }

  /// Mean cross-entropy of output [..., C] against integer targets [...], over the targets that are
  /// not kIgnoreIndex, taken in fp32 (bf16 and fp16 outputs are widened first).
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) const;
  /// The sum that loss() averages: cross-entropy summed over the targets that are not
  /// kIgnoreIndex. A strategy that splits a batch divides each slice's sum by the whole batch's
  /// count_targets(), so the slices add up to the whole batch's mean.
  torch::Tensor loss_sum(const torch::Tensor& output, const torch::Tensor& target) const;
  /// Targets that count (are not kIgnoreIndex).
  static int64_t count_targets(const torch::Tensor& target);

  /// Parameters in canonical order, each once (tied parameters identified by TensorImpl).
  const std::vector<NamedParameter>& parameters() const { return parameters_; }
  /// For each block, the indices into parameters() of the parameters it uses.
  const std::vector<std::vector<int64_t>>& block_parameters() const { return block_parameters_; }
  /// True if some parameter is used by more than one block.
  bool has_tied_parameters() const;
  /// Buffers (running statistics, fixed tables) in canonical order, each once, like parameters().
  const std::vector<NamedBuffer>& buffers() const { return buffers_; }
  /// For each block, the indices into buffers() of the buffers it holds.
  const std::vector<std::vector<int64_t>>& block_buffers() const { return block_buffers_; }

  int64_t parameter_count() const;
  int64_t parameter_bytes() const;
  /// Forward FLOPs for one item (a token for gpt, a sample otherwise); a training step costs ~3x.
  double forward_flops_per_item() const;
  /// Items in a batch of `batch_size` samples (tokens for gpt).
  int64_t items_per_batch(int64_t batch_size) const;

 private:
  ModelConfig config_;
  std::vector<std::shared_ptr<Block>> blocks_;
  std::vector<NamedParameter> parameters_;
  std::vector<std::vector<int64_t>> block_parameters_;
  std::vector<NamedBuffer> buffers_;
  std::vector<std::vector<int64_t>> block_buffers_;
};

/// Builds the model of `config`; the same config and seed give the same parameters on any machine.
BlockModel build_model(const ModelConfig& config, uint64_t seed);

/// A batch of `batch_size` samples drawn from `seed` (host tensors).
Batch make_batch(const ModelConfig& config, int64_t batch_size, uint64_t seed);

/// Named sizes, from tiny (CPU tests) to sizes an H200 trains only offloaded or split.
struct Preset {
  std::string name;
  ModelConfig config;
  int64_t batch_size;
  std::string note;
};
const std::vector<Preset>& presets();
/// The preset called `name`; an unknown name is an Error that lists the known ones.
const Preset& preset(const std::string& name);

}  // namespace strata::models
