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
        c.width = c.kind == ModelKind::mlp ? heads * head_dim + 1 : heads * head_dim;  // odd widths too
        c.vocab = vocab;
        c.seq_len = seq;
        c.classes = classes;
        c.in_features = in;
        c.tied = c.kind != ModelKind::bert && tied;
        if (c.kind == ModelKind::mlp && c.tied) c.classes = c.in_features;
        return c;
      },
      rc::gen::inRange(0, 3), rc::gen::inRange(1, 4), rc::gen::inRange(1, 4), rc::gen::inRange(1, 6),
      rc::gen::inRange(2, 18), rc::gen::inRange(1, 7), rc::gen::inRange(2, 14), rc::gen::inRange(2, 10),
      rc::gen::arbitrary<bool>());
}

const std::map<std::string, OptionsGenerator>& option_generators() {
  static const std::map<std::string, OptionsGenerator> all = {};
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
