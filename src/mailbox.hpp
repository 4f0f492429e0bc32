#pragma once
// The actor's mailbox: a lock-free multi-producer queue of requests.
// moodycamel's ConcurrentQueue keeps each producer thread's items in FIFO
// order, which is what gives "requests initiated from one thread apply in
// the order they were initiated".

#include "concurrent_queue.hpp"
#include "ghostlink/detail/request.hpp"

namespace ghostlink::detail {

struct mailbox {
  moodycamel::ConcurrentQueue<request*> queue;
};

}  // namespace ghostlink::detail
