"""The decision engine and the budget planner in plain C: compile
tests/c/test_engine.c and tests/c/test_solver.c with csrc/engine.c and
csrc/solver.c (no Python, no torch) and run them.

The program is built with ``-std=c11 -Wall -Wextra -Werror`` and, when the
compiler and the host support them, ``-fsanitize=address,undefined``; it
prints one line per check group and ends with ``N passed, M failed``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [
    ROOT / "tests" / "c" / "test_engine.c",
    ROOT / "csrc" / "engine.c",
    ROOT / "csrc" / "solver.c",
    ROOT / "csrc" / "memory.c",
]
BASE_FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-g"]
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=undefined",
]
GROUPS = [
    "names",
    "smart-skip",
    "force-all",
    "ineligible",
    "greedy",
    "nothing-fits",
    "disabled",
    "empty",
    "determinism",
    "exhaustive",
    "fuzz",
]
SOLVER_SOURCES = [
    ROOT / "tests" / "c" / "test_solver.c",
    ROOT / "csrc" / "solver.c",
    ROOT / "csrc" / "memory.c",
]
SOLVER_GROUPS = [
    "model",
    "known",
    "tail",
    "selective",
    "exhaustive",
    "fuzz",
    "min-budget",
    "timing",
]
SUMMARY = re.compile(r"^(\d+) passed, (\d+) failed$")

PROBE = r"""
#include <stdio.h>
#include <stdlib.h>
int main(void) {
    char *p = malloc(16);
    if (p == NULL) { return 1; }
    p[0] = 'x';
    printf("%c\n", p[0]);
    free(p);
    return 0;
}
"""


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "gcc", "cc", "clang"):
        if cand and shutil.which(cand):
            return cand
    return None


def _run_env(sanitized: bool, leaks: bool) -> dict[str, str]:
    env = dict(os.environ)
    # A sanitizer runtime preloaded for the Python process (MEMSCALE_SANITIZE
    # runs) must not leak into a program that links its own.
    env.pop("LD_PRELOAD", None)
    if sanitized:
        env["ASAN_OPTIONS"] = f"detect_leaks={int(leaks)}:abort_on_error=0"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    return env


def _try_sanitizer(cc: str, tmp: pathlib.Path) -> tuple[bool, bool]:
    """(sanitizers usable, leak detection usable), found by trying."""
    src = tmp / "probe.c"
    exe = tmp / "probe"
    src.write_text(PROBE)
    built = subprocess.run(
        [cc, *BASE_FLAGS, *SANITIZE_FLAGS, str(src), "-o", str(exe)], capture_output=True, text=True
    )
    if built.returncode != 0:
        return False, False
    for leaks in (True, False):
        ran = subprocess.run(
            [str(exe)], capture_output=True, text=True, env=_run_env(True, leaks), timeout=60
        )
        if ran.returncode == 0 and ran.stdout.strip() == "x":
            return True, leaks
    return False, False


def _build_and_run(tmp_path_factory, name, sources):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler found")
    tmp = tmp_path_factory.mktemp(name)
    sanitized, leaks = _try_sanitizer(cc, tmp)
    exe = tmp / name
    flags = BASE_FLAGS + (SANITIZE_FLAGS if sanitized else [])
    built = subprocess.run(
        [cc, *flags, *map(str, sources), "-o", str(exe), "-lm"], capture_output=True, text=True
    )
    assert built.returncode == 0, (
        f"compiling the engine test failed ({cc} {' '.join(flags)}):\n{built.stdout}{built.stderr}"
    )
    # -Werror: a warning is an error, so the build is clean if it built.
    ran = subprocess.run(
        [str(exe)], capture_output=True, text=True, env=_run_env(sanitized, leaks), timeout=120
    )
    return {
        "rc": ran.returncode,
        "stdout": ran.stdout,
        "stderr": ran.stderr,
        "sanitized": sanitized,
    }


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    return _build_and_run(tmp_path_factory, "test_engine", SOURCES)


@pytest.fixture(scope="module")
def solver_run(tmp_path_factory):
    return _build_and_run(tmp_path_factory, "test_solver", SOLVER_SOURCES)


def _explain(run) -> str:
    return (
        f"(sanitizers {'on' if run['sanitized'] else 'off'})\n"
        f"--- stdout\n{run['stdout']}\n--- stderr\n{run['stderr']}"
    )


def test_engine_program_exits_zero(engine_run):
    assert engine_run["rc"] == 0, _explain(engine_run)
    assert engine_run["stderr"].strip() == "", _explain(engine_run)


def test_engine_program_summary(engine_run):
    lines = engine_run["stdout"].strip().splitlines()
    assert lines, _explain(engine_run)
    m = SUMMARY.match(lines[-1])
    assert m, f"last line is not 'N passed, M failed': {lines[-1]!r}"
    passed, failed = int(m.group(1)), int(m.group(2))
    assert failed == 0, _explain(engine_run)
    # The exhaustive and fuzz groups alone run tens of thousands of checks.
    assert passed > 10_000, _explain(engine_run)


@pytest.mark.parametrize("group", GROUPS)
def test_engine_group(engine_run, group):
    pattern = re.compile(
        rf"^(ok  |FAIL) {re.escape(group)}\s+(\d+) checks, "
        rf"(\d+) failed$"
    )
    found = [m for m in map(pattern.match, engine_run["stdout"].splitlines()) if m]
    assert len(found) == 1, f"group {group!r} not reported\n" + _explain(engine_run)
    status, checks, failed = found[0].groups()
    assert status == "ok  " and failed == "0", _explain(engine_run)
    assert int(checks) > 0


@pytest.mark.slow
def test_solver_program(solver_run):
    """The budget planner: hand-checked cases, an exhaustive reference
    search on every chain of up to 6 layers drawn, a fuzz, the smallest
    feasible budget, and 1,000 and 10,000-layer chains (their times are
    printed, not asserted: see scripts/solver_bench.py)."""
    assert solver_run["rc"] == 0, _explain(solver_run)
    lines = solver_run["stdout"].strip().splitlines()
    m = SUMMARY.match(lines[-1])
    assert m and int(m.group(2)) == 0, _explain(solver_run)
    for group in SOLVER_GROUPS:
        pattern = re.compile(rf"^ok   {re.escape(group)}\s+(\d+) checks, 0 failed$")
        assert any(pattern.match(line) for line in lines), (group, _explain(solver_run))
