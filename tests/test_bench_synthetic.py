"""scripts/bench_synthetic.py refuses bad options in one line and measures decode ms/token past noise (its figures:
tests/test_gpu_session.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_synthetic.py"


def test_bench_synthetic_refuses_bad_lengths():
    done = subprocess.run([sys.executable, str(SCRIPT), "--decode-lens", "8", "8"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--decode-lens needs 0 < SHORT < LONG, got 8 8" in done.stderr


class _Engine:
    """Records the decode lengths asked for; the test scripts how long each run 'took'."""

    def __init__(self):
        self.lengths = []

    def generate(self, prompts, params, use_tqdm):
        self.lengths.append(params.max_tokens)


def _decode_ms(monkeypatch, seconds_per_run):
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_synthetic

    engine = _Engine()

    def timed(fn):
        fn()
        return seconds_per_run(engine.lengths[-1], len(engine.lengths))

    monkeypatch.setattr(bench_synthetic, "timed", timed)
    return bench_synthetic.decode_seconds_per_token(engine, [1, 2, 3], short=4, long=14, repeats=2), engine.lengths


def test_decode_ms_is_the_extra_tokens_time_measured_again_after_noise(monkeypatch):
    # The first try's long runs were slowed less than its short ones (noise): it is measured again, not reported.
    noisy_first_try = {2: 0.5, 3: 0.5, 4: 0.1, 5: 0.1}
    per_token, lengths = _decode_ms(monkeypatch, lambda n, run: noisy_first_try.get(run, 0.01 * n))
    assert per_token == pytest.approx(0.01)
    assert lengths == [14] + [4, 4, 14, 14] * 2  # a compiling run, then two tries of two repeats each


def test_decode_ms_refuses_when_noise_outweighs_the_extra_tokens_every_time(monkeypatch):
    with pytest.raises(SystemExit, match="decoding 10 more tokens took no longer .* three times"):
        _decode_ms(monkeypatch, lambda n, run: 0.1)
