"""Which malloc serves the process (runner/host_allocator.py), and the start-up line a CPU engine logs when it is
glibc's: XLA:CPU's per-step temporaries over 32 MiB come from the kernel afresh on every step under glibc."""

import logging
import shutil
import subprocess
import sys
from pathlib import Path

from jaxserve import Engine
from jaxserve.runner import host_allocator
from jaxserve.runner.host_allocator import allocator_advice, mapped_allocator

GLIBC_MAPS = """\
7f0c1a000000-7f0c1a022000 r--p 00000000 08:01 1316 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0c1b000000-7f0c1b100000 r-xp 00000000 08:01 2001 /work/.venv/lib/python3.11/site-packages/jaxlib/_jax.so
7f0c1c000000-7f0c1c021000 rw-p 00000000 00:00 0
"""
TCMALLOC_MAPS = GLIBC_MAPS + \
    "7f0c1d000000-7f0c1d040000 r-xp 00000000 08:01 3003 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n"


def test_the_mapped_allocator_is_read_from_the_process_maps():
    assert mapped_allocator(GLIBC_MAPS) is None
    assert mapped_allocator(TCMALLOC_MAPS) == "tcmalloc"
    assert mapped_allocator(GLIBC_MAPS + "7f0c1e000000-7f0c1e001000 r-xp 0 08:01 9 /opt/lib/libjemalloc.so.2\n") \
        == "jemalloc"
    # A path that merely mentions an allocator is not that allocator's library.
    assert mapped_allocator(GLIBC_MAPS + "7f0c1e000000-7f0c1e001000 r--p 0 08:01 9 /tmp/tcmalloc-notes/data.bin\n") \
        is None


def test_a_preloaded_library_shows_in_this_process_maps(tmp_path):
    """LD_PRELOAD as a user sets it, read back through /proc/self/maps: any shared library named like tcmalloc's
    (a copy of libm here; this machine need not have tcmalloc) is what the dynamic loader mapped."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    libm = next(line.split()[-1] for line in maps if line.endswith("/libm.so.6"))  # CPython links it
    stand_in = shutil.copy(libm, tmp_path / "libtcmalloc_minimal.so.4")
    read = "from jaxserve.runner.host_allocator import mapped_allocator as m; print(m())"
    found = {}
    for preload in ("", stand_in):
        done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(preload)},
                              cwd=Path(__file__).parents[2])
        assert done.returncode == 0, done.stderr
        found[bool(preload)] = done.stdout.strip()
    assert found == {False: "None", True: "tcmalloc"}


def test_the_advice_names_the_library_to_preload_on_cpu_only():
    advice = allocator_advice("cpu", GLIBC_MAPS, tcmalloc="libtcmalloc_minimal.so.4")
    assert "start the process with LD_PRELOAD=libtcmalloc_minimal.so.4" in advice
    assert allocator_advice("cpu", TCMALLOC_MAPS, tcmalloc="libtcmalloc_minimal.so.4") is None
    assert allocator_advice("gpu", GLIBC_MAPS) is None and allocator_advice("tpu", GLIBC_MAPS) is None


def test_without_tcmalloc_installed_the_advice_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(host_allocator, "installed_tcmalloc", lambda: None)
    advice = allocator_advice("cpu", GLIBC_MAPS)
    assert "apt install libtcmalloc-minimal4" in advice and "LD_PRELOAD=libtcmalloc_minimal.so.4" in advice


def test_a_cpu_engine_logs_the_advice_under_glibc(tiny_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(host_allocator, "mapped_allocator", lambda maps=None: None)  # as under glibc's malloc
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.engine"):
        Engine(str(tiny_checkpoint("llama")), num_kv_blocks=16, max_num_seqs=2, max_num_batched_tokens=16,
               warmup=False)
    lines = [r.getMessage() for r in caplog.records if "glibc's malloc" in r.getMessage()]
    assert lines == [allocator_advice("cpu", GLIBC_MAPS)]
