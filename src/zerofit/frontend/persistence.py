"""The Accelerator's saving and loading: resumable checkpoints, consolidated weights, single objects.

`PersistenceMixin` holds the methods scripts call for files (`save_state`, `load_state`,
`register_for_checkpointing`, `get_state_dict`, `save_model`, `save`); the sharded formats
themselves belong to `zerofit.checkpoint`, and the loop state that goes with them to
`zerofit.checkpoint.loop_state`. Every method here except `save` and `register_for_checkpointing` is
collective: each process must call it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerofit.checkpoint import loop_state as checkpointing
from zerofit.checkpoint import resume
from zerofit.distributed import arrival, process_group
from zerofit.engine import ZeroEngine
from zerofit.errors import CheckpointError, ConfigError
from zerofit.frontend import compiling, ops


class PersistenceMixin:
    """File methods of `zerofit.Accelerator` (it provides `_prepared`, `config` and the rest)."""

    resumed_from: str | None = None
    """The checkpoint `prepare()` loaded by itself (see `zerofit.checkpoint.resume`), else None."""
    _resume_checked = False
    _custom_to_restore: list[Any] | tuple[()] = ()
    """Saved states of registered objects that an automatic resume found before the script registered them."""
    _adopted_folders: frozenset[Path] = frozenset()
    """Folders whose every checkpoint this run may replace or delete: it loaded one from there, or
    checkpoint.overwrite is on ([Note: an earlier run's checkpoints] in zerofit.checkpoint.ownership)."""
    _checked_folders: frozenset[Path] = frozenset()
    """Folders that held no earlier run's checkpoint at this run's first save there: later saves skip the check."""
    _checkpoint_dataloaders = True
    """False where the loop keeps its own data position (transformers' Trainer): the dataloaders' positions
    are then neither saved nor restored, so a loader prepared later (evaluation) cannot mismatch."""

    def _loop_loaders(self) -> list[Any]:
        return self._prepared.dataloaders if self._checkpoint_dataloaders else []

    @property
    def completed_steps(self) -> int:
        """Optimizer steps taken so far, counting those restored from a checkpoint (where to continue)."""
        return max((opt.steps_taken for opt in self._prepared.optimizers), default=0)

    def _engine_of(self, model: nn.Module) -> ZeroEngine:
        engine = self._prepared.engine_of(model)
        if engine is None:
            raise ValueError(f"this {type(model).__name__} was not prepared by this Accelerator: pass the model "
                             "returned by prepare()")
        return engine

    def get_state_dict(self, model: nn.Module, unwrap: bool = True, *,
                       keys: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The full weights of `model`; every process must call it (it may gather).

        Every key of `model.state_dict()`, a tied weight under each of its names (one tensor), so a
        strict `load_state_dict` into a plain model works, as with Accelerate under DDP or DeepSpeed.
        Each parameter comes in the dtype it had when prepared (a bf16 `from_pretrained` model gives
        bf16). Stages 0-2: the full dict on every process. Stage 3: full CPU tensors on the main process,
        tensors on the meta device (shapes and dtypes, no values) on the others, so only one process
        holds a full copy; write from the main process (`is_main_process=accelerator.is_main_process`).
        `keys` (zerofit's own argument, the same on every process): only those entries, gathering only the
        parameters they name - a LoRA adapter's keys from a large frozen base take a moment where the whole
        base would take minutes and a host copy of it (`zerofit.integrations.adapter_keys` finds a PEFT
        model's). See `zerofit.checkpoint.consolidate.full_state_dict`.
        """
        from zerofit.checkpoint import full_state_dict

        model = compiling.uncompiled(model)  # names without torch.compile's `_orig_mod.`
        return full_state_dict(self._engine_of(model), model, every_tied_key=True, keys=keys)

    @contextlib.contextmanager
    def gathered_parameters(self, model: nn.Module) -> Iterator[nn.Module]:
        """zerofit's own: the full weights of a ZeRO-3 model in place for a block, on every process; every process
        must enter it. For code that reads or changes weights outside a forward - PEFT's `merge_and_unload()`
        after training, then `save_pretrained(..., is_main_process=...)` inside the block. What the block writes
        into the weights is dropped at its end; training goes on from the state it had ([Note: gathered
        parameters] in zerofit.engine.full_state). Stages 0-2 hold the full weights anyway: nothing to do."""
        engine = self._engine_of(model)  # through a torch.compile wrapper (Prepared.engine_of)
        with engine.full_state.held() if engine.shards_parameters else contextlib.nullcontext():
            yield model

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike, max_shard_size: str | int = "10GB",
                   safe_serialization: bool = True) -> None:
        """Consolidated weights (`model.safetensors`, sharded with an index above `max_shard_size`)."""
        from zerofit.checkpoint import save_consolidated

        model = compiling.uncompiled(model)
        save_consolidated(self._engine_of(model), model, str(save_directory), max_shard_size=max_shard_size,
                          safe_serialization=safe_serialization)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Write `obj` once, from the main process (safetensors for a dict of tensors when asked).

        safetensors stores no two names over one storage: a tensor met again under a later name (a tied
        weight, as `get_state_dict` gives it) is written under its first name only, as `save_pretrained`
        does; `from_pretrained` ties it again."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            seen: set[tuple] = set()
            tensors = {}
            for k, v in obj.items():
                key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else (id(v),)
                if key not in seen:
                    seen.add(key)
                    tensors[k] = v.contiguous()
            save_file(tensors, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and load these objects' `state_dict()` with `save_state` / `load_state`."""
        bad = [type(o).__name__ for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise TypeError(f"register_for_checkpointing takes objects with state_dict() and load_state_dict(); "
                            f"{', '.join(bad)} lack(s) them: add both methods or save the object yourself")
        for obj in objects:
            if self._custom_to_restore:  # restored by an automatic resume before the script registered it
                obj.load_state_dict(self._custom_to_restore.pop(0))
            self._prepared.custom.append(obj)

    def _checkpoint_dir(self, directory: str | os.PathLike | None) -> str:
        if directory is not None:
            return str(directory)
        pc = self.project_configuration
        if pc.automatic_checkpoint_naming and pc.project_dir:
            return os.path.join(pc.project_dir, "checkpoints", f"checkpoint_{pc.iteration}")
        if self.config.checkpoint.output_dir:
            return self.config.checkpoint.output_dir
        raise ValueError("save_state() / load_state() need a directory: pass one, set checkpoint.output_dir in "
                         "the config, or use ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)")

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   exclude_frozen_parameters: bool = False, **kwargs: Any) -> str:
        """A resumable sharded checkpoint: engine state plus the loop's state of every rank. Collective.
        `exclude_frozen_parameters` (the argument Accelerate hands DeepSpeed): no values of the frozen
        parameters - a PEFT run's base - which the run that loads it must build itself ([Note: a checkpoint
        without the frozen weights] in zerofit.checkpoint.sharded)."""
        return self._save(output_dir, exclude_frozen=exclude_frozen_parameters)

    def _save(self, output_dir: str | os.PathLike | None, *, client_state: dict[str, Any] | None = None,
              update_latest: bool = True, exclude_frozen: bool = False, guard: bool = True) -> str:
        """`save_state`, with a DeepSpeed-style `client_state` stored beside the loop state. `guard`: refuse
        to replace or prune an earlier run's checkpoints (False where the caller's loop owns the folder, as
        transformers' Trainer owns its `checkpoint-<step>` folders)."""
        from zerofit.checkpoint import ownership, retention, save_state

        engine = self._prepared.only_trained_engine("save_state") or self._prepared.any_engine()
        if engine is None:
            raise ValueError("save_state() needs a prepared model: call prepare(model, optimizer, ...) first")
        arrival.check_in(arrival.SAVE_STATE)  # collective from here: every rank must be here too
        extra = checkpointing.collect(schedulers=self._prepared.schedulers, optimizers=self._prepared.optimizers,
                                      dataloaders=self._loop_loaders(), custom=self._prepared.custom,
                                      iteration=self.project_configuration.iteration)
        if client_state is not None:
            extra["client_state"] = dict(client_state)
        target = Path(self._checkpoint_dir(output_dir)).absolute()
        if guard:
            self._refuse_earlier_runs(target)
        run = ownership.run_id()
        path = save_state(str(target), engine, extra_state=extra, config=self.config,
                          update_latest=update_latest, exclude_frozen=exclude_frozen, run=run)
        owner = None if Path(path).parent in self._adopted_folders or not guard else run
        retention.prune(path, config_limit=self.config.checkpoint.total_limit,
                        project_limit=self.project_configuration.total_limit,
                        is_main=self.is_main_process, fixed_dir=self.config.checkpoint.output_dir, owner=owner)
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration += 1
        return path

    def _refuse_earlier_runs(self, final: Path) -> None:
        """Before a save at `final` writes anything: raise on every rank when it would replace or prune an
        earlier run's checkpoints ([Note: an earlier run's checkpoints] in zerofit.checkpoint.ownership). Collective
        unless the folder was checked or adopted already (the same on every rank: every decision is broadcast)."""
        from zerofit.checkpoint import ownership, retention

        folder = final.parent
        if folder in self._adopted_folders or folder in self._checked_folders:
            return
        if self.config.checkpoint.overwrite:
            self._adopted_folders |= {folder}
            return
        message, clean = None, False
        if self.is_main_process:  # one decision for every rank, even if their views of the disk differ
            pc = self.project_configuration
            fixed = self.config.checkpoint.output_dir
            try:
                message, clean = ownership.refusal(
                    final, run=ownership.run_id(),
                    named_root=(Path(pc.project_dir, "checkpoints").absolute()
                                if pc.automatic_checkpoint_naming and pc.project_dir else None),
                    fixed_dir=Path(fixed).absolute() if fixed else None,
                    limit=retention.limit_of(self.config.checkpoint.total_limit, pc.total_limit))
            except Exception as e:  # noqa: BLE001 - the peers must not wait for a decision
                message = f"rank 0: checking {folder} for an earlier run's checkpoints failed: {type(e).__name__}: {e}"
        message, clean = ops.broadcast_object((message, clean))
        if message:
            raise CheckpointError(message)
        if clean:
            self._checked_folders |= {folder}

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        """Restore what `save_state` wrote (at any world size or stage, see zerofit.checkpoint). Collective."""
        self._load(input_dir, custom_may_follow=False)

    def _load(self, input_dir: str | os.PathLike | None, *, custom_may_follow: bool) -> dict[str, Any]:
        """`load_state`; returns the checkpoint's extra state (its `client_state`, for one)."""
        from zerofit.checkpoint import load_state
        from zerofit.checkpoint.commit import resolve
        from zerofit.checkpoint.ranks import Ranks

        engine = self._prepared.only_trained_engine("load_state") or self._prepared.any_engine()
        if engine is None:
            raise ValueError("load_state() needs the prepared model: call prepare(model, optimizer, ...) first")
        arrival.check_in(arrival.LOAD_STATE)  # collective from here: every rank must be here too
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            input_dir = _latest_checkpoint(os.path.join(self.project_dir or ".", "checkpoints"))
        where = self._checkpoint_dir(input_dir)
        extra = load_state(where, engine)
        error = None
        try:  # a rank file that parses but has the wrong shape fails here, on its rank alone
            self._custom_to_restore = checkpointing.restore(
                extra, schedulers=self._prepared.schedulers, optimizers=self._prepared.optimizers,
                dataloaders=self._loop_loaders(), custom=self._prepared.custom,
                custom_may_follow=custom_may_follow)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as bad:
            error = (f"rank {engine.comm.rank}: {where}: the loop state saved with the checkpoint (schedulers, "
                     f"dataloaders, optimizers, registered objects) cannot be restored: {type(bad).__name__}: {bad}")
            if custom_may_follow and isinstance(bad, ValueError):  # objects this prepare() has not seen
                error += (" (checkpoint.resume loads at the end of the prepare() call that prepares the model: "
                          "pass the model, optimizer, scheduler and dataloaders to that one call)")
        Ranks(engine.comm.group).agree(error)  # every rank raises the same error, none waits in a collective
        # Loading from a folder continues it: its numbering and retention (see zerofit.checkpoint.ownership).
        self._adopted_folders |= {resolve(where).absolute().parent}
        if self.project_configuration.automatic_checkpoint_naming:
            self.project_configuration.iteration = extra.get("iteration", 0) + 1
        return extra

    def _resume_if_configured(self) -> None:
        """At the end of the first prepare() of the trained model: load the checkpoint `checkpoint.resume`
        asks for (see zerofit.checkpoint.resume), so the script continues where the checkpoint left off. Collective."""
        if self._resume_checked or not self._prepared.trained_engines():
            return
        self._resume_checked = True
        pc = self.project_configuration
        root = resume.checkpoint_root(pc.project_dir, pc.automatic_checkpoint_naming, self.config.checkpoint.output_dir)
        chosen, problems, bad_config = None, None, False
        if self.is_main_process:  # one decision for every rank, even if their views of the disk differ
            try:
                chosen = resume.choose(self.config.checkpoint.resume, process_group.restart_count(), root)
            except ConfigError as e:
                problems, bad_config = e.problems, True
            except CheckpointError as e:
                problems = [str(e)]
            except Exception as e:  # noqa: BLE001 - anything else too: the peers must not wait for a decision
                resume.logger.exception("zerofit: choosing the checkpoint to resume from failed")
                problems = [f"rank 0: choosing the checkpoint to resume from under {root} failed: "
                            f"{type(e).__name__}: {e}"]
        chosen, problems, bad_config = ops.broadcast_object(
            (None if chosen is None else str(chosen), problems, bad_config))
        if problems:  # raised on every rank alike, so none is left waiting in a collective
            raise ConfigError(problems) if bad_config else CheckpointError(problems[0])
        if chosen is None:
            if self.is_main_process and root is not None and not self.config.checkpoint.overwrite:
                self._warn_of_earlier_runs(root)
            return
        self._load(chosen, custom_may_follow=True)
        for loader in self._prepared.dataloaders:
            loader.skip_batches(loader.resume_position)  # its next epoch continues after the saved batch
        self.resumed_from = chosen
        if self.is_main_process:
            resume.logger.warning("zerofit: resumed from checkpoint %s (attempt %d): %d optimizer step(s) done, "
                                  "continuing with step %d", chosen, process_group.restart_count(),
                                  self.completed_steps, self.completed_steps + 1)

    @staticmethod
    def _warn_of_earlier_runs(root: Path) -> None:
        """Say at once, not only at the first save, that this fresh run's checkpoint folder holds an earlier
        run's checkpoints (see zerofit.checkpoint.ownership); the script may still load one after prepare()."""
        from zerofit.checkpoint import ownership

        try:
            text = ownership.held_at_start(root.absolute(), ownership.run_id())
        except OSError:  # only a warning: the save checks again and refuses
            return
        if text:
            resume.logger.warning("zerofit: %s", text)


def _latest_checkpoint(folder: str) -> str:
    """The checkpoint `folder/latest` names (only complete checkpoints are ever named there)."""
    found = resume.latest_complete(Path(folder))
    if found is None:
        raise ValueError(f"no complete checkpoint in {folder} (no {folder}/latest): pass load_state(directory) "
                         "explicitly, or save_state() first")
    return str(found)
