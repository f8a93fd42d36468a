"""`jaxserve check` on two processes x 4 fake CPU devices: lists both and their devices, all-reduce over tp and
ppermute over pp pass with a bandwidth each; with process 1 never started, process 0 names it within a bound."""

import time

from tests.distributed.procs import cluster_args, free_port_pair


def test_check_passes_on_the_two_process_mesh(processes):
    port = free_port_pair()
    for pid in (0, 1):
        processes.start(f"p{pid}", ["check", "--mesh", "4x2", "--size-mib", "1", *cluster_args(port, 2, pid)])
    for name in ("p0", "p1"):
        rc, _ = processes.wait(name, 90)
        assert rc == 0, processes.log(name)[-2000:]
    report = processes.log("p0")
    assert "2 process(es), 8 cpu devices, mesh 4x2" in report
    assert "process 0 on" in report and "process 1 on" in report and "2048->pp1/tp0" in report
    assert "all-reduce over tp (4 devices, within each process)" in report
    assert "ppermute over pp (2 stages, across processes)" in report
    assert report.count("GB/s bus bandwidth") == 2 and "OK: every process joined" in report
    assert "every collective passed" in processes.log("p1")


def test_check_names_the_process_that_never_started(processes):
    start = time.monotonic()
    processes.start("p0", ["check", "--mesh", "4x2", "--distributed-timeout", "3",
                           *cluster_args(free_port_pair(), 2, 0)])
    rc, _ = processes.wait("p0", 30)
    assert rc == 2 and time.monotonic() - start < 30
    assert "process 1 of 2 did not join within 3 s" in processes.log("p0")
