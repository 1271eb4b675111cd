#include "correctness/support/generators.h"

namespace strata::correctness {

rc::Gen<models::ModelConfig> gen_model_config() {
  using models::ModelKind;
  // Each field is its own shrinkable draw, so a failure shrinks towards the smallest model.
  return rc::gen::apply(
      [](int kind, int depth, int heads, int head_dim, int vocab, int seq, int classes, int in, bool tied) {
        models::ModelConfig c;
        c.kind = static_cast<ModelKind>(kind);
        c.depth = depth;
        c.heads = heads;
        // Odd widths too. Never below 2: a layer norm over one feature outputs a constant, its input
        // gradient is zero up to rounding amplified by 1/sqrt(eps), and no real model has it.
        c.width = c.kind == ModelKind::mlp ? heads * head_dim + 1 : heads * head_dim;
        c.vocab = vocab;
        c.seq_len = seq;
        c.classes = classes;
        c.in_features = in;
        c.tied = c.kind != ModelKind::bert && tied;
        if (c.kind == ModelKind::mlp && c.tied) c.classes = c.in_features;
        return c;
      },
      rc::gen::inRange(0, 3), rc::gen::inRange(1, 4), rc::gen::inRange(1, 4), rc::gen::inRange(2, 6),
      rc::gen::inRange(2, 18), rc::gen::inRange(1, 7), rc::gen::inRange(2, 14), rc::gen::inRange(2, 10),
      rc::gen::arbitrary<bool>());
}

int64_t block_count(const models::ModelConfig& c) {
  switch (c.kind) {
    case models::ModelKind::mlp: return c.depth + 1;   // dense layers + output
    case models::ModelKind::gpt: return c.depth + 2;   // embedding + blocks + head
    case models::ModelKind::bert: return c.depth + 3;  // embedding + blocks + pooler + classifier
  }
  return 0;
}

namespace {

// hook_offload: prefetch depth, activations kept or recomputed, last block merged or not, and
// sometimes one block kept resident.
rc::Gen<std::map<std::string, std::string>> hook_offload_options(const models::ModelConfig& model,
                                                                  const std::vector<std::string>&) {
  const int64_t blocks = block_count(model);
  return rc::gen::apply(
      [](int prefetch, bool keep, bool merge_last, int resident) {
        std::map<std::string, std::string> o{{"prefetch", std::to_string(prefetch)},
                                             {"activations", keep ? "keep" : "recompute"},
                                             {"merge_last", merge_last ? "1" : "0"}};
        if (resident >= 0) o["resident"] = std::to_string(resident);
        return o;
      },
      rc::gen::inRange(0, 4), rc::gen::arbitrary<bool>(), rc::gen::arbitrary<bool>(),
      rc::gen::weightedOneOf<int>({{3, rc::gen::just(-1)}, {1, rc::gen::inRange<int>(0, static_cast<int>(blocks))}}));
}

// manual_split: 1 to 3 stages on the test's devices, balance automatic or drawn, and for heads of
// their own (not tied) sometimes a column split of the classifier.
rc::Gen<std::map<std::string, std::string>> manual_split_options(const models::ModelConfig& model,
                                                                  const std::vector<std::string>& devices) {
  const int64_t blocks = block_count(model);
  const bool splittable_head = !model.tied;
  const int64_t classes = model.kind == models::ModelKind::gpt ? model.vocab : model.classes;
  return rc::gen::mapcat(rc::gen::inRange<int64_t>(1, std::min<int64_t>(3, blocks) + 1), [=](int64_t stages) {
    return rc::gen::apply(
        [=](std::vector<int64_t> cuts, bool automatic, bool memory, int64_t shards) {
          std::map<std::string, std::string> o;
          std::string devs;
          for (int64_t s = 0; s < stages; ++s) devs += (s ? "," : "") + devices[s % devices.size()];
          o["devices"] = devs;
          if (automatic) {
            o["weigh"] = memory ? "memory" : "params";
          } else {
            // stages - 1 distinct cut points in 1..blocks-1 give a balance with no empty stage.
            std::sort(cuts.begin(), cuts.end());
            cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
            cuts.resize(std::min<size_t>(cuts.size(), stages - 1));
            std::string balance;
            int64_t prev = 0;
            for (auto c : cuts) {
              balance += std::to_string(c - prev) + ",";
              prev = c;
            }
            balance += std::to_string(blocks - prev);
            o["balance"] = balance;
            // Fewer distinct cuts than drawn means fewer stages: one device per stage.
            std::string trimmed;
            for (size_t s = 0; s <= cuts.size(); ++s) trimmed += (s ? "," : "") + devices[s % devices.size()];
            o["devices"] = trimmed;
          }
          if (splittable_head && shards > 1) o["classifier_shards"] = std::to_string(std::min(shards, classes));
          return o;
        },
        rc::gen::container<std::vector<int64_t>>(static_cast<size_t>(stages - 1),
                                                 rc::gen::inRange<int64_t>(1, std::max<int64_t>(2, blocks))),
        rc::gen::arbitrary<bool>(), rc::gen::arbitrary<bool>(), rc::gen::inRange<int64_t>(1, 4));
  });
}

}  // namespace

const std::map<std::string, OptionsGenerator>& option_generators() {
  static const std::map<std::string, OptionsGenerator> all = {
      {"hook_offload", hook_offload_options},
      {"hook_offload_overlap", hook_offload_options},
      {"hook_offload_sync", hook_offload_options},
      {"manual_split", manual_split_options},
  };
  return all;
}

rc::Gen<ParityCase> gen_parity_case(const std::string& strategy, const std::vector<std::string>& devices) {
  return rc::gen::mapcat(gen_model_config(), [strategy, devices](const models::ModelConfig& model) {
    auto found = option_generators().find(strategy);
    auto options = found == option_generators().end()
                       ? rc::gen::just(std::map<std::string, std::string>{})
                       : found->second(model, devices);
    return rc::gen::apply(
        [model](int batch, unsigned seed, std::map<std::string, std::string> opts) {
          ParityCase c;
          c.model = model;
          c.batch_size = batch;
          c.seed = seed;
          c.options = std::move(opts);
          return c;
        },
        rc::gen::inRange(1, 6), rc::gen::inRange(0u, 1000u), options);
  });
}

}  // namespace strata::correctness
