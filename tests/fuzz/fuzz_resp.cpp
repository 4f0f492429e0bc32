// The fuzz target of the Redis tier's RESP2 reply parser
// (detail::parse_redis_reply, src/store/redis/connection.cpp), which reads what a
// server, or anything listening where one should be, sends. For any input:
// - it takes one reply (at most the input's bytes), asks for more (0), or
//   throws std::runtime_error; nothing else escapes, nothing crashes;
// - a reply it takes parses the same with any bytes after it (the next
//   reply's, in a connection's buffer);
// - every proper prefix of a reply's bytes asks for more and never throws:
//   a reply split across reads is taken whole once the rest arrives (the
//   connection parses its buffer again on each read);
// - the reply encoded again parses back to the same reply.
// A mismatch aborts, naming what differed.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "store/redis/connection.hpp"

namespace {

using ghostlink::detail::parse_redis_reply;
using ghostlink::detail::redis_reply;

[[noreturn]] void mismatch(const char* what) {
  std::fprintf(stderr, "MISMATCH: %s\n", what);
  std::abort();
}

/// The bytes taken, 0 for more, or npos for a protocol error.
std::size_t parse(std::string_view in, redis_reply& out, std::size_t max_bulk = static_cast<std::size_t>(-1)) {
  try {
    return parse_redis_reply(in, out, max_bulk);
  } catch (const std::runtime_error&) {
    return std::string_view::npos;
  }
}

bool same(const redis_reply& a, const redis_reply& b) {
  if (a.kind != b.kind || a.bytes != b.bytes || a.elements.size() != b.elements.size()) return false;
  if ((a.kind == redis_reply::type::integer || a.kind == redis_reply::type::array) && a.integer != b.integer)
    return false;
  return std::equal(a.elements.begin(), a.elements.end(), b.elements.begin(), same);
}

void encode(const redis_reply& r, std::string& out) {
  switch (r.kind) {
    case redis_reply::type::status: out.append("+").append(r.text()).append("\r\n"); return;
    case redis_reply::type::error: out.append("-").append(r.text()).append("\r\n"); return;
    // Appended piece by piece, never "x" + std::string: at -O3 GCC 12 warns
    // of the concatenation (-Wrestrict, a false positive: GCC bug 105329).
    case redis_reply::type::integer: out.append(":").append(std::to_string(r.integer)).append("\r\n"); return;
    case redis_reply::type::bulk:
      out.append("$").append(std::to_string(r.bytes.size())).append("\r\n").append(r.text()).append("\r\n");
      return;
    case redis_reply::type::nil: out.append("$-1\r\n"); return;
    case redis_reply::type::array:
      out.append("*").append(std::to_string(r.elements.size())).append("\r\n");
      for (const redis_reply& e : r.elements) encode(e, out);
      return;
    case redis_reply::type::failed: mismatch("a reply taken with no kind");
    case redis_reply::type::oversized: mismatch("an oversized reply without a cap");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  redis_reply reply;
  const std::size_t took = parse(in, reply);
  if (took == 0 || took == std::string_view::npos) return 0;
  if (took > size) mismatch("took more bytes than the input has");
  const std::string_view whole = in.substr(0, took);

  redis_reply alone;
  if (parse(whole, alone) != took || !same(alone, reply)) mismatch("the reply parses otherwise without what follows");

  // Every prefix when short, else 256 spread over it and the last 16.
  const std::size_t stride = took <= 256 ? 1 : took / 256;
  for (std::size_t k = 0; k < took; k += (took - k <= 16 ? 1 : stride)) {
    redis_reply part;
    if (parse(whole.substr(0, k), part) != 0) mismatch("a prefix of a reply was taken or refused");
  }

  // With a cap below a top-level bulk's length: its header alone, the
  // length said; a cap at its length: the same reply.
  if (reply.kind == redis_reply::type::bulk && !reply.bytes.empty()) {
    redis_reply capped;
    const std::size_t header = took - reply.bytes.size() - 2;
    if (parse(whole, capped, reply.bytes.size() - 1) != header || capped.kind != redis_reply::type::oversized ||
        capped.integer != static_cast<std::int64_t>(reply.bytes.size()))
      mismatch("a bulk beyond the cap is not its header alone");
    if (parse(whole, capped, reply.bytes.size()) != took || !same(capped, reply))
      mismatch("a bulk at the cap parses otherwise");
  }

  std::string again;
  encode(reply, again);
  redis_reply back;
  if (parse(again, back) != again.size() || !same(back, reply)) mismatch("the reply encoded again parses otherwise");
  return 0;
}
