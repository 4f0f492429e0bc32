#!/usr/bin/env python3
"""write_prometheus() against the exposition format and its own readings.

Usage: check_metrics.py METRICS_DUMP [PROMTOOL]. Runs the dump, which writes
the exposition to stdout and the readings it was made from to a JSON file;
lints the exposition with `promtool check metrics` (no problem may be
reported); parses it with prometheus_client's parser; and compares every
sample with the value computed here from the readings, both ways (none
missing, none extra). Exit 77 (Meson's skip) without promtool or
prometheus_client, or 1 if GHOSTLINK_REQUIRE_TOOLS=1 (as CI sets it, so
that a missing tool cannot pass for a checked exposition)."""
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

SKIP = 1 if os.environ.get('GHOSTLINK_REQUIRE_TOOLS') == '1' else 77

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print('prometheus_client is not installed (Debian: python3-prometheus-client): skipped')
    sys.exit(SKIP)

INF = math.inf
MOST = 2**64 - 1  # SIZE_MAX
DRAIN_BOUNDS = ['1', '3', '7', '15', '31', '63', '127', '128']
PRIORITY_BANDS = ['0-24', '25-49', '50-74', '75-100']


def pool_series(p):
    # kv_pool_limits left at its defaults: the byte limit over the block size.
    unlimited = p['max_blocks'] == MOST or (p['block_bytes'] and p['max_blocks'] == MOST // p['block_bytes'])
    budget = lambda v: INF if unlimited else v
    used = max(p['blocks_in_use'] - p['blocks_cached_idle'], 0)
    usage = 0 if unlimited or p['max_blocks'] == 0 else used / p['max_blocks']
    return {
        'ghostlink_kv_cache_usage_ratio': usage,
        'ghostlink_kv_blocks_max': budget(p['max_blocks']),
        'ghostlink_kv_blocks_in_use': p['blocks_in_use'],
        'ghostlink_kv_blocks_in_use_peak': p['peak_blocks_in_use'],
        'ghostlink_kv_blocks_available': budget(p['blocks_available']),
        'ghostlink_kv_blocks_cached': p['blocks_cached'],
        'ghostlink_kv_blocks_cached_idle': p['blocks_cached_idle'],
        'ghostlink_kv_blocks_reserved': p['blocks_reserved'],
        'ghostlink_kv_blocks_shared': p['blocks_shared'],
        'ghostlink_kv_blocks_free': p['blocks_free'],
        'ghostlink_kv_blocks_allocated': p['blocks_allocated'],
        'ghostlink_kv_allocated_bytes': p['bytes_allocated'],
        'ghostlink_kv_block_size_bytes': p['block_bytes'],
        'ghostlink_kv_in_use_bytes': p['blocks_in_use'] * p['block_bytes'],
        'ghostlink_kv_block_copies_total': p['cow_copies'],
    }


def prefix_series(x):
    return {
        'ghostlink_prefix_cache_queries_total': x['query_tokens'],
        'ghostlink_prefix_cache_hits_total': x['hit_tokens'],
        'ghostlink_prefix_cache_hit_ratio': x['hit_tokens'] / x['query_tokens'] if x['query_tokens'] else 0,
        'ghostlink_prefix_cache_lookups_total': x['queries'],
        'ghostlink_prefix_cache_insertions_total': x['inserted_blocks'],
        'ghostlink_prefix_cache_evictions_total': x['evicted_blocks'],
        'ghostlink_prefix_cache_entries': x['cached_blocks'],
        'ghostlink_prefix_cache_idle_entries': x['idle_blocks'],
        'ghostlink_prefix_cache_window_evictions_total': x['window_evictions'],
    }


# The publisher's counters; each is the series ghostlink_events_<field less
# its "events_" prefix>_total.
EVENTS_FIELDS = ('events_published', 'batches_published', 'events_dropped', 'batches_lost', 'replays_served',
                 'dumps_served', 'bad_requests', 'replies_dropped')


def store_series(x, pool):
    """The store's families, as {(sample name, frozenset(labels)): value}."""
    out = {}
    put = lambda name, value, **extra: out.__setitem__((name, frozenset({'pool': pool, **extra}.items())), value)
    put('ghostlink_store_puts_total', x['puts'])
    put('ghostlink_store_lookups_total', x['lookups'])
    put('ghostlink_store_hits_total', x['hits'])
    put('ghostlink_store_evictions_total', x['evictions'])
    put('ghostlink_store_oversized_total', x['oversized'])
    put('ghostlink_store_entries', x['entries'])
    put('ghostlink_store_bytes', x['bytes'])
    put('ghostlink_store_pending_bytes', x['pending_bytes'])
    put('ghostlink_store_directory_writable_by_others', x['directory_writable_by_others'])
    error = x['last_error_category'] is not None
    put('ghostlink_store_last_error_timestamp_seconds', x['last_error_time'] if error else 0)
    for outcome, field in (('stored', 'stored'), ('dropped', 'dropped'), ('failed', 'write_errors')):
        put('ghostlink_store_writes_total', x[field], outcome=outcome)
    put('ghostlink_store_connection_errors_total', x['auth_errors'], kind='auth')
    put('ghostlink_store_connection_errors_total', x['tls_errors'], kind='tls')
    if error:
        put('ghostlink_store_last_error_code', x['last_error_code'], category=x['last_error_category'])
    return out


def request_series(prefix, caches, labels):
    """The request families of `prefix` over the sum of `caches`, as
    {(sample name, frozenset(labels)): value}."""
    total = lambda f: sum(c[f] for c in caches)
    out = {}
    put = lambda name, value, **extra: out.__setitem__((prefix + name, frozenset({**labels, **extra}.items())), value)
    for outcome in ('applied', 'failed', 'cancelled'):
        put('_requests_total', total('requests_' + outcome), outcome=outcome)
    put('_requests_delayed_total', total('requests_delayed'))
    put('_requests_queued', total('requests_queued'))
    put('_requests_waiting', total('requests_waiting'))
    cumulative = 0
    for i, le in enumerate(DRAIN_BOUNDS):
        cumulative += sum(c['requests_per_drain'][i] for c in caches)
        put('_requests_per_drain_bucket', cumulative, le=le)
    put('_requests_per_drain_bucket', cumulative, le='+Inf')
    put('_requests_per_drain_sum', total('requests_applied') + total('requests_failed') + total('requests_cancelled'))
    put('_requests_per_drain_count', cumulative)
    put('_epochs_alive', total('epochs_alive'))
    put('_snapshots_alive', total('snapshots_alive'))
    return out


def expected(readings):
    out = {}
    for r in readings:
        pool = {'pool': r['pool']}
        key = lambda name, labels=pool: (name, frozenset(labels.items()))
        for name, v in pool_series(r['pool_stats']).items():
            out[key(name)] = v
        if r['prefix'] is not None:
            for name, v in prefix_series(r['prefix']).items():
                out[key(name)] = v
            for band, v in zip(PRIORITY_BANDS, r['prefix']['evictions_by_priority']):
                out[key('ghostlink_prefix_cache_evictions_by_priority_total', {**pool, 'priority': band})] = v
        if r['store'] is not None:
            out.update(store_series(r['store'], r['pool']))
        if r['events'] is not None:
            for field in EVENTS_FIELDS:
                out[key('ghostlink_events_%s_total' % field.replace('events_', ''))] = r['events'][field]
        out[key('ghostlink_kv_caches')] = len(r['caches'])
        out.update(request_series('ghostlink_kv_cache', r['caches'], pool))
        if r['per_cache_series']:
            for c in r['caches']:
                labels = {'pool': r['pool'], 'cache': str(c['cache_id'])}
                out.update(request_series('ghostlink_kv_layer', [c], labels))
                out[key('ghostlink_kv_layer_tokens', labels)] = c['size']
                out[key('ghostlink_kv_layer_epoch', labels)] = c['epoch']
                out[key('ghostlink_kv_layer_oldest_epoch_alive', labels)] = c['oldest_epoch_alive']
    return out


def main():
    dump = sys.argv[1]
    promtool = sys.argv[2] if len(sys.argv) > 2 else shutil.which('promtool')
    if not promtool or not os.path.exists(promtool):
        print('promtool is not installed (Debian: prometheus): skipped')
        return SKIP
    with tempfile.TemporaryDirectory() as tmp:
        readings_path = os.path.join(tmp, 'readings.json')
        text = subprocess.run([dump, readings_path], capture_output=True, text=True, check=True).stdout
        with open(readings_path) as f:
            readings = json.load(f)

    failures = 0
    lint = subprocess.run([promtool, 'check', 'metrics'], input=text, capture_output=True, text=True)
    if lint.returncode != 0 or lint.stdout.strip() or lint.stderr.strip():
        failures += 1
        print('promtool check metrics (exit %d):\n%s%s' % (lint.returncode, lint.stdout, lint.stderr))

    got = {}
    families = 0
    for family in text_string_to_metric_families(text):
        families += 1
        if not family.documentation:
            failures += 1
            print('family %s has no HELP' % family.name)
        for s in family.samples:
            k = (s.name, frozenset(s.labels.items()))
            if k in got:
                failures += 1
                print('sample %s %s twice' % (s.name, dict(s.labels)))
            got[k] = s.value
    # Each family's HELP and TYPE once: the parser would merge repeats.
    for kind in ('# HELP ', '# TYPE '):
        names = [line.split(' ')[2] for line in text.splitlines() if line.startswith(kind)]
        if len(names) != len(set(names)):
            failures += 1
            print('a family has two %s lines' % kind.strip())

    want = expected(readings)
    for k in sorted(want.keys() | got.keys(), key=lambda k: (k[0], sorted(k[1]))):
        label = '%s%s' % (k[0], dict(sorted(k[1])))
        if k not in got:
            failures += 1
            print('missing: %s, expected %r' % (label, want[k]))
        elif k not in want:
            failures += 1
            print('unexpected: %s = %r' % (label, got[k]))
        elif not (got[k] == want[k] or (math.isfinite(want[k]) and math.isclose(got[k], want[k], rel_tol=1e-12))):
            failures += 1
            print('%s = %r, expected %r' % (label, got[k], want[k]))

    # The dump must have done real work, or the comparison proves little.
    nonzero = sum(1 for v in want.values() if v)
    for name in ('ghostlink_prefix_cache_hits_total', 'ghostlink_prefix_cache_evictions_total',
                 'ghostlink_kv_blocks_in_use', 'ghostlink_kv_block_copies_total', 'ghostlink_kv_cache_usage_ratio',
                 'ghostlink_store_puts_total', 'ghostlink_store_hits_total', 'ghostlink_store_last_error_code',
                 'ghostlink_events_dropped_total', 'ghostlink_events_batches_lost_total'):
        if not any(v for (n, _), v in want.items() if n == name):
            failures += 1
            print('the dump left %s at zero in every pool' % name)
    print('%d families, %d samples compared (%d nonzero), %d failures' % (families, len(want), nonzero, failures))
    return 1 if failures or not want else 0


if __name__ == '__main__':
    sys.exit(main())
