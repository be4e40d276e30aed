"""The README and docs/ against the tree: every file, script flag, link and
anchor they name exists, and the Quickstart is the example that is run.

Nothing here runs a benchmark; it checks what would make a copied command
or a followed link fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

# Paths the pages name in `code`: scripts, CI, tests, sources, results.
PATH = re.compile(
    r"(?<![\w./-])((?:scripts|\.ci|tests|csrc|memscale|benchmarks|examples|docs)"
    r"/[\w./{},*-]+)"
)
# A command that runs a script: the script and the flags given to it.
SCRIPT_COMMAND = re.compile(r"\.venv/bin/python (scripts/[\w-]+\.py)((?: [^`]*)?)`")
BENCH_COMMAND = re.compile(r"bash scripts/bench\.sh((?: [^`]*)?)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _expand(path: str) -> list[str]:
    """``benchmarks/quick.{json,png}`` names two files."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [
        p
        for alt in m.group(1).split(",")
        for p in _expand(path[: m.start()] + alt + path[m.end() :])
    ]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_named_files_exist(page):
    missing = []
    for code in re.findall(r"`([^`\n]+)`", page.read_text()):
        for found in PATH.findall(code):
            for path in _expand(found.rstrip(".,")):
                name = path.rsplit("/", 1)[-1]
                if "*" in path or "NAME" in path or not name:
                    continue  # a pattern, a placeholder or a directory
                if "." not in name and not path.startswith(".ci/"):
                    continue  # a key such as memscale/bytes_saved, not a file
                if not (ROOT / path).exists():
                    missing.append(path)
    assert not missing, f"{page.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_script_flags_exist(page):
    text = page.read_text().replace("\n", " ")
    wrong = []
    for script, args in SCRIPT_COMMAND.findall(text):
        if "NAME" in script:
            continue  # the placeholder of "scripts/NAME.py"
        source = (ROOT / script).read_text()
        wrong += [
            f"{script} {flag}"
            for flag in re.findall(r"(--[\w-]+)", args)
            if f'"{flag}"' not in source
        ]
    suite = (ROOT / "memscale/benchmarks/__main__.py").read_text()
    for args in BENCH_COMMAND.findall(text):
        wrong += [
            f"scripts/bench.sh {flag}"
            for flag in re.findall(r"(--[\w-]+)", args)
            if f'"{flag}"' not in suite and flag != "--help"
        ]
    assert not wrong, f"{page.name} gives flags the scripts do not take: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an external URL
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"


def test_quickstart_is_the_example_that_runs():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", quickstart, flags=re.S).group(1)
    assert code == (ROOT / "examples/quickstart.py").read_text()


def test_install_never_names_the_bare_package():
    # "memscale" on the package index is another product: every install
    # command in the docs installs from a path or a VCS URL.
    bare = re.compile(r"pip install (?:-U )?['\"]?memscale(?:\[[\w,]+\])?['\"]?(?!\s*@)(?=\s|`|$)")
    for page in PAGES:
        text = page.read_text()
        for m in bare.finditer(text):
            line = text[text.rfind("\n", 0, m.start()) + 1 : text.find("\n", m.end())]
            # The README's warning quotes the bare command to say not to use it.
            assert (
                "installs that other package" in text[m.start() : m.start() + 200]
                or "never" in line
            ), f"{page.name}: {line.strip()}"


def test_architecture_names_every_source_file():
    """docs/architecture.md gives every C file and every Python module its
    one job: a file added without a line there fails here."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w./]+)`", page))
    sources = [p for p in (ROOT / "csrc").iterdir() if p.suffix in (".c", ".h")]
    sources += [p for p in (ROOT / "memscale").rglob("*.py*") if p.suffix in (".py", ".pyi")]
    missing = []
    for path in sources:
        rel = path.relative_to(ROOT)
        if path.name in named or str(rel) in page:
            continue
        missing.append(str(rel))
    assert not missing, f"docs/architecture.md does not name: {missing}"
