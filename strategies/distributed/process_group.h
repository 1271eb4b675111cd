#pragma once
// The process-group layer: one process per rank, finding each other the torchrun way (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, a c10d TCPStore; under torchrun's agent, its
// store), with c10d's own backends: Gloo for tensors on the CPU, NCCL for tensors on CUDA. So any
// launcher that sets those variables (torchrun --no-python, Slurm, strategies/distributed/
// launch.py) starts strata on any number of machines. Without them, a process is rank 0 of a world
// of one. Every collective and every rendezvous has a timeout: a rank that died or never came
// turns into an Error on the others, never a hang.
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

namespace strata::distributed {

/// Where this process stands, from the environment.
struct Environment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool agent_store = false;  ///< TORCHELASTIC_USE_AGENT_STORE: torchrun's agent serves the store
  int restart_count = 0;     ///< TORCHELASTIC_RESTART_COUNT: the store's keys are this attempt's
  bool launched = false;     ///< the variables were set (else: a world of one)
  /// STRATA_RANKS_SHARE_DEVICE=1: every rank of this machine computes on the one device it is
  /// given (cuda:0 by default) instead of cuda:LOCAL_RANK, so a one-GPU machine runs every
  /// multi-process CUDA path. NCCL refuses two ranks on one GPU, so CUDA tensors then travel over
  /// Gloo (STRATA_CUDA_BACKEND=nccl with it is an Error).
  bool ranks_share_device = false;

  /// Reads and checks the variables; an Error names a missing or malformed one.
  static Environment from_env();
};

/// A collective in flight. wait() returns once it is done (the CPU) or once the current CUDA
/// stream waits for it (NCCL), and throws a strata::Error naming the collective and the ranks if it
/// failed or timed out. Waiting twice is a no-op.
class Work {
 public:
  Work() = default;
  explicit Work(std::function<void()> wait) : wait_(std::move(wait)) {}
  void wait();
  bool pending() const { return static_cast<bool>(wait_); }

 private:
  std::function<void()> wait_;
};

class Group {
 public:
  virtual ~Group() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& backend() const = 0;  ///< "gloo" or "nccl"
  virtual std::chrono::milliseconds timeout() const = 0;
  /// out (contiguous, size() x in.numel() elements) <- every rank's `in`, in rank order.
  virtual Work all_gather(const torch::Tensor& out, const torch::Tensor& in) = 0;
  /// out (in.numel() / size() elements) <- the sum over ranks of their `in`'s slice number rank().
  /// `in` is used as scratch space and must not be read until the work is waited for.
  virtual Work reduce_scatter(const torch::Tensor& out, const torch::Tensor& in) = 0;
  /// t <- the sum (or, with `max`, the largest) of every rank's t, in place.
  virtual Work all_reduce(const torch::Tensor& t, bool max = false) = 0;
  /// t <- rank `root`'s t, in place, on every rank.
  virtual Work broadcast(const torch::Tensor& t, int root) = 0;
  /// Every rank passes its `value` for `topic` (e.g. a description of its model); throws the same
  /// Error on every rank when one differs from rank 0's, naming both, or when a rank does not
  /// arrive within the timeout.
  virtual void agree(const std::string& topic, const std::string& value) = 0;
};

/// One direction of a point-to-point link: rank `from` sends, rank `to` receives, both in one order
/// (the order the sender sends in). Each channel is a two-rank group of its own, so messages in the
/// two directions between a pair never queue behind each other (one NCCL stream per direction).
/// A tensor travels with a header (dtype and sizes): the receiver needs no shape. An undefined
/// tensor travels as a marker and arrives undefined; a failure travels as its text. Gloo moves
/// host memory only: a CUDA tensor over Gloo (ranks sharing a GPU) is staged through the host on
/// both ends, in the current stream's order.
class Channel {
 public:
  virtual ~Channel() = default;
  int from() const { return from_; }
  int to() const { return to_; }
  /// On `from`: queues `t` behind the current stream's work (NCCL) or at once (Gloo). The Work
  /// completes when the message has left; `t` is kept alive until then.
  virtual Work send(const torch::Tensor& t) = 0;
  /// On `from`: tells the receiver that this message will not come, and why.
  virtual Work send_failure(const std::string& what) = 0;
  struct Received {
    torch::Tensor tensor;  ///< undefined when an undefined tensor was sent
    bool failed = false;   ///< the sender sent a failure; `failure` is its text
    std::string failure;
  };
  /// On `to`: the next message, on the channel's device. With NCCL the current stream waits for it.
  /// An Error when the sender does not send within the timeout.
  virtual Received receive() = 0;
  /// Bytes this end has handed to the link so far, headers included (what a byte counter reports).
  virtual int64_t bytes_sent() const = 0;

 protected:
  Channel(int from, int to) : from_(from), to_(to) {}
  int from_, to_;
};

/// The channel from rank `from` to rank `to` for tensors on `device` (Gloo on the CPU, NCCL on
/// CUDA), made on first use and kept. Both ranks must ask for it; a process that asks for several
/// must ask in one order agreed by all (e.g. sorted by (from, to)), since making one waits for the
/// other side.
std::shared_ptr<Channel> channel(const torch::Device& device, int from, int to);

/// The process's group for tensors on `device`'s type (Gloo for the CPU; NCCL for CUDA, or Gloo
/// where STRATA_CUDA_BACKEND=gloo), made on first use from the environment and kept for the
/// process's lifetime. Timeout: STRATA_DIST_TIMEOUT_S seconds (default 300).
std::shared_ptr<Group> group_for(const torch::Device& device);

/// The group of the world's ranks 0..size-1 for tensors on `device`'s type (the world's own group
/// when `size` is the world's): a strategy over part of a launch, e.g. one that resumes a run at
/// another world size. Only those ranks call it, each the first time at the same point of its
/// program (joining waits for the others); kept, as group_for's groups are. A rank outside it, or
/// a size outside 1..world, is an Error.
std::shared_ptr<Group> first_ranks(const torch::Device& device, int size);

/// True when `mine` is true on every rank of `group` (a flag all-reduced on `device`): a decision
/// taken the same way everywhere, e.g. whether all of a step's gradients are finite.
bool on_every_rank(Group& group, bool mine, const torch::Device& device);

/// Returns once every rank of `group` has called it (an all-reduce of one number), or throws the
/// group's timeout Error.
void barrier(Group& group);

/// Bytes each rank sends in a ring all-reduce of `bytes` over `world` ranks: 2 (W - 1) / W of them
/// (what the byte counters report for an all-reduce, whichever backend runs it).
int64_t ring_all_reduce_bytes(int64_t bytes, int world);

/// The environment group_for() uses, read once.
const Environment& environment();

/// The device this rank computes on when a strategy is asked for `requested`: launched over
/// several processes on CUDA, cuda:LOCAL_RANK (each rank its own GPU), or `requested` itself where
/// the ranks share a device (Environment::ranks_share_device); otherwise `requested`.
torch::Device rank_device(const torch::Device& requested);

}  // namespace strata::distributed
