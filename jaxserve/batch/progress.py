"""The job's progress: requests done of the total, generated tokens per second, and the ETA. A bar (tqdm) on a
terminal; where stderr is a file or a pipe (a cluster's log, `nohup`), a log line every LOG_INTERVAL_S instead: a
bar redrawn with carriage returns there is one ever-growing line, with the log's records glued onto it."""

from __future__ import annotations

import logging
import sys
import threading
import time

from tqdm.auto import tqdm

log = logging.getLogger("jaxserve.batch")

# Recomputing the postfix every step would cost more than the bar is worth on fast steps.
POSTFIX_INTERVAL_S = 0.5
LOG_INTERVAL_S = 30.0


class BatchProgress:
    def __init__(self, total: int, already_done: int, enabled: bool = True, terminal: bool | None = None):
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = tqdm(total=total, initial=already_done, desc="batch", unit="req", dynamic_ncols=True,
                         disable=not (enabled and terminal))
        self._logs = enabled and not terminal
        self._total, self._done, self._done_at_start = total, already_done, already_done
        self._started = time.monotonic()
        self._last_postfix = self._last_log = self._started
        self.generated_tokens = 0
        self._lock = threading.Lock()

    def tokens_generated(self, count: int) -> None:
        with self._lock:  # data-parallel replicas' runners report from their own threads
            self.generated_tokens += count
            now = time.monotonic()
            if now - self._last_postfix >= POSTFIX_INTERVAL_S:
                self._last_postfix = now
                self._bar.set_postfix_str(f"{self.tokens_per_second:.1f} tok/s", refresh=False)

    def request_done(self) -> None:
        with self._lock:
            self._bar.update(1)
            self._done += 1
            now = time.monotonic()
            if self._logs and (now - self._last_log >= LOG_INTERVAL_S or self._done == self._total):
                self._last_log = now
                log.info("batch: %s", self.status_line(now))

    def status_line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        rate = (self._done - self._done_at_start) / elapsed
        left = self._total - self._done
        eta = f", about {left / rate / 60:.1f} min left" if rate > 0 and left else ""
        return f"{self._done}/{self._total} requests done, {self.tokens_per_second:.1f} tok/s generated{eta}"

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(time.monotonic() - self._started, 1e-9)

    def close(self) -> None:
        self._bar.close()
