#include "strategies/hook_offload/options.h"

#include <algorithm>

#include "models/check.h"
#include "strategies/options.h"
#include "strategies/strategy.h"

namespace strata {

HookOffloadOptions HookOffloadOptions::parse(const std::map<std::string, std::string>& options) {
  STRATA_CHECK(!options.count("grads_early"),
               "hook_offload: option grads_early is called grads_in_parts now (the same values: auto, 1, 0)");
  OptionReader reader("hook_offload", options);
  HookOffloadOptions o;
  o.prefetch = reader.get_int("prefetch", o.prefetch);
  o.lead = reader.get_int("lead", o.lead);
  const auto opening = reader.get_string("opening", "auto");
  if (opening == "fit") {
    o.opening = HookOffloadOptions::kOpeningFit;
  } else if (opening != "auto") {
    o.opening = reader.get_int("opening", o.opening);  // an Error names a value that is not an integer
    STRATA_CHECK(o.opening >= 0, "hook_offload: option opening='"
                                     << opening << "' is not valid; use auto, fit or a window count, 0 or more");
  }
  const auto parts = reader.get_choice("grads_in_parts", {"auto", "1", "0"});
  o.grads_in_parts = parts == "auto" ? HookOffloadOptions::kPartsAuto : parts == "1" ? 1 : 0;
  o.recompute = reader.get_choice("activations", {"recompute", "keep"}) == "recompute";
  o.carry_tied = reader.get_bool("carry_tied", o.carry_tied);
  o.tied_rows = reader.get_bool("tied_rows", o.tied_rows);
  o.tied_early = reader.get_bool("tied_early", o.tied_early);
  const auto chunks = reader.get_string("tied_chunks", "auto");
  if (chunks != "auto") {
    o.tied_chunks = reader.get_int("tied_chunks", o.tied_chunks);  // an Error names a value that is not an integer
    STRATA_CHECK(o.tied_chunks >= 1, "hook_offload: option tied_chunks='" << chunks
                                         << "' is not valid; use auto or a copy count, 1 or more");
  }
  o.merge_last = reader.get_bool("merge_last", o.merge_last);
  o.resident = reader.get_ints("resident", o.resident);
  o.recompute_resident = reader.get_choice("resident_activations", {"keep", "recompute"}) == "recompute";
  o.resident_updates_on_device = reader.get_choice("resident_updates", {"host", "device"}) == "device";
  o.overlap_optimizer = reader.get_bool("overlap_optimizer", o.overlap_optimizer);
  o.defer_updates = reader.get_bool("defer_updates", o.defer_updates);
  o.fetch_ready_first = reader.get_choice("fetch_order", {"ready", "in_order"}) == "ready";
  o.debug_poison = reader.get_bool("debug_poison", o.debug_poison);
  o.debug_skip_waits = reader.get_bool("debug_skip_waits", o.debug_skip_waits);
  o.debug_release_late = reader.get_bool("debug_release_late", o.debug_release_late);
  o.debug_step_unwaited = reader.get_bool("debug_step_unwaited", o.debug_step_unwaited);
  reader.finish();
  o.validate();
  return o;
}

int64_t HookOffloadOptions::fit_opening_windows(const std::vector<int64_t>& new_bytes, int64_t floor, int64_t budget) {
  const auto n = static_cast<int64_t>(new_bytes.size());
  int64_t k = 0, used = 0;
  for (; k < n; ++k) {
    used += new_bytes[k];
    if (k >= floor && used > budget) break;
  }
  return k;
}

void HookOffloadOptions::validate() const {
  STRATA_CHECK(prefetch >= 0, "hook_offload: prefetch=" << prefetch << " must be 0 (synchronous) or more");
  STRATA_CHECK(lead >= 0, "hook_offload: lead=" << lead << " must be 0 (wait for each released window's compute) or more");
  STRATA_CHECK(opening >= kOpeningFit,
               "hook_offload: opening=" << opening << " must be -1 (auto), -2 (fit) or a window count, 0 or more");
  // The overlapped optimizer fetches nothing in optimizer_step (its updates finish under the next
  // forward, whose own fetches wait for them): an opening there would be silently ignored.
  STRATA_CHECK(opening == kOpeningAuto || !overlap_optimizer,
               "hook_offload: opening=" << (opening == kOpeningFit ? std::string("fit") : std::to_string(opening))
                                        << " needs overlap_optimizer=0 (the overlapped optimizer fetches no window in "
                                           "optimizer_step)");
  STRATA_CHECK(tied_chunks >= 1 || tied_chunks == kChunksAuto,
               "hook_offload: tied_chunks=" << tied_chunks << " must be auto, 1 (one copy) or more");
  for (auto b : resident) STRATA_CHECK(b >= 0, "hook_offload: resident block " << b << " is negative");
  STRATA_CHECK(!recompute_resident || !resident.empty(),
               "hook_offload: resident_activations=recompute recomputes resident blocks, and resident names none; "
               "give resident=BLOCKS");
  STRATA_CHECK(!resident_updates_on_device || !resident.empty(),
               "hook_offload: resident_updates=device trains resident blocks on the device, and resident names none; "
               "give resident=BLOCKS");
}

void HookOffloadOptions::validate_for(int64_t num_blocks) const {
  for (auto b : resident)
    STRATA_CHECK(b < num_blocks, "hook_offload: resident block " << b << " does not exist; the model has "
                                                                 << num_blocks << " blocks (0 to " << num_blocks - 1
                                                                 << ")");
  // The merged last block keeps its activations whatever it is: asking it alone to recompute would
  // silently do nothing.
  STRATA_CHECK(!recompute_resident || !merge_last ||
                   std::any_of(resident.begin(), resident.end(), [&](int64_t b) { return b != num_blocks - 1; }),
               "hook_offload: resident_activations=recompute names only the last block ("
                   << num_blocks - 1 << "), which merge_last=1 keeps from its forward through its backward; "
                   "give merge_last=0 or other resident blocks");
}

static const OptionDocumenter hook_offload_docs(
    {"hook_offload", "hook_offload_sync", "hook_offload_overlap"},
    {{"prefetch", "0..", "blocks fetched ahead of the one computing"},
     {"lead", "0..", "released windows whose compute may still be pending when the host fetches another"},
     {"opening", "auto, fit, 0..",
      "windows from block 0 on that optimizer_step fetches for the next forward beside its host pass (auto: prefetch + 1, "
      "none with prefetch 0; fit: that, and more while they fit in the device memory the last backward used; resident "
      "ones count, already there; needs overlap_optimizer=0)"},
     {"carry_tied", "0/1",
      "a unit several blocks share (tied embedding and head) stays on the device between its uses in a forward, not fetched again"},
     {"tied_rows", "0/1",
      "a tied matrix used twice (embedding and head): the first use's gradient goes to the host at once and of the last "
      "use's only the rows it touched (with overlap_optimizer the host steps the matrix from the first at once, into a "
      "second copy, and the touched rows again when they land); 0: the two are summed on the device and travel once"},
     {"tied_early", "0/1",
      "with tied_rows and overlap_optimizer: the matrix as the first use's step left it goes to the device during "
      "backward, once that step has ended (at backward's end until a batch touched at most half its rows), and the next "
      "forward's fetch sends only the rows stepped again (the matrix's device bytes held in between)"},
     {"tied_chunks", "auto, 1..",
      "with tied_rows and overlap_optimizer: the first use's gradient of the tied matrix goes to the host as this many "
      "copies of row ranges, and the host steps each range as soon as it has landed (1: one copy, stepped once whole); "
      "auto: 8 where the compute dtype is fp32, else 1"},
     {"grads_in_parts", "auto, 1, 0",
      "a block's own gradients go to the host in parts while its backward runs, a quarter of the block's gradient bytes "
      "at a time (1), or all at once when the backward has ended (0); auto: 1 where the compute dtype is fp32"},
     {"activations", "recompute, keep",
      "recompute blocks in backward, or keep their activations (resident ones follow resident_activations)"},
     {"merge_last", "0/1", "the last block stays from its forward through its backward"},
     {"resident", "block indices", "blocks kept on the device for good"},
     {"resident_activations", "keep, recompute",
      "resident blocks keep their forward's activations through backward, or are recomputed like the others (less "
      "device memory, one more forward of each)"},
     {"resident_updates", "host, device",
      "where units used only by resident blocks are trained: on the host like the rest, or on the device (masters, "
      "gradients and optimizer state stay there; up to 16 bytes a parameter of device memory)"},
     {"overlap_optimizer", "0/1", "each unit updated on the host as soon as its gradients land"},
     {"defer_updates", "0/1",
      "with overlap_optimizer: updates left when backward ends finish under the next forward (1) or in optimizer_step (0)"},
     {"fetch_order", "ready, in_order",
      "with overlap_optimizer: a fetch whose unit's update is still running is queued once it has run, letting the "
      "fetches of units already updated cross first (ready), or every fetch is queued in forward order, each behind "
      "its update (in_order)"},
     {"debug_poison", "0/1", "every fetched buffer filled with NaN before its copy", true},
     {"debug_skip_waits", "0/1", "compute does not wait for its fetches (a deliberate bug)", true},
     {"debug_release_late", "0/1", "each window dropped one block late (a deliberate bug)", true},
     {"debug_step_unwaited", "0/1", "optimizer_step does not wait for the gradients in flight (a deliberate bug)", true}});

}  // namespace strata
