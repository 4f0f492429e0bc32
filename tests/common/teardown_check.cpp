// After every test case: every block pool is gone (each block holds its
// pool, so none alive means no block, epoch or snapshot leaked) and every
// pool was destroyed with zero blocks counted in use. A violation fails the
// run, naming the test case.
#ifdef GHOSTLINK_CATCH2_V3
#include <catch2/catch_test_case_info.hpp>
#include <catch2/reporters/catch_reporter_event_listener.hpp>
#include <catch2/reporters/catch_reporter_registrars.hpp>
using listener_base = Catch::EventListenerBase;
namespace {
const Catch::TestCaseInfo& info(const Catch::TestCaseStats& s) { return *s.testInfo; }
}  // namespace
#else
#define CATCH_CONFIG_EXTERNAL_INTERFACES  // the listener interface
#include <catch2/catch.hpp>
using listener_base = Catch::TestEventListenerBase;
namespace {
const Catch::TestCaseInfo& info(const Catch::TestCaseStats& s) { return s.testInfo; }
}  // namespace
#endif

#include "testing/hooks.hpp"

#include <cstdlib>
#include <iostream>

namespace {

using ghostlink::detail::pools_alive;
using ghostlink::detail::pools_destroyed_unbalanced;

class pool_teardown_check final : public listener_base {
 public:
  using listener_base::listener_base;

  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    const std::size_t alive = pools_alive();
    const std::size_t unbalanced = pools_destroyed_unbalanced();
    if (alive != 0 || unbalanced != unbalanced_before_) {
      std::cerr << "teardown check failed after \"" << info(stats).name << "\": " << alive
                << " block pool(s) still alive, " << (unbalanced - unbalanced_before_)
                << " destroyed with blocks still counted in use\n";
      failed_ = true;
    }
    unbalanced_before_ = unbalanced;
  }

  void testRunEnded(const Catch::TestRunStats&) override {
    if (failed_) std::exit(EXIT_FAILURE);  // NOLINT(concurrency-mt-unsafe): the run is over, no test thread is left
  }

 private:
  std::size_t unbalanced_before_ = 0;
  bool failed_ = false;
};

}  // namespace

CATCH_REGISTER_LISTENER(pool_teardown_check)
