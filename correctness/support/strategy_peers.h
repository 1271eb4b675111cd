#pragma once
// The tests' way into a strategy's state that no user of it needs (a friend test peer, as abseil's
// CordTestPeer): so the strategies' public interfaces carry nothing test-only. hook_offload's,
// larger, is correctness/support/hook_offload_peer.h.
#include "strategies/manual_split/manual_split.h"
#include "strategies/pipeline/pipeline.h"
#include "strategies/sharded/sharded.h"

namespace strata {

class ManualSplitTestPeer {
 public:
  explicit ManualSplitTestPeer(ManualSplit& s) : s_(s) {}
  /// Largest |replica - home| over all tied replicas (0 while they are in sync).
  double max_replica_drift() { return s_.max_replica_drift(); }

 private:
  ManualSplit& s_;
};

class PipelineTestPeer {
 public:
  explicit PipelineTestPeer(Pipeline& s) : s_(s) {}
  /// Largest |replica - home| over all replicas of shared parameters (0 while in sync).
  double max_replica_drift() { return s_.max_replica_drift(); }

 private:
  Pipeline& s_;
};

class ShardedTestPeer {
 public:
  explicit ShardedTestPeer(Sharded& s) : s_(s) {}
  /// Gathered parameter bytes on the device now (0 at rest: only shards remain).
  int64_t gathered_bytes() const { return s_.gathered_bytes_; }

 private:
  Sharded& s_;
};

}  // namespace strata
