#!/usr/bin/env python3
"""kv_event_publisher's wire read as a router written from vLLM v0.25.1's
schema alone would read it (vllm/distributed/kv_events.py: KVEventBatch,
BlockStored, BlockRemoved, AllBlocksCleared, and ZmqEventPublisher's replay
socket), with Python's zmq and msgpack, no msgspec.

Usage: check_wire.py EVENT_SERVER. Runs the server (event_server.cpp) on
ipc:// endpoints, once with bytes hashes and once with uint64 hashes, and
drives it over its standard input: chained prompts, evictions from its small
pool, a clear. Every payload received goes through a strict schema check
(the envelope, each event's keys in order, each field's type). Routers that
receive every batch, that drop every third on purpose and recover through
replay, and that join late from a dump must each end with a mirror equal to
the server's own entries; replays from 0, from the middle and past the end,
the dump, and bad requests on the replay socket are checked frame by frame.
Every wait is bounded (10 s). Exit 0 when all holds, 1 at the first mismatch;
77 (Meson's skip) without zmq or msgpack, or 1 if GHOSTLINK_REQUIRE_TOOLS=1
(as CI sets it, so that a missing module cannot pass for a checked wire)."""
import json
import os
import select
import subprocess
import sys
import tempfile
import time

SKIP = 1 if os.environ.get('GHOSTLINK_REQUIRE_TOOLS') == '1' else 77

try:
    import msgpack
    import zmq
except ImportError as e:
    print('%s (Debian: python3-zmq, python3-msgpack): skipped' % e)
    sys.exit(SKIP)

PATIENCE = 10.0  # seconds, for any one answer, message or reply
BLOCK = 4  # the server's block_tokens
END = b'\xff' * 8  # vLLM's END_SEQ: (-1).to_bytes(8, "big", signed=True)
KEYS = {  # v0.25.1, as msgspec writes them: the tag, then the fields not left out
    'BlockStored': ['type', 'block_hashes', 'parent_block_hash', 'token_ids', 'block_size', 'lora_id', 'medium',
                    'lora_name'],
    'BlockRemoved': ['type', 'block_hashes', 'medium'],
    'AllBlocksCleared': ['type'],
}


class Mismatch(Exception):
    pass


def check(ok, message):
    if not ok:
        raise Mismatch(message)


def u64(n):
    return n.to_bytes(8, 'big')


# The schema ------------------------------------------------------------------

def check_hash(h, mode, where):
    """ExternalBlockHash (bytes | int): the form `mode` says, and no other."""
    if mode == 'bytes':
        check(type(h) is bytes and len(h) == 32, '%s: %r is not a 32-byte bin hash' % (where, h))
    else:
        check(type(h) is int and 0 <= h < 2**64, '%s: %r is not an unsigned 64-bit int hash' % (where, h))


def check_payload(payload, mode, dump=False):
    """The batch `payload` holds, if it is a KVEventBatch exactly as vLLM
    v0.25.1 encodes one (with ghostlink's values: rank 0, medium "RAM", no
    LoRA); Mismatch otherwise. vLLM publishes no batch without events; a
    dump of an empty cache is one (`dump`), to carry its N."""
    raw = bytes(payload)
    # msgspec writes an array_like struct as an array, and a Python float as
    # float64 always: the header and the float's marker, in the bytes.
    check(len(raw) >= 11 and raw[0] == 0x93 and raw[1] == 0xcb,
          'batch does not start [fixarray of 3, float64]: %s' % raw[:12].hex())
    try:
        batch = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, object_pairs_hook=list)
        unpacker.feed(raw)
        ordered = unpacker.unpack()  # every map as its (key, value) pairs, in wire order
    except Exception as e:  # trailing bytes, a bad marker, a cut payload
        raise Mismatch('batch does not decode as one msgpack value (%s): %s' % (e, raw[:40].hex()))
    check(type(batch) is list and len(batch) == 3, 'batch is not [ts, events, data_parallel_rank]: %r' % (batch,))
    ts, events, rank = batch
    check(type(ts) is float and abs(ts - time.time()) < 60, 'ts %r is not a float of now' % (ts,))
    check(type(events) is list and (events or dump), 'events %r is not a non-empty list' % (events,))
    check(type(rank) is int and rank == 0, 'data_parallel_rank %r is not the int 0' % (rank,))
    for i, (e, pairs) in enumerate(zip(events, ordered[1])):
        where = 'event %d' % i
        check(type(e) is dict, '%s: %r is not a map (v0.24+ events are maps)' % (where, e))
        keys = [k for k, _ in pairs]
        check(keys and keys[0] == 'type', '%s: the first key is not "type": %r' % (where, keys))
        kind = e['type']
        check(kind in KEYS, '%s: unknown type %r' % (where, kind))
        check(keys == KEYS[kind], '%s: %s keys %r, vLLM v0.25.1 writes %r' % (where, kind, keys, KEYS[kind]))
        where += ' (%s)' % kind
        if kind == 'AllBlocksCleared':
            continue
        hashes = e['block_hashes']
        check(type(hashes) is list and hashes, '%s: block_hashes %r is not a non-empty list' % (where, hashes))
        for h in hashes:
            check_hash(h, mode, where + ' block_hashes')
        check(type(e['medium']) is str and e['medium'] == 'RAM', '%s: medium %r is not "RAM"' % (where, e['medium']))
        if kind == 'BlockRemoved':
            continue
        if e['parent_block_hash'] is not None:
            check_hash(e['parent_block_hash'], mode, where + ' parent_block_hash')
        tokens, size = e['token_ids'], e['block_size']
        check(type(size) is int and size == BLOCK, '%s: block_size %r is not %d' % (where, size, BLOCK))
        check(type(tokens) is list and all(type(t) is int for t in tokens),
              '%s: token_ids %r is not a list of ints' % (where, tokens))
        check(len(tokens) == size * len(hashes),
              '%s: %d token_ids for %d blocks of %d' % (where, len(tokens), len(hashes), size))
        check(e['lora_id'] is None and e['lora_name'] is None,
              '%s: lora_id %r, lora_name %r, expected nil' % (where, e['lora_id'], e['lora_name']))
    return batch


def self_test():
    """The checker refuses what it must: payloads one change away from a good one."""
    h = bytes(range(32))
    stored = {'type': 'BlockStored', 'block_hashes': [h], 'parent_block_hash': None, 'token_ids': [1, 2, 3, 4],
              'block_size': 4, 'lora_id': None, 'medium': 'RAM', 'lora_name': None}

    def pack(events, ts=None, rank=0, single=False):
        return msgpack.packb([time.time() if ts is None else ts, events, rank], use_single_float=single)

    def changed(**fields):
        return dict(stored, **fields)

    good = [(pack([stored]), 'bytes'), (pack([changed(block_hashes=[7, 2**64 - 1], parent_block_hash=0,
                                                     token_ids=list(range(8)))]), 'uint64'),
            (pack([{'type': 'AllBlocksCleared'}, {'type': 'BlockRemoved', 'block_hashes': [h], 'medium': 'RAM'}]),
             'bytes')]
    reordered = {k: stored[k] for k in KEYS['BlockStored'][1:]}
    reordered['type'] = 'BlockStored'
    bad = {
        'int hash where bytes are expected': (pack([changed(block_hashes=[5])]), 'bytes'),
        'bytes hash where an int is expected': (pack([stored]), 'uint64'),
        'negative int hash': (pack([changed(block_hashes=[-1])]), 'uint64'),
        '31-byte hash': (pack([changed(block_hashes=[h[:31]])]), 'bytes'),
        'int parent where bytes are expected': (pack([changed(parent_block_hash=3)]), 'bytes'),
        '"type" not first': (pack([reordered]), 'bytes'),
        'lora_name missing': (pack([{k: v for k, v in stored.items() if k != 'lora_name'}]), 'bytes'),
        'an extra key': (pack([changed(group_idx=0)]), 'bytes'),
        'a token short': (pack([changed(token_ids=[1, 2, 3])]), 'bytes'),
        'a bool token id': (pack([changed(token_ids=[1, 2, 3, True])]), 'bytes'),
        'medium nil': (pack([changed(medium=None)]), 'bytes'),
        'float32 ts': (pack([stored], single=True), 'bytes'),
        'int ts': (pack([stored], ts=int(time.time())), 'bytes'),
        'rank nil': (pack([stored], rank=None), 'bytes'),
        'a 2-element batch (v0.9.0)': (msgpack.packb([time.time(), [stored]]), 'bytes'),
        'an array event (v0.23)': (pack([['BlockStored', [h], None, [1, 2, 3, 4], 4, None, 'RAM', None]]), 'bytes'),
        'trailing bytes': (pack([stored]) + b'\xc0', 'bytes'),
        'unknown type': (pack([{'type': 'BlockInactive'}]), 'bytes'),
    }
    for payload, mode in good:
        check_payload(payload, mode)
    for what, (payload, mode) in bad.items():
        try:
            check_payload(payload, mode)
        except Mismatch:
            continue
        raise Mismatch('the schema checker took a payload with %s' % what)
    return len(bad)


# A router's mirror -------------------------------------------------------------

class Mirror:
    """hash -> (parent, tokens), the events applied in order, as a router
    keeps a server's cache. Strict: it saw every event from the first, so a
    removal finds its entry and a store is of an entry it lacks."""

    def __init__(self, strict=False):
        self.entries = {}
        self.strict = strict

    def apply(self, batch):
        for e in batch[1]:
            kind = e['type']
            if kind == 'AllBlocksCleared':
                self.entries.clear()
            elif kind == 'BlockRemoved':
                for h in e['block_hashes']:
                    check(not self.strict or h in self.entries, 'BlockRemoved of %s, which is not cached' % show(h))
                    self.entries.pop(h, None)
            else:
                size, parent, tokens = e['block_size'], e['parent_block_hash'], e['token_ids']
                for i, h in enumerate(e['block_hashes']):
                    check(not self.strict or h not in self.entries, 'BlockStored of %s, cached already' % show(h))
                    self.entries[h] = (parent, tuple(tokens[i * size:(i + 1) * size]))
                    parent = h


def show(h):
    return h.hex() if type(h) is bytes else repr(h)


def wire(hex_hash, mode):
    """A hash of the server's state (hex) as it goes on the wire: the 32
    bytes, or their first 8 read big-endian."""
    if hex_hash is None:
        return None
    b = bytes.fromhex(hex_hash)
    return b if mode == 'bytes' else int.from_bytes(b[:8], 'big')


def expected(state, mode):
    out = {wire(e['hash'], mode): (wire(e['parent'], mode), tuple(e['tokens'])) for e in state}
    check(len(out) == len(state), 'state: %d entries, %d distinct wire hashes' % (len(state), len(out)))
    return out


def compare(name, got, want):
    missing = [h for h in want if h not in got]
    extra = [h for h in got if h not in want]
    wrong = [h for h in want if h in got and got[h] != want[h]]
    first = ''
    if missing or extra:
        first = '%s %s' % ('missing' if missing else 'extra', show((missing + extra)[0]))
    elif wrong:
        h = wrong[0]
        first = '%s: (%s, %r) on the wire, (%s, %r) in the server' % (show(h), show(got[h][0]), got[h][1],
                                                                       show(want[h][0]), want[h][1])
    check(not (missing or extra or wrong), '%s: the mirror differs from the server: %d missing, %d extra, %d wrong '
          '(first: %s)' % (name, len(missing), len(extra), len(wrong), first))


# The server --------------------------------------------------------------------

class Server:
    """event_server, driven over its standard input: one line each way."""

    def __init__(self, path, directory, mode):
        self.pub = 'ipc://' + os.path.join(directory, 'pub')
        self.replay = 'ipc://' + os.path.join(directory, 'replay')
        self.proc = subprocess.Popen([path, '--endpoint', self.pub, '--replay', self.replay, '--hashes', mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pending = b''
        line = self.read_line()
        check(line == 'ready', 'event_server said %r, not "ready"' % line)

    def read_line(self):
        deadline = time.monotonic() + PATIENCE
        while b'\n' not in self.pending:
            left = deadline - time.monotonic()
            check(left > 0, 'event_server: no answer within %g s' % PATIENCE)
            if select.select([self.proc.stdout], [], [], left)[0]:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                check(chunk, 'event_server exited (status %r)' % self.proc.poll())
                self.pending += chunk
        line, self.pending = self.pending.split(b'\n', 1)
        return line.decode()

    def ask(self, command):
        self.proc.stdin.write(command.encode() + b'\n')
        self.proc.stdin.flush()
        line = self.read_line()
        check(not line.startswith('error'), 'event_server: %r: %s' % (command[:60], line))
        return line

    def insert(self, tokens):
        return json.loads(self.ask('insert ' + ' '.join(map(str, tokens))))

    def state(self):
        return json.loads(self.ask('state'))

    def stats(self):
        return json.loads(self.ask('stats'))

    def stop(self, how):
        """Ends it by `quit` or by the end of its input; it must exit 0."""
        if how == 'quit':
            self.proc.stdin.write(b'quit\n')
        self.proc.stdin.close()
        try:
            status = self.proc.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            raise Mismatch('event_server did not exit within %g s of %s' % (PATIENCE, how))
        check(status == 0, 'event_server exited with status %d after %s' % (status, how))

    def kill(self):
        """Whatever happened: the process is gone when this returns."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(PATIENCE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if not f.closed:
                f.close()


# A router ----------------------------------------------------------------------

class Router:
    """A SUB socket for the batches and a DEALER for replays and dumps, and a
    mirror kept from them in batch order: a gap is filled by a replay from
    the first batch missing (a replay that does not start there means the
    batches are gone: join afresh from a dump). `drop_every`: every n-th
    live message is thrown away unread, as a lossy link would."""

    def __init__(self, ctx, server, mode, name, drop_every=0, strict=False):
        self.mode, self.name, self.drop_every = mode, name, drop_every
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b'')
        self.sub.connect(server.pub)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(server.replay)
        self.mirror = Mirror(strict)
        self.next = 0  # the next batch to apply
        self.last_live = -1
        self.live = self.dropped = self.gap_replays = self.tail_replays = self.joins = 0
        self.applied = {}  # seq -> payload of every batch applied
        self.stored = []  # (hash, parent, tokens) of every BlockStored block applied, in order
        self.kinds = {k: 0 for k in KEYS}

    def close(self):
        self.sub.close(0)
        self.dealer.close(0)

    def recv_live(self, timeout):
        if not self.sub.poll(int(timeout * 1000)):
            return None
        frames = self.sub.recv_multipart()
        check(len(frames) == 3 and frames[0] == b'' and len(frames[1]) == 8,
              '%s: a live message is not [topic "", seq8, payload]: %r' % (self.name, [f[:16] for f in frames]))
        seq = int.from_bytes(frames[1], 'big')
        check(seq > self.last_live, '%s: live batch %d after %d' % (self.name, seq, self.last_live))
        self.last_live = seq
        return seq, frames[2]

    def request(self, *body):
        """Sends [b"", body...] and collects the reply up to its end marker:
        [(seq, payload), ...]."""
        self.dealer.send_multipart([b''] + list(body))
        return self.collect(body)

    def collect(self, body):
        out = []
        for _ in range(1_000_000):
            check(self.dealer.poll(int(PATIENCE * 1000)),
                  '%s: no reply to %r within %g s' % (self.name, body, PATIENCE))
            frames = self.dealer.recv_multipart()
            check(len(frames) == 3 and frames[0] == b'' and len(frames[1]) == 8,
                  '%s: a reply is not [b"", seq8, payload]: %r' % (self.name, [f[:16] for f in frames]))
            if frames[1] == END:
                check(frames[2] == b'', '%s: the end marker has a payload' % self.name)
                return out
            check(frames[2] != b'', '%s: reply %s has an empty payload' % (self.name, frames[1].hex()))
            out.append((int.from_bytes(frames[1], 'big'), frames[2]))
        raise Mismatch('%s: a reply without an end' % self.name)

    def replay(self, start):
        return self.request(u64(start))

    def dump(self, asked=False):
        """[(N, payload), ...]: the entries, each a BlockStored of its own
        (`asked`: the request went already)."""
        chunks = self.collect((b'dump',)) if asked else self.request(b'dump')
        check(chunks, '%s: a dump with no chunk (one at least carries N)' % self.name)
        check(len({n for n, _ in chunks}) == 1, '%s: dump chunks of different N: %r' % (self.name, chunks))
        for _, payload in chunks:
            batch = check_payload(payload, self.mode, dump=True)
            for e in batch[1]:
                check(e['type'] == 'BlockStored' and len(e['block_hashes']) == 1,
                      '%s: a dump event is not a BlockStored of one block: %r' % (self.name, e))
        return chunks

    def join(self, asked=False):
        chunks = self.dump(asked)
        self.mirror = Mirror()  # what follows may repeat what the dump holds
        for _, payload in chunks:
            self.mirror.apply(check_payload(payload, self.mode, dump=True))
        self.next = chunks[0][0]
        self.joins += 1
        return self.next

    def apply(self, seq, payload):
        check(seq == self.next, '%s: batch %d applied when %d is next' % (self.name, seq, self.next))
        batch = check_payload(payload, self.mode)
        self.mirror.apply(batch)
        for e in batch[1]:
            self.kinds[e['type']] += 1
            if e['type'] == 'BlockStored':
                parent, size = e['parent_block_hash'], e['block_size']
                for i, h in enumerate(e['block_hashes']):
                    self.stored.append((h, parent, tuple(e['token_ids'][i * size:(i + 1) * size])))
                    parent = h
        self.applied[seq] = payload
        self.next = seq + 1

    def catch_up(self, upto=None):
        """Applies what a replay from the next batch holds (below `upto`);
        the number applied."""
        n = 0
        for _ in range(3):
            got = self.replay(self.next)
            if got and got[0][0] != self.next:
                self.join()  # batch self.next is gone for good
                continue
            for seq, payload in got:
                if seq != self.next or (upto is not None and seq >= upto):
                    break
                self.apply(seq, payload)
                n += 1
            return n
        raise Mismatch('%s: three joins and the batches still gone' % self.name)

    def take(self, seq, payload):
        """A live batch: dropped on purpose, or applied in order."""
        self.live += 1
        check_payload(payload, self.mode)
        if self.drop_every and self.live % self.drop_every == 0:
            self.dropped += 1
            return
        if seq > self.next:  # a gap (or the slow joiner's first): replay it
            self.gap_replays += 1
            self.catch_up(seq)
            check(self.next >= seq, '%s: batches %d..%d missing after a replay' % (self.name, self.next, seq - 1))
        if seq == self.next:
            self.apply(seq, payload)

    def follow(self, done, last=None):
        """Takes live batches until `done()`. A batch dropped at the end
        shows in no later one: once batch `last` (the end of the traffic)
        came live, a replay from the next batch gets the rest."""
        for _ in range(100_000):
            if done():
                return
            if last is not None and self.last_live >= last:
                self.tail_replays += 1
                check(self.catch_up(), '%s: batches %d..%d missing after a replay' % (self.name, self.next, last))
                continue
            m = self.recv_live(PATIENCE)
            check(m is not None, '%s: no batch within %g s' % (self.name, PATIENCE))
            self.take(*m)
        raise Mismatch('%s: not done after 100000 batches' % self.name)

    def has(self, h):
        return lambda: h in self.mirror.entries


# The run -----------------------------------------------------------------------

def prompt(first, blocks, extra=0):
    return list(range(first, first + blocks * BLOCK + extra))


def run(server_path, mode, ctx, directory, stop_by):
    server = Server(server_path, directory, mode)
    routers = []
    try:
        full = Router(ctx, server, mode, mode + '/full', strict=True)
        lossy = Router(ctx, server, mode, mode + '/lossy', drop_every=3)
        routers += [full, lossy]
        inserted = {}  # wire hash -> (wire parent, tokens), from every insert's block hashes

        def insert(tokens, added=None):
            out = server.insert(tokens)
            hashes = out['block_hashes']
            check(len(hashes) == len(tokens) // BLOCK, 'insert: %d hashes for %d tokens' % (len(hashes), len(tokens)))
            check(added is None or out['added'] == added,
                  'insert added %d entries, expected %r' % (out['added'], added))
            for i, h in enumerate(hashes):
                inserted[wire(h, mode)] = (wire(hashes[i - 1], mode) if i else None,
                                           tuple(tokens[i * BLOCK:(i + 1) * BLOCK]))
            return hashes

        def go_live(r, first):
            """Inserts one-block prompts until a batch reaches `r` live: a SUB
            misses what is sent before its subscription is through (ZeroMQ's
            slow joiner), and only a batch coming shows that it is. Polls of
            50 ms, 200 inserts at most. The batch, for `r` to take."""
            for i in range(200):
                insert(prompt(first + BLOCK * i, 1), 1)
                m = r.recv_live(0.05)
                if m is not None:
                    return m
            raise Mismatch('%s: no batch came live after 200 inserts' % r.name)

        def settle(sentinel, full, *rs):
            """Every router's mirror equals the server's entries once it has
            the sentinel's last block (an insert's last event), which `full`
            takes to say which batch is the last."""
            tail = wire(insert(prompt(sentinel, 1), 1)[-1], mode)
            state = server.state()
            want = expected(state, mode)
            for h, entry in want.items():
                check(inserted.get(h) == entry, 'state: entry %s is not the block an insert made' % show(h))
            for r in (full,) + rs:
                try:
                    if r is full:
                        r.follow(r.has(tail))
                    else:
                        r.follow(lambda r=r: r.next >= full.next, full.next - 1)
                except Mismatch as e:  # with how the mirror differs, if it does
                    try:
                        compare(r.name, r.mirror.entries, want)
                    except Mismatch as c:
                        raise Mismatch('%s; %s' % (e, c))
                    raise
                compare(r.name, r.mirror.entries, want)
            return want

        full.take(*go_live(full, 80_000))
        lossy.take(*go_live(lossy, 81_000))

        # Chained prompts: a prefix, its extension, a branch, a partial block.
        base = prompt(1000, 3)
        chain = insert(base, 3)
        longer = insert(base + prompt(2000, 2), 2)
        insert(base[:2 * BLOCK] + prompt(3000, 1), 1)
        insert(base + [1, 2], 0)
        # 16 blocks: 6 more prompts of 3 evict.
        for k in range(6):
            insert(prompt(10_000 + 100 * k, 3))
        settle(90_000, full, lossy)
        check(server.stats()['evicted_blocks'] > 0, 'no entry was evicted')

        # The first stored blocks on the wire are the first insert's, chained,
        # then the extension's two.
        first = [(wire(h, mode), wire(chain[i - 1], mode) if i else None, tuple(base[i * BLOCK:(i + 1) * BLOCK]))
                 for i, h in enumerate(chain)]
        first += [(wire(longer[3], mode), wire(chain[2], mode), tuple(prompt(2000, 1))),
                  (wire(longer[4], mode), wire(longer[3], mode), tuple(prompt(2004, 1)))]
        at = full.stored.index(first[0]) if first[0] in full.stored else 0
        check(full.stored[at:at + 5] == first,
              'the first insert\'s BlockStored blocks %r, expected %r' % (full.stored[at:at + 5], first))

        # Late joiners: one from a dump of a quiet server, one whose dump is
        # taken while the inserts below run.
        quiet = Router(ctx, server, mode, mode + '/joined')
        routers.append(quiet)
        quiet_n = quiet.join()
        compare(quiet.name + ' (its dump)', quiet.mirror.entries, expected(server.state(), mode))
        check(quiet.next == full.next, 'a quiet dump gives N %d, the next batch is %d' % (quiet.next, full.next))
        quiet.take(*go_live(quiet, 82_000))
        busy = Router(ctx, server, mode, mode + '/joined-busy')
        routers.append(busy)
        early = go_live(busy, 83_000)  # before its dump: not applied
        busy.dealer.send_multipart([b'', b'dump'])
        for k in range(4):
            insert(prompt(20_000 + 100 * k, 3))
        server.ask('clear')
        insert(base, 3)  # the same hashes again, after the clear
        insert(base + prompt(2000, 2), 2)
        for k in range(3):
            insert(prompt(30_000 + 100 * k, 2, extra=3))
        busy_n = busy.join(asked=True)
        busy.take(*early)
        want = settle(91_000, full, lossy, quiet, busy)
        check(full.kinds['AllBlocksCleared'] == 1, 'AllBlocksCleared seen %d times' % full.kinds['AllBlocksCleared'])
        check(full.kinds['BlockRemoved'] > 0, 'no BlockRemoved seen')
        check(lossy.dropped > 0 and lossy.gap_replays > 0, 'the lossy router dropped %d of %d live batches and '
              'filled %d gaps' % (lossy.dropped, lossy.live, lossy.gap_replays))
        check(lossy.joins == 0 and full.joins == 0 and quiet.joins == 1 and busy.joins == 1,
              'a router had to join afresh: batches were lost')

        # Every batch, in the replay buffer: from 0, from the middle, past the end.
        total = full.next
        everything = full.replay(0)
        check([s for s, _ in everything] == list(range(total)),
              'replay from 0: batches %r, expected 0..%d' % ([s for s, _ in everything], total - 1))
        check(all(p == full.applied[s] for s, p in everything), 'replay from 0: a payload differs from the live one')
        again = Mirror(strict=True)
        for _, p in everything:
            again.apply(check_payload(p, mode))
        compare(mode + '/replayed', again.entries, want)
        mid = total // 2
        check(full.replay(mid) == everything[mid:], 'replay from %d differs from the tail of replay from 0' % mid)
        check(full.replay(total) == [] and full.replay(total + 1000) == [], 'a replay past the end is not END alone')
        stats = server.stats()
        check(stats['batches_published'] == total and stats['batches_lost'] == 0 and stats['events_dropped'] == 0,
              'stats %r: %d batches on the wire' % (stats, total))
        removed = sum(len(e['block_hashes']) for _, p in everything for e in check_payload(p, mode)[1]
                      if e['type'] == 'BlockRemoved')
        check(removed == stats['evicted_blocks'], '%d hashes removed on the wire, %d evicted' %
              (removed, stats['evicted_blocks']))
        check(len(full.stored) == stats['inserted_blocks'], '%d blocks stored on the wire, %d inserted' %
              (len(full.stored), stats['inserted_blocks']))

        # The dump of a quiet server: every entry once, N the next batch.
        chunks = full.dump()
        check(chunks[0][0] == total, 'dump N %d, the next batch is %d' % (chunks[0][0], total))
        dumped = Mirror(strict=True)
        for _, p in chunks:
            dumped.apply(check_payload(p, mode, dump=True))
        compare(mode + '/dump', dumped.entries, want)

        # Bad requests: the end alone, or no reply at all; then a good one.
        bad_before = stats['bad_requests']
        check(full.request(b'garbage!!') == [], 'a garbage body is not answered by END alone')
        check(full.request(b'') == [], 'an empty body is not answered by END alone')
        check(full.request(u64(2**64 - 2)) == [], 'a start of 2^64 - 2 is not answered by END alone')
        full.dealer.send_multipart([b'', b'a', b'b'])  # 3 frames: no reply
        full.dealer.send_multipart([u64(0)])  # no empty delimiter: no reply
        check(full.replay(total - 1) == everything[-1:], 'a good request after bad ones is not answered')
        bad = server.stats()['bad_requests'] - bad_before
        check(bad == 4, '%d bad requests counted, 4 sent' % bad)

        # vLLM's example client asks with REQ: one frame, and it takes the first reply.
        req = ctx.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(server.replay)
        req.send(u64(total - 1))
        check(req.poll(int(PATIENCE * 1000)), 'REQ: no reply within %g s' % PATIENCE)
        frames = req.recv_multipart()
        req.close(0)
        check(frames == [u64(total - 1), everything[-1][1]], 'REQ: the reply is not [seq8, payload]')

        server.stop(stop_by)
        return ('%s: %d batches (%d stored, %d removed, %d cleared events), %d entries; lossy dropped %d of %d and '
                'replayed %d times; joiners at N=%d and N=%d' %
                (mode, total, full.kinds['BlockStored'], full.kinds['BlockRemoved'], full.kinds['AllBlocksCleared'],
                 len(want), lossy.dropped, lossy.live, lossy.gap_replays + lossy.tail_replays, quiet_n, busy_n))
    finally:
        for r in routers:
            r.close()
        server.kill()


def main():
    if len(sys.argv) != 2:
        print('usage: check_wire.py EVENT_SERVER')
        return 2
    try:
        summary = ['the schema checker refuses %d near misses' % self_test()]
    except Mismatch as e:
        print('check_wire.py: FAILED: %s' % e)
        return 1
    for mode, stop_by in (('bytes', 'quit'), ('uint64', 'end of input')):
        ctx = zmq.Context()
        try:
            with tempfile.TemporaryDirectory() as directory:
                summary.append(run(sys.argv[1], mode, ctx, directory, stop_by))
        except Mismatch as e:
            print('check_wire.py: %s hashes: FAILED: %s' % (mode, e))
            return 1
        finally:
            ctx.destroy(linger=0)
    print('vLLM v0.25.1 wire: ok; ' + '; '.join(summary))
    return 0


if __name__ == '__main__':
    sys.exit(main())
