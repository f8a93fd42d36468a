"""The result files: append-only JSONL that survives a kill at any moment, and tells a re-run what is done.

Each step's finished results are appended, flushed and fsync'd before the next step, so a kill loses at most the
requests still running. The one thing a kill can leave behind is a torn last line (a write cut short: the bytes
after the last newline, the start of a record); reopening drops it, and its request simply runs again. Any other
bad line, even the last whole one, means the file is not this job's output, and the job refuses to touch it.
A re-run also runs again the lines that failed before (a model name fixed, a body corrected): their records are
taken out of the files first (written anew beside them, then moved over them), so each line keeps one record.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import pydantic

from jaxserve.batch.input_file import ResultKey
from jaxserve.batch.records import BatchOutputLine
from jaxserve.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class ResultsOnDisk:
    records: list[BatchOutputLine] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)  # each record's line as written (its newline included)
    intact_bytes: int = 0  # length of the file up to the end of its last good line
    torn_tail: bytes = b""  # what follows it: a line cut short by a kill

    @property
    def keys(self) -> set[ResultKey]:
        return {record.key for record in self.records if record.key is not None}

    @property
    def succeeded_keys(self) -> set[ResultKey]:
        return {record.key for record in self.records if record.key is not None and not record.failed}

    @property
    def failed(self) -> int:
        return sum(record.failed for record in self.records)


RECORD_START = b'{"id":'  # how every record's line begins (BatchOutputLine's first field)


def parse_results(data: bytes, path: Path) -> ResultsOnDisk:
    """The records in a result file's bytes. Only the end may be torn: what follows the last newline if it begins
    as a record does (a kill never writes a newline it did not finish), or a tail of zero bytes (a power loss can
    leave the file longer than what reached the disk). Any other bad line is an error."""
    lines = data.split(b"\n")  # the last item follows the final newline: b"" unless a write was cut short
    results = ResultsOnDisk()
    for number, line in enumerate(lines[:-1], start=1):
        if line.strip():
            try:
                results.records.append(BatchOutputLine.model_validate_json(line))
                results.lines.append(line + b"\n")
            except pydantic.ValidationError:
                if _zero_filled(data[results.intact_bytes:]):
                    break
                raise _not_results(path, f"line {number}") from None
        results.intact_bytes += len(line) + 1
    results.torn_tail = tail = data[results.intact_bytes:]
    if tail and not (tail.startswith(RECORD_START) or RECORD_START.startswith(tail) or _zero_filled(tail)):
        raise _not_results(path, f"line {len(lines)}")
    return results


def _zero_filled(data: bytes) -> bool:
    return not data.replace(b"\x00", b"").strip()


def _not_results(path: Path, where: str) -> UserError:
    return UserError(f"{where} of {path} is not a batch result line; this file was not written by `jaxserve batch` "
                     "(or was edited): move it away or point `output` elsewhere")


def read_results(path: Path | None) -> ResultsOnDisk:
    """What a result file holds now, read-only (for --validate); empty if it does not exist."""
    if path is None or not path.exists():
        return ResultsOnDisk()
    return parse_results(path.read_bytes(), path)


class ResultLog:
    """The output file (and the errors file, if the job has one), locked and open for appending."""

    def __init__(self, output: Path, errors: Path | None):
        self._lock = threading.Lock()
        self._output = self._open_locked(output)
        self._errors = self._open_locked(errors) if errors is not None else None
        self.done: set[ResultKey] = set()  # lines with a successful result: the others run (again)
        self.retried = 0  # failed results of earlier runs taken out, their lines to run again
        for name, path in (("_output", output), ("_errors", errors)):
            file = getattr(self, name)
            if file is None:
                continue
            results = self._recover(file, path)
            if results.failed:
                setattr(self, name, self._without_failures(file, path, results))
                self.retried += results.failed
            self.done |= results.succeeded_keys

    @staticmethod
    def _open_locked(path: Path) -> BinaryIO:
        try:
            file = open(path, "a+b")
        except OSError as exc:
            raise UserError(f"cannot open {path} for the results: {exc.strerror or exc}") from None
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise UserError(f"another `jaxserve batch` is writing {path}; wait for it to finish") from None
        return file

    @staticmethod
    def _recover(file: BinaryIO, path: Path) -> ResultsOnDisk:
        """Read what earlier runs wrote, cutting off a torn last line."""
        file.seek(0)
        results = parse_results(file.read(), path)
        if results.torn_tail:
            log.warning("%s ended in a torn line (%d bytes, from an interrupted run); dropped it, its request will "
                        "run again", path, len(results.torn_tail))
            file.truncate(results.intact_bytes)
            _sync(file)
        return results

    def _without_failures(self, file: BinaryIO, path: Path, results: ResultsOnDisk) -> BinaryIO:
        """The file with its failed records taken out: the rest written beside it and moved over it (a kill
        leaves the old file or the new one whole), then opened and locked in its place."""
        kept = b"".join(line for line, record in zip(results.lines, results.records) if not record.failed)
        fresh = path.with_name(path.name + ".retrying")
        try:
            with open(fresh, "wb") as new:
                new.write(kept)
                _sync(new)
            os.replace(fresh, path)
        except OSError as exc:
            raise UserError(f"cannot rewrite {path} without its failed results: {exc.strerror or exc}") from None
        file.close()
        return self._open_locked(path)

    def write(self, record: BatchOutputLine) -> None:
        """Append one result (durable after the next `commit`)."""
        file = self._errors if record.failed and self._errors is not None else self._output
        line = record.model_dump_json().encode() + b"\n"
        with self._lock:  # data-parallel replicas' runners write from their own threads: whole lines, one at a time
            file.write(line)
            if record.key is not None:
                self.done.add(record.key)

    def commit(self) -> None:
        with self._lock:
            for file in (self._output, self._errors):
                if file is not None:
                    try:
                        _sync(file)
                    except OSError as exc:  # a full disk, a lost network file system
                        raise UserError(f"writing the results to {file.name} failed: {exc.strerror or exc}; the "
                                        "lines written before are kept: fix it and run the job again to resume"
                                        ) from None

    def close(self) -> None:
        self.commit()
        for file in (self._output, self._errors):
            if file is not None:
                file.close()  # closing releases the lock

    def __enter__(self) -> ResultLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _sync(file: BinaryIO) -> None:
    file.flush()
    os.fsync(file.fileno())
