#include "strategies/device/device.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <regex>
#include <system_error>
#include <thread>

#include "models/check.h"

namespace strata::device {

bool cuda_available() { return torch::cuda::is_available(); }
int64_t cuda_device_count() { return cuda_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0; }

torch::Device parse_name(const std::string& text) {
  static const std::regex pattern("^(cpu|cuda)(:([0-9]+))?$");
  std::smatch m;
  STRATA_CHECK(std::regex_match(text, m, pattern),
               "device '" << text << "' is not valid; expected cpu, cuda or cuda:N");
  STRATA_CHECK(!(m[1] == "cpu" && m[2].matched), "device '" << text << "': the CPU takes no index; use cpu");
  torch::Device device = m[1] == "cpu" ? torch::Device(torch::kCPU)
                                       : torch::Device(torch::kCUDA, m[2].matched ? std::stoi(m[3]) : 0);
  return device;
}

torch::Device parse(const std::string& text) {
  const auto device = parse_name(text);
  check_available(device);
  return device;
}

void check_available(const torch::Device& device) {
  if (device.is_cpu()) return;
  STRATA_CHECK(device.is_cuda(), "device '" << device << "' is not supported; use cpu or cuda:N");
  const auto n = cuda_device_count();
  STRATA_CHECK(n > 0, "device '" << device << "' is not available: this machine has no CUDA device");
  STRATA_CHECK(device.index() < n, "device '" << device << "' is not available: this machine has " << n
                                              << " CUDA device(s), cuda:0 to cuda:" << n - 1);
}

namespace {
// The head of oneDNN's dnnl_version_t (its C API, stable since 1.0).
struct OnednnVersion {
  int major, minor, patch;
};
template <typename F>
F onednn_symbol(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_DEFAULT, name));
}
// A capacity variable as oneDNN 2.x/3.x reads it: set, not empty, shorter than 12 characters
// (longer values and empty ones are ignored there, and the next name or the default applies).
const char* onednn_capacity_variable() {
  for (const char* name : {"ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"}) {
    const char* value = std::getenv(name);
    if (value && *value && std::strlen(value) < 12) return name;
  }
  return nullptr;
}
}  // namespace

const OnednnCacheGuard& guard_onednn_cache() {
  static const OnednnCacheGuard guard = [] {
    OnednnCacheGuard g;
    const auto version = onednn_symbol<const OnednnVersion* (*)()>("dnnl_version");
    const int before = detail::onednn_cache_capacity();
    if (!version || before < 0) {
      g.summary = "oneDNN: its C API is not among this process's global symbols; its primitive cache is left "
                  "as it is";
      return g;
    }
    const OnednnVersion* v = version();
    g.version = std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
    g.affected = v->major < 3 || (v->major == 3 && v->minor < 4);
    g.capacity = before;
    const std::string head = "oneDNN " + g.version + ": ";
    const std::string affected = head + "affected by the descriptor use-after-free";
    const std::string kept = "cache capacity " + std::to_string(before) + " left as it is";
    if (!g.affected) {
      g.summary = head + "not affected by the descriptor use-after-free (fixed in 3.4); " + kept;
    } else if (const char* variable = onednn_capacity_variable()) {
      g.variable = variable;
      g.summary = affected + ", but " + variable + "=" + std::getenv(variable) + " is set: " + kept +
                  (before == 0 ? " (no cache: safe)" : " (evictions can crash bf16 matmuls on several threads)");
    } else if (before == 0) {
      g.summary = affected + "; the cache is off (capacity 0), which is safe: left off";
    } else if (before >= kOnednnCacheCapacity) {
      g.summary = affected + "; " + kept + ", already large enough";
    } else {
      detail::set_onednn_cache_capacity(kOnednnCacheCapacity);
      g.capacity = detail::onednn_cache_capacity();
      g.raised = g.capacity == kOnednnCacheCapacity;
      g.summary = affected + "; " +
                  (g.raised ? "primitive cache capacity raised from " + std::to_string(before) + " to " +
                                  std::to_string(kOnednnCacheCapacity) + " so that nothing is evicted"
                            : "raising the primitive cache capacity failed (it reads " + std::to_string(g.capacity) +
                                  "); evictions can crash bf16 matmuls on several threads");
    }
    return g;
  }();
  return guard;
}

namespace detail {
int onednn_cache_capacity() {
  const auto get = onednn_symbol<int (*)(int*)>("dnnl_get_primitive_cache_capacity");
  int capacity = -1;
  return get && get(&capacity) == 0 ? capacity : -1;
}
bool set_onednn_cache_capacity(int capacity) {
  const auto set = onednn_symbol<int (*)(int)>("dnnl_set_primitive_cache_capacity");
  return set && set(capacity) == 0;
}
}  // namespace detail

std::string name(const torch::Device& device) { return device.is_cuda() ? detail::cuda_name(device) : "cpu"; }

void synchronize(const torch::Device& device) {
  if (device.is_cuda()) detail::cuda_synchronize(device);
}

void synchronize_all() {
  const auto n = cuda_device_count();
  for (int64_t i = 0; i < n; ++i) detail::cuda_synchronize(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i)));
}

torch::Tensor host_buffer(at::IntArrayRef sizes, torch::ScalarType dtype, const torch::Device& device) {
  return torch::empty(sizes, torch::TensorOptions().dtype(dtype).pinned_memory(device.is_cuda()));
}

AllocatorStats allocator_stats(const torch::Device& device) {
  return device.is_cuda() ? detail::cuda_allocator_stats(device) : AllocatorStats{};
}

void reset_peak_stats(const torch::Device& device) {
  if (device.is_cuda()) detail::cuda_reset_peak_stats(device);
}

void release_cached_memory(const torch::Device& device) {
  if (device.is_cuda()) detail::cuda_release_cached_memory(device);
}

int64_t total_memory(const torch::Device& device) { return device.is_cuda() ? detail::cuda_total_memory(device) : 0; }

void limit_memory(const torch::Device& device, int64_t bytes) {
  STRATA_CHECK(device.is_cuda(), "a device memory limit applies to a CUDA device, not '" << device << "'");
  const auto total = detail::cuda_total_memory(device);
  STRATA_CHECK(bytes > 0 && bytes <= total, "a device memory limit of " << bytes << " bytes on " << device
                                                                        << " must be above 0 and at most its "
                                                                        << total << " bytes");
  detail::cuda_set_memory_fraction(device, static_cast<double>(bytes) / static_cast<double>(total));
}

namespace {
std::mutex delays_mutex;
Delays current_delays;
}  // namespace

Delays injected_delays() {
  std::lock_guard<std::mutex> lock(delays_mutex);
  return current_delays;
}

ScopedDelays::ScopedDelays(Delays delays) {
  std::lock_guard<std::mutex> lock(delays_mutex);
  previous_ = current_delays;
  current_delays = delays;
}

ScopedDelays::~ScopedDelays() {
  std::lock_guard<std::mutex> lock(delays_mutex);
  current_delays = previous_;
}

// ---------------------------------------------------------------------------------------------
// Host queue.
struct HostQueue::State {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  size_t submitted = 0, finished = 0;
  bool stopping = false;
  std::exception_ptr error;
  std::thread worker;

  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex);
        cv.wait(lock, [&] { return stopping || !tasks.empty(); });
        if (tasks.empty()) return;  // stopping, and everything submitted has run
        task = std::move(tasks.front());
        tasks.pop_front();
      }
      std::exception_ptr failure;
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (failure && !error) error = failure;
        ++finished;
      }
      cv.notify_all();
    }
  }
};

HostQueue::HostQueue() : state_(std::make_unique<State>()) {
  try {
    state_->worker = std::thread([s = state_.get()] { s->run(); });
  } catch (const std::system_error& e) {
    STRATA_FAIL("cannot start the host copy-engine thread of a CPU side stream: " << e.what());
  }
}

HostQueue::~HostQueue() {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
  }
  state_->cv.notify_all();
  state_->worker.join();
}

void HostQueue::submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->tasks.push_back(std::move(task));
    ++state_->submitted;
  }
  state_->cv.notify_all();
}

void HostQueue::drain() {
  std::unique_lock<std::mutex> lock(state_->mutex);
  const size_t target = state_->submitted;
  state_->cv.wait(lock, [&] { return state_->finished >= target; });
  if (state_->error) {
    auto e = state_->error;
    state_->error = nullptr;
    std::rethrow_exception(e);
  }
}

// ---------------------------------------------------------------------------------------------
// CPU implementation.
namespace {

class CpuEvent : public EventImpl {
 public:
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
  }
  bool done() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  void complete() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
};

std::shared_ptr<CpuEvent> completed_event() {
  auto e = std::make_shared<CpuEvent>();
  e->complete();
  return e;
}

void copy_now(const torch::Tensor& dst, const torch::Tensor& src) {
  torch::NoGradGuard no_grad;
  dst.copy_(src);
}

// Compute on the CPU runs in the calling thread, so this "stream" does its work immediately.
class CpuComputeStream : public StreamImpl {
 public:
  const torch::Device& device() const override { return device_; }
  void copy(const torch::Tensor& dst, const torch::Tensor& src) override {
    delay(injected_delays().copy);
    copy_now(dst, src);
  }
  void copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                  const std::vector<int64_t>& offsets) override {
    delay(injected_delays().copy);
    detail::copy_parts_into(dst, parts, offsets, /*non_blocking=*/false);
  }
  void copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src) override {
    delay(injected_delays().copy);
    detail::copy_rows_into(dst, index, src, /*non_blocking=*/false);
  }
  std::shared_ptr<EventImpl> record() override { return completed_event(); }
  void wait(const std::shared_ptr<EventImpl>& event) override {
    if (event) event->synchronize();
  }
  void synchronize() override {}
  void keep_alive(const torch::Tensor&) override {}
  void delay(std::chrono::microseconds d) override {
    if (d.count() > 0) std::this_thread::sleep_for(d);
  }
  void hold(std::shared_ptr<const Gate>) override {
    STRATA_FAIL("a hold on the CPU's compute stream would block the caller; hold a side stream");
  }
  std::shared_ptr<void> make_current() override { return nullptr; }

 private:
  torch::Device device_{torch::kCPU};
};

// A side stream on the CPU: a HostQueue whose thread acts as the copy engine.
class CpuSideStream : public StreamImpl {
 public:
  const torch::Device& device() const override { return device_; }
  void copy(const torch::Tensor& dst, const torch::Tensor& src) override {
    const auto d = injected_delays().copy;
    // The task holds dst and src until it has run, so neither can be freed under it.
    queue_.submit([dst, src, d] {
      if (d.count() > 0) std::this_thread::sleep_for(d);
      copy_now(dst, src);
    });
  }
  void copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                  const std::vector<int64_t>& offsets) override {
    const auto d = injected_delays().copy;
    queue_.submit([dst, parts, offsets, d] {
      if (d.count() > 0) std::this_thread::sleep_for(d);
      detail::copy_parts_into(dst, parts, offsets, /*non_blocking=*/false);
    });
  }
  void copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src) override {
    const auto d = injected_delays().copy;
    queue_.submit([dst, index, src, d] {
      if (d.count() > 0) std::this_thread::sleep_for(d);
      detail::copy_rows_into(dst, index, src, /*non_blocking=*/false);
    });
  }
  std::shared_ptr<EventImpl> record() override {
    auto e = std::make_shared<CpuEvent>();
    queue_.submit([e] { e->complete(); });
    return e;
  }
  void wait(const std::shared_ptr<EventImpl>& event) override {
    if (event) queue_.submit([event] { event->synchronize(); });
  }
  void synchronize() override { queue_.drain(); }
  void keep_alive(const torch::Tensor&) override {}
  void delay(std::chrono::microseconds d) override {
    if (d.count() > 0) queue_.submit([d] { std::this_thread::sleep_for(d); });
  }
  void hold(std::shared_ptr<const Gate> gate) override {
    queue_.submit([gate] { gate->wait(); });
  }
  std::shared_ptr<void> make_current() override { return nullptr; }

 private:
  torch::Device device_{torch::kCPU};
  HostQueue queue_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Dispatch.
void Event::synchronize() const {
  if (impl_) impl_->synchronize();
}
bool Event::done() const { return !impl_ || impl_->done(); }

Stream Stream::compute(const torch::Device& device) {
  check_available(device);
  if (device.is_cuda()) return Stream(detail::cuda_compute_stream(device));
  static auto cpu = std::make_shared<CpuComputeStream>();
  return Stream(cpu);
}

Stream Stream::side(const torch::Device& device) {
  check_available(device);
  if (device.is_cuda()) return Stream(detail::cuda_side_stream(device));
  return Stream(std::make_shared<CpuSideStream>());
}

const torch::Device& Stream::device() const { return impl_->device(); }
void Stream::copy(const torch::Tensor& dst, const torch::Tensor& src) { impl_->copy(dst, src); }
void detail::copy_parts_into(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                             const std::vector<int64_t>& offsets, bool non_blocking) {
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (!offsets.empty()) offset = offsets[i];
    dst.narrow(0, offset, parts[i].numel()).copy_(parts[i], non_blocking);
    offset += parts[i].numel();
  }
}

void detail::copy_rows_into(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src,
                            bool non_blocking) {
  torch::NoGradGuard no_grad;
  dst.index_copy_(0, index, src.to(dst.options(), non_blocking));  // src itself where nothing changes
}

void Stream::copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src) {
  STRATA_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.size(1) == src.size(1),
               "Stream::copy_rows: rows of " << src.sizes() << " cannot go into rows of " << dst.sizes());
  STRATA_CHECK(index.dim() == 1 && index.scalar_type() == torch::kLong && index.numel() == src.size(0) &&
                   index.device() == dst.device(),
               "Stream::copy_rows: the index must be " << src.size(0) << " int64 row numbers on " << dst.device()
                                                       << ", not " << index.sizes() << " " << index.scalar_type()
                                                       << " on " << index.device());
  impl_->copy_rows(dst, index, src);
}

void Stream::copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                        const std::vector<int64_t>& offsets) {
  STRATA_CHECK(dst.dim() == 1, "Stream::copy_parts: the destination has " << dst.dim() << " dimensions, not 1");
  STRATA_CHECK(offsets.empty() || offsets.size() == parts.size(),
               "Stream::copy_parts: " << offsets.size() << " offsets for " << parts.size() << " parts");
  int64_t total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    STRATA_CHECK(part.dim() == 1, "Stream::copy_parts: a part has " << part.dim() << " dimensions, not 1");
    if (!offsets.empty())
      STRATA_CHECK(offsets[i] >= 0 && offsets[i] + part.numel() <= dst.numel(),
                   "Stream::copy_parts: a part of " << part.numel() << " elements at offset " << offsets[i]
                                                    << " does not fit a destination of " << dst.numel());
    total += part.numel();
  }
  STRATA_CHECK(!offsets.empty() || total == dst.numel(),
               "Stream::copy_parts: the parts hold " << total << " elements, the destination " << dst.numel());
  impl_->copy_parts(dst, parts, offsets);
}
Event Stream::record() { return Event(impl_->record()); }
void Stream::wait(const Event& event) { impl_->wait(event.impl()); }
void Stream::synchronize() { impl_->synchronize(); }
void Stream::keep_alive(const torch::Tensor& t) { impl_->keep_alive(t); }
void Stream::delay(std::chrono::microseconds d) { impl_->delay(d); }
void Stream::compute_point() { impl_->delay(injected_delays().compute); }
void Stream::hold(std::shared_ptr<const Gate> gate) {
  STRATA_CHECK(gate, "Stream::hold needs a gate");
  impl_->hold(std::move(gate));
}

void Gate::open() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
  }
  cv_.notify_all();
}
bool Gate::is_open() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return open_;
}
void Gate::wait() const {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return open_; });
}
bool Gate::wait_for(std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mutex_);
  return cv_.wait_for(lock, timeout, [this] { return open_; });
}

Stream::Guard::Guard(const Stream& stream) : state_(stream.impl()->make_current()) {}
Stream::Guard::~Guard() = default;

Stopwatch::Stopwatch(const torch::Device& device) : device_(device) {}

void Stopwatch::start() {
  if (device_.is_cuda()) {
    start_ = detail::cuda_timing_event(device_);
  } else {
    host_start_ = std::chrono::steady_clock::now();
  }
}

void Stopwatch::stop() {
  if (device_.is_cuda()) {
    stop_ = detail::cuda_timing_event(device_);
  } else {
    host_stop_ = std::chrono::steady_clock::now();
  }
}

double Stopwatch::elapsed_ms() {
  if (device_.is_cuda()) return detail::cuda_elapsed_ms(start_, stop_);
  return std::chrono::duration<double, std::milli>(host_stop_ - host_start_).count();
}

#ifndef STRATA_WITH_CUDA
namespace detail {
// This LibTorch has no CUDA; check_available() has already refused any CUDA device.
std::shared_ptr<StreamImpl> cuda_compute_stream(const torch::Device& d) {
  STRATA_FAIL("device '" << d << "': strata was built against a LibTorch without CUDA");
}
std::shared_ptr<StreamImpl> cuda_side_stream(const torch::Device& d) { return cuda_compute_stream(d); }
AllocatorStats cuda_allocator_stats(const torch::Device&) { return {}; }
void cuda_reset_peak_stats(const torch::Device&) {}
void cuda_release_cached_memory(const torch::Device&) {}
int64_t cuda_total_memory(const torch::Device&) { return 0; }
void cuda_set_memory_fraction(const torch::Device&, double) {}
std::shared_ptr<void> cuda_timing_event(const torch::Device& d) { return cuda_compute_stream(d); }
double cuda_elapsed_ms(const std::shared_ptr<void>&, const std::shared_ptr<void>&) { return 0.0; }
void cuda_synchronize(const torch::Device&) {}
std::string cuda_name(const torch::Device&) { return "cuda"; }
}  // namespace detail
#endif

}  // namespace strata::device
