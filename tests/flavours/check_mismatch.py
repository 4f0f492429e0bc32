#!/usr/bin/env python3
"""A translation unit of one flavour links against that flavour's library and
fails to link against the other's (each flavour's names live in their own
inline namespace). Both directions are checked.

  check_mismatch.py SOURCE INCLUDE_DIR STANDALONE_LIB BOOST_LIB -- COMPILER...

Exit status 0 if every expectation holds, 1 otherwise.
"""
import os
import subprocess
import sys
import tempfile


def main() -> int:
    sep = sys.argv.index("--")
    source, include, standalone_lib, boost_lib = sys.argv[1:sep]
    compiler = sys.argv[sep + 1:]
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        for flavour, defines in (("standalone", []), ("boost", ["-DGHOSTLINK_ASIO_BOOST=1"])):
            obj = os.path.join(work, flavour + ".o")
            subprocess.run(compiler + ["-std=c++20", "-pthread", "-I", include] + defines +
                           ["-c", source, "-o", obj], check=True)
            for lib_flavour, lib in (("standalone", standalone_lib), ("boost", boost_lib)):
                exe = os.path.join(work, flavour + "-" + lib_flavour)
                link = subprocess.run(compiler + [obj, lib, "-pthread", "-lcrypto", "-o", exe],
                                      capture_output=True, text=True)
                expect_link = flavour == lib_flavour
                wanted = flavour + "_asio"
                if expect_link and link.returncode != 0:
                    print(f"FAIL: a {flavour} unit did not link against the {lib_flavour} library:\n{link.stderr}")
                    failures += 1
                elif not expect_link and link.returncode == 0:
                    print(f"FAIL: a {flavour} unit linked against the {lib_flavour} library")
                    failures += 1
                elif not expect_link and wanted not in link.stderr:
                    print(f"FAIL: linking a {flavour} unit against the {lib_flavour} library failed, "
                          f"but not for {wanted} names:\n{link.stderr}")
                    failures += 1
                else:
                    print(f"ok: {flavour} unit + {lib_flavour} library: "
                          + ("links" if expect_link else f"fails (undefined {wanted} names)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
