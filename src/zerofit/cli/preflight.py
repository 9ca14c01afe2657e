"""What every worker would find wrong on this machine, found by the launch before any worker starts.

`load_config` checks the rules a config file holds by itself; some settings are checked only where the
script uses them: the trackers of `logging.log_with` when the Accelerator is built, the NVMe directory
when the engine is. Both fail in every worker, after the model and data loaded. The launch (and
`--dry_run`, which promises to check everything) runs the same checks first, naming each key as the
user's file spells it. Every machine of a run launches its own workers, so each checks its own disk.
"""

from __future__ import annotations

from zerofit.config.naming import key_name
from zerofit.config.schema import RunConfig
from zerofit.errors import ConfigError


def check(config: RunConfig) -> None:
    """Raise one ConfigError listing what the workers would refuse (see the module doc)."""
    from zerofit.engine.offload import nvme  # imported here: torch, which `zerofit launch --help` does not need
    from zerofit.frontend.tracking import selection

    def spell(key: str) -> str:
        return key_name(config.source_format, key)

    problems: list[str] = []
    try:
        selection.requested(list(config.logging.log_with), spell("logging.log_with"))
    except ConfigError as e:
        problems += e.problems
    offload = config.zero.offload_optimizer
    if offload.device == "nvme":  # validation already requires nvme_path with it
        error = nvme.preflight_error(offload.nvme_path, 0, 0, key=spell("zero.offload_optimizer.nvme_path"),
                                     who="this machine")
        if error:
            problems.append(error)
    if problems:
        raise ConfigError(problems, source=config.source)
