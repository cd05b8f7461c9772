"""tuning.ThreadGovernor (--threads' default): one thread per core other processes leave free, re-checked."""
import os
import subprocess
import sys
import time

import pytest
import torch

from tuning import TICKS_PER_S, ThreadGovernor, cpu_ticks, threads_for

SELF_STAT = "4242 (python my (odd) name) R 1 4242 4242 0 -1 4194304 100 0 0 0 {utime} {stime} 0 0 20 0 3 0 1 2 3"


def proc(busy_ticks, own_ticks, cpus=2, idle_ticks=1000):
    """Texts of /proc/stat and /proc/self/stat with these busy ticks (all CPUs) and this process's ticks."""
    return {"/proc/stat": f"cpu  {busy_ticks} 0 0 {idle_ticks} 0 0 0 0 0 0\ncpu0 0 0 0 0\n",
            "/proc/self/stat": SELF_STAT.format(utime=own_ticks, stime=0)}


def test_cpu_ticks_parses_proc():
    texts = proc(busy_ticks=500, own_ticks=120)
    assert cpu_ticks(texts["/proc/stat"], texts["/proc/self/stat"]) == (500, 120)


@pytest.mark.parametrize("other, cpus, threads", [(0.0, 2, 2), (0.3, 2, 2), (0.5, 2, 1), (1.0, 2, 1), (2.0, 2, 1),
                                                  (1.0, 4, 3), (0.05, 1, 1)])
def test_threads_for(other, cpus, threads):
    assert threads_for(other, cpus) == threads


def test_governor_follows_the_load():
    """Idle: both cores; a neighbour takes a core: one thread; it leaves: both again. Our own threads' time never
    counts as load, and nothing changes before the interval has passed."""
    state = {"t": 0.0, "busy": 0, "own": 0}
    governor = ThreadGovernor(2, interval=1.0, read=lambda path: proc(state["busy"], state["own"])[path],
                              clock=lambda: state["t"])
    threads = torch.get_num_threads()
    try:
        def run(seconds, own_cores, other_cores):
            state["t"] += seconds
            state["own"] += int(own_cores * seconds * TICKS_PER_S)
            state["busy"] += int((own_cores + other_cores) * seconds * TICKS_PER_S)
            return governor.check()

        assert run(1.0, own_cores=2.0, other_cores=0.0) == 2  # we use both cores: no one else
        assert run(1.0, own_cores=1.2, other_cores=0.8) == 1  # a CPU-burning neighbour
        assert run(0.5, own_cores=1.0, other_cores=0.0) == 1  # too soon to look again
        assert run(1.0, own_cores=1.0, other_cores=0.0) == 2  # it left
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_governor_sees_a_real_busy_core():
    """A real CPU-burning process: the governor measures it from /proc and leaves its core alone."""
    cpus = len(os.sched_getaffinity(0))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus - 1)]
    threads = torch.get_num_threads()
    try:
        time.sleep(0.3)
        governor = ThreadGovernor(cpus, interval=0.0)
        time.sleep(1.0)
        assert governor.check() == 1
    finally:
        for b in burners:
            b.kill()
        torch.set_num_threads(threads)
