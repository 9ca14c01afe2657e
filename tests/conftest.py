"""Shared set-up for the suite.

Launches through zerofit.testing.distributed.run_distributed (about 60 of them, most of two gloo ranks)
fork their ranks from one server process that has imported torch, zerofit and the shared test helpers
once, instead of spawning a fresh interpreter per rank: those imports (with torch._dynamo, which the
first optimizer step pulls in, and transformers' GPT-2 for the tests that build one) are 2-4 s of CPU
per rank, which was most of the fast tier's time. Each rank is still a new process and gets the test's
current environment, working directory and sys.path; see use_forkserver.
"""

import os
import pkgutil
import tempfile

import zerofit

# The suite never reads this machine's own Hugging Face folder: a default config that `accelerate config`
# wrote there would change what a launch without --config_file runs (zerofit reads it, as Accelerate's
# launcher does). Set before the fork server starts, so every rank and subprocess inherits it.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="zerofit-tests-hf-")
# comet_ml, once imported (transformers' integrations import it where installed), patches mlflow and other
# libraries to copy what they log into an offline Comet experiment written under the working directory:
# the MLflow tracker test then left `.cometml-runs/` in the checkout. Off for the suite; the comet_ml
# tracker test asks for its experiment explicitly, which this does not affect. Its error reports off too.
os.environ["COMET_DISABLE_AUTO_LOGGING"] = "1"
os.environ["COMET_ERROR_TRACKING_ENABLE"] = "false"
from zerofit.testing.distributed import stop_forkserver, use_forkserver

_PRELOADED = ("config", "distributed", "engine", "frontend", "checkpoint", "plan")
_LIBRARY = ["zerofit"] + [m.name for m in pkgutil.walk_packages(zerofit.__path__, "zerofit.")
                          if m.name.split(".")[1] in _PRELOADED]
use_forkserver(["numpy", "torch", "torch.distributed", "torch._dynamo", "pytest", *_LIBRARY,
                "engine_cases", "test_checkpoint_support",
                # absent without transformers (the fork server skips what does not import)
                "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"])


def pytest_sessionfinish(session, exitstatus):
    stop_forkserver()  # and wait for it: its ranks' CPU time then counts in pytest's (`time pytest`)
