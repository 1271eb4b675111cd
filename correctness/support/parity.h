#pragma once
// The one parity checker: given a strategy, a model, a seed and batches, run the strategy beside
// the baseline and compare the loss, every gradient and every buffer by canonical name, and the
// parameters after each optimizer step (SGD-momentum and AdamW). The second step accumulates the
// gradients of two batches before its optimizer step.
//
// The error bound follows from the computation, not from trial. Every quantity is also computed by
// a float64 run of the baseline (the reference R, exact to far below fp32's rounding), and by fp32
// runs of the baseline (B_0 as given, B_1..B_k with every parameter and buffer moved by one ulp in a
// random direction). A strategy computes the same mathematics as the baseline in fp32, in another
// order (a tied gradient summed elsewhere, a softmax split over shards, another matmul kernel), so
// its error against R is rounding of the same size as the baseline's own: for each tensor,
//
//   max|S - R|  <=  kReferenceErrorMultiple * max_k max|B_k - R|  +  kRoundingFloorUlps * u * scale
//                   + kFp32SmallestNormal
//
// with u = 2^-24 and `scale` the magnitude of what entered the computation (below; for a strategy
// whose batch_slices() is above 1, a gradient's scale also takes the sum over the slices of each
// slice's |gradient|, from a float64 run on the slices: the strategy rounds the slices and their
// sum at that size, which the whole-batch baselines never see where the slices cancel). A gradient
// that fails this bound is looked at once more with its scale widened the same way to the sum over
// the batch's samples of |sample's gradient| (a strategy that forms each sample's share by another
// route, a softmax split over class shards, rounds at the shares' size where they cancel); a model
// that cannot run a sample alone (BatchNorm) keeps the first verdict. The B_k measure
// how large fp32 rounding is for this very quantity, cancellation included: a gradient that is
// zero in exact arithmetic (a bias before a BatchNorm) is pure rounding noise in every fp32 run, and
// so is its bound. The moved ulp gives each B_k its own rounding pattern, so one lucky run cannot
// make the bound small. Parameters after optimizer steps get, on top, what the gradients' own
// allowed errors can move them: lr x gain x (gradient bound) per step, with gain 1 / (1 - momentum)
// for SGD and 1 / eps for AdamW, at most lr per AdamW step (whose update g / (|g| + eps) turns a gradient of pure rounding
// noise into a step of up to lr; found by the explorer on a bias before a BatchNorm, where the
// baselines' noise happened to be 3000 times smaller than a sharded head's). A strategy that is off
// by one ulp in every element passes (its error is at
// most B_0's plus one ulp of the value); one that doubles a gradient fails (its error is the
// gradient itself, far above rounding). Why these constants: beside each.
#include <functional>
#include <optional>
#include <string>

#include "correctness/support/chain.h"
#include "strategies/strategy.h"

namespace strata::correctness {

/// fp32's unit roundoff, 2^-24: the largest relative error of one rounding.
inline constexpr double kFp32UnitRoundoff = 5.9604644775390625e-08;
/// A strategy's error may be this many times the largest error of the fp32 baselines. Rounding
/// errors of one quantity in independent runs are samples of one distribution; where a tensor is
/// pure rounding noise dominated by one element (a gradient that cancels to zero, amplified by a
/// small BatchNorm variance), the strategy's error and the baselines' are effectively single
/// samples, and one sample exceeds a multiple of the largest of five others with a probability that
/// falls fast with the multiple (simulated for normal errors: 6e-5 at 8x, 2e-6 at 16x, 2.5e-7 at
/// 32x; 1.5e-6 at 32x when the strategy's rounding is twice the baseline's, as in a softmax split
/// over shards). 32x keeps exploration over thousands of cases free of false alarms and is still
/// far below any real defect (a missed or doubled contribution is of the order of the value itself,
/// about 10^7 times fp32's rounding). Three runs and 4x, tried first, failed about once in a
/// hundred such tensors.
inline constexpr double kReferenceErrorMultiple = 32.0;
/// The floor for quantities the fp32 baselines happen to round exactly: eight roundings of the
/// largest magnitude that entered the computation — for a gradient, the largest gradient of any
/// parameter of the blocks that use it (the same backward products fed both); for the loss, the
/// larger of itself and the model's largest output (a cross entropy that cancels rounds at its
/// logits' size); for a parameter or buffer, its own largest value.
inline constexpr double kRoundingFloorUlps = 8.0;
/// fp32's smallest normal number: below it every value is zero as far as training can tell (a zero
/// moved by one ulp lands in the denormals), so no bound is tighter.
inline constexpr double kFp32SmallestNormal = 1.1754943508222875e-38;
/// fp32 baselines with moved parameters, beside the unmoved one: five samples of the rounding in all.
inline constexpr int kPerturbedReferences = 4;
/// AdamW divides by sqrt(v) + eps; at eps = 1e-8 an element whose gradient is pure rounding noise
/// gets an update of about lr, different in every run, which no parameter comparison could tell
/// from a bug. 1e-5 keeps such updates small while real gradients (1e-4 and up) behave as in
/// training.
inline constexpr double kParityAdamwEps = 1e-5;

/// A model of the caller's own for a parity case: its blocks (any Block subclasses, tied
/// parameters, buffers and frozen parameters included) and its batches.
struct OwnModel {
  std::string name;                                                        ///< how messages name the model
  std::function<models::BlockModel(uint64_t seed)> build;                  ///< the same model for the same seed
  std::function<models::Batch(int64_t batch_size, uint64_t seed)> batch;   ///< host tensors, the same for the same seed
};

/// What a parity case trains: a preset kind at some size, a chain of library blocks, or a model
/// of the caller's own.
struct ParityCase {
  models::ModelConfig model;
  std::optional<ChainSpec> chain;             ///< when set, the model is this chain and `model` is unused
  std::optional<OwnModel> own;                ///< when set, the model is this one and `model`, `chain` are unused
  int64_t batch_size = 2;
  uint64_t seed = 0;
  int steps = 3;                              ///< optimizer steps, each after one train_step
  bool ignore_targets = false;                ///< about a third of the targets are kIgnoreIndex (never all)
  std::map<std::string, std::string> options; ///< the strategy's own options
  /// The order a trainer calls the strategy in: train_step (each accumulated batch), optimizer_step
  /// at once (before the checker's own work on the device), then parameters() and buffers(),
  /// nothing read between. The default order reads gradients()
  /// and buffers() before each optimizer_step, and gradients() waits for the gradients in flight,
  /// so a strategy whose optimizer_step forgets that wait passes it; this order catches it (with
  /// the device layer's delays injected, where the copies run late). Gradients are then not
  /// compared: their bounds, from the references alone, still bound the parameters.
  bool trainer_order = false;
  /// Resume anywhere: the steps before `resume_at` (1 or more) run in the registered strategy
  /// `resume_from` (its default options); its training_state() then goes through checkpoint files
  /// (strategies/state_files.h) into a new instance of the strategy under test, which trains the
  /// rest. Every step is checked as usual. 0: the strategy under test trains every step.
  std::string resume_from;
  int resume_at = 0;
  /// The strategy and the baselines B_k train under it (the float64 reference does not): its
  /// compute dtype's unit roundoff replaces fp32's in the bound, and each B_k moves every
  /// parameter by one ulp of that dtype, so the B_k measure its rounding. Default fp32.
  PrecisionPolicy precision;

  /// "gpt(depth=1 ...) batch=1 seed=145 steps=3 balance=3 classifier_shards=2": the model, the
  /// case's own fields, then the options; parse() reads it back (not for a model of one's own).
  std::string to_string() const;
  static ParityCase parse(const std::string& text);

  models::BlockModel build() const;
  /// The batch of optimizer step `step` (its `micro`-th when it accumulates several).
  models::Batch batch(int step, int micro = 0) const;
  std::string model_text() const { return own ? own->name : chain ? chain->to_string() : model.to_string(); }
};

struct ParityResult {
  bool ok = true;
  std::string message;  ///< the first mismatch: optimizer, step, tensor, its error and the bound
};

using StrategyMaker = std::function<std::unique_ptr<Strategy>(const StrategyConfig&)>;

/// Runs `steps` steps of each optimizer on the references and on `make(config)`; stops at the
/// first mismatch. `device` is the main device of all of them. TF32 is off during the check (the
/// bound is fp32's) and restored after it. A model whose training step draws random numbers
/// (dropout) is an Error: the runs compared would draw other numbers.
/// A resume across processes, for check_parity: every rank of the launch runs the check (each
/// comparison settled over all of them: one rank's mismatch ends it everywhere). The steps before
/// ParityCase::resume_at run in `first(config)` (resume_from on the ranks that train it, a stand-in
/// on the others), and at resume_at `hand_over(from, to)` takes the state of `from` into `to`
/// (made by the check's StrategyMaker and attached), e.g. through checkpoint files the ranks of one
/// world write and those of another read.
struct ResumeAcross {
  StrategyMaker first;
  std::function<void(Strategy& from, Strategy& to)> hand_over;
};

ParityResult check_parity(const StrategyMaker& make, const ParityCase& c, const torch::Device& device,
                          const ResumeAcross* across = nullptr);
/// Same, for a registered strategy.
ParityResult check_parity(const std::string& strategy, const ParityCase& c, const torch::Device& device);

/// Magnitudes that bound the rounding of each tensor (see above), by position in the lists.
using Scales = std::vector<double>;
/// The bound above for one list of named tensors: `actual` (the strategy) against `reference`
/// (float64), with the fp32 baselines `baselines`. Names, order and shapes must match exactly.
/// `carried` (per tensor, may be empty) is added to each bound: for parameters, what the gradient
/// errors allowed at earlier steps may have moved them. `bounds`, when given, receives each
/// tensor's bound. Returns an empty string when every tensor is within its bound, else what differs.
std::string compare_to_reference(const std::string& what, const NamedTensors& actual,
                                 const std::vector<NamedTensors>& baselines, const NamedTensors& reference,
                                 const Scales& scales, const std::vector<double>& carried = {},
                                 std::vector<double>* bounds = nullptr, double unit_roundoff = kFp32UnitRoundoff);

}  // namespace strata::correctness
