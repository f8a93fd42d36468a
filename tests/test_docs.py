"""The docs point at what exists: every relative link (and its #section) in the README, docs/ and BENCHMARKS.md
resolves, and every repository path the README and docs/ name in backticks is there. BENCHMARKS.md's commands
are left out of the second check: a row records the command as it ran at its commit."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
TOP_LEVEL = ("scripts/", "jaxserve/", "tests/", "pallas_kernels/", "deploy/", "configs/", "docs/", ".ci/")
# jaxserve's own packages, which the docs name without the jaxserve/ prefix (`runner/layer_loop.py`)
PACKAGES = tuple(f"{p.name}/" for p in (ROOT / "jaxserve").iterdir() if (p / "__init__.py").exists())


def anchors(page: Path) -> set[str]:
    """GitHub's ids for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    return broken


def exists(path: str) -> bool:
    """A file or directory, or a module's attribute spelled as a dotted path (`tests/helpers.write_gguf`)."""
    if any(c in path for c in "*{<"):  # a pattern, not a path
        return True
    module, _, attribute = path.rpartition(".")
    return (ROOT / path).exists() or bool(module and (ROOT / f"{module}.py").exists() and attribute.isidentifier())


def missing_paths(page: Path) -> list[str]:
    missing = []
    for token in CODE.findall(page.read_text()):
        path = token.rstrip(".,:;)").split("::")[0]
        if path.startswith(TOP_LEVEL) and not exists(path):
            missing.append(path)
        elif path.startswith(PACKAGES) and path.endswith(".py") and not exists(f"jaxserve/{path}"):
            missing.append(path)
    return missing


@pytest.mark.parametrize("page", [*PAGES, ROOT / "BENCHMARKS.md"], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_repository_paths_exist(page):
    assert missing_paths(page) == []


def test_the_checks_find_what_is_missing(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A section\n[ok](#a-section) [gone](#no-section) [file](missing.md)\n"
                    "`scripts/no_such_script.py` `runner/no_such_module.py` `tests/helpers.write_gguf`\n")
    assert broken_links(page) == ["#no-section", "missing.md"]
    assert missing_paths(page) == ["scripts/no_such_script.py", "runner/no_such_module.py"]
