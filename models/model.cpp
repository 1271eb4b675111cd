#include "models/model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <atomic>
#include <numeric>
#include <thread>
#include <sstream>
#include <unordered_map>

#include "models/builders.h"
#include "models/check.h"
#include "models/text.h"
#include "models/threads.h"

namespace strata::models {

namespace {
thread_local bool graph_only_forward = false;

// The linear map's backward without its forward: the output is allocated, never computed.
struct LinearGraphOnly : torch::autograd::Function<LinearGraphOnly> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["bias"] = bias.defined();
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    return torch::empty(sizes, x.options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& weight = saved[1];
    const auto g = grad_out[0].reshape({-1, weight.size(0)});
    torch::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = g.mm(weight).view(x.sizes());
    if (ctx->needs_input_grad(1)) gw = g.t().mm(x.reshape({-1, weight.size(1)}));
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = g.sum(0);
    return {gx, gw, gb};
  }
};
}  // namespace

GraphOnlyForward::GraphOnlyForward() : was_(graph_only_forward) { graph_only_forward = true; }
GraphOnlyForward::~GraphOnlyForward() { graph_only_forward = was_; }
bool GraphOnlyForward::active() { return graph_only_forward; }

torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return torch::linear(x, layer->weight, layer->bias);
}

torch::Tensor linear_graph_only(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return LinearGraphOnly::apply(x, layer->weight, layer->bias);
}

std::string to_string(ModelKind kind) {
  switch (kind) {
    case ModelKind::mlp: return "mlp";
    case ModelKind::gpt: return "gpt";
    case ModelKind::bert: return "bert";
    case ModelKind::custom: return "custom";
  }
  return "?";
}

ModelKind parse_model_kind(const std::string& name) {
  if (name == "mlp") return ModelKind::mlp;
  if (name == "gpt") return ModelKind::gpt;
  if (name == "bert") return ModelKind::bert;
  if (name == "custom") return ModelKind::custom;
  STRATA_FAIL("unknown model kind '" << name << "'; known kinds: mlp, gpt, bert, custom");
}

void ModelConfig::validate() const {
  const auto kind_name = models::to_string(kind);
  if (kind == ModelKind::custom) return;  // the user's blocks say what they are
  STRATA_CHECK(depth >= 1, kind_name << ": depth=" << depth << " must be at least 1");
  STRATA_CHECK(width >= 1, kind_name << ": width=" << width << " must be at least 1");
  if (kind == ModelKind::mlp) {
    STRATA_CHECK(in_features >= 1, "mlp: in_features=" << in_features << " must be at least 1");
    STRATA_CHECK(classes >= 2, "mlp: classes=" << classes << " must be at least 2");
    STRATA_CHECK(!tied || classes == in_features,
                 "mlp: tied output layer needs classes == in_features, got classes=" << classes
                     << " in_features=" << in_features);
    return;
  }
  STRATA_CHECK(heads >= 1, kind_name << ": heads=" << heads << " must be at least 1");
  STRATA_CHECK(width % heads == 0,
               kind_name << ": heads=" << heads << " does not divide width=" << width);
  STRATA_CHECK(vocab >= 2, kind_name << ": vocab=" << vocab << " must be at least 2");
  STRATA_CHECK(seq_len >= 1, kind_name << ": seq_len=" << seq_len << " must be at least 1");
  if (kind == ModelKind::bert) {
    STRATA_CHECK(classes >= 2, "bert: classes=" << classes << " must be at least 2");
    STRATA_CHECK(!tied, "bert: tied=1 is not supported (its classifier has no input embedding to tie to)");
  }
}

std::string ModelConfig::to_string() const {
  std::ostringstream out;
  if (kind == ModelKind::custom) return "custom()";
  out << models::to_string(kind) << "(depth=" << depth << " width=" << width;
  if (kind == ModelKind::mlp) {
    out << " in_features=" << in_features << " classes=" << classes;
  } else {
    out << " heads=" << heads << " vocab=" << vocab << " seq_len=" << seq_len;
    if (kind == ModelKind::bert) out << " classes=" << classes;
  }
  if (kind != ModelKind::bert) out << " tied=" << tied;
  out << ")";
  return out.str();
}

namespace {

// Canonical names: the first name a tensor gets walking the blocks in order; a tensor held by
// several blocks (a tied parameter, a shared table) is recognised by its TensorImpl, never by its
// name, and listed once.
void index_by_identity(const std::vector<std::shared_ptr<Block>>& blocks,
                       const std::function<torch::OrderedDict<std::string, torch::Tensor>(Block&)>& named,
                       std::vector<NamedParameter>& all, std::vector<std::vector<int64_t>>& per_block) {
  std::unordered_map<const void*, int64_t> index_of;
  per_block.assign(blocks.size(), {});
  for (size_t b = 0; b < blocks.size(); ++b) {
    for (const auto& item : named(*blocks[b])) {
      if (!item.value().defined()) continue;  // a registered but empty slot
      const void* key = item.value().unsafeGetTensorImpl();
      auto found = index_of.find(key);
      int64_t index;
      if (found == index_of.end()) {
        index = static_cast<int64_t>(all.size());
        index_of.emplace(key, index);
        all.push_back({std::to_string(b) + "." + item.key(), item.value(), static_cast<int64_t>(b)});
      } else {
        index = found->second;
      }
      auto& uses = per_block[b];
      if (std::find(uses.begin(), uses.end(), index) == uses.end()) uses.push_back(index);
    }
  }
}

}  // namespace

ModelConfig ModelConfig::parse(const std::string& text) {
  const auto call = parse_call(text);
  ModelConfig c;
  c.kind = parse_model_kind(call.name);
  std::vector<std::string> keys;
  switch (c.kind) {
    case ModelKind::mlp: keys = {"depth", "width", "in_features", "classes", "tied"}; break;
    case ModelKind::gpt: keys = {"depth", "width", "heads", "vocab", "seq_len", "tied"}; break;
    case ModelKind::bert: keys = {"depth", "width", "heads", "vocab", "seq_len", "classes"}; c.tied = false; break;
    case ModelKind::custom: break;
  }
  for (const auto& [key, value] : call.args)
    STRATA_CHECK(std::find(keys.begin(), keys.end(), key) != keys.end(),
                 "'" << text << "': " << call.name << " has no field '" << key << "'");
  const std::map<std::string, int64_t*> fields = {{"depth", &c.depth},     {"width", &c.width},
                                                  {"heads", &c.heads},     {"vocab", &c.vocab},
                                                  {"seq_len", &c.seq_len}, {"classes", &c.classes},
                                                  {"in_features", &c.in_features}};
  for (const auto& key : keys) {
    if (key == "tied") {
      c.tied = int_arg(call, key) != 0;
    } else {
      *fields.at(key) = int_arg(call, key);
    }
  }
  c.validate();
  return c;
}

BlockModel::BlockModel(ModelConfig config, std::vector<std::shared_ptr<Block>> blocks)
    : config_(std::move(config)), blocks_(std::move(blocks)) {
  index_by_identity(blocks_, [](Block& b) { return b.named_parameters(/*recurse=*/true); }, parameters_,
                    block_parameters_);
  index_by_identity(blocks_, [](Block& b) { return b.named_buffers(/*recurse=*/true); }, buffers_, block_buffers_);
}

namespace {
// The loss is taken in fp32 whatever the compute dtype (bf16 or fp16 logits are widened first);
// float64 outputs (the parity checker's reference) stay as they are.
torch::Tensor widened(const torch::Tensor& output) {
  return output.scalar_type() == torch::kBFloat16 || output.scalar_type() == torch::kHalf ? output.to(torch::kFloat)
                                                                                         : output;
}
}  // namespace

torch::Tensor BlockModel::loss(const torch::Tensor& logits, const torch::Tensor& target) const {
  namespace F = torch::nn::functional;
  const auto output = widened(logits);
  return F::cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex));
}

torch::Tensor BlockModel::loss_sum(const torch::Tensor& logits, const torch::Tensor& target) const {
  namespace F = torch::nn::functional;
  const auto output = widened(logits);
  return F::cross_entropy(output.reshape({-1, output.size(-1)}), target.reshape({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(kIgnoreIndex).reduction(torch::kSum));
}

int64_t BlockModel::count_targets(const torch::Tensor& target) {
  return (target != kIgnoreIndex).sum().item<int64_t>();
}

bool BlockModel::has_tied_parameters() const {
  std::vector<int> users(parameters_.size(), 0);
  for (const auto& uses : block_parameters_)
    for (auto i : uses) ++users[i];
  return std::any_of(users.begin(), users.end(), [](int n) { return n > 1; });
}

int64_t BlockModel::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters_) n += p.tensor.numel();
  return n;
}

int64_t BlockModel::parameter_bytes() const {
  int64_t n = 0;
  for (const auto& p : parameters_) n += p.tensor.numel() * static_cast<int64_t>(p.tensor.element_size());
  return n;
}

double BlockModel::forward_flops_per_item() const {
  // Two FLOPs per multiply-add of every matrix product; attention counted over the full T x T
  // square (the causal half is not discounted), as is usual for MFU figures.
  const double d = static_cast<double>(config_.width), L = static_cast<double>(config_.depth);
  const double T = static_cast<double>(config_.seq_len);
  switch (config_.kind) {
    case ModelKind::mlp:
      return 2.0 * (config_.in_features * d + (L - 1) * d * d + d * config_.classes);
    case ModelKind::gpt:  // per token
      return 2.0 * (L * 12.0 * d * d + config_.vocab * d) + L * 4.0 * T * d;
    case ModelKind::bert:  // per sample: T tokens through the encoder, then pooler and classifier
      return T * (2.0 * L * 12.0 * d * d + L * 4.0 * T * d) + 2.0 * d * d + 2.0 * d * config_.classes;
    case ModelKind::custom: return 0.0;  // unknown: the user's blocks
  }
  return 0.0;
}

int64_t BlockModel::items_per_batch(int64_t batch_size) const {
  return config_.kind == ModelKind::gpt ? batch_size * config_.seq_len : batch_size;
}

namespace {

// Deterministic initialisation, so the same config and seed give bit-identical models whatever the
// module constructors drew. Weights are drawn in fixed chunks of 2^20 elements, each from its own
// generator seeded by (seed, parameter, chunk): the result does not depend on the thread count,
// and a 4.6-billion-parameter classifier initialises on all cores instead of one.
void initialise(BlockModel& model, uint64_t seed) {
  torch::NoGradGuard no_grad;
  constexpr int64_t kChunk = int64_t{1} << 20;
  struct Job {
    torch::Tensor flat;
    int64_t chunk;
    uint64_t seed;
  };
  std::vector<Job> jobs;
  const auto& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    auto t = params[i].tensor;
    const auto& name = params[i].name;
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    if (is_bias) {
      t.zero_();
    } else if (t.dim() == 1) {  // norm scales
      t.fill_(1.0);
    } else {
      auto flat = t.view({-1});
      for (int64_t c = 0; c * kChunk < flat.numel(); ++c)
        jobs.push_back({flat, c, seed * 0x9E3779B97F4A7C15ULL + (uint64_t{i} << 32) + static_cast<uint64_t>(c)});
    }
  }
  const auto threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), jobs.size()));
  std::atomic<size_t> next{0};
  auto work = [&] {
    torch::NoGradGuard guard;
    for (size_t j = next++; j < jobs.size(); j = next++) {
      auto gen = at::detail::createCPUGenerator(jobs[j].seed);
      const auto lo = jobs[j].chunk * kChunk;
      jobs[j].flat.narrow(0, lo, std::min(kChunk, jobs[j].flat.numel() - lo)).normal_(0.0, 0.02, gen);
    }
  };
  run_on_threads(threads, work);
}

}  // namespace

BlockModel build_model(const ModelConfig& config, uint64_t seed) {
  config.validate();
  std::vector<std::shared_ptr<Block>> blocks;
  switch (config.kind) {
    case ModelKind::mlp: blocks = detail::build_mlp_blocks(config); break;
    case ModelKind::gpt: blocks = detail::build_gpt_blocks(config); break;
    case ModelKind::bert: blocks = detail::build_bert_blocks(config); break;
    case ModelKind::custom:
      STRATA_FAIL("build_model: a custom model is built from its own blocks with BlockModel(config, blocks)");
  }
  BlockModel model(config, std::move(blocks));
  initialise(model, seed);
  return model;
}

Batch make_batch(const ModelConfig& config, int64_t batch_size, uint64_t seed) {
  config.validate();
  STRATA_CHECK(config.kind != ModelKind::custom, "make_batch: a custom model makes its own batches");
  STRATA_CHECK(batch_size >= 1, "batch_size=" << batch_size << " must be at least 1");
  auto gen = at::detail::createCPUGenerator(seed ^ 0x5eedba7c4ULL);
  const auto i64 = torch::TensorOptions().dtype(torch::kLong);
  switch (config.kind) {
    case ModelKind::mlp: {
      auto x = torch::randn({batch_size, config.in_features}, gen);
      auto y = torch::randint(config.classes, {batch_size}, gen, i64);
      return {x, y};
    }
    case ModelKind::gpt: {
      auto tokens = torch::randint(config.vocab, {batch_size, config.seq_len + 1}, gen, i64);
      using torch::indexing::Slice;
      return {tokens.index({Slice(), Slice(0, config.seq_len)}).contiguous(),
              tokens.index({Slice(), Slice(1, torch::indexing::None)}).contiguous()};
    }
    case ModelKind::bert: {
      auto tokens = torch::randint(config.vocab, {batch_size, config.seq_len}, gen, i64);
      auto y = torch::randint(config.classes, {batch_size}, gen, i64);
      return {tokens, y};
    }
    case ModelKind::custom: break;
  }
  return {};
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = [] {
    auto mlp = [](int64_t depth, int64_t width, int64_t in, int64_t classes, bool tied) {
      ModelConfig c;
      c.kind = ModelKind::mlp; c.depth = depth; c.width = width; c.in_features = in; c.classes = classes; c.tied = tied;
      return c;
    };
    auto gpt = [](int64_t depth, int64_t width, int64_t heads, int64_t vocab, int64_t seq) {
      ModelConfig c;
      c.kind = ModelKind::gpt; c.depth = depth; c.width = width; c.heads = heads; c.vocab = vocab; c.seq_len = seq; c.tied = true;
      return c;
    };
    auto bert = [](int64_t depth, int64_t width, int64_t heads, int64_t vocab, int64_t seq, int64_t classes) {
      ModelConfig c;
      c.kind = ModelKind::bert; c.depth = depth; c.width = width; c.heads = heads; c.vocab = vocab; c.seq_len = seq;
      c.classes = classes; c.tied = false;
      return c;
    };
    return std::vector<Preset>{
        {"mlp-tiny", mlp(2, 16, 8, 8, false), 4, "CPU tests"},
        {"mlp-tied-tiny", mlp(2, 16, 8, 8, true), 4, "CPU tests; output layer tied to the input layer"},
        {"gpt-tiny", gpt(2, 32, 4, 64, 8), 4, "CPU tests"},
        {"gpt-cpu", gpt(4, 128, 4, 1024, 64), 8, "the CPU comparison job: 0.5-1 s a step on two CPU cores; the default matrix in about a minute"},
        {"bert-tiny", bert(2, 32, 4, 64, 8, 100), 4, "CPU tests"},
        {"mlp-wide", mlp(8, 4096, 1024, 1024, false), 256, "GPU: 126M parameters, matmul-bound"},
        {"gpt-small", gpt(4, 256, 4, 4096, 128), 8, "a few seconds a step on two CPU cores"},
        {"gpt-medium", gpt(8, 1024, 16, 32000, 512), 8, "GPU comparison job: 134M parameters"},
        {"gpt-871m", gpt(16, 2048, 16, 32000, 1024), 8,
         "seed 003's measurement model: 871M parameters, 805.7M of them in blocks"},
        {"gpt-13b", gpt(40, 5120, 40, 32000, 2048), 1,
         "12.7B parameters: 203 GB with AdamW state, more than an H200 holds; offloaded it needs that much host memory"},
        {"bert-base-1m", bert(12, 768, 12, 30522, 128, 1000000), 32, "seed 000's model at 1M classes"},
        {"bert-base-6m", bert(12, 768, 12, 30522, 128, 6000000), 32,
         "seed 000's case: BERT-base and a 768 x 6,000,000 classifier (4.7B parameters)"},
        {"bert-base-12m", bert(12, 768, 12, 30522, 128, 12000000), 32,
         "a classifier of 9.2B parameters: with AdamW state more than one H200 holds; needs a split"},
    };
  }();
  return all;
}

const Preset& preset(const std::string& name) {
  std::string known;
  for (const auto& p : presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  STRATA_FAIL("unknown model preset '" << name << "'; known presets: " << known);
}

}  // namespace strata::models
