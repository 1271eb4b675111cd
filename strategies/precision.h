#pragma once
// Mixed precision, one policy for every strategy: forward and backward in a compute dtype (fp32,
// bf16 or fp16) over fp32 master parameters and fp32 optimizer state, the loss in fp32, gradients
// summed in a reduction dtype, and for fp16 dynamic loss scaling with skipped steps.
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "models/model.h"

namespace strata {

/// The precision a strategy trains in. fp32 everywhere is the default and changes nothing.
struct PrecisionPolicy {
  torch::ScalarType compute = torch::kFloat;   ///< parameters and activations in forward and backward
  torch::ScalarType transfer = torch::kFloat;  ///< parameters as they travel (to the device, gathered, between stages)
  torch::ScalarType reduce = torch::kFloat;    ///< gradients as they are summed (over micro-batches, ranks)
  /// fp16 only: the loss scale of the first step; it halves on a step with an inf or nan gradient
  /// (the step is skipped) and doubles after `scale_growth_interval` good steps.
  double initial_scale = 65536.0;
  int64_t scale_growth_interval = 2000;

  /// "fp32", "bf16" or "fp16" (compute and transfer in that dtype, reduction in fp32), optionally
  /// followed by comma-separated overrides: "bf16,transfer=fp32,reduce=bf16,scale=1024,growth=100".
  /// An unknown dtype, key or malformed value is an Error that names it; the result is validated.
  static PrecisionPolicy parse(const std::string& text);
  /// Rejects combinations that make no sense, naming them: a transfer or reduction dtype other
  /// than the compute dtype or fp32 (fp16 beside bf16, or narrower than compute), loss scaling
  /// settings that are not positive.
  void validate() const;
  /// The inverse of parse(): "fp32", "bf16", or "bf16,reduce=bf16" where a field differs from the
  /// name's defaults.
  std::string to_string() const;
  bool is_fp32() const { return compute == torch::kFloat && transfer == torch::kFloat && reduce == torch::kFloat; }
  /// Dynamic loss scaling applies (compute in fp16).
  bool scales_loss() const { return compute == torch::kHalf; }
  /// A floating input (features) in the compute dtype; token ids and other integers as they are;
  /// under fp32, every input as it is.
  torch::Tensor cast_input(const torch::Tensor& input) const;
};

/// Refuses a policy `device` cannot compute in, naming both (fp16 on a CPU whose LibTorch has no
/// fp16 matrix products, as Debian's 1.13).
void check_precision_on(const PrecisionPolicy& policy, const torch::Device& device);

/// Refuses, naming the first such buffer, a model with floating-point buffers (a BatchNorm's
/// running statistics) under a policy other than fp32: blocks would meet compute-dtype weights
/// beside fp32 statistics, and casting the statistics would lose what they accumulate.
void check_buffers_under(const PrecisionPolicy& policy, const models::BlockModel& model, const std::string& strategy);

/// "fp32", "bf16", "fp16"; parse_dtype() reads them back (and float32, bfloat16, float16).
std::string dtype_name(torch::ScalarType dtype);
torch::ScalarType parse_dtype(const std::string& name);
/// The largest relative error of one rounding to `dtype`: 2^-24 (fp32), 2^-8 (bf16), 2^-11 (fp16).
double unit_roundoff(torch::ScalarType dtype);

/// Compute copies of parameters that live in ordinary modules: while bound, each parameter's data
/// is a copy in the compute dtype (made from its fp32 master), so the blocks run in that dtype and
/// autograd leaves their gradients there; unbinding adds those gradients (through the reduction
/// dtype) to the masters' fp32 gradients and puts the masters back. Under an fp32 policy it does
/// nothing. The optimizer always sees fp32 parameters with fp32 gradients.
class ComputeCopies {
 public:
  ComputeCopies() = default;
  ComputeCopies(const PrecisionPolicy& policy, std::vector<torch::Tensor> parameters);
  void bind();
  /// Safe to call when not bound; `keep_gradients` = false drops what the bound step produced
  /// (a step that failed).
  void unbind(bool keep_gradients = true);
  bool bound() const { return bound_; }

  /// bind() for a scope. commit() unbinds keeping the step's gradients (and may throw, e.g. out
  /// of memory, as any step may); a scope left without it (an error on the way) unbinds dropping
  /// them, and never throws from its destructor.
  class Scope {
   public:
    explicit Scope(ComputeCopies& copies) : copies_(copies) { copies_.bind(); }
    void commit() { copies_.unbind(/*keep_gradients=*/true); }
    ~Scope() {
      try {
        copies_.unbind(/*keep_gradients=*/false);  // nothing left to do after commit()
      } catch (...) {
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    ComputeCopies& copies_;
  };

 private:
  PrecisionPolicy policy_;
  std::vector<torch::Tensor> parameters_, masters_, master_grads_;
  bool bound_ = false;
};

/// Dynamic loss scaling for fp16: the loss is multiplied by scale() before backward, so small
/// gradients do not flush to zero in fp16; unscale() divides the gradients back and says whether
/// all are finite. A step with an inf or nan is skipped and the scale halved; after the growth
/// interval of good steps in a row it doubles. Disabled (scale 1, nothing skipped) for other dtypes.
class LossScaler {
 public:
  LossScaler() = default;
  explicit LossScaler(const PrecisionPolicy& policy);
  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  /// Multiplies every defined gradient by 1 / scale() (as an fp32 factor) in place; true if all
  /// the results are finite.
  bool unscale(const std::vector<torch::Tensor>& gradients) const;
  /// `loss` times scale(), what backward starts from; `loss` itself when disabled.
  torch::Tensor scaled(const torch::Tensor& loss) const;
  /// A gradient as unscale() leaves it (a new tensor); `gradient` itself when disabled.
  torch::Tensor unscaled(const torch::Tensor& gradient) const;
  /// After each optimizer step: `finite` false means the step was skipped.
  void update(bool finite);
  int64_t skipped_steps() const { return skipped_; }
  /// {scale, good steps in a row, skipped steps}, for a checkpoint; restore() takes it back.
  torch::Tensor state() const;
  void restore(const torch::Tensor& state);

 private:
  bool enabled_ = false;
  double scale_ = 1.0;
  int64_t interval_ = 2000, good_in_a_row_ = 0, skipped_ = 0;
};

}  // namespace strata
