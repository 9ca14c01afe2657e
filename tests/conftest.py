"""Shared set-up for the suite.

Launches through zerofit.testing.distributed.run_distributed (about 60 of them, most of two gloo ranks)
fork their ranks from one server process that has imported torch and zerofit once, instead of spawning
a fresh interpreter per rank: that import is 1-2 s of CPU per rank, which was most of the fast tier's
time. Each rank is still a new process and gets the test's current environment, working directory and
sys.path; see use_forkserver.
"""

from zerofit.testing.distributed import stop_forkserver, use_forkserver

use_forkserver(("torch", "torch.distributed", "pytest", "zerofit", "zerofit.engine", "zerofit.frontend",
                "engine_cases"))


def pytest_sessionfinish(session, exitstatus):
    stop_forkserver()
