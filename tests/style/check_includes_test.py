#!/usr/bin/env python3
"""scripts/check-includes.py passes on this tree and fails on a copy of
src/ in which one include points up, one points at a sibling, and one
public header includes src/."""
import pathlib
import shutil
import subprocess
import sys
import tempfile

root = pathlib.Path(sys.argv[1])
check = root / "scripts" / "check-includes.py"


def run(tree: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(check), str(tree)], capture_output=True, text=True)


ok = run(root)
assert ok.returncode == 0, f"the tree itself fails the check:\n{ok.stdout}"

with tempfile.TemporaryDirectory() as tmp:
    tree = pathlib.Path(tmp)
    shutil.copytree(root / "src", tree / "src")
    shutil.copytree(root / "include", tree / "include")
    up = tree / "src" / "memory" / "block_pool.cpp"
    up.write_text('#include "prefix/index.hpp"\n' + up.read_text())
    sibling = tree / "src" / "store" / "entry.cpp"
    sibling.write_text('#include "persist/format.hpp"\n' + sibling.read_text())
    public = tree / "include" / "ghostlink" / "config.hpp"
    public.write_text('#include "core/actor.hpp"\n' + public.read_text())
    bad = run(tree)
    assert bad.returncode == 1, f"an upward include passed the check:\n{bad.stdout}"
    for expected in ('src/memory/block_pool.cpp: includes "prefix/index.hpp", which points up (memory -> prefix)',
                     'src/store/entry.cpp: includes "persist/format.hpp", which points sideways (store -> persist)',
                     'include/ghostlink/config.hpp: includes "core/actor.hpp"'):
        assert expected in bad.stdout, f"missing finding {expected!r} in:\n{bad.stdout}"
    assert "3 include(s) out of order" in bad.stdout, bad.stdout
print("check-includes: passes this tree, finds all 3 planted includes")
