#pragma once
// rapidcheck generators for the parity properties: preset model kinds at generated sizes (tied and
// untied, odd sizes), chains of library blocks (buffers, frozen parameters, shared parameters),
// batch sizes, seeds, targets with ignored positions, and each strategy's own options. Every draw
// covers its whole range at any rapidcheck size (rapidcheck's inRange alone narrows with the size).
#include <rapidcheck.h>

#include "correctness/support/parity.h"

namespace strata::correctness {

/// Uniform over [min, max) whatever the test size; shrinks towards min.
template <typename T>
rc::Gen<T> uniform(T min, T max) {
  return rc::gen::resize(rc::kNominalSize, rc::gen::inRange<T>(min, max));
}

/// Small configs of every preset kind; about half of the gpt and mlp ones are tied.
rc::Gen<models::ModelConfig> gen_model_config();

/// What the chain generator may use.
struct ChainLimits {
  /// BatchNorm couples the samples of a batch: a strategy that runs slices of the batch apart
  /// (data parallel ranks, micro-batches) computes other statistics by design, so it sets this false.
  bool batch_coupled_blocks = true;
};
/// Chains of 0..6 library blocks between the input layer and the head; about half of them share
/// one parameter among 2..4 blocks, some a second one too.
rc::Gen<ChainSpec> gen_chain_spec(ChainLimits limits = {});

/// What the options generators see of a model, without building it.
struct ModelShape {
  int64_t blocks = 0;
  bool splittable_head = false;  ///< the last block is a linear head with a weight of its own
  int64_t head_classes = 0;
};
ModelShape shape_of(const ParityCase& c);
/// Blocks in a model of `config` (without building it).
int64_t block_count(const models::ModelConfig& config);

using Options = std::map<std::string, std::string>;
using OptionsGenerator = std::function<rc::Gen<Options>(const ModelShape&, const std::vector<std::string>& devices)>;

/// What a strategy's parity property draws beyond the model: its options (none when unset) and
/// the limits on chain models.
struct StrategyTraits {
  OptionsGenerator options;
  ChainLimits chain;
  /// Runs one slice of the batch per rank: batches of at least the world size, no BatchNorm.
  bool data_parallel = false;
  /// Splits the batch into micro-batches (a pipeline): their count under the drawn options, the
  /// least batch those options accept. Unset for a strategy that runs the batch whole.
  std::function<int(const Options&)> micro_batches;
  /// Option values the property must have drawn, each at least once, in a run of 25 cases or more
  /// (CI's fixed-seed run among them): key -> values.
  std::map<std::string, std::vector<std::string>> must_reach;
};
/// Strategy name -> its traits; a strategy with options or limits adds itself here.
const std::map<std::string, StrategyTraits>& strategy_traits();

/// Whether `strategy` trains under `policy`: asked of the strategy itself, built under fp32 on the
/// CPU with the options it requires (one that cannot be built so: no). A user's own registered
/// strategy that trains in fp32 only is given fp32 cases only.
bool strategy_supports(const std::string& strategy, const PrecisionPolicy& policy);

/// The registered strategies that save and load their training state (Strategy::training_state).
const std::vector<std::string>& saving_strategies();

/// A parity case for `strategy` that starts in another saving strategy (or the same one; not a
/// pipeline, whose default micro-batches a batch may not fill) and resumes from its state after 1
/// or 2 of its 3 steps (ParityCase::resume_from).
rc::Gen<ParityCase> gen_resume_case(const std::string& strategy, const std::vector<std::string>& devices);

/// A resume across the processes of a launch (check_parity with ResumeAcross): the first steps'
/// strategy trains at first_world ranks, the strategy under test at then_world.
struct ResumeAcrossCase {
  ParityCase c;        ///< with resume_from and resume_at
  int first_world = 1;
  int then_world = 1;
  std::string to_string() const;
};
/// gen_resume_case's cases for `strategy` (not a pipeline) in a launch of `world` ranks, where a
/// data-parallel first strategy gets only cases it slices exactly (no BatchNorm); world sizes
/// 1..world for a data-parallel strategy (never more ranks than the batch has samples), 1 for
/// another.
rc::Gen<ResumeAcrossCase> gen_resume_across(const std::string& strategy, const std::vector<std::string>& devices,
                                            int world);

/// A parity case for `strategy`: a preset kind or a chain (half each), a batch of 1..5 (4..8 with
/// BatchNorm; world size and up for data-parallel strategies), a seed, ignored targets or not,
/// the strategy's options, and fp32 or (a third of the cases, where the strategy trains in bf16
/// and the model has no floating-point buffers) bf16. `devices` lists what the machine offers for
/// multi-device strategies.
rc::Gen<ParityCase> gen_parity_case(const std::string& strategy, const std::vector<std::string>& devices);

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
inline void showValue(const ResumeAcrossCase& c, std::ostream& os) { os << c.to_string(); }
inline void showValue(const ChainSpec& c, std::ostream& os) { os << c.to_string(); }
}  // namespace strata::correctness
