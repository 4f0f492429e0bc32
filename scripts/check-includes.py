#!/usr/bin/env python3
"""Includes only point down: the one place the order of src/'s folders is
written (docs/ARCHITECTURE.md links here).

    scripts/check-includes.py [ROOT]

A file under src/ may include a file of its own folder or of a folder ranked
below it, and any public header (include/ghostlink/); never one ranked above
it. A public header never includes src/. Prints each include that points up
and exits 1 if there is any.
"""
import pathlib
import re
import sys

# Lowest first. Folders on one rank may not include each other (a rank is
# a set of siblings); a folder's subfolders share its rank (store/redis is
# part of store).
ORDER = [
    ["base"],                     # config, errors, element types, fault countdowns
    ["io"],                       # file I/O, the I/O executor, little-endian, checksums
    ["memory"],                   # blocks, the pool, the reclaimer it asks
    ["core"],                     # a layer cache's actor, mailbox, working state, epochs
    ["sequence"],                 # sequences over many layer actors, steps
    ["persist", "store"],         # saving and loading sequences; the tiers below RAM
    ["prefix"],                   # the prefix cache: hashes, index, attach
    ["attend", "metrics", "testing", "events"],  # top: the kernel, the exposition, test hooks,
                                                 # ghostlink-events (a library of its own)
]
RANK = {folder: rank for rank, folders in enumerate(ORDER) for folder in folders}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder_of(relative: pathlib.PurePath) -> str:
    """src/core/actor.hpp -> core; src/attend.cpp -> attend."""
    parts = relative.parts
    return parts[0] if len(parts) > 1 else relative.stem


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    src, public = root / "src", root / "include" / "ghostlink"
    problems = []
    files = sorted(p for p in src.rglob("*") if p.suffix in (".hpp", ".cpp"))
    for path in files:
        rel = path.relative_to(src)
        mine = folder_of(rel)
        if mine not in RANK:
            problems.append(f"src/{rel}: folder '{mine}' has no rank in scripts/check-includes.py")
            continue
        for target in INCLUDE.findall(path.read_text()):
            if target.startswith("ghostlink/"):
                continue
            if not (src / target).exists():
                problems.append(f"src/{rel}: includes \"{target}\", not a path under src/ (write it from src/)")
                continue
            theirs = folder_of(pathlib.PurePath(target))
            if theirs == mine:
                continue
            if theirs not in RANK or RANK[theirs] >= RANK[mine]:
                how = "sideways" if RANK.get(theirs) == RANK[mine] else "up"
                problems.append(f"src/{rel}: includes \"{target}\", which points {how} ({mine} -> {theirs})")
    for path in sorted(public.rglob("*.hpp")):
        for target in INCLUDE.findall(path.read_text()):
            if not target.startswith("ghostlink/"):
                problems.append(f"{path.relative_to(root)}: includes \"{target}\": a public header includes only public headers")
    for p in problems:
        print(p)
    print(f"check-includes: {'FAILED' if problems else 'OK'}: {len(files)} files under src/, {len(problems)} include(s) out of order")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
