#!/usr/bin/env python3
"""block_hashes() against the definition (DESIGN.md, "The block hash"),
computed here with hashlib.sha256 alone. Usage: check_hash.py HASH_DUMP."""
import hashlib
import random
import struct
import subprocess
import sys


def block_hashes(model, salt, layers, heads, dim, bt, element, scales, keys_only, windows, tokens):
    u64 = lambda v: struct.pack('<Q', v)
    root = (b'ghostlink-prefix-v1' + u64(len(model)) + model + u64(len(salt)) + salt
            + u64(layers) + u64(heads) + u64(dim) + u64(bt) + bytes([element]))
    if element == 5:  # fp8_e4m3: its scales are part of what its blocks are
        root += struct.pack('<ff', *scales)
    windows = windows if windows and any(w for w, _ in windows) else None
    if keys_only or windows:  # a layout other than full layers storing values
        root += bytes([keys_only]) + b''.join(u64(w) + u64(s) for w, s in (windows or [(0, 0)] * layers))
    h = hashlib.sha256(root).digest()
    out = []
    for b in range(len(tokens) // bt):
        h = hashlib.sha256(h + struct.pack('<%di' % bt, *tokens[b * bt:(b + 1) * bt])).digest()
        out.append(h.hex())
    return out


def main():
    rng = random.Random(2026)
    one = (1.0, 1.0)
    gemma = [(0, 0) if (l + 1) % 6 == 0 else (1024, 0) for l in range(12)]
    cases = [(b'', b'', 32, 8, 128, 16, 0, one, 0, None, list(range(100))),
             (b'llama-3-8b@main', b'tenant \xff', 2, 4, 64, 4, 1, one, 0, None, [-1, 0, 2**31 - 1, -2**31] * 5),
             (b'm', b'', 1, 1, 1, 1, 2, one, 0, None, [7, 8, 9]),
             (b'q', b'', 4, 8, 128, 16, 3, one, 0, None, list(range(40))),
             (b'q', b'', 4, 8, 128, 16, 4, one, 0, None, list(range(40))),
             (b'q', b'', 4, 8, 128, 16, 5, one, 0, None, list(range(40))),
             (b'q', b'', 4, 8, 128, 16, 5, (0.5, 3.75), 0, None, list(range(40))),
             (b'gemma', b'', 12, 4, 64, 16, 1, one, 0, gemma, list(range(50))),
             (b'mistral', b's', 3, 2, 64, 16, 0, one, 0, [(4096, 4)] * 3, list(range(40))),
             (b'deepseek', b'', 2, 1, 576, 16, 1, one, 1, None, list(range(40))),
             (b'deepseek', b'', 2, 1, 576, 16, 3, one, 1, [(128, 0), (0, 0)], list(range(40))),
             (b'fp8', b'', 2, 2, 32, 4, 5, (0.5, 2.0), 0, [(8, 2), (0, 0)], list(range(20)))]
    for _ in range(30):
        bt = rng.choice([1, 2, 4, 16, 32])
        tokens = [rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(0, 5 * bt + 3))]
        model = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 12)))
        salt = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 12)))
        element = rng.randrange(6)
        dim = rng.choice([64, 128] if element in (3, 4) else [4, 64, 128])  # whole groups of 32
        scales = (rng.choice([0.25, 1.0, 1.5, 448.0]), rng.choice([0.125, 1.0, 3.0])) if element == 5 else one
        layers = rng.randrange(1, 40)
        keys_only = rng.randrange(2)
        windows = None
        if rng.randrange(2):
            windows = [(0, 0) if rng.randrange(3) == 0 else (rng.randrange(1, 5000), rng.randrange(0, 9))
                       for _ in range(layers)]
        cases.append((model, salt, layers, rng.choice([1, 2, 8]), dim, bt, element, scales, keys_only, windows,
                      tokens))
    hexs = lambda s: s.hex() if s else '-'
    wins = lambda w: ','.join('%d:%d' % p for p in w) if w else '-'
    lines = ['%s %s %d %d %d %d %d %r %r %d %s %s' % (hexs(m), hexs(s), l, h, d, bt, e, sc[0], sc[1], k, wins(w),
                                                    ','.join(map(str, t)))
             for m, s, l, h, d, bt, e, sc, k, w, t in cases]
    got = subprocess.run([sys.argv[1]], input='\n'.join(lines) + '\n', capture_output=True, text=True,
                         check=True).stdout.split('\n')
    failures = 0
    for i, case in enumerate(cases):
        want = ' '.join(block_hashes(*case))
        if got[i] != want:
            failures += 1
            print('case %d differs:\n  ghostlink %s\n  hashlib   %s' % (i, got[i], want))
    blocks = sum(len(c[10]) // c[5] for c in cases)
    print('%d cases, %d block hashes compared, %d differ' % (len(cases), blocks, failures))
    return 1 if failures or blocks == 0 else 0


if __name__ == '__main__':
    sys.exit(main())
