// Test main: the device is a parameter of the whole suite (--device=cpu or --device=cuda[:N]); CTest
// runs every test once per device with labels cpu and cuda. On a machine without the device the
// binary prints why and exits 77, which CTest reports as skipped (never as passed).
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <iostream>

#include "correctness/support/test_device.h"
#include "strategies/device/device.h"

namespace strata::test {
namespace {
torch::Device g_device{torch::kCPU};

// A test that crashes prints the native stack (function names from the shared libraries) before
// the signal ends it as before, so that a crash on a machine without a debugger can be read.
void print_stack_and_reraise(int sig) {
  const char head[] = "\nstrata_tests: a fatal signal; the native stack:\n";
  (void)!write(STDERR_FILENO, head, sizeof head - 1);
  void* frames[64];
  backtrace_symbols_fd(frames, backtrace(frames, 64), STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}
}  // namespace
const torch::Device& device() { return g_device; }
}  // namespace strata::test

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, strata::test::print_stack_and_reraise);
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
