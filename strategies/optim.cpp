#include "strategies/optim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__SSE__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>
#include <sstream>

#include "models/check.h"
#include "models/threads.h"

namespace strata {

OptimizerKind parse_optimizer_kind(const std::string& name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adamw") return OptimizerKind::adamw;
  STRATA_FAIL("unknown optimizer '" << name << "'; known: sgd, adamw");
}

void OptimizerConfig::validate() const {
  STRATA_CHECK(lr > 0 && std::isfinite(lr), "optimizer lr=" << lr << " must be a positive number");
  STRATA_CHECK(momentum >= 0 && momentum < 1, "optimizer momentum=" << momentum << " must be in [0, 1)");
  STRATA_CHECK(beta1 >= 0 && beta1 < 1, "optimizer beta1=" << beta1 << " must be in [0, 1)");
  STRATA_CHECK(beta2 >= 0 && beta2 < 1, "optimizer beta2=" << beta2 << " must be in [0, 1)");
  STRATA_CHECK(eps > 0, "optimizer eps=" << eps << " must be positive");
  STRATA_CHECK(weight_decay >= 0, "optimizer weight_decay=" << weight_decay << " must not be negative");
}

std::string OptimizerConfig::to_string() const {
  std::ostringstream out;
  if (kind == OptimizerKind::sgd)
    out << "sgd(lr=" << lr << " momentum=" << momentum << ")";
  else
    out << "adamw(lr=" << lr << " betas=" << beta1 << "," << beta2 << " eps=" << eps << " wd=" << weight_decay << ")";
  return out.str();
}

namespace {

bool fusable(const torch::Tensor& param, const torch::Tensor& grad) {
  return param.device().is_cpu() && grad.device().is_cpu() && param.scalar_type() == torch::kFloat &&
         grad.scalar_type() == torch::kFloat && param.is_contiguous() && grad.is_contiguous() &&
         param.numel() == grad.numel();
}

// Host updates in one pass over memory, split over threads: a chain of tensor operations reads
// and writes every buffer once per operation (about twice the traffic), and host memory bandwidth
// is what bounds a host optimizer. Same formulas as the tensor chain below, in float.
// Out: void, or the dtype of a rounded copy written in the same loop (c10::BFloat16, c10::Half:
// their conversions from float are the ones copy_() uses).

// One element's SGD step with momentum (`first`: the step that starts the momentum buffer).
struct SgdStep {
  float momentum, lr;
  bool first;
  /// Element i read from the `_in` buffers (buf_in unread on the first step) and written to the
  /// others (the same ones in place).
  template <typename Out>
  void apply(int64_t i, const float* p_in, const float* buf_in, const float* g, float* p, float* buf, Out* out) const {
    const float b = first ? g[i] : buf_in[i] * momentum + g[i];
    buf[i] = b;
    const float pi = p_in[i] - lr * b;
    p[i] = pi;
    if constexpr (!std::is_void_v<Out>) out[i] = Out(pi);
  }
};

// One element's AdamW step (t = the step's number, from 1), in the order the loops below apply it.
struct AdamwStep {
  float decay, b1, b2, one_minus_b1, one_minus_b2, bias2, step_size, eps;
  AdamwStep(const OptimizerConfig& c, int64_t step) {
    const double t = static_cast<double>(step);
    decay = static_cast<float>(1.0 - c.lr * c.weight_decay);
    b1 = static_cast<float>(c.beta1);
    b2 = static_cast<float>(c.beta2);
    one_minus_b1 = static_cast<float>(1.0 - c.beta1);
    one_minus_b2 = static_cast<float>(1.0 - c.beta2);
    bias2 = static_cast<float>(1.0 - std::pow(c.beta2, t));
    step_size = static_cast<float>(c.lr / (1.0 - std::pow(c.beta1, t)));
    eps = static_cast<float>(c.eps);
  }
  /// Element i read from the `_in` buffers and written to the others (the same ones in place).
  template <typename Out>
  void apply(int64_t i, const float* p_in, const float* m_in, const float* v_in, const float* g, float* p, float* m,
             float* v, Out* out) const {
    const float gi = g[i];
    const float mi = m_in[i] * b1 + gi * one_minus_b1;
    const float vi = v_in[i] * b2 + gi * gi * one_minus_b2;
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi / bias2) + eps;
    const float pi = p_in[i] * decay - step_size * mi / denom;
    p[i] = pi;
    if constexpr (!std::is_void_v<Out>) out[i] = Out(pi);
  }
};

// A rounded copy's element `i` (null where there is no rounded copy, Out = void).
template <typename Out>
Out* element(Out* out, int64_t i) {
  if constexpr (std::is_void_v<Out>) return nullptr;
  else return out + i;
}

// optimizer_update's spans, in place: each buffer is read and written at one index only, and the
// buffers are distinct tensors (parameter, gradient, the state's, the rounded copy), said by the
// restrict-qualified pointers and ivdep. Without them GCC vectorized the fp32 loop behind a run-time
// overlap check but left the loop that also writes a bf16 copy scalar: 5.1 ns an element against
// 1.2 vectorized on one core of the 2-core CPU machine, which made the bf16 host pass compute-bound
// (bench/notes/bf16-host-pass.md).
template <typename Out>
void sgd_in_place(const SgdStep& step, float* __restrict__ p, float* __restrict__ buf, const float* __restrict__ g,
                  Out* __restrict__ out, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) step.apply(i, p, buf, g, p, buf, out);
}

template <typename Out>
void adamw_in_place(const AdamwStep& step, float* __restrict__ p, float* __restrict__ m, float* __restrict__ v,
                    const float* __restrict__ g, Out* __restrict__ out, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) step.apply(i, p, m, v, g, p, m, v, out);
}

template <typename Out>
void fused_host_update(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                       OptimizerState& state, Out* out) {
  const int64_t n = param.numel();
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  if (c.kind == OptimizerKind::sgd) {
    const SgdStep step{static_cast<float>(c.momentum), static_cast<float>(c.lr), !state.exp_avg.defined()};
    if (step.first) state.exp_avg = torch::empty_like(grad);
    float* buf = state.exp_avg.data_ptr<float>();
    parallel_chunks(n, [&](int64_t begin, int64_t end) {
      sgd_in_place(step, p + begin, buf + begin, g + begin, element(out, begin), end - begin);
    });
    return;
  }
  if (!state.exp_avg.defined()) {
    state.exp_avg = torch::zeros_like(grad);
    state.exp_avg_sq = torch::zeros_like(grad);
  }
  float* m = state.exp_avg.data_ptr<float>();
  float* v = state.exp_avg_sq.data_ptr<float>();
  const AdamwStep step(c, state.step);
  parallel_chunks(n, [&](int64_t begin, int64_t end) {
    adamw_in_place(step, p + begin, m + begin, v + begin, g + begin, element(out, begin), end - begin);
  });
}

// optimizer_update_into's spans: `n` elements read from the `_in` buffers and written to the
// others, which never overlap them (optimizer_update_into checks `from` and `to`, and the states
// are separate tensors): said by the restrict-qualified pointers here, and to the loops by ivdep,
// since the element steps are the in-place loops' own, whose parameters cannot say it (the
// in-place loops pass the same buffers as input and output). Without ivdep GCC leaves AdamW's
// loop scalar for this many pointers; without the restrict qualifiers the loop runs ~1.5 x slower
// (32 M elements on the 2-core CPU machine: 22 against 15 ms).
template <typename Out>
void sgd_span(const SgdStep& step, const float* __restrict__ p_in, const float* __restrict__ buf_in,
              const float* __restrict__ g, float* __restrict__ p, float* __restrict__ buf, Out* __restrict__ out,
              int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) step.apply(i, p_in, buf_in, g, p, buf, out);
}

template <typename Out>
void adamw_span(const AdamwStep& step, const float* __restrict__ p_in, const float* __restrict__ m_in,
                const float* __restrict__ v_in, const float* __restrict__ g, float* __restrict__ p,
                float* __restrict__ m, float* __restrict__ v, Out* __restrict__ out, int64_t n) {
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) step.apply(i, p_in, m_in, v_in, g, p, m, v, out);
}

// An update into other buffers writes lines it never read: an ordinary store first reads each line
// from memory (12 B an element more than in place, ~40 B against 28 for AdamW), and the lines
// then displace the inputs from cache. This span computes blocks of elements into a staging area
// that stays in cache, with the same element step, and streams them out with non-temporal stores,
// which write whole lines without reading them. Needs p, m and v at the same offset within 16
// bytes (buffers allocated alike are); otherwise, for the head and tail, and without SSE, the plain
// span.
template <typename Out>
void adamw_span_streamed(const AdamwStep& step, const float* p_in, const float* m_in, const float* v_in, const float* g,
                         float* p, float* m, float* v, Out* out, int64_t n) {
#if !defined(__SSE__)
  adamw_span(step, p_in, m_in, v_in, g, p, m, v, out, n);
#else
  const auto misalign = [](const float* x) { return reinterpret_cast<std::uintptr_t>(x) & 15; };
  if (misalign(p) != misalign(m) || misalign(p) != misalign(v)) return adamw_span(step, p_in, m_in, v_in, g, p, m, v, out, n);
  const auto at = [&](int64_t i) { return element(out, i); };
  const int64_t head = std::min<int64_t>(n, static_cast<int64_t>((16 - misalign(p)) & 15) / 4);
  adamw_span(step, p_in, m_in, v_in, g, p, m, v, at(0), head);
  constexpr int64_t kBlock = 512;  // 3 x 2 KiB of staging
  alignas(64) float sp[kBlock], sm[kBlock], sv[kBlock];
  const auto stream = [](float* dst, const float* src) {
    for (int64_t k = 0; k < kBlock; k += 4) _mm_stream_ps(dst + k, _mm_load_ps(src + k));
  };
  int64_t i = head;
  for (; i + kBlock <= n; i += kBlock) {
    adamw_span(step, p_in + i, m_in + i, v_in + i, g + i, sp, sm, sv, at(i), kBlock);
    stream(p + i, sp);
    stream(m + i, sm);
    stream(v + i, sv);
  }
  adamw_span(step, p_in + i, m_in + i, v_in + i, g + i, p + i, m + i, v + i, at(i), n - i);
  _mm_sfence();  // the streamed lines reach memory before this thread reports the span done
#endif
}

// optimizer_update_into's loop, over the whole tensor (rows == nullptr) or the listed rows of
// `cols` elements. The pointers are the tensors' starts; `first` (0 with rows) moves every buffer,
// the states' too, to the first element of a span of `count`.
template <typename Out>
void fused_host_update_into(const OptimizerConfig& c, const float* p_in, OptimizerState& in, const float* g,
                            float* p_out, OptimizerState& out_state, Out* out, int64_t count, const int64_t* rows,
                            int64_t cols, int64_t first) {
  if (c.kind == OptimizerKind::sgd) {
    const SgdStep step{static_cast<float>(c.momentum), static_cast<float>(c.lr), !in.exp_avg.defined()};
    const float* buf_in = step.first ? nullptr : in.exp_avg.data_ptr<float>() + first;
    float* buf = out_state.exp_avg.data_ptr<float>() + first;
    p_in += first, g += first, p_out += first, out = element(out, first);
    parallel_row_spans(count, rows, cols, [&](int64_t, int64_t i, int64_t n) {
      sgd_span(step, p_in + i, step.first ? nullptr : buf_in + i, g + i, p_out + i, buf + i, element(out, i), n);
    });
    return;
  }
  const float* m_in = in.exp_avg.data_ptr<float>() + first;
  const float* v_in = in.exp_avg_sq.data_ptr<float>() + first;
  float* m = out_state.exp_avg.data_ptr<float>() + first;
  float* v = out_state.exp_avg_sq.data_ptr<float>() + first;
  p_in += first, g += first, p_out += first, out = element(out, first);
  const AdamwStep step(c, out_state.step);
  parallel_row_spans(count, rows, cols, [&](int64_t, int64_t i, int64_t n) {
    adamw_span_streamed(step, p_in + i, m_in + i, v_in + i, g + i, p_out + i, m + i, v + i, element(out, i), n);
  });
}

// The same update as a chain of tensor operations, for any device and dtype.
void update_with_tensor_ops(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                            OptimizerState& state) {
  if (c.kind == OptimizerKind::sgd) {
    if (!state.exp_avg.defined())
      state.exp_avg = grad.clone();
    else
      state.exp_avg.mul_(c.momentum).add_(grad);
    param.add_(state.exp_avg, -c.lr);
    return;
  }
  if (!state.exp_avg.defined()) {
    state.exp_avg = torch::zeros_like(grad);
    state.exp_avg_sq = torch::zeros_like(grad);
  }
  const double t = static_cast<double>(state.step);
  const double bias1 = 1.0 - std::pow(c.beta1, t);
  const double bias2 = 1.0 - std::pow(c.beta2, t);
  param.mul_(1.0 - c.lr * c.weight_decay);
  state.exp_avg.mul_(c.beta1).add_(grad, 1.0 - c.beta1);
  state.exp_avg_sq.mul_(c.beta2).addcmul_(grad, grad, 1.0 - c.beta2);
  auto denom = (state.exp_avg_sq / bias2).sqrt_().add_(c.eps);
  param.addcdiv_(state.exp_avg, denom, -c.lr / bias1);
}

}  // namespace

void optimizer_update(const OptimizerConfig& c, torch::Tensor& param, const torch::Tensor& grad,
                      OptimizerState& state, const torch::Tensor& rounded) {
  torch::NoGradGuard no_grad;
  if (rounded.defined())
    STRATA_CHECK(rounded.numel() == param.numel(), "optimizer_update: the rounded copy has " << rounded.numel()
                                                       << " elements, the parameter " << param.numel());
  STRATA_CHECK(grad.data_ptr() != param.data_ptr() &&
                   (!rounded.defined() || (rounded.data_ptr() != param.data_ptr() && rounded.data_ptr() != grad.data_ptr())),
               "optimizer_update: the parameter, its gradient and the rounded copy must be distinct buffers");
  ++state.step;
  if (fusable(param, grad)) {
    const bool fused_copy = rounded.defined() && rounded.is_cpu() && rounded.is_contiguous();
    if (fused_copy && rounded.scalar_type() == torch::kBFloat16) {
      fused_host_update(c, param, grad, state, rounded.data_ptr<c10::BFloat16>());
    } else if (fused_copy && rounded.scalar_type() == torch::kHalf) {
      fused_host_update(c, param, grad, state, rounded.data_ptr<c10::Half>());
    } else {
      fused_host_update<void>(c, param, grad, state, nullptr);
      if (rounded.defined()) rounded.copy_(param);
    }
    return;
  }
  update_with_tensor_ops(c, param, grad, state);
  if (rounded.defined()) rounded.copy_(param);
}

namespace {

// optimizer_update_into and optimizer_update_span_into: the step over the whole tensors, the listed
// rows, or (first, count) a span of them; `what` names the caller in errors.
void update_into(const char* what, const OptimizerConfig& c, const torch::Tensor& from, OptimizerState& from_state,
                 const torch::Tensor& grad, torch::Tensor& to, OptimizerState& to_state, const torch::Tensor& rounded,
                 const torch::Tensor& rows, int64_t cols, int64_t first, int64_t span) {
  torch::NoGradGuard no_grad;
  STRATA_CHECK(fusable(from, grad) && fusable(to, grad),
               what << ": needs contiguous float32 host tensors of one size; got "
                   << from.sizes() << " " << from.scalar_type() << ", into " << to.sizes() << " " << to.scalar_type()
                   << ", gradient " << grad.sizes() << " " << grad.scalar_type());
  STRATA_CHECK(from.data_ptr() != to.data_ptr(), what << ": `from` and `to` are the same buffer; use optimizer_update");
  STRATA_CHECK(&from_state != &to_state, what << ": `from_state` and `to_state` are the same state");
  STRATA_CHECK(grad.data_ptr() != to.data_ptr(), what << ": the gradient is the buffer written");
  if (rounded.defined())
    STRATA_CHECK(rounded.is_cpu() && rounded.is_contiguous() && rounded.numel() == from.numel() &&
                     (rounded.scalar_type() == torch::kBFloat16 || rounded.scalar_type() == torch::kHalf),
                 what << ": the rounded copy must be a contiguous host bf16 or fp16 tensor of "
                     << from.numel() << " elements; got " << rounded.sizes() << " " << rounded.scalar_type());
  int64_t count = from.numel();
  if (span >= 0) {
    STRATA_CHECK(first >= 0 && first <= from.numel() && span <= from.numel() - first,
                 what << ": the span of " << span << " elements from " << first << " leaves the tensor's " << from.numel());
    count = span;
  }
  const int64_t* row = nullptr;
  if (rows.defined()) {
    STRATA_CHECK(cols > 0 && from.numel() % cols == 0 && rows.is_cpu() && rows.scalar_type() == torch::kLong &&
                     rows.is_contiguous() && rows.dim() == 1,
                 what << ": rows must be a contiguous 1-D int64 host tensor and cols (" << cols
                                                                                                     << ") divide " << from.numel());
    row = rows.data_ptr<int64_t>();
    const int64_t n_rows = from.numel() / cols;
    std::vector<bool> seen(static_cast<size_t>(n_rows));
    for (int64_t i = 0; i < rows.numel(); ++i) {
      STRATA_CHECK(row[i] >= 0 && row[i] < n_rows, what << ": row " << row[i] << " is outside 0.." << n_rows - 1);
      STRATA_CHECK(!seen[static_cast<size_t>(row[i])], what << ": row " << row[i] << " is listed twice");
      seen[static_cast<size_t>(row[i])] = true;
    }
    count = rows.numel() * cols;
  }
  // The state the step starts from: a first AdamW step starts from zero moments (SGD's first step
  // takes the gradient itself as its momentum, as optimizer_update does).
  if (c.kind == OptimizerKind::adamw && !from_state.exp_avg.defined()) {
    from_state.exp_avg = torch::zeros_like(grad);
    from_state.exp_avg_sq = torch::zeros_like(grad);
  }
  if (!to_state.exp_avg.defined()) to_state.exp_avg = torch::zeros_like(grad);
  if (c.kind == OptimizerKind::adamw && !to_state.exp_avg_sq.defined()) to_state.exp_avg_sq = torch::zeros_like(grad);
  to_state.step = from_state.step + 1;
  const float* p_in = from.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* p_out = to.data_ptr<float>();
  if (rounded.defined() && rounded.scalar_type() == torch::kBFloat16)
    fused_host_update_into(c, p_in, from_state, g, p_out, to_state, rounded.data_ptr<c10::BFloat16>(), count, row, cols, first);
  else if (rounded.defined())
    fused_host_update_into(c, p_in, from_state, g, p_out, to_state, rounded.data_ptr<c10::Half>(), count, row, cols, first);
  else
    fused_host_update_into<void>(c, p_in, from_state, g, p_out, to_state, nullptr, count, row, cols, first);
}

}  // namespace

void optimizer_update_into(const OptimizerConfig& c, const torch::Tensor& from, OptimizerState& from_state,
                           const torch::Tensor& grad, torch::Tensor& to, OptimizerState& to_state,
                           const torch::Tensor& rounded, const torch::Tensor& rows, int64_t cols) {
  update_into("optimizer_update_into", c, from, from_state, grad, to, to_state, rounded, rows, cols, 0, -1);
}

void optimizer_update_span_into(const OptimizerConfig& c, const torch::Tensor& from, OptimizerState& from_state,
                                const torch::Tensor& grad, torch::Tensor& to, OptimizerState& to_state,
                                const torch::Tensor& rounded, int64_t first, int64_t count) {
  STRATA_CHECK(count >= 0, "optimizer_update_span_into: count is " << count);
  update_into("optimizer_update_span_into", c, from, from_state, grad, to, to_state, rounded, {}, 0, first, count);
}

void step_and_release_grad(const OptimizerConfig& config, torch::Tensor& param, OptimizerState& state) {
  if (!param.grad().defined()) return;
  optimizer_update(config, param, param.grad(), state);
  param.mutable_grad() = torch::Tensor();
}

}  // namespace strata
