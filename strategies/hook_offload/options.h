#pragma once
// hook_offload's options: what each one changes in the strategy's schedule, and what it costs.
// The measurements behind the defaults are in the notes each option names (bench/notes/).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace strata {

struct HookOffloadOptions {
  /// Blocks fetched ahead; 0 fetches each block when it is needed. Two by default: where a block's
  /// window takes longer to cross the link than the block to compute, one ahead leaves the link
  /// idle between windows; two cost one more window of device memory during the forward
  /// (bench/notes/prefetch-2.md).
  int64_t prefetch = 2;
  /// Windows released by the host whose compute may still be queued on the device when it fetches
  /// another: how far the host may run ahead. Memory a released window held is reusable only once
  /// that compute has run, so each one more costs up to a window of reserved device memory; a host
  /// that issues a block's work about as fast as the device runs it (small blocks) needs the lead
  /// (bench/notes/lead.md).
  int64_t lead = 1;
  /// Windows, from block 0 on, that optimizer_step fetches for the next forward (needs
  /// overlap_optimizer=0), each as soon as its units are updated, so their copies run beside the
  /// host pass and not at the forward's start. Resident windows count and are already there. More
  /// than the model has: all. They stay on the device from the step to their block's forward.
  /// kOpeningAuto: prefetch + 1 (what backward holds at every block, so never more than a step
  /// holds anyway), none with prefetch=0. kOpeningFit: that, and more windows while their bytes
  /// fit in the device memory the last backward was seen using beyond what is in use when the
  /// opening starts, less one window of headroom (fit_opening_windows); where a step's
  /// peak is set in backward (a head's), those cost no peak allocated, but they move their copies
  /// into the host pass, which they slow (bench/notes/opening.md). With no backward seen (the CPU
  /// reports no device memory; a first or failed step) fit is auto.
  static constexpr int64_t kOpeningAuto = -1, kOpeningFit = -2;
  int64_t opening = kOpeningAuto;
  /// A unit several blocks share (a tied embedding and head) stays on the device from one of its
  /// uses in a forward to the next, instead of being released and fetched again: one fetch of it
  /// fewer a forward, for its bytes held in between. Where the later use is a head whose backward
  /// sets the step's peak (a GPT's), the peak holds it anyway (bench/notes/carry-tied.md).
  bool carry_tied = true;
  /// A tied matrix used twice (an embedding and a head): the first use's gradient goes to the host
  /// as soon as it exists and of the last use's only the rows that are not all zero. With
  /// overlap_optimizer the host takes the matrix's step from the first gradient at once, into a
  /// second copy of the matrix and its optimizer state, and takes it again for the touched rows when
  /// they land, from the same start: most of the step runs while backward still has blocks to go
  /// rather than after its end, for one more host copy of the matrix and its state and the touched
  /// rows' step taken twice. false: the uses' gradients are summed on the device and travel once
  /// (bench/notes/tied-rows.md).
  bool tied_rows = true;
  /// With tied_rows and overlap_optimizer: the matrix as the first use's step left it goes to the
  /// device ahead of its fetch (during backward, at the first block boundary after that step has
  /// ended, once a last use of the matrix was seen sparse; at the end of backward before that), and
  /// the next forward's fetch sends only the touched rows once their step has run. It trades the
  /// matrix's device bytes, held from then to the next forward, for a fetch of its rows alone at
  /// the step's boundary; a last use that turns dense wastes one copy. It pays where the host's
  /// pass is shorter than the device's step (the fetch at the boundary is then what the forward
  /// waits for); where the host's pass is the critical path, the forward waits for the updates
  /// instead, and the copy's read of host memory slows them. Off by default, for the second kind
  /// of model (bench/notes/tied-early.md). "Early" in this strategy means this copy, ahead of its
  /// fetch, and nothing else.
  bool tied_early = false;
  /// With tied_rows and overlap_optimizer: the first use's gradient of a tied matrix (the head's)
  /// goes to the host as this many copies of consecutive row ranges, and the host steps each range
  /// as soon as its copy has landed, rather than waiting for the whole matrix's copy before the
  /// first part starts. The same element steps, so the same result to the bit. The ranges' writes
  /// into host memory run beside the first part's pass and slow it, taking back part of what
  /// starting earlier gains, which in bf16 (half the copy) is about all of it. 1: one copy.
  /// kChunksAuto: 8 where the compute dtype is fp32, else 1 (bench/notes/tied-chunks.md).
  static constexpr int64_t kChunksAuto = -1;
  int64_t tied_chunks = kChunksAuto;
  /// A block's own gradients go to the host in parts while its backward runs, each part once
  /// autograd has produced a quarter of the unit's gradient bytes (its last at the block's end),
  /// rather than all of them once the backward has ended: what is left to cross the link after the
  /// last block's backward is then its last part, not its whole window. Tied units, units trained
  /// on the device and a step's later micro-batches (summed on the host through staging) still go
  /// at the block's end. 1 or 0; kPartsAuto: 1 where the compute dtype is fp32 (under bf16 it made
  /// the step slower, for a cause not traced; bench/notes/grads-in-parts.md). Named grads_early
  /// before; that name is refused with the new one named.
  static constexpr int kPartsAuto = -1;
  int grads_in_parts = kPartsAuto;
  bool recompute = true;               ///< recompute blocks in backward (checkpointing); false keeps activations
  bool merge_last = true;              ///< the last block stays on the device from its forward through its backward
  std::vector<int64_t> resident;       ///< blocks kept on the device for good
  /// Resident blocks recompute in backward too (resident_activations=recompute), instead of keeping
  /// their forward's activations: about as much device memory a transformer block as its training
  /// state, for one more forward of it (bench/notes/resident-activations.md).
  bool recompute_resident = false;
  /// Units every use of which is a resident block are also trained on the device: their fp32
  /// masters, gradients and optimizer state stay there and their update runs there (in the overlap
  /// mode as soon as their gradient is complete), so they cost the link and the host nothing, for
  /// up to 16 bytes a parameter of device memory. A unit shared with a block that is not resident
  /// (a tied embedding whose head is offloaded) stays on the host. The host's pass shrinks by their
  /// share, which is what bounds the overlapped step (bench/notes/resident-updates.md).
  bool resident_updates_on_device = false;
  /// Update each unit on the host as soon as its gradients land; updates that backward's end
  /// leaves undone finish while the next step's forward runs, in the order it needs them.
  bool overlap_optimizer = false;
  /// With overlap_optimizer: optimizer_step returns before the updates backward left undone have
  /// run (each unit's next fetch waits for its own); false waits for all of them there
  /// (bench/notes/defer-updates.md).
  bool defer_updates = true;
  /// fetch_order=ready, with overlap_optimizer: a fetch whose unit's host update is still running is
  /// not queued on the copy stream until that update has run (the forward's thread waits for it
  /// where it needs the unit), so the fetches asked for after it, of units already updated, cross
  /// the link first. At the step's boundary the first windows' updates end out of forward order.
  /// in_order (false) queues every fetch in forward order, each behind its update, and everything
  /// after a held one waits with it (bench/notes/fetch-order.md).
  bool fetch_ready_first = true;
  bool debug_poison = false;           ///< fill every fetched buffer with NaN before the copy (tests)
  bool debug_skip_waits = false;       ///< compute does not wait for fetches: a deliberate bug (tests)
  bool debug_release_late = false;     ///< each window is dropped one block late: a deliberate bug (tests)
  bool debug_step_unwaited = false;    ///< optimizer_step does not wait for the gradients in flight: a
                                       ///< deliberate bug (tests)

  /// opening=fit: how many windows, from block 0 on, the opening holds. `new_bytes[k]`: the device
  /// bytes window k adds to windows 0 to k-1 (0 for units held already or in an earlier window).
  /// At least `floor` (capped at the model's windows); beyond it, windows while the sum of their
  /// bytes stays within `budget`.
  static int64_t fit_opening_windows(const std::vector<int64_t>& new_bytes, int64_t floor, int64_t budget);

  static HookOffloadOptions parse(const std::map<std::string, std::string>& options);
  void validate() const;
  /// Checks the options against a model of `num_blocks` blocks.
  void validate_for(int64_t num_blocks) const;
};

}  // namespace strata
