#pragma once
// This process's place among the ranks that run a multi-process test (launch.py sets the
// environment; one rank of one when the suite runs as a single process).
#include "strategies/distributed/process_group.h"

namespace strata::test {
inline int world() { return distributed::environment().world_size; }
inline int rank() { return distributed::environment().rank; }
}  // namespace strata::test

// At the top of a test that means something only across processes (ranks that disagree, options a
// launch refuses): run outside a launch, in a world of one, it fails saying what it needs instead of
// with whatever a one-rank run happens to do. A failure, not a skip: a launcher that stopped setting
// the world must not turn these into passes.
// (In a do-while, so that it stays one statement beside an if or else.)
#define STRATA_NEEDS_PROCESSES(n)                                                                     \
  do {                                                                                               \
    if (::strata::test::world() < (n))                                                               \
      FAIL() << "needs a launch of at least " << (n) << " processes (ctest starts it under "         \
             << "strategies/distributed/launch.py); this is a world of " << ::strata::test::world(); \
  } while (0)
