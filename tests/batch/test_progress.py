"""Progress on a terminal is a bar; in a log file (stderr not a terminal) it is a log line now and then."""

import logging

from jaxserve.batch import progress as progress_module
from jaxserve.batch.progress import BatchProgress


def test_progress_is_logged_in_lines_where_stderr_is_no_terminal(caplog, capsys, monkeypatch):
    caplog.set_level(logging.INFO, logger="jaxserve.batch")
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)
    progress = BatchProgress(total=3, already_done=1, terminal=False)
    progress.tokens_generated(12)
    progress.request_done()
    progress.request_done()
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(",")[0] for line in lines] == ["batch: 2/3 requests done", "batch: 3/3 requests done"]
    assert "min left" in lines[0] and "tok/s generated" in lines[1]
    assert "\r" not in capsys.readouterr().err  # no bar drawn into the log


def test_no_progress_means_neither_bar_nor_lines(caplog, capsys):
    caplog.set_level(logging.INFO, logger="jaxserve.batch")
    progress = BatchProgress(total=1, already_done=0, enabled=False, terminal=False)
    progress.request_done()
    progress.close()
    assert caplog.records == [] and capsys.readouterr().err == ""
