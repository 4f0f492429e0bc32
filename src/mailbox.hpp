#pragma once
// The actor's mailbox: a lock-free multi-producer queue of requests.
// moodycamel's ConcurrentQueue keeps each producer thread's items in FIFO
// order, which is what gives "requests initiated from one thread apply in
// the order they were initiated".

#if __has_include(<concurrentqueue/moodycamel/concurrentqueue.h>)
#include <concurrentqueue/moodycamel/concurrentqueue.h>
#elif __has_include(<concurrentqueue/concurrentqueue.h>)
#include <concurrentqueue/concurrentqueue.h>
#else
#include <concurrentqueue.h>
#endif

#include "ghostlink/detail/request.hpp"

namespace ghostlink::detail {

struct mailbox {
  moodycamel::ConcurrentQueue<request*> queue;
};

}  // namespace ghostlink::detail
