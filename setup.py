"""Build of memscale's C core, memscale._core.

The extension uses the CPython C API only: it includes no torch header and
links no libtorch, so the build needs setuptools and a C compiler, and one
build works with every supported torch.

Environment switches:
  MEMSCALE_DEV=1       a development build: -Werror on top of -Wall -Wextra
                       (scripts/setup-env.sh, .ci/run and .ci/sanitize set
                       it).  A user's build leaves warnings as warnings, so
                       a newer compiler's new warning cannot fail an install.
  MEMSCALE_DEBUG=1     -O0 -g3 -UNDEBUG (asserts on)
  MEMSCALE_SANITIZE=1  -fsanitize=address,undefined (run with the ASan
                       runtime preloaded; see tests/README or .ci/sanitize)
"""

import glob
import os

from setuptools import Extension, setup

SOURCES = [
    "csrc/module.c",
    "csrc/engine.c",
    "csrc/memory.c",
    "csrc/layer_stats.c",
    "csrc/plan.c",
    "csrc/profiler.c",
    "csrc/hardware.c",
    "csrc/units.c",
    "csrc/hook_handles.c",
    "csrc/versions.c",
    "csrc/executor.c",
    "csrc/frame.c",
    "csrc/hooks.c",
    "csrc/segment.c",
    "csrc/exec_offload.c",
    "csrc/exec_tiling.c",
    "csrc/root.c",
    "csrc/spill.c",
    "csrc/spill_file.c",
    "csrc/spill_worker.c",
    "csrc/adam8bit.c",
    "csrc/tiling.c",
    "csrc/solver.c",
    "csrc/dispatch_guard.c",
    "csrc/fake_calls.c",
    "csrc/storage_track.c",
]

# Every header: a change to one rebuilds the extension.
DEPENDS = sorted(glob.glob("csrc/*.h"))

# POSIX 2008 for openat/pread/pwrite under -std=c11; -pthread for the
# offload I/O thread.
compile_args = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-pthread", "-Wall",
                "-Wextra"]
link_args = ["-pthread"]

if os.environ.get("MEMSCALE_DEV") == "1":
    compile_args.append("-Werror")

if os.environ.get("MEMSCALE_DEBUG") == "1":
    compile_args += ["-O0", "-g3", "-UNDEBUG"]
if os.environ.get("MEMSCALE_SANITIZE") == "1":
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
             "-fno-sanitize-recover=undefined"]
    compile_args += flags + ["-O1", "-g"]
    link_args += flags

setup(
    ext_modules=[
        Extension(
            "memscale._core",
            sources=SOURCES,
            depends=DEPENDS,
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            libraries=["m"],
        )
    ],
)
