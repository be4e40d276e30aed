"""The CUDA check: one command on a GPU machine (run it as
``bash scripts/gpu-check.sh``; docs/gpu.md says what it covers).

On a machine with CUDA it

1. describes the machine (Python, torch and its CUDA, the devices),
2. builds the C extension in place with the Python that runs it
   (``setup.py build_ext --inplace``; if setuptools cannot, a direct
   compile of the same sources with the C compiler Python was built with),
3. runs ``tests/gpu`` under pytest (JUnit XML, the log, the figures the
   tests record),
4. runs the benchmark suite's quick models with ``--device cuda`` (the
   device's own peak),

and writes everything to the output folder (``--out``, else ``$OUT``, else
``gpu-check-out``): ``summary.json``, ``summary.txt``, ``environment.json``,
``build.log``, ``pytest.log``, ``junit.xml``, ``figures.json``,
``bench.json``, ``bench.txt``.  A package a step needs that is missing is
named in one line, and the other steps run.  No package is installed and
nothing is downloaded.

Without CUDA it stops at once, says so and exits 3; ``--dry-run`` checks on
any machine what can be checked without a GPU: the packages, a build of
the extension in a temporary folder (never in place), the collection of
``tests/gpu`` (every test skipped with its reason) and the benchmark
suite's ``--device cuda`` flag.

Exit status: 0 everything ran and passed; 1 something failed (the summary
says what); 2 bad arguments; 3 no CUDA device (not a dry run).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Pure-Python packages pytest needs, copied by --bundle for a machine
# without pytest (carry the folder there; see docs/gpu.md).
BUNDLE = ("pytest", "_pytest", "py", "pluggy", "iniconfig", "packaging", "pygments")
BUNDLE_DIR = os.path.join(ROOT, ".gpu-deps")
# What each step needs, and what happens without it.
NEEDS = {
    "torch": "everything",
    "pytest": "tests/gpu is not run",
    "transformers": "the Hugging Face models of tests/gpu are skipped and the "
    "benchmark suite runs its mlp and cnn models only",
    "tqdm": "the benchmark suite is not run",
    "setuptools": "the extension is compiled directly with the C compiler",
}
OPTIONAL = {
    "bitsandbytes": "its AdamW8bit test is skipped",
    "matplotlib": "the benchmark suite writes no plot",
}
QUICK_MODELS = ("mlp", "cnn", "gpt2", "bert", "llama")
BUILD_TIMEOUT = 180
# memscale's modes with and without async offload, against torch's own
# checkpointing: what fits in the time (the rest run with the full suite).
BENCH_VARIANTS = ("unoptimized", "conservative", "balanced", "balanced-async", "torch-checkpoint")


def say(line: str = "") -> None:
    print(line, flush=True)


def _have(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if env["cuda_available"]:
        env["devices"] = [
            {
                "name": props.name,
                "total_memory": props.total_memory,
                "capability": f"{props.major}.{props.minor}",
            }
            for props in (
                torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())
            )
        ]
        env["bf16"] = torch.cuda.is_bf16_supported()
    for name in (*NEEDS, *OPTIONAL):
        if name != "torch":
            env[f"has_{name}"] = _have(name)
    return env


class Runner:
    """Runs a command with its output to a log file and to stdout, killed
    (its whole process group) after ``timeout`` seconds."""

    def __init__(self, out: str) -> None:
        self.out = out

    def __call__(
        self,
        cmd: list[str],
        log: str,
        timeout: float,
        env: dict[str, str] | None = None,
        echo: bool = True,
    ) -> tuple[int | None, float]:
        start = time.perf_counter()
        with open(os.path.join(self.out, log), "a", encoding="utf-8") as sink:
            sink.write(f"$ {' '.join(cmd)}\n")
            sink.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            expired = threading.Event()

            def kill() -> None:
                expired.set()
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    sink.write(line)
                    if echo:
                        sys.stdout.write(line)
                        sys.stdout.flush()
                rc = proc.wait()
            finally:
                timer.cancel()
            if expired.is_set():
                sink.write(f"\n[gpu-check: killed after {timeout:.0f} s]\n")
                return None, time.perf_counter() - start
        return rc, time.perf_counter() - start


def _sources() -> list[str]:
    """The extension's sources, as setup.py lists them."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SOURCES" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise RuntimeError("setup.py has no SOURCES list")


def _direct_compile(run: Runner, target: str, timeout: float) -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    include = sysconfig.get_paths()["include"]
    cmd = [
        *cc,
        "-shared",
        "-fPIC",
        "-O2",
        "-std=c11",
        "-D_POSIX_C_SOURCE=200809L",
        "-pthread",
        "-Wall",
        "-Wextra",
        f"-I{include}",
        *_sources(),
        "-o",
        target,
        "-lm",
    ]
    rc, _ = run(cmd, "build.log", timeout, echo=False)
    return rc == 0


def build(run: Runner, in_place: bool, missing: list[str]) -> dict[str, Any]:
    """Build memscale._core with this Python: in place, or (a dry run) in a
    temporary folder.  A user's build: warnings stay warnings."""
    env = {k: v for k, v in os.environ.items() if k != "MEMSCALE_DEV"}
    jobs = str(max(1, min(16, os.cpu_count() or 1)))
    start = time.perf_counter()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    scratch = None if in_place else tempfile.mkdtemp(prefix="memscale-gpu-check-build-")
    where = ["--inplace"] if in_place else ["--build-lib", scratch, "--build-temp", scratch]
    how = "setup.py build_ext"
    ok = False
    if "setuptools" not in missing:
        cmd = [sys.executable, "setup.py", "build_ext", *where, "-j", jobs]
        rc, _ = run(cmd, "build.log", BUILD_TIMEOUT, env=env, echo=False)
        ok = rc == 0
    if not ok:
        how = "direct compile (setup.py build_ext failed or setuptools is missing; see build.log)"
        folder = os.path.join(ROOT, "memscale") if in_place else scratch
        assert folder is not None
        ok = _direct_compile(run, os.path.join(folder, "_core" + suffix), BUILD_TIMEOUT)
    result: dict[str, Any] = {"ok": ok, "how": how, "seconds": time.perf_counter() - start}
    if ok and in_place:
        probe = subprocess.run(
            [sys.executable, "-c", "import memscale._core, memscale; print(memscale.__version__)"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        result["ok"] = probe.returncode == 0
        result["import"] = (probe.stdout + probe.stderr).strip()[-2000:]
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _junit(path: str) -> dict[str, Any]:
    counts = {"total": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    reasons: list[str] = []
    cases: list[dict[str, Any]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        counts["total"] += 1
        outcome = "passed"
        for child in case:
            if child.tag == "failure":
                outcome = "failed"
            elif child.tag == "error":
                outcome = "errors"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
                reasons.append(child.get("message", ""))
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failures.append(name)
        cases.append({"name": name, "outcome": outcome, "seconds": float(case.get("time", 0))})
    return {**counts, "failures": failures, "skip_reasons": reasons, "cases": cases}


def _from_log(path: str) -> dict[str, Any]:
    """The outcomes ``pytest -v`` printed, for a run killed before it wrote
    its JUnit file."""
    names = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}
    counts = dict.fromkeys(("total", *names.values()), 0)
    failures: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].startswith("tests/gpu/") and parts[1] in names:
                outcome = names[parts[1]]
                counts["total"] += 1
                counts[outcome] += 1
                if outcome in ("failed", "errors"):
                    failures.append(parts[0])
    return {**counts, "failures": failures, "skip_reasons": [], "cases": []}


def run_tests(
    run: Runner, out: str, missing: list[str], bundled: bool, timeout: float
) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["MEMSCALE_GPU_FIGURES"] = os.path.join(out, "figures.json")
    if "pytest" in missing:
        return {"status": "not run: pytest is missing"}
    paths = [ROOT] + ([BUNDLE_DIR] if bundled else [])  # pytest from the carried bundle
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    junit = os.path.join(out, "junit.xml")
    for stale in (junit, env["MEMSCALE_GPU_FIGURES"]):  # an earlier run's
        if os.path.exists(stale):
            os.remove(stale)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/gpu",
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    rc, seconds = run(cmd, "pytest.log", timeout, env=env)
    result: dict[str, Any] = {"seconds": seconds, "returncode": rc}
    if os.path.exists(junit):
        result.update(_junit(junit))
    else:  # killed before pytest wrote it: what the log says ran
        result.update(_from_log(os.path.join(out, "pytest.log")))
    if rc is None:
        result["status"] = f"timed out after {timeout:.0f} s"
    elif rc in (0, 1) and os.path.exists(junit):
        result["status"] = "ok" if rc == 0 else "failures"
    else:
        result["status"] = f"pytest exited with {rc}"
    return result


def run_bench(run: Runner, out: str, missing: list[str], dry: bool, timeout: float) -> dict:
    if "tqdm" in missing:
        return {"status": "not run: tqdm is missing"}
    models = [m for m in QUICK_MODELS if m in ("mlp", "cnn") or "transformers" not in missing]
    cmd = [
        sys.executable,
        "-m",
        "memscale.benchmarks",
        "--device",
        "cuda",
        "--no-rss",
        "--keep-going",
    ]
    cmd += ["--models", *models, "--variants", *BENCH_VARIANTS, "--repeats", "3"]
    cmd += ["--json", os.path.join(out, "bench.json")]
    if "matplotlib" in missing:
        cmd.append("--no-plot")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    if dry:
        rc, seconds = run(cmd, "bench.txt", 120, env=env)
        with open(os.path.join(out, "bench.txt"), encoding="utf-8") as f:
            refused = "--device cuda: no CUDA device here" in f.read()
        status = "refused: no CUDA device" if rc == 2 and refused else f"unexpected exit {rc}"
        return {"status": status, "seconds": seconds}
    rc, seconds = run(cmd, "bench.txt", timeout, env=env)
    status = (
        "ok" if rc == 0 else (f"timed out after {timeout:.0f} s" if rc is None else f"exit {rc}")
    )
    return {"status": status, "seconds": seconds, "models": models}


def measure_costs(run: Runner, out: str) -> dict[str, Any]:
    """The planner's cost constants timed on this GPU (python -m
    memscale.costs), kept in out/costs/ rather than the user's cache."""
    cmd = [sys.executable, "-m", "memscale.costs", "--device", "cuda"]
    env = dict(os.environ, PYTHONPATH=ROOT, MEMSCALE_CACHE_DIR=os.path.join(out, "costs"))
    rc, seconds = run(cmd, "costs.txt", 60, env=env)
    result: dict[str, Any] = {"status": "ok" if rc == 0 else f"exit {rc}", "seconds": seconds}
    if rc == 0:
        with open(os.path.join(out, "costs.txt"), encoding="utf-8") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flop_rate", "host_bw", "disk_bw", "tile_overhead"):
                    result[name.strip()] = value.split()[0]
    return result


def bundle(folder: str) -> int:
    """Copy pytest and the pure-Python packages it needs into ``folder``."""
    os.makedirs(folder, exist_ok=True)
    for name in BUNDLE:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        source = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        target = os.path.join(folder, os.path.basename(source))
        if os.path.isdir(source):
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
        say(f"bundled {name} from {source}")
    return 0


def _summary_text(summary: dict[str, Any]) -> str:
    env = summary["environment"]
    lines = [
        f"gpu-check {summary['status']}: Python {env['python']}, torch {env['torch']} "
        f"(CUDA {env['torch_cuda'] or 'none'})"
    ]
    for i, dev in enumerate(env.get("devices", [])):
        lines.append(
            f"  cuda:{i} {dev['name']}, {dev['total_memory'] / 2**30:.1f} GiB, "
            f"compute capability {dev['capability']}"
        )
    for name in summary["missing"]:
        lines.append(f"  missing: {name} ({NEEDS.get(name) or OPTIONAL.get(name)})")
    build_ = summary.get("build")
    if build_:
        lines.append(
            f"build: {'ok' if build_['ok'] else 'FAILED'} ({build_['how']}, "
            f"{build_['seconds']:.0f} s)"
        )
    costs = summary.get("costs")
    if costs:
        measured = ", ".join(
            f"{k} {costs[k]}"
            for k in ("flop_rate", "host_bw", "disk_bw", "tile_overhead")
            if k in costs
        )
        lines.append(f"cost constants: {costs['status']}" + (f" ({measured})" if measured else ""))
    tests = summary.get("tests")
    if tests:
        if "total" in tests:
            lines.append(
                f"tests/gpu: {tests['passed']} passed, {tests['failed']} failed, "
                f"{tests['errors']} errors, {tests['skipped']} skipped of {tests['total']} "
                f"({tests['status']}, {tests['seconds']:.0f} s)"
            )
            lines += [f"  FAILED {name}" for name in tests["failures"]]
            lines += [f"  skipped: {r}" for r in sorted(set(tests["skip_reasons"]))]
        else:
            lines.append(f"tests/gpu: {tests['status']}")
    bench = summary.get("bench")
    if bench:
        took = f", {bench['seconds']:.0f} s" if "seconds" in bench else ""
        lines.append(f"benchmarks --device cuda: {bench['status']}{took}")
    lines.append(f"total {summary['seconds']:.0f} s; files in {summary['out']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bash scripts/gpu-check.sh", description=__doc__)
    parser.add_argument("--out", help="output folder (default: $OUT, else gpu-check-out)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check without a GPU: packages, a build in a temporary folder, "
        "the collection of tests/gpu, the benchmarks' --device flag",
    )
    parser.add_argument("--skip-bench", action="store_true", help="run tests/gpu only")
    # The defaults keep the whole check under 10 minutes (the device
    # runner's limit for one command) even when every step runs to its
    # timeout: 180 s for the build, 270 s for the tests, 150 s for the suite.
    parser.add_argument("--tests-timeout", type=float, default=270, metavar="S")
    parser.add_argument("--bench-timeout", type=float, default=150, metavar="S")
    parser.add_argument(
        "--bundle",
        metavar="DIR",
        help="copy pytest and its pure-Python dependencies into DIR and exit "
        f"(for a GPU machine without pytest: use {os.path.relpath(BUNDLE_DIR, ROOT)}/ "
        "and carry it there)",
    )
    args = parser.parse_args(argv)
    if args.bundle:
        return bundle(args.bundle)
    out = os.path.abspath(args.out or os.environ.get("OUT") or os.path.join(ROOT, "gpu-check-out"))
    os.makedirs(out, exist_ok=True)
    start = time.perf_counter()
    if not _have("torch"):
        say("missing: torch (everything needs it); nothing run")
        return 1
    missing = [name for name in (*NEEDS, *OPTIONAL) if name != "torch" and not _have(name)]
    bundled = False
    if "pytest" in missing and os.path.isdir(BUNDLE_DIR):
        sys.path.append(BUNDLE_DIR)
        importlib.invalidate_caches()
        if _have("pytest"):
            missing.remove("pytest")
            bundled = True
            say(f"pytest: from the bundle in {BUNDLE_DIR}")
    environment = _environment()
    with open(os.path.join(out, "environment.json"), "w", encoding="utf-8") as f:
        json.dump(environment, f, indent=1)
    summary: dict[str, Any] = {
        "schema": "memscale-gpu-check/1",
        "out": out,
        "dry_run": args.dry_run,
        "environment": environment,
        "missing": missing,
    }
    for name in missing:
        say(f"missing: {name} ({NEEDS.get(name) or OPTIONAL.get(name)})")

    def save(status: str) -> str:
        # After every step, so that a run killed from outside leaves what
        # it had found.
        summary["status"] = status
        summary["seconds"] = time.perf_counter() - start
        text = _summary_text(summary)
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(out, "summary.txt"), "w", encoding="utf-8") as f:
            f.write(text + "\n")
        return text

    def finish(status: str, code: int) -> int:
        say("\n" + save(status))
        return code

    if not environment["cuda_available"] and not args.dry_run:
        say(
            f"no CUDA device: torch.cuda.is_available() is False (torch "
            f"{environment['torch']}, CUDA build {environment['torch_cuda'] or 'none'}); "
            "nothing built or run.  On a machine without a GPU, "
            "`bash scripts/gpu-check.sh --dry-run` checks the build and the collection."
        )
        return finish("no CUDA device", 3)
    run = Runner(out)
    say("== build" + (" (in a temporary folder: dry run)" if args.dry_run else " (in place)"))
    summary["build"] = build(run, not args.dry_run, missing)
    save("running: built")
    if not summary["build"]["ok"]:
        say("build failed: see build.log; nothing else can run")
        return finish("build failed", 1)
    if not args.dry_run:
        say("== cost constants (python -m memscale.costs --device cuda)")
        summary["costs"] = measure_costs(run, out)
        save("running: costs measured")
    say("== tests/gpu")
    summary["tests"] = run_tests(run, out, missing, bundled, args.tests_timeout)
    save("running: tests done")
    if not args.skip_bench:
        say("== benchmarks --device cuda")
        summary["bench"] = run_bench(run, out, missing, args.dry_run, args.bench_timeout)
    figures = os.path.join(out, "figures.json")
    if os.path.exists(figures):
        with open(figures, encoding="utf-8") as f:
            summary["figures"] = json.load(f)
    tests = summary["tests"]
    bench = summary.get("bench", {"status": "ok"})
    if args.dry_run:
        ok = tests.get("total", 0) > 0 and tests.get("skipped") == tests.get("total")
        ok = ok and bench["status"] in ("refused: no CUDA device", "not run: tqdm is missing")
        return finish("dry run ok" if ok else "dry run FAILED", 0 if ok else 1)
    ok = tests.get("status") == "ok" and bench["status"] == "ok"
    return finish("ok" if ok else "FAILED", 0 if ok else 1)


if __name__ == "__main__":
    sys.exit(main())
