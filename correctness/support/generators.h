#pragma once
// rapidcheck generators for the parity properties: model configs (tied and untied, odd sizes),
// batch sizes, seeds, and each strategy's own options.
#include <rapidcheck.h>

#include "correctness/support/parity.h"

namespace strata::correctness {

/// Small configs of every kind; about half of the gpt and mlp ones are tied.
rc::Gen<models::ModelConfig> gen_model_config();
/// A parity case for `strategy`: a model, a batch of 1..5, a seed, and the strategy's options as
/// drawn by the generator registered for it (none by default). `devices` lists what the
/// machine offers for multi-device strategies.
rc::Gen<ParityCase> gen_parity_case(const std::string& strategy, const std::vector<std::string>& devices);

using OptionsGenerator = std::function<rc::Gen<std::map<std::string, std::string>>(
    const models::ModelConfig&, const std::vector<std::string>& devices)>;
/// Blocks in a model of `config` (without building it).
int64_t block_count(const models::ModelConfig& config);

/// Strategy name -> generator of its options; a strategy with options adds itself here.
const std::map<std::string, OptionsGenerator>& option_generators();

}  // namespace strata::correctness

namespace rc {
template <>
struct Arbitrary<strata::models::ModelConfig> {
  static Gen<strata::models::ModelConfig> arbitrary() { return strata::correctness::gen_model_config(); }
};
}  // namespace rc

namespace strata::models {
inline void showValue(const ModelConfig& c, std::ostream& os) { os << c.to_string(); }
}  // namespace strata::models
namespace strata::correctness {
inline void showValue(const ParityCase& c, std::ostream& os) { os << c.to_string(); }
}  // namespace strata::correctness
