#pragma once
// This process's place among the ranks that run a multi-process test (launch.py sets the
// environment; one rank of one when the suite runs as a single process).
#include "strategies/distributed/process_group.h"

namespace strata::test {
inline int world() { return distributed::environment().world_size; }
inline int rank() { return distributed::environment().rank; }
}  // namespace strata::test
