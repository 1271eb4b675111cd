#pragma once
// The device layer: everything that differs between a CUDA device and the CPU (streams, events,
// pinned host memory, allocator statistics) behind one small API with a CPU implementation, so a
// strategy runs the same code on both. On the CPU a side stream is a worker thread acting as copy
// engine, which makes the asynchrony real (and testable) without a GPU.
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::device {

bool cuda_available();
int64_t cuda_device_count();

/// The device's model name as its driver reports it ("NVIDIA H200"); "cpu" for the CPU.
std::string name(const torch::Device& device);

/// "cpu", "cuda" or "cuda:N"; an Error names the value if it is malformed or the device is absent.
torch::Device parse(const std::string& text);
/// The same without the check that the device is here (a plan for another machine).
torch::Device parse_name(const std::string& text);
/// Throws an Error naming `device` if it does not exist on this machine.
void check_available(const torch::Device& device);
/// Waits until all work queued on `device` has finished (no-op on CPU).
void synchronize(const torch::Device& device);
/// Waits for every CUDA device of the machine (no-op without CUDA): what a timer around work
/// spread over several devices must wait for.
void synchronize_all();

/// oneDNN before 3.4 (Debian 12's LibTorch 1.13 links 2.6.3) has a use-after-free in its CPU
/// matmuls: a brgemm descriptor keeps pointers into the primitive descriptor that first built it,
/// copies of that descriptor keep them, and a primitive built again from a copy (its cache entry
/// evicted while another thread looked it up) reads freed memory and dies in bad_alloc, "Broken
/// promise" or a segmentation fault. bf16 matmuls with a bias on several threads meet it (CPU
/// pipeline stages, CPU ranks). oneDNN 3.4 fixed it (its commit 7d9257c).
/// guard_onednn_cache() raises such a oneDNN's primitive cache capacity to kOnednnCacheCapacity,
/// which no run fills, so nothing is evicted. The cost: the cache keeps every primitive the process
/// built (one per distinct matmul shape and thread count; a few hundred MB after the CPU suite's
/// most varied runs), and a primitive whose creation threw stays failed in the cache. It leaves the
/// cache alone when oneDNN is 3.4 or newer, when oneDNN's C API is not among the process's global
/// symbols (dlsym), when the cache is off (capacity 0) or already as large, and when
/// ONEDNN_PRIMITIVE_CACHE_CAPACITY or DNNL_PRIMITIVE_CACHE_CAPACITY is set (the user's choice).
/// It acts once per process and is cheap to call again; Strategy::attach calls it, before the
/// strategy starts any thread.
inline constexpr int kOnednnCacheCapacity = 1 << 20;
struct OnednnCacheGuard {
  std::string version;     ///< oneDNN's version ("2.6.3"); empty when LibTorch does not export it
  bool affected = false;   ///< the version has the use-after-free (before 3.4)
  std::string variable;    ///< the environment variable that set the capacity, when one did
  bool raised = false;     ///< this call raised the capacity (read back from oneDNN)
  int capacity = -1;       ///< the cache's capacity after the call; -1 when unknown
  std::string summary;     ///< one line: what was found and done
};
const OnednnCacheGuard& guard_onednn_cache();

/// Host memory for buffers that stream to and from `device`: page-locked when `device` is CUDA
/// (copies from pageable memory are not asynchronous), ordinary memory otherwise.
torch::Tensor host_buffer(at::IntArrayRef sizes, torch::ScalarType dtype, const torch::Device& device);

/// Caching-allocator statistics of a CUDA device, in bytes; all zero for the CPU.
struct AllocatorStats {
  int64_t allocated = 0, reserved = 0, peak_allocated = 0, peak_reserved = 0;
};
AllocatorStats allocator_stats(const torch::Device& device);
void reset_peak_stats(const torch::Device& device);
/// Waits for the device, drops cuBLAS's per-stream workspaces and returns cached, unused device
/// memory to the driver, so the next measurement of allocated and reserved bytes starts from what
/// is really in use (no-op on CPU). Only between measurements: no work may be in flight.
void release_cached_memory(const torch::Device& device);

/// Total memory of a CUDA device in bytes (0 for the CPU).
int64_t total_memory(const torch::Device& device);
/// Caps what the caching allocator of a CUDA device may hold at `bytes` (its memory fraction), so
/// that allocations beyond fail as on a card that small (strata_capacity's --device-memory). An
/// Error for the CPU, or for more than the device has.
void limit_memory(const torch::Device& device, int64_t bytes);

/// Delays injected into every queued copy and at every compute point a strategy marks, to expose
/// missing waits (asynchrony tests). Zero by default.
struct Delays {
  std::chrono::microseconds copy{0};
  std::chrono::microseconds compute{0};
  std::chrono::microseconds collective{0};  ///< before every collective a process group starts
};
Delays injected_delays();
/// Sets the delays for the lifetime of the object, then restores the previous ones.
class ScopedDelays {
 public:
  explicit ScopedDelays(Delays delays);
  ~ScopedDelays();
  ScopedDelays(const ScopedDelays&) = delete;  // restores once; a copy would restore twice
  ScopedDelays& operator=(const ScopedDelays&) = delete;

 private:
  Delays previous_;
};

class StreamImpl;
class EventImpl;

/// A one-way switch that work queued on a side stream can be made to wait for (Stream::hold).
/// Tests use it to keep a copy in flight for certain, however loaded the machine: a delay only
/// makes it likely. Opening is final.
class Gate {
 public:
  void open();
  bool is_open() const;
  /// Blocks until the gate is open.
  void wait() const;
  /// Blocks until the gate is open or `timeout` has passed; true if it is open.
  bool wait_for(std::chrono::milliseconds timeout) const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

/// A worker thread that runs submitted host functions in order. The CPU's side streams are built
/// on it, and strategies use it for host-side work that must not block the caller (accumulating
/// gradients that arrived from the device, host optimizer updates).
class HostQueue {
 public:
  HostQueue();
  ~HostQueue();  ///< runs everything submitted, then stops
  HostQueue(const HostQueue&) = delete;  // owns a thread
  HostQueue& operator=(const HostQueue&) = delete;

  void submit(std::function<void()> task);
  /// Blocks until everything submitted so far has run; rethrows the first error a task threw.
  void drain();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// Adds the wall time from its construction to its destruction, in nanoseconds, to a counter
/// that other threads may read (host work timed where it runs, e.g. a host optimizer's updates).
class TimeInto {
 public:
  explicit TimeInto(std::atomic<int64_t>& total) : total_(total), start_(std::chrono::steady_clock::now()) {}
  ~TimeInto() {
    total_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  TimeInto(const TimeInto&) = delete;
  TimeInto& operator=(const TimeInto&) = delete;

 private:
  std::atomic<int64_t>& total_;
  std::chrono::steady_clock::time_point start_;
};

/// A point in a stream's queue; the host or another stream can wait for it.
class Event {
 public:
  Event() = default;  ///< an event that is already complete
  explicit Event(std::shared_ptr<EventImpl> impl) : impl_(std::move(impl)) {}
  /// Blocks the host until the work before the event has finished.
  void synchronize() const;
  /// True once the work before the event has finished.
  bool done() const;
  const std::shared_ptr<EventImpl>& impl() const { return impl_; }

 private:
  std::shared_ptr<EventImpl> impl_;
};

/// An ordered queue of device work.
class Stream {
 public:
  /// The stream compute runs on: CUDA's current stream; on the CPU, the calling thread.
  static Stream compute(const torch::Device& device);
  /// A new side stream: a CUDA stream from the pool; on the CPU, a worker thread of its own.
  static Stream side(const torch::Device& device);

  const torch::Device& device() const;
  /// Queues dst.copy_(src) behind everything queued so far; returns at once on side streams.
  void copy(const torch::Tensor& dst, const torch::Tensor& src);
  /// Queues the copies of `parts` (1-D) into consecutive slices of the 1-D `dst`, from its start, as
  /// one transfer (one injected copy delay): pieces sent where they belong, not concatenated on
  /// the device first. Their sizes must add up to dst's. With `offsets` (one a part), each part goes
  /// to the slice starting at its offset instead, and may leave the rest of dst as it is.
  void copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                  const std::vector<int64_t>& offsets = {});
  /// Queues dst.index_copy_(0, index, src) as one transfer (one injected copy delay): the rows of
  /// `src` (wherever it is, in any dtype) written into the rows `index` (distinct, int64, on dst's
  /// device) of `dst`. On CUDA `src` crosses into a buffer on dst's device first, allocated on this
  /// stream.
  void copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src);
  /// Queues an event and returns it.
  Event record();
  /// Makes later work on this stream wait for `event` (blocks the host only on CPU compute).
  void wait(const Event& event);
  /// Blocks the host until everything queued so far has finished.
  void synchronize();
  /// Tells the caching allocator that `t` is in use by this stream's queued work, so freeing it
  /// elsewhere does not hand its memory out before that work is done (CPU: the queued task
  /// holds a reference already).
  void keep_alive(const torch::Tensor& t);
  /// Queues a delay of `d` (a spinning kernel on CUDA, a sleep on CPU).
  void delay(std::chrono::microseconds d);
  /// Queues the injected compute delay, if any (call before compute that reads fetched data).
  void compute_point();
  /// Makes everything queued on this side stream from now on wait until `gate` opens (a blocking
  /// host function in the stream on CUDA, a task of the worker thread on the CPU). Refused on the
  /// CPU's compute stream, which is the calling thread.
  void hold(std::shared_ptr<const Gate> gate);

  /// Makes `stream` the current stream for tensor operations in this scope (no-op on CPU).
  class Guard {
   public:
    explicit Guard(const Stream& stream);
    ~Guard();
    Guard(const Guard&) = delete;  // restores the previous stream once
    Guard& operator=(const Guard&) = delete;

   private:
    std::shared_ptr<void> state_;
  };

  const std::shared_ptr<StreamImpl>& impl() const { return impl_; }

 private:
  explicit Stream(std::shared_ptr<StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<StreamImpl> impl_;
};

/// Times device work: CUDA events on the compute stream (so queued work counts, and a host stall
/// shows as an idle device), a host clock after synchronising on the CPU.
class Stopwatch {
 public:
  explicit Stopwatch(const torch::Device& device);
  void start();
  void stop();
  /// Milliseconds between start() and stop(); waits for the stop to complete.
  double elapsed_ms();

 private:
  torch::Device device_;
  std::shared_ptr<void> start_, stop_;
  std::chrono::steady_clock::time_point host_start_, host_stop_;
};

// Implementation interfaces (device.cpp for the CPU, device_cuda.cpp for CUDA).
class EventImpl {
 public:
  virtual ~EventImpl() = default;
  virtual void synchronize() = 0;
  virtual bool done() = 0;
};

class StreamImpl {
 public:
  virtual ~StreamImpl() = default;
  virtual const torch::Device& device() const = 0;
  virtual void copy(const torch::Tensor& dst, const torch::Tensor& src) = 0;
  /// Checked by Stream::copy_parts: parts 1-D, their sizes adding up to dst's, or each within dst
  /// at its offset.
  virtual void copy_parts(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                          const std::vector<int64_t>& offsets) = 0;
  /// Checked by Stream::copy_rows: dst and src 2-D with equal widths, index 1-D int64 on dst's device.
  virtual void copy_rows(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src) = 0;
  virtual std::shared_ptr<EventImpl> record() = 0;
  virtual void wait(const std::shared_ptr<EventImpl>& event) = 0;
  virtual void synchronize() = 0;
  virtual void keep_alive(const torch::Tensor& t) = 0;
  virtual void delay(std::chrono::microseconds d) = 0;
  virtual void hold(std::shared_ptr<const Gate> gate) = 0;
  virtual std::shared_ptr<void> make_current() = 0;
};

namespace detail {
/// dst's consecutive slices, from its start, take the parts in turn, or each part the slice at its
/// offset (what copy_parts queues).
void copy_parts_into(const torch::Tensor& dst, const std::vector<torch::Tensor>& parts,
                     const std::vector<int64_t>& offsets, bool non_blocking);
/// dst's rows `index` take src's rows, src brought to dst's device and dtype first (what copy_rows queues).
void copy_rows_into(const torch::Tensor& dst, const torch::Tensor& index, const torch::Tensor& src, bool non_blocking);
std::shared_ptr<StreamImpl> cuda_compute_stream(const torch::Device& device);
std::shared_ptr<StreamImpl> cuda_side_stream(const torch::Device& device);
AllocatorStats cuda_allocator_stats(const torch::Device& device);
void cuda_reset_peak_stats(const torch::Device& device);
void cuda_release_cached_memory(const torch::Device& device);
int64_t cuda_total_memory(const torch::Device& device);
void cuda_set_memory_fraction(const torch::Device& device, double fraction);
void cuda_synchronize(const torch::Device& device);
std::string cuda_name(const torch::Device& device);
std::shared_ptr<void> cuda_timing_event(const torch::Device& device);
double cuda_elapsed_ms(const std::shared_ptr<void>& start, const std::shared_ptr<void>& stop);
/// oneDNN's primitive cache capacity, read from oneDNN through its C API; -1 when the API is not
/// among the process's global symbols or the call fails.
int onednn_cache_capacity();
/// Sets it; false when the API is absent or oneDNN refuses the value.
bool set_onednn_cache_capacity(int capacity);
}  // namespace detail

}  // namespace strata::device
