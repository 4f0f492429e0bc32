#pragma once
/// @file
/// ghostlink: the key/value cache of a transformer layer as an actor-based
/// async component for Asio. Include this header for the whole public API.

/// @namespace ghostlink
/// The public API: `layer_kv_cache` and `sequence_kv_cache` (written through
/// actors, read through snapshots), `kv_snapshot`, `kv_block_pool`,
/// `kv_prefix_cache` (reuse of prompt prefixes across requests), saving and
/// loading sequences (`async_save`, `async_load`), the
/// config, errors, statistics and events. Names in `ghostlink::detail` are
/// internals, with no stability promise.

#include "ghostlink/attend.hpp"
#include "ghostlink/block_pool.hpp"
#include "ghostlink/config.hpp"
#include "ghostlink/element.hpp"
#include "ghostlink/error.hpp"
#include "ghostlink/events.hpp"
#include "ghostlink/layer_kv_cache.hpp"
#include "ghostlink/layer_kv_view.hpp"
#include "ghostlink/layout.hpp"
#include "ghostlink/metrics.hpp"
#include "ghostlink/persist.hpp"
#include "ghostlink/prefix_cache.hpp"
#include "ghostlink/sequence_kv_cache.hpp"
#include "ghostlink/sequence_step.hpp"
#include "ghostlink/snapshot.hpp"
#include "ghostlink/stats.hpp"
#include "ghostlink/types.hpp"
