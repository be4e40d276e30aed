"""Line counts of the C core, the Python package and the README at two
revisions, as a Markdown table: how the code's layout changed.

    .venv/bin/python scripts/line_counts.py 3b26d30 HEAD

(3b26d30 is main before the restructure of issue 15.)  Only what git holds
at each revision is counted; a file absent at one revision has an empty
cell there.
"""

from __future__ import annotations

import argparse
import subprocess


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def counts(rev: str) -> dict[str, int]:
    """Lines of each counted file at ``rev``."""
    out = {}
    for path in _git("ls-tree", "-r", "--name-only", rev).split():
        counted = (
            (path.startswith("csrc/") and path.endswith((".c", ".h")))
            or (path.startswith("memscale/") and path.endswith(".py"))
            or path == "README.md"
        )
        if counted:
            out[path] = _git("show", f"{rev}:{path}").count("\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default="HEAD")
    args = parser.parse_args()
    a, b = counts(args.before), counts(args.after)
    print(f"| file | {args.before} | {args.after} |\n| --- | ---: | ---: |")
    for path in sorted(set(a) | set(b)):
        print(f"| `{path}` | {a.get(path, '')} | {b.get(path, '')} |")
    for prefix, label in (("csrc/", "C"), ("memscale/", "Python")):
        total_a = sum(v for k, v in a.items() if k.startswith(prefix))
        total_b = sum(v for k, v in b.items() if k.startswith(prefix))
        max_a = max((v for k, v in a.items() if k.startswith(prefix)), default=0)
        max_b = max((v for k, v in b.items() if k.startswith(prefix)), default=0)
        print(f"| **{label}: total** | {total_a} | {total_b} |")
        print(f"| **{label}: largest file** | {max_a} | {max_b} |")


if __name__ == "__main__":
    main()
