#!/usr/bin/env python3
"""A/B of two ghostlink-bench binaries, as docs/PERFORMANCE.md reports them.

    bench/ab.py BASE_BENCH NEW_BENCH SCENARIO[,SCENARIO...] PAIRS

For each of PAIRS pairs and each scenario, runs both binaries as separate
processes (`--only S --runs 1 --impl ghostlink --json F`), base first in
even pairs and new first in odd ones, and prints per figure the median of
new/base (base/new where lower is better) and its spread. A figure is
ghostlink's, or a named variant's where a scenario reports several (the
element types of the quantized scenarios, say: `metric [q8_0]`).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    base, new, scenarios, pairs = sys.argv[1], sys.argv[2], sys.argv[3].split(','), int(sys.argv[4])
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for s in scenarios:
                values = {}
                order = (('base', base), ('new', new)) if i % 2 == 0 else (('new', new), ('base', base))
                for name, exe in order:
                    out = os.path.join(tmp, name + '.json')
                    subprocess.run([exe, '--only', s, '--runs', '1', '--impl', 'ghostlink', '--json', out],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
                    for m in json.load(open(out))['metrics']:
                        for impl, value in m['values'].items():
                            label = m['metric'] if impl == 'ghostlink' else f"{m['metric']} [{impl}]"
                            key = (m['scenario'], label, m['higher_is_better'])
                            values.setdefault(key, {})[name] = value
                for key, v in values.items():
                    if v.get('base') and 'new' in v:
                        ratios.setdefault(key, []).append(v['new'] / v['base'] if key[2] else v['base'] / v['new'])
    for (scenario, metric, _), rs in ratios.items():
        rs.sort()
        print(f'{scenario:24s} {metric[:64]:64s} median {statistics.median(rs):.3f} '
              f'spread {rs[0]:.3f}-{rs[-1]:.3f} n={len(rs)}')


if __name__ == '__main__':
    main()
