// Test main: the device is a parameter of the whole suite (--device=cpu or --device=cuda[:N]); CTest
// runs every test once per device with labels cpu and cuda. On a machine without the device the
// binary prints why and exits 77, which CTest reports as skipped (never as passed).
#include <execinfo.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "correctness/support/test_device.h"
#include "strategies/device/device.h"

namespace strata::test {
namespace {
torch::Device g_device{torch::kCPU};

// A test that crashes prints the native stack (function names from the shared libraries) before
// the signal ends it as before, so that a crash on a machine without a debugger can be read. Where
// the unwinder cannot leave the faulting frame (a jump to a bad address, a smashed stack), the
// fault's address, the interrupted instruction and stack pointer, and the stack's words that point
// into executable code (return addresses, most of them; each with its file and file offset, for
// addr2line) still tell where it came from.
void say(const char* text) { (void)!write(STDERR_FILENO, text, std::strlen(text)); }

void print_code_words(uintptr_t ip, uintptr_t sp) {
  static char maps[1 << 20];  // LibTorch and CUDA map hundreds of ranges
  const int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return;
  size_t n = 0;
  for (ssize_t got; n + 1 < sizeof maps && (got = read(fd, maps + n, sizeof maps - 1 - n)) > 0;) n += static_cast<size_t>(got);
  close(fd);
  maps[n] = '\0';
  // Each line of the maps: its range, permissions, file offset and path (none for anonymous memory).
  struct Range {
    unsigned long lo = 0, hi = 0, offset = 0;
    char perms[8] = {}, path[256] = {};
  };
  auto parse = [](char* at, char* end, Range& r) {
    *end = '\0';  // one line at a time: a line without a path must not take the next line's
    const bool ok = std::sscanf(at, "%lx-%lx %7s %lx %*s %*s %255s", &r.lo, &r.hi, r.perms, &r.offset, r.path) >= 4;
    *end = '\n';
    return ok;
  };
  // Words of the stack up to the end of its mapping (reading past it would fault in the handler).
  int words = 512;
  for (char* at = maps; *at;) {
    char* end = std::strchr(at, '\n');
    if (!end) break;
    Range r;
    if (parse(at, end, r) && sp >= r.lo && sp < r.hi) words = static_cast<int>(std::min<uintptr_t>(512, (r.hi - sp) / 8));
    at = end + 1;
  }
  char line[512];
  int shown = 0;
  for (int i = -1; i < words && shown < 24; ++i) {  // -1: the instruction itself
    const uintptr_t word = i < 0 ? ip : reinterpret_cast<const uintptr_t*>(sp)[i];
    for (char* at = maps; *at;) {
      char* end = std::strchr(at, '\n');
      if (!end) break;
      Range r;
      auto& [lo, hi, offset, perms, path] = r;
      if (parse(at, end, r) && perms[2] == 'x' && word >= lo && word < hi) {
        char slot[16] = "instruction";
        if (i >= 0) std::snprintf(slot, sizeof slot, "sp+%d", i * 8);
        std::snprintf(line, sizeof line, "  %s: %#lx in %s +%#lx\n", slot, static_cast<unsigned long>(word),
                      path[0] ? path : "?", static_cast<unsigned long>(word - lo + offset));
        say(line);
        ++shown;
        break;
      }
      at = end + 1;
    }
  }
}

void print_stack_and_reraise(int sig, siginfo_t* info, void* context) {
  say("\nstrata_tests: a fatal signal; the native stack:\n");
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
#if defined(__x86_64__)
  const auto* uc = static_cast<const ucontext_t*>(context);
  const auto rip = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  const auto rsp = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RSP]);
  char line[160];
  std::snprintf(line, sizeof line, "fault address %p, instruction at %#lx, stack at %#lx; code addresses on the stack:\n",
                info->si_addr, static_cast<unsigned long>(rip), static_cast<unsigned long>(rsp));
  say(line);
  print_code_words(rip, rsp);
#endif
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace
const torch::Device& device() { return g_device; }
}  // namespace strata::test

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
    struct sigaction action = {};
    action.sa_sigaction = strata::test::print_stack_and_reraise;
    action.sa_flags = SA_SIGINFO;
    sigaction(sig, &action, nullptr);
  }
  ::testing::InitGoogleTest(&argc, argv);
  std::string requested = "cpu";
  int min_gpus = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--device=", 9) == 0) requested = argv[i] + 9;
    if (std::strncmp(argv[i], "--min-gpus=", 11) == 0) min_gpus = std::atoi(argv[i] + 11);
  }
  if (strata::device::cuda_device_count() < min_gpus) {
    std::cout << "SKIPPED: needs " << min_gpus << " CUDA devices, this machine has "
              << strata::device::cuda_device_count() << std::endl;
    return 77;
  }
  if (requested.rfind("cuda", 0) == 0 && !strata::device::cuda_available()) {
    std::cout << "SKIPPED: --device=" << requested << " but this machine has no CUDA device"
              << (torch::cuda::is_available() ? "" : " (or LibTorch was built without CUDA)") << std::endl;
    return 77;
  }
  try {
    strata::test::g_device = strata::device::parse(requested);
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  }
  // Parity is checked in full fp32: TF32 matmuls would make every CUDA comparison a 1e-3 one.
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
  return RUN_ALL_TESTS();
}
