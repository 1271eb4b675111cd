#include "strategies/distributed/process_group.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <thread>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>

#include "models/check.h"
#include "models/compat.h"
#include "strategies/device/device.h"
#include "strategies/distributed/nccl.h"

namespace strata::distributed {
namespace {

int int_from_env(const char* name, int fallback, bool required) {
  const char* v = std::getenv(name);
  if (!v || !*v) {
    STRATA_CHECK(!required, "distributed: " << name << " is not set (launch with torchrun or strategies/distributed/"
                                               "launch.py, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)");
    return fallback;
  }
  size_t used = 0;
  int out = 0;
  try {
    out = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  STRATA_CHECK(used > 0 && v[used] == '\0', "distributed: " << name << "='" << v << "' is not an integer");
  return out;
}

std::chrono::milliseconds configured_timeout() {
  return std::chrono::seconds(int_from_env("STRATA_DIST_TIMEOUT_S", 300, false));
}

}  // namespace

Environment Environment::from_env() {
  Environment e;
  e.launched = std::getenv("RANK") != nullptr;
  if (!e.launched) return e;
  e.rank = int_from_env("RANK", 0, true);
  e.world_size = int_from_env("WORLD_SIZE", 1, true);
  e.local_rank = int_from_env("LOCAL_RANK", e.rank, false);
  e.master_port = int_from_env("MASTER_PORT", 29500, true);
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  if (const char* a = std::getenv("TORCHELASTIC_USE_AGENT_STORE")) e.agent_store = std::string(a) == "True" || std::string(a) == "1";
  e.restart_count = int_from_env("TORCHELASTIC_RESTART_COUNT", 0, false);
  e.ranks_share_device = int_from_env("STRATA_RANKS_SHARE_DEVICE", 0, false) != 0;
  STRATA_CHECK(e.world_size >= 1, "distributed: WORLD_SIZE=" << e.world_size << " must be at least 1");
  STRATA_CHECK(e.rank >= 0 && e.rank < e.world_size,
               "distributed: RANK=" << e.rank << " is not in 0.." << e.world_size - 1 << " (WORLD_SIZE=" << e.world_size << ")");
  STRATA_CHECK(e.master_port > 0 && e.master_port < 65536, "distributed: MASTER_PORT=" << e.master_port << " is not a port");
  return e;
}

const Environment& environment() {
  static const Environment env = Environment::from_env();
  return env;
}

int64_t ring_all_reduce_bytes(int64_t bytes, int world) {
  const auto w = static_cast<double>(world);
  return static_cast<int64_t>(std::llround(static_cast<double>(bytes) * 2 * (w - 1) / w));
}

torch::Device rank_device(const torch::Device& requested) {
  const auto& env = environment();
  if (!requested.is_cuda() || !env.launched || env.world_size <= 1) return requested;
  if (env.ranks_share_device) return torch::Device(torch::kCUDA, requested.has_index() ? requested.index() : 0);
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
}

void Work::wait() {
  if (!wait_) return;
  auto w = std::move(wait_);
  wait_ = nullptr;
  w();
}

namespace {

// The process's store, shared by its groups: a TCPStore that rank 0 serves (or torchrun's agent
// does, then under the prefix of this restart attempt, as torchrun's own rendezvous keys it); a
// HashStore in a world of one.
c10::intrusive_ptr<c10d::Store> process_store() {
  static std::mutex mutex;
  static c10::intrusive_ptr<c10d::Store> store;
  std::lock_guard<std::mutex> lock(mutex);
  if (store) return store;
  const auto& env = environment();
  if (!env.launched) {
    store = c10::make_intrusive<c10d::HashStore>();
    return store;
  }
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(env.master_port);
  options.isServer = env.rank == 0 && !env.agent_store;
  options.numWorkers = env.agent_store ? c10::nullopt : c10::optional<std::size_t>(env.world_size);
  options.waitWorkers = !env.agent_store;
  options.timeout = configured_timeout();
  try {
    c10::intrusive_ptr<c10d::Store> tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
    if (env.agent_store)
      tcp = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + std::to_string(env.restart_count), tcp);
    store = tcp;
  } catch (const std::exception& e) {
    STRATA_FAIL("distributed: rank " << env.rank << " of " << env.world_size << " could not reach the store at "
                                     << env.master_addr << ":" << env.master_port << " within "
                                     << configured_timeout().count() / 1000 << " s: " << e.what());
  }
  return store;
}

std::shared_ptr<::gloo::transport::Device> gloo_device(const Environment& env) {
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME")) return c10d::ProcessGroupGloo::createDeviceForInterface(iface);
  const bool local = env.master_addr == "localhost" || env.master_addr.rfind("127.", 0) == 0;
  return local ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
               : c10d::ProcessGroupGloo::createDefaultDevice();
}

// Waits for c10d work that `start` starts (or has started). NCCL: wait() without a timeout only
// makes the current stream wait (the watchdog enforces the group's timeout); with one it would
// block the host. Gloo: block, up to the timeout. Failures become an Error naming `where()`.
void wait_work(const std::function<c10::intrusive_ptr<c10d::Work>()>& start, const std::string& backend,
               std::chrono::milliseconds timeout, const std::function<std::string()>& where) {
  try {
    auto work = start();
    if (backend == "nccl")
      work->wait();
    else
      work->wait(timeout);
  } catch (const std::exception& e) {
    STRATA_FAIL("distributed: " << where() << " (" << backend << ") failed or timed out after "
                                << timeout.count() / 1000 << " s: " << e.what());
  }
}

class C10dGroup : public Group {
 public:
  // The world's ranks 0..size-1 (the whole world when `size` is the world's), this one among them.
  C10dGroup(std::string backend, torch::Device device, int size)
      : backend_(std::move(backend)), device_(device), timeout_(configured_timeout()) {
    const auto& env = environment();
    rank_ = env.rank;
    size_ = size;
    const std::string name = size == env.world_size ? "" : "/first-" + std::to_string(size);
    store_ = c10::make_intrusive<c10d::PrefixStore>("strata/" + backend_ + name, process_store());
    try {
      if (backend_ == "nccl") {
        impl_ = make_nccl_backend(store_, rank_, size_, timeout_);
      } else {
        auto options = c10d::ProcessGroupGloo::Options::create(timeout_);
        options->devices.push_back(gloo_device(env));
        options->threads = 2;
        impl_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, size_, options);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      STRATA_FAIL("distributed: rank " << rank_ << " could not join the " << backend_ << " group of " << size_
                                       << " ranks within " << timeout_.count() / 1000 << " s: " << e.what());
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& backend() const override { return backend_; }
  std::chrono::milliseconds timeout() const override { return timeout_; }

  Work all_gather(const torch::Tensor& out, const torch::Tensor& in) override {
    STRATA_CHECK(out.is_contiguous() && in.is_contiguous() && out.numel() == in.numel() * size_,
                 "all_gather: out has " << out.numel() << " elements, in " << in.numel() << ", world " << size_);
    STRATA_CHECK(out.scalar_type() == in.scalar_type(),
                 "all_gather: out is " << out.scalar_type() << " but in is " << in.scalar_type());
    if (backend_ == "nccl") {
      return launch("all-gather", [this, o = torch::Tensor(out), i = torch::Tensor(in)]() mutable { return impl_->_allgather_base(o, i); });
    }
    return launch("all-gather", gloo_all_gather(out, in));
  }

  Work reduce_scatter(const torch::Tensor& out, const torch::Tensor& in) override {
    STRATA_CHECK(in.is_contiguous() && out.is_contiguous() && in.numel() == out.numel() * size_,
                 "reduce_scatter: in has " << in.numel() << " elements, out " << out.numel() << ", world " << size_);
    if (backend_ == "nccl") {
      return launch("reduce-scatter", [this, o = torch::Tensor(out), i = torch::Tensor(in)]() mutable { return impl_->_reduce_scatter_base(o, i); });
    }
    // Gloo in LibTorch 1.13 has no reduce-scatter: all-reduce the whole, keep this rank's slice.
    if (in.scalar_type() == torch::kBFloat16) {
      auto sum = std::make_shared<torch::Tensor>();
      return launch("reduce-scatter", gloo_bf16_sum_start(in, sum), [this, out, sum]() mutable {
        torch::NoGradGuard no_grad;
        out.copy_(sum_in_rank_order(*sum, out.numel(), rank_ * out.numel(), false));
      });
    }
    auto slice = in.narrow(0, rank_ * out.numel(), out.numel());
    return launch(
        "reduce-scatter",
        [this, in] {
          std::vector<torch::Tensor> ts{in};
          return impl_->allreduce(ts);
        },
        [out, slice]() mutable {
          torch::NoGradGuard no_grad;
          out.copy_(slice);
        });
  }

  Work all_reduce(const torch::Tensor& t, bool max) override {
    if (backend_ == "gloo" && t.scalar_type() == torch::kBFloat16) {
      STRATA_CHECK(t.is_contiguous(), "all_reduce: a bfloat16 tensor over Gloo must be contiguous");
      auto sum = std::make_shared<torch::Tensor>();
      return launch("all-reduce", gloo_bf16_sum_start(t, sum), [this, t, sum, max]() mutable {
        torch::NoGradGuard no_grad;
        t.view({-1}).copy_(sum_in_rank_order(*sum, t.numel(), 0, max));
      });
    }
    return launch("all-reduce", [this, t, max] {
      std::vector<torch::Tensor> ts{t};
      c10d::AllreduceOptions options;
      options.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
      return impl_->allreduce(ts, options);
    });
  }

  Work broadcast(const torch::Tensor& t, int root) override {
    STRATA_CHECK(root >= 0 && root < size_, "broadcast: root " << root << " is not a rank of a world of " << size_);
    // Gloo's broadcast knows no bfloat16: its 16-bit words travel as Half's, unchanged.
    auto words = backend_ == "gloo" && t.scalar_type() == torch::kBFloat16 ? t.view(torch::kHalf) : t;
    return launch("broadcast", [this, words, root] {
      std::vector<torch::Tensor> ts{words};
      c10d::BroadcastOptions options;
      options.rootRank = root;
      return impl_->broadcast(ts, options);
    });
  }

  void agree(const std::string& topic, const std::string& value) override {
    const auto round = rounds_[topic]++;
    const std::string prefix = "agree/" + topic + "/" + std::to_string(round) + "/";
    auto as_bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
    store_->set(prefix + std::to_string(rank_), as_bytes(value));
    std::string first;
    for (int r = 0; r < size_; ++r) {
      std::vector<uint8_t> got;
      try {
        got = store_->get(prefix + std::to_string(r));
      } catch (const std::exception& e) {
        STRATA_FAIL(topic << ": rank " << r << " did not arrive within " << timeout_.count() / 1000 << " s (rank "
                          << rank_ << " waited; do all " << size_ << " ranks run the same program with the same WORLD_SIZE?)");
      }
      const std::string v(got.begin(), got.end());
      if (r == 0) first = v;
      STRATA_CHECK(v == first, topic << ": rank " << r << " has " << v << " but rank 0 has " << first);
    }
  }

 private:
  using Start = std::function<c10::intrusive_ptr<c10d::Work>()>;

  // Gloo in LibTorch 1.13 knows no bfloat16 (Half it does). A gather only moves bytes, so bfloat16
  // travels as Half's 16-bit words, unchanged. A sum gathers every rank's tensor that way and adds
  // them in rank order in bfloat16 (each addition rounded to bfloat16, as a bfloat16 reduction's
  // would be), the same order and so the same result on every rank.
  Start gloo_all_gather(const torch::Tensor& out, const torch::Tensor& in) {
    const bool words = in.scalar_type() == torch::kBFloat16;
    auto o = words ? out.view(torch::kHalf) : out;
    auto i = words ? in.view(torch::kHalf) : in;
    return [this, o, i] {
      std::vector<std::vector<torch::Tensor>> outs(1);
      for (int r = 0; r < size_; ++r) outs[0].push_back(o.narrow(0, r * i.numel(), i.numel()));
      std::vector<torch::Tensor> ins{i};
      return impl_->allgather(outs, ins);
    };
  }

  Start gloo_bf16_sum_start(const torch::Tensor& t, const std::shared_ptr<torch::Tensor>& all) {
    auto flat = t.reshape({-1});
    *all = torch::empty({size_ * flat.numel()}, flat.options());
    return gloo_all_gather(*all, flat);
  }

  // Elements [at, at + n) of the rank-order sum (or maximum) of every rank's part of `all`.
  torch::Tensor sum_in_rank_order(const torch::Tensor& all, int64_t n, int64_t at, bool max) const {
    const int64_t part = all.numel() / size_;
    auto acc = all.narrow(0, at, n).clone();
    for (int r = 1; r < size_; ++r) {
      const auto next = all.narrow(0, r * part + at, n);
      if (max)
        acc = torch::maximum(acc, next);
      else
        acc.add_(next);
    }
    return acc;
  }

  // Starts a collective; the injected collective delay (device::Delays) holds back the collective
  // itself, not the caller, so compute that skips its wait really races it. On the CPU every
  // collective starts from one launcher thread in call order (the order every rank must keep),
  // after the delay; on a GPU the collective runs behind a side stream that waits for compute and
  // then for the delay.
  Work launch(const char* what, Start start, std::function<void()> after = {}) {
    const auto delay = device::injected_delays().collective;
    if (device_.is_cpu()) {
      auto promise = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
      auto started = promise->get_future().share();
      launcher_.submit([promise, start, delay] {
        if (delay.count() > 0) std::this_thread::sleep_for(delay);
        try {
          promise->set_value(start());
        } catch (...) {
          promise->set_exception(std::current_exception());
        }
      });
      return finish(what, [started] { return started.get(); }, std::move(after));
    }
    if (delay.count() <= 0) {
      auto work = start();
      return finish(what, [work] { return work; }, std::move(after));
    }
    if (!side_) side_ = std::make_unique<device::Stream>(device::Stream::side(device_));
    side_->wait(device::Stream::compute(device_).record());
    side_->delay(delay);
    c10::intrusive_ptr<c10d::Work> work;
    {
      device::Stream::Guard on_side(*side_);
      work = start();
    }
    return finish(what, [work] { return work; }, std::move(after));
  }

  Work finish(const char* what, std::function<c10::intrusive_ptr<c10d::Work>()> started, std::function<void()> after) {
    auto timeout = timeout_;
    const int rank = rank_, size = size_;
    const std::string backend = backend_;
    return Work([started, after, timeout, rank, size, backend, what] {
      wait_work(started, backend, timeout, [&] {
        return std::string(what) + " on rank " + std::to_string(rank) + " of " + std::to_string(size);
      });
      if (after) after();
    });
  }

  std::string backend_;
  torch::Device device_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<compat::CollectiveBackend> impl_;
  std::map<std::string, int64_t> rounds_;
  device::HostQueue launcher_;             ///< the CPU's collectives start here, in order
  std::unique_ptr<device::Stream> side_;   ///< a GPU's delayed collectives run behind it
};

// A channel's header: what follows it. Sizes beyond kMaxDims dimensions are refused.
enum class Kind : int64_t { tensor = 0, undefined = 1, failure = 2 };
constexpr int64_t kMaxDims = 8;
constexpr int64_t kHeader = 3 + kMaxDims;  // kind, dtype, dims, sizes

class C10dChannel : public Channel {
 public:
  C10dChannel(std::string backend, torch::Device device, int from, int to)
      : Channel(from, to), backend_(std::move(backend)), device_(device), timeout_(configured_timeout()) {
    const auto& env = environment();
    STRATA_CHECK(env.rank == from || env.rank == to,
                 "distributed: rank " << env.rank << " asked for the channel " << from << " -> " << to);
    STRATA_CHECK(from != to && from >= 0 && to >= 0 && from < env.world_size && to < env.world_size,
                 "distributed: no channel " << from << " -> " << to << " in a world of " << env.world_size);
    const int me = env.rank == from ? 0 : 1;
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        "strata/p2p/" + backend_ + "/" + std::to_string(from) + "-" + std::to_string(to), process_store());
    try {
      if (backend_ == "nccl") {
        impl_ = make_nccl_backend(store, me, 2, timeout_);
      } else {
        auto options = c10d::ProcessGroupGloo::Options::create(timeout_);
        options->devices.push_back(gloo_device(env));
        options->threads = 1;
        impl_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, me, 2, options);
      }
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      STRATA_FAIL("distributed: rank " << env.rank << " could not open the channel " << from << " -> " << to << " ("
                                       << backend_ << ") within " << timeout_.count() / 1000 << " s: " << e.what());
    }
  }

  Work send(const torch::Tensor& t) override {
    if (!t.defined()) return send_header(header(Kind::undefined, torch::kUInt8, {}), {});
    STRATA_CHECK(t.dim() <= kMaxDims, "distributed: a channel carries at most " << kMaxDims << " dimensions, not "
                                                                                << t.dim());
    STRATA_CHECK(t.device().type() == device_.type(),
                 "distributed: the channel " << from_ << " -> " << to_ << " carries " << device_.type()
                                             << " tensors, not " << t.device());
    return send_header(header(Kind::tensor, t.scalar_type(), t.sizes()), t.contiguous());
  }

  int64_t bytes_sent() const override { return sent_; }

  Work send_failure(const std::string& what) override {
    auto text = torch::empty({static_cast<int64_t>(what.size())}, torch::kUInt8);
    std::memcpy(text.data_ptr(), what.data(), what.size());
    return send_header(header(Kind::failure, torch::kUInt8, text.sizes()), text);
  }

  Received receive() override {
    auto h = torch::empty({kHeader}, torch::TensorOptions().dtype(torch::kLong).device(link_device()));
    wait("receive", recv(h));
    h = h.cpu();
    const auto* v = h.data_ptr<int64_t>();
    const auto kind = static_cast<Kind>(v[0]);
    Received out;
    if (kind == Kind::undefined) return out;
    std::vector<int64_t> sizes(v + 3, v + 3 + v[2]);
    auto t = torch::empty(sizes, torch::TensorOptions().dtype(static_cast<torch::ScalarType>(v[1])).device(link_device()));
    if (t.numel() > 0) wait("receive", recv(t));
    // Staged through the host (Gloo): up to the device in the current stream's order.
    if (t.device() != device_ && kind == Kind::tensor) t = t.to(device_, /*non_blocking=*/true);
    if (kind == Kind::failure) {
      auto text = t.cpu();
      out.failed = true;
      out.failure.assign(reinterpret_cast<const char*>(text.data_ptr()), static_cast<size_t>(text.numel()));
      return out;
    }
    out.tensor = t;
    return out;
  }

 private:
  static torch::Tensor header(Kind kind, torch::ScalarType dtype, at::IntArrayRef sizes) {
    auto h = torch::zeros({kHeader}, torch::kLong);
    auto* v = h.data_ptr<int64_t>();
    v[0] = static_cast<int64_t>(kind);
    v[1] = static_cast<int64_t>(dtype);
    v[2] = static_cast<int64_t>(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) v[3 + k] = sizes[k];
    return h;
  }

  // Where the link reads and writes: the channel's device, or the host for Gloo (which moves host
  // memory only; a CUDA device's tensors are staged).
  torch::Device link_device() const { return backend_ == "gloo" ? torch::Device(torch::kCPU) : device_; }

  Work send_header(torch::Tensor h, torch::Tensor payload) {
    h = h.to(link_device());
    // A blocking copy in the current stream's order: the host copy holds what the stream computed.
    if (payload.defined() && payload.device() != link_device()) payload = payload.to(link_device());
    sent_ += h.nbytes() + (payload.defined() ? payload.nbytes() : 0);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::vector<torch::Tensor> ts{h};
      works.push_back(call("send", [&] { return impl_->send(ts, 1, 0); }));
    }
    if (payload.defined() && payload.numel() > 0) {
      std::vector<torch::Tensor> ts{payload};
      works.push_back(call("send", [&] { return impl_->send(ts, 1, 0); }));
    }
    return Work([this, works, h, payload] {
      for (const auto& w : works) wait("send", w);
    });
  }

  c10::intrusive_ptr<c10d::Work> recv(torch::Tensor t) {
    std::vector<torch::Tensor> ts{t};
    return call("receive", [&] { return impl_->recv(ts, 0, 0); });
  }

  template <typename F>
  c10::intrusive_ptr<c10d::Work> call(const char* what, F&& f) {
    try {
      return f();
    } catch (const std::exception& e) {
      STRATA_FAIL("distributed: " << what << " on the channel " << from_ << " -> " << to_ << " (" << backend_
                                  << ") failed: " << e.what());
    }
  }

  void wait(const char* what, const c10::intrusive_ptr<c10d::Work>& w) const {
    wait_work([&] { return w; }, backend_, timeout_, [&] {
      return std::string(what) + " on the channel " + std::to_string(from_) + " -> " + std::to_string(to_);
    });
  }

  std::string backend_;
  torch::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<compat::CollectiveBackend> impl_;
  std::atomic<int64_t> sent_{0};
};

std::string backend_for(const torch::Device& device) {
  if (!device.is_cuda()) return "gloo";
  const char* choice = std::getenv("STRATA_CUDA_BACKEND");
  const bool shared = environment().ranks_share_device && environment().world_size > 1;
  std::string backend = choice && *choice ? choice : shared ? "gloo" : "nccl";
  STRATA_CHECK(backend == "nccl" || backend == "gloo",
               "distributed: STRATA_CUDA_BACKEND='" << backend << "' is not valid; use nccl or gloo");
  STRATA_CHECK(!(shared && backend == "nccl"),
               "distributed: STRATA_RANKS_SHARE_DEVICE=1 puts every rank on one GPU, which NCCL refuses; "
               "leave STRATA_CUDA_BACKEND unset or set it to gloo");
  return backend;
}

// As torch.cuda.set_device(LOCAL_RANK) before init_process_group: a CUDA device becomes the current
// one, for NCCL's communicators and for every allocation without a device of its own.
void make_current(const torch::Device& device) {
  if (!device.is_cuda()) return;
  c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  cuda.setDevice(torch::Device(torch::kCUDA, device.index() < 0 ? 0 : device.index()));
}

}  // namespace

std::shared_ptr<Channel> channel(const torch::Device& device, int from, int to) {
  static std::mutex mutex;
  // Kept for the process's lifetime, as the groups are (see group_for).
  static auto& channels = *new std::map<std::tuple<std::string, int, int>, std::shared_ptr<Channel>>();
  const auto backend = backend_for(device);
  std::lock_guard<std::mutex> lock(mutex);
  auto& c = channels[{device.str(), from, to}];
  if (!c) c = std::make_shared<C10dChannel>(backend, device, from, to);
  return c;
}

bool on_every_rank(Group& group, bool mine, const torch::Device& device) {
  auto failed = torch::full({1}, mine ? 0.0f : 1.0f, torch::TensorOptions().device(device));
  group.all_reduce(failed, /*max=*/true).wait();
  return failed.item<float>() == 0.0f;
}

void barrier(Group& group) {
  auto t = torch::zeros({1});
  group.all_reduce(t).wait();
}

std::shared_ptr<Group> group_for(const torch::Device& device) {
  static std::mutex mutex;
  // Never destroyed: a process group outlives every strategy, and NCCL's destructor at exit runs
  // after CUDA has shut down and aborts the process (seen on the GPU machine). The system reclaims
  // it; the ranks' work is complete by then (every collective is waited for). NCCL groups are shut
  // down, watchdog included, by an exit handler that runs before CUDA's teardown (nccl.cpp).
  static auto& groups = *new std::map<std::string, std::shared_ptr<Group>>();
  const std::string backend = backend_for(device);
  std::lock_guard<std::mutex> lock(mutex);
  make_current(device);
  auto& g = groups[backend];
  if (!g)
    g = std::make_shared<C10dGroup>(backend, device.is_cuda() ? torch::Device(torch::kCUDA, device.index()) : device,
                                    environment().world_size);
  return g;
}

std::shared_ptr<Group> first_ranks(const torch::Device& device, int size) {
  const auto& env = environment();
  STRATA_CHECK(size >= 1 && size <= env.world_size,
               "distributed: a group of the first " << size << " ranks in a world of " << env.world_size);
  STRATA_CHECK(env.rank < size, "distributed: rank " << env.rank << " asked to join the group of ranks 0.." << size - 1
                                                      << ", which it is not in");
  if (size == env.world_size) return group_for(device);
  // Not group_for(): making the world's group would wait for ranks that never come here.
  const std::string backend = backend_for(device);
  static std::mutex mutex;
  static auto& groups = *new std::map<std::pair<std::string, int>, std::shared_ptr<Group>>();  // as group_for's
  std::lock_guard<std::mutex> lock(mutex);
  make_current(device);
  auto& g = groups[{backend, size}];
  if (!g) g = std::make_shared<C10dGroup>(backend, device.is_cuda() ? torch::Device(torch::kCUDA, device.index()) : device, size);
  return g;
}

}  // namespace strata::distributed
