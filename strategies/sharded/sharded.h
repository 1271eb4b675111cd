#pragma once
// Sharded data parallel (ZeRO-3 / FSDP style), one process per rank over the c10d group of
// strategies/distributed. Units as in hook_offload — a block's own parameters, or one parameter
// several blocks share — each one flat fp32 buffer padded to a multiple of the world size; rank r
// keeps slice r (its shard) and the optimizer state of that slice only. A block's units are
// all-gathered just before it runs (the next blocks' gathers already in flight) and freed after it
// (or kept to backward: reshard_after_forward=0; the last block's always are); backward gathers them
// again in reverse, recomputes the block (or keeps its activations; the last block always keeps them) and reduce-scatters each unit's gradient as soon as its last
// use is done, while the next block's backward runs. Each rank is handed the global batch, runs its
// own slice of it, and weighs its loss by its share of the batch's targets, so the result is the
// whole batch's mean whatever the split. Buffers (BatchNorm's running statistics) are rank 0's on
// every rank after each forward, as DDP's default keeps them (agree_on_buffers).
//
// A unit's reduce-scatter is waited for one block later (when the next block's gradients are
// flushed), so it overlaps that block's backward; on a fresh step it reduces straight into the
// shard's gradient. A unit larger than piece_kib goes in pieces, each taking the same range of
// every rank's shard, a piece waiting for the one two before it: its reduction needs a few pieces'
// memory beside the block's own gradient. A gather is in place (this rank's slot of the gathered
// buffer is its source). In a world of one nothing crosses a process: an fp32 unit on the device
// is its shard (the parameters view it), and gradients go straight into the shard's.
//
// sharded_offload keeps shards, their gradients and the optimizer state in pinned host memory and
// steps the optimizer there (the ZeRO-Offload / FSDP CPUOffloadPolicy arrangement). On CUDA a shard
// is copied to the device on a copy stream just before its gather (overlapping the block computing),
// a reduced gradient goes back on another, and, by default (overlap_optimizer=1), the host updates
// each unit as soon as its gradient has landed, while backward goes on. On the CPU the same path
// runs with worker threads as the copy streams.
//
// Mixed precision (StrategyConfig::precision): shards and optimizer state stay fp32; units are
// gathered in the compute dtype (the transfer dtype, which must equal it here), so the blocks
// compute in it; gradients are summed and reduce-scattered in the reduction dtype and added to the
// fp32 shard gradients. sharded_offload keeps a pinned compute-dtype copy of each shard beside it,
// refreshed by each host update, so the shards go up at half the bytes under bf16. fp16 scales the
// loss; a step with an inf or nan gradient on any rank is skipped on every rank.
#include <deque>
#include <optional>

#include "strategies/device/device.h"
#include "strategies/distributed/process_group.h"
#include "strategies/strategy.h"
#include "strategies/windowed.h"

namespace strata {

struct ShardedOptions {
  int64_t prefetch = 1;                ///< blocks whose gathers run ahead of the one computing
  bool recompute = true;               ///< activations=recompute (default) or keep
  bool reshard_after_forward = true;   ///< free gathered units after forward (gather again in backward)
  bool offload = false;                ///< shards, gradients and optimizer state in pinned host memory
  bool overlap_optimizer = false;      ///< offload: update each unit on the host during backward
                                       ///< (default with offload; refuses gradient accumulation)
  int64_t piece_kib = 256 * 1024;      ///< a unit one block uses is reduced in pieces of at most this
                                       ///< many KiB of each rank's shard
  bool debug_poison = false;           ///< fill every gathered buffer with NaN first (tests)
  bool debug_skip_waits = false;       ///< compute does not wait for gathers: a deliberate bug (tests)
  int64_t debug_fail_rank = -1;        ///< this rank throws in the second block's forward (fault tests)

  static ShardedOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
  std::string to_string() const;
};

class Sharded : public Strategy, public WindowedRunner {
 public:
  Sharded(std::string name, const StrategyConfig& config, ShardedOptions options);
  ~Sharded() override;

  std::string name() const override { return name_; }
  double train_step(const models::Batch& batch) override;
  torch::Tensor forward(const torch::Tensor& input) override;
  void optimizer_step() override;
  NamedTensors gradients() override;
  NamedTensors parameters() override;
  NamedTensors buffers() override;
  /// This rank's part of the state: each parameter's and moment's elements in its shard as pieces
  /// (training_state.h), each step count by the rank holding the parameter's first element, the
  /// buffers and the loss scaler by rank 0. The ranks' parts together are the whole state, and
  /// load_training_state() takes any state (whole, or all ranks' parts of any world) on every rank.
  NamedTensors training_state() override;
  void load_training_state(const NamedTensors& state) override;
  bool accumulates_gradients() const override { return !options_.overlap_optimizer; }
  bool supports(const PrecisionPolicy& policy) const override;
  void finish_backward() override;
  Stats stats() override;
  void reset_stats() override;

  int rank() const;
  int world_size() const override;
  int64_t batch_slices(int64_t batch_size) const override { return world_size(); }

  // WindowedRunner.
  models::BlockModel& model() override;
  void before_compute(int64_t block, bool backward) override;
  void after_compute(int64_t block, bool backward) override;
  void flush_gradients(int64_t block, const std::vector<torch::Tensor>& grads) override;
  /// The last block (a head whose output goes straight into the loss) keeps its graph and its
  /// window: its backward follows its forward at once, so a recompute and a second gather would
  /// redo the widest product and the head's cast for nothing (baseline_checkpoint leaves it out too).
  bool recompute_block(int64_t block) const override { return options_.recompute && !last_block(block); }
  std::vector<KeptGraph>& kept_graphs() override { return kept_; }
  bool last_block(int64_t block) const { return block + 1 == static_cast<int64_t>(windows_.size()); }

 protected:
  void attach_model(models::BlockModel model) override;

 private:
  friend class ShardedTestPeer;  // correctness/support/strategy_peers.h
  /// This rank's rows [first, second) of a batch of `batch` samples.
  std::pair<int64_t, int64_t> slice_of(int64_t batch) const;
  struct Unit;
  // One reduction in flight: elements [offset, offset + length) of a unit's shard. A unit's gradient
  // goes as one (a shared unit's summed grad_full) or in pieces of at most piece_kib (a unit one
  // block uses), each piece taking the same range of every rank's shard.
  struct Reduction {
    int64_t unit = 0;
    int64_t offset = 0, length = 0;
    bool fresh = false;        ///< the unit's first gradient since the last optimizer step: written, not added
    bool last = false;         ///< the unit's last piece of this step (overlap_optimizer: then its update)
    torch::Tensor in;          ///< [world x length] every rank's range, in rank order (the collective's scratch)
    torch::Tensor out;         ///< [length] this rank's sum (a range of shard_grad itself where it can be)
    distributed::Work work;
    device::Event done;        ///< its result is where it goes (offload: landed on the host)
  };
  void gather(Unit& unit);
  void release(Unit& unit);
  void hold_window(int64_t block);
  void drop_window(int64_t block);
  void prefetch_from(int64_t block, bool backward);
  /// Waits for the reduce-scatters launched so far and adds each result to its shard's gradient
  /// (offload on CUDA: sends it to the host, where it is added and, with overlap_optimizer, applied).
  void finish_reductions();
  void finish_reduction(Reduction& r);
  /// Counts a reduction of `elements` (every rank's part) as the group's backend moves it.
  void count_reduction(int64_t elements);
  /// Everything queued on the host and the copy streams (offload) has run.
  void finish_pending();
  void update_shard(Unit& unit);
  /// Buffers as DDP keeps them (its broadcast_buffers default): every rank takes rank 0's after
  /// each forward (rank 0's are what its own slice left), so the next forward starts from them on
  /// every rank and buffers() is the same everywhere.
  void agree_on_buffers();
  /// A full tensor assembled from every rank's slice `part` of `unit` (a shard or its gradient).
  torch::Tensor gather_full(const Unit& unit, const torch::Tensor& part);
  NamedTensors full_tensors(bool grads);
  void count_collective(int64_t bytes, double factor);
  /// Bytes of one element as gathered (the transfer dtype) and as reduced (the reduction dtype).
  int64_t gathered_element() const;
  int64_t reduced_element() const;
  /// What `unit` is gathered from on the device's side: its shard (or pinned travel copy) in the
  /// transfer dtype.
  torch::Tensor travel_source(const Unit& unit) const;

  std::string name_;
  StrategyConfig config_;
  ShardedOptions options_;
  torch::Device device_;                  ///< compute device: distributed::rank_device(config.device)
  std::shared_ptr<distributed::Group> group_;
  std::optional<models::BlockModel> model_;
  std::vector<Unit> units_;
  std::vector<std::vector<int64_t>> windows_;
  std::vector<bool> held_;
  std::vector<std::pair<int64_t, int64_t>> param_slot_;  ///< parameter -> (unit, offset in the flat)
  std::vector<KeptGraph> kept_;
  LossScaler scaler_;
  torch::Tensor anchor_;
  std::deque<Reduction> reducing_;           ///< reductions in flight, in launch order
  std::optional<device::Stream> h2d_, d2h_;  ///< offload on CUDA: shards up, gradients down
  std::optional<device::HostQueue> host_;    ///< offload on CUDA: landed gradients added and applied
  bool step_in_flight_ = false;              ///< overlap_optimizer: a train_step awaits optimizer_step
  bool backward_ = false;
  int64_t step_blocks_ = 0;  ///< blocks computed in this forward (debug_fail_rank)
  int64_t gathered_bytes_ = 0, peak_gathered_ = 0, shard_bytes_ = 0;
  int64_t bytes_interconnect_ = 0, bytes_h2d_ = 0, bytes_d2h_ = 0;
  std::atomic<int64_t> host_update_ns_{0};  ///< Stats::host_update_ms (offload: the host optimizer's time)
};

}  // namespace strata
