"""scripts/benchmark_table.py: the commit cell of a benchmark row names what ran."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from benchmark_table import current_commit  # noqa: E402


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def test_a_changed_tree_is_marked(tmp_path, monkeypatch):
    """A tree whose tracked files differ from HEAD (a GPU session's device copy) is not reported as HEAD."""
    git("init", "-q", cwd=tmp_path)
    (tmp_path / "kernel.py").write_text("x = 1\n")
    git("add", "kernel.py", cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first", cwd=tmp_path)
    head = git("rev-parse", "--short", "HEAD", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert current_commit() == head
    (tmp_path / "BENCH.md").write_text("| row |\n")
    git("add", "BENCH.md", cwd=tmp_path)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "table", cwd=tmp_path)
    head = git("rev-parse", "--short", "HEAD", cwd=tmp_path)
    (tmp_path / "BENCH.md").write_text("| row |\n| another row |\n")  # a benchmark appending its row
    assert current_commit() == head
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert current_commit() == f"{head}+changes"
