"""What every benchmark script's `--append BENCHMARKS.md` writes first: the date, the machine, the commit and the
command as it was run, then the script's own figures, as one markdown table row."""

from __future__ import annotations

import datetime
import subprocess
import sys


def current_commit() -> str:
    """HEAD's short hash, with "+changes" when tracked files other than Markdown differ from it. A GPU session's device receives the
    working tree over the git directory of the session's first commit, so its HEAD alone would name a commit
    that is not what ran; the mark says to correct the cell by hand."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # Markdown does not count: appending a row to BENCHMARKS.md changes no code that runs.
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md"],
                             capture_output=True, text=True).stdout.strip()
    return f"{head}+changes" if head and changed else head


def command_line(script: str, append_path: str | None) -> str:
    """How this script was run, without the --append option that writes the row."""
    command = " ".join([f"scripts/{script}", *sys.argv[1:]])
    return command.replace(f" --append {append_path}", "") if append_path else command


def append_row(path: str, machine: str, command: str, *figures: str) -> None:
    cells = [str(datetime.date.today()), machine, current_commit(), f"`{command}`", *figures]
    with open(path, "a") as f:
        f.write("| " + " | ".join(cells) + " |\n")
