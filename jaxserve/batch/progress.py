"""The job's progress bar: requests done of the total, generated tokens per second, and the ETA (tqdm)."""

from __future__ import annotations

import threading
import time

from tqdm.auto import tqdm

# Recomputing the postfix every step would cost more than the bar is worth on fast steps.
POSTFIX_INTERVAL_S = 0.5


class BatchProgress:
    def __init__(self, total: int, already_done: int, enabled: bool = True):
        self._bar = tqdm(total=total, initial=already_done, desc="batch", unit="req", dynamic_ncols=True,
                         disable=not enabled)
        self._started = time.monotonic()
        self._last_postfix = 0.0
        self.generated_tokens = 0
        self._lock = threading.Lock()

    def tokens_generated(self, count: int) -> None:
        with self._lock:  # data-parallel replicas' runners report from their own threads
            self.generated_tokens += count
            now = time.monotonic()
            if now - self._last_postfix >= POSTFIX_INTERVAL_S:
                self._last_postfix = now
                rate = self.generated_tokens / max(now - self._started, 1e-9)
                self._bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)

    def request_done(self) -> None:
        with self._lock:
            self._bar.update(1)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(time.monotonic() - self._started, 1e-9)

    def close(self) -> None:
        self._bar.close()
