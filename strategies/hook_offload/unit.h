#pragma once
// What hook_offload moves as one, and the state that travels with it. A unit is the parameters
// only one block uses (that block's own), or one parameter several blocks share (a tied weight).
// Each has one flat pinned host copy of its values and gradients, and one flat device buffer whose
// memory exists only while it is held. A tied matrix used twice (an embedding and a head) carries
// the state of its split step (TiedRows); a unit sent in parts during its backward, the parts on
// their way (GradientParts).
#include <torch/torch.h>

#include <array>
#include <memory>
#include <vector>

#include "strategies/device/device.h"
#include "strategies/optim.h"

namespace strata::hook_offload {

/// A unit's gradients that go to its host buffer while its block's backward runs
/// (grads_in_parts): the parts waiting to go, where each goes in the unit's flat gradient, and
/// their bytes. They go once they make up a quarter of the unit's gradient bytes, or at the
/// block's end.
struct GradientParts {
  std::vector<torch::Tensor> waiting;
  std::vector<int64_t> offsets;
  int64_t bytes = 0;

  void add(torch::Tensor part, int64_t offset) {
    bytes += part.nbytes();
    waiting.push_back(std::move(part));
    offsets.push_back(offset);
  }
  /// A quarter of `trainable_numel` fp32 elements waits: time for a transfer.
  bool quarter_of(int64_t trainable_numel) const {
    return 4 * bytes >= trainable_numel * static_cast<int64_t>(sizeof(float));
  }
  void clear() {
    waiting.clear();
    offsets.clear();
    bytes = 0;
  }
};

/// tied_early: a tied matrix copied to the device ahead of its fetch, as the first part of its
/// step left it, so the next forward's fetch sends only the rows the rows part stepped again.
/// Its life: the first part writes `source`; once that part has ended the buffer goes to `flat`
/// (a device buffer of its own; `loaded` after it); the rows part gathers its stepped rows into
/// `staging` (rows `touched`, made on the device at `touched_made`) and opens `rows_gathered`;
/// the next acquire takes `flat`'s memory as the unit's buffer (`rows_next`) and its fetch sends
/// `staging` into those rows. A full fetch, a dense last use or a failed step drops it.
struct EarlyCopy {
  torch::Tensor source;
  torch::Tensor flat;
  torch::Tensor touched;
  torch::Tensor staging;
  device::Event touched_made, loaded;
  std::shared_ptr<device::Gate> rows_gathered;
  bool rows_next = false;
  /// A last use of the matrix was sparse: from then on the copy is wanted as soon as the first
  /// part has ended (`wanted`, set when the first part is queued), not only at the end of backward.
  bool sparse_seen = false, wanted = false;

  /// Sent during this backward, its rows part not queued yet (the rows part's gate is made then).
  bool sent_in_backward() const { return flat.defined() && !rows_gathered; }
  /// Forgets the copy; true if it held a device buffer (whose bytes the caller stops counting).
  bool drop() {
    const bool had_buffer = flat.defined();
    flat = torch::Tensor();  // allocated on the copy stream: reused only behind its copy
    touched = torch::Tensor();
    staging = torch::Tensor();
    rows_gathered.reset();
    rows_next = false;
    return had_buffer;
  }
};

/// A tied matrix used twice (an embedding and a head; tied_rows): `rows` is its row count, 0 for
/// any other unit (or one whose last use turned dense: from then on its uses are summed on the
/// device). The first use's gradient goes to the host as soon as it exists, and of the last use's
/// only the rows that are not all zero. With the overlapped optimizer the host takes the step from
/// the first use's gradient (the first part) into the spare buffers, and again for the touched
/// rows from the same start (the rows part); once the rows part is queued the spare buffers are
/// the master and the old master the next step's spare (promote_spare).
struct TiedRows {
  int64_t rows = 0;
  torch::Tensor spare_param, spare_travel;
  /// Written by the host worker: this step's first part ran to its end. A rows part after one that
  /// did not takes the whole step instead of the rows alone. Read on the main thread only once
  /// first_part_ended is open: a backward that failed after a first part leaves it true into the
  /// next step, until that step's own first part writes it again.
  bool first_part_done = false;
  /// Opens once this step's first part has ended, whether it ran or failed (null before one is queued).
  std::shared_ptr<device::Gate> first_part_ended;
  bool first_use_sent = false;  ///< this step's first use went to the host; the last use's rows follow
  /// tied_chunks: the first use's gradient went as row ranges [bounds[k], bounds[k + 1]), range k
  /// landed once landed_ranges[k] has passed; handed to the first part when it is queued.
  std::vector<device::Event> landed_ranges;
  std::vector<int64_t> range_bounds;
  EarlyCopy early;

  bool active() const { return rows > 0; }
  /// The spare buffers become the master (and their optimizer slot the current one); the master
  /// becomes the spare. Twice is no change.
  void promote_spare(torch::Tensor& master, torch::Tensor& master_travel, int& optimizer_now) {
    std::swap(master, spare_param);
    std::swap(master_travel, spare_travel);
    optimizer_now = 1 - optimizer_now;
  }
  /// After a backward that failed: what it sent of this step is not this step's any more.
  /// Returns true where the unit's host gradient held only this step's first use (a first use is
  /// sent only when the unit held none), which the caller then drops. A copy sent during that
  /// backward may be what left too little memory: from now on it goes at backward's end again.
  bool reset_after_failed_backward() {
    landed_ranges.clear();
    range_bounds.clear();
    if (early.sent_in_backward()) early.sparse_seen = false;
    early.wanted = false;
    return std::exchange(first_use_sent, false);
  }
};

/// Adds a tied matrix's touched rows' gradients (values [n, cols], distinct row indices `touched`)
/// into its flat host gradient, on the host's threads.
void add_rows(const torch::Tensor& grad, const torch::Tensor& values, const torch::Tensor& touched);

/// One unit. Its parameters are views of device_flat, whose storage exists only while the unit is
/// held (references > 0).
struct Unit {
  std::vector<int64_t> params;  ///< indices into the model's parameters(), in flat order: trainable ones first
  int64_t numel = 0;
  int64_t bytes = 0;            ///< on the device, in the compute dtype
  int64_t trainable_numel = 0;  ///< the leading elements that train; the rest are frozen
  int users = 0;                ///< blocks whose window holds this unit
  int64_t first_use = 0;        ///< the first block whose window holds this unit (forward order)
  std::vector<int64_t> uses;    ///< the blocks whose windows hold this unit, in forward order

  torch::Tensor host_param;     ///< fp32 master
  torch::Tensor host_travel;    ///< the master in the transfer dtype; undefined when that is fp32
  int64_t travel_bytes = 0;     ///< bytes of one fetch to the device
  torch::Tensor host_grad;      ///< trainable_numel elements; undefined for a unit that is all frozen
  /// Optimizer state: slot `optimizer_now` goes with host_param, the other with the spare (tied).
  std::array<OptimizerState, 2> optimizer_slots;
  int optimizer_now = 0;
  OptimizerState& optimizer() { return optimizer_slots[optimizer_now]; }

  torch::Tensor device_flat;    ///< parameters are views of it; its storage is released when unheld
  int references = 0;
  device::Event loaded;
  /// carry_tied: the block whose window, once held, takes over the reference this unit keeps from
  /// its previous use in this forward; -1 when it keeps none.
  int64_t carried_to = -1;
  bool stale = false;           ///< held on the device across an optimizer step: its copy is old
  /// overlap mode: opens once this step's host update of the unit has run; the unit's next fetch
  /// waits for it. Null when no update is pending.
  std::shared_ptr<device::Gate> updated;
  /// fetch_order=ready: its fetch was asked for before `updated` opened and is not queued yet; its
  /// device buffer is allocated and unwritten (listed among the strategy's deferred fetches).
  bool fetch_deferred = false;

  bool grad_filled = false;     ///< host_grad holds this step's gradient (else it is stale)
  int pending_users = 0;        ///< backward contributions still to come this step
  torch::Tensor device_grad;    ///< a tied unit's gradients of this step's earlier uses, summed on the device
  GradientParts parts;

  /// resident_updates=device and every use resident: trained on the device. Its master is
  /// device_master (device_flat itself when the compute dtype is fp32), its gradient of this step
  /// device_grad_sum, its optimizer state on the device; host_param and host_grad are not used.
  bool on_device() const { return device_master.defined(); }
  torch::Tensor device_master;
  torch::Tensor device_grad_sum;

  TiedRows tied;
};

}  // namespace strata::hook_offload
