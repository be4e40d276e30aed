"""The CI scripts under .ci/ (issue 20, item 8): under ``pipefail`` a pipe
into a reader that stops early (``grep -q``, ``head``) fails whenever the
writer is still writing when the reader exits (SIGPIPE, status 141), so a
check written that way fails at random.  Checked on the scripts' text, and
the hazard itself shown with bash."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / ".ci"
EARLY_EXIT = re.compile(r"\|\s*(grep\s+(-\w*q\w*|--quiet|--silent)\b|head\b)")


def _scripts():
    return sorted(p for p in CI.iterdir() if p.is_file())


def _code_lines(path: Path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        yield number, stripped


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: p.name)
def test_no_early_exiting_reader_under_pipefail(script):
    text = script.read_text()
    if "pipefail" not in text:
        pytest.skip(f"{script.name} does not set pipefail")
    bad = [
        f"{script.name}:{n}: {line.strip()}"
        for n, line in _code_lines(script)
        if EARLY_EXIT.search(line)
    ]
    assert not bad, "a pipe into a reader that exits early, under pipefail:\n" + "\n".join(bad)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_hazard_is_real():
    """What the rule above prevents: the same check, once in a pipe and
    once on captured output, with a writer that outlives grep -q."""
    piped = subprocess.run(["bash", "-c", "set -o pipefail; seq 1 200000 | grep -q 1"])
    captured = subprocess.run(
        ["bash", "-c", "set -o pipefail; out=$(seq 1 200000) && [[ $out == *1* ]]"]
    )
    assert piped.returncode == 141  # grep matched, yet the pipeline failed
    assert captured.returncode == 0
