"""Pretrained models too large for one copy per rank: built empty, filled at `prepare()` one unit at a time.

    from zerofit.utils import empty_from_pretrained
    model = empty_from_pretrained(AutoModelForCausalLM, "path/to/checkpoint", dtype=torch.bfloat16)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=2e-5))

or, with a model built on the meta device by the script itself, `load_at_prepare(model, path)`. Each rank
then reads only the tensors of the unit the engine is laying out (see zerofit.engine.weight_source), so
no rank holds more than one unit of the model beyond its shards (docs/accelerate.md, "Loading a
pretrained model too big for one copy per rank").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerofit.engine.materialize import has_meta_tensors
from zerofit.engine.weight_source import CheckpointFiles, WeightSource, mark

MODEL_KWARGS = ("attn_implementation", "trust_remote_code")
"""Keyword arguments of `empty_from_pretrained` that go to the model's constructor; the others go to the config."""


def load_at_prepare(model: nn.Module, checkpoint_dir: str | Path) -> nn.Module:
    """Have `prepare()` fill `model`'s meta tensors from the safetensors checkpoint in `checkpoint_dir`.

    `model` is built on the meta device (`with torch.device("meta"):` or `init_empty_weights()`), with the
    checkpoint's config. At `prepare()` each unit's parameters and persistent buffers are read from the
    checkpoint (`model.safetensors`, or the shards `model.safetensors.index.json` names) as the engine
    lays the unit out; what the checkpoint lacks is initialised as a meta model's is, and named in one
    warning. Names and shapes are checked now, so a wrong directory fails here. Returns `model`.
    """
    if not has_meta_tensors(model):
        raise ValueError(f"load_at_prepare: {type(model).__name__} has no tensors on the meta device, so there is "
                         f"nothing to fill from {str(checkpoint_dir)!r}: a model built with its weights in memory "
                         "loads them with from_pretrained(checkpoint_dir); build it under torch.device('meta') "
                         "(or init_empty_weights()) for prepare() to fill it instead")
    return _fill_at_prepare(model, CheckpointFiles(checkpoint_dir))


def _fill_at_prepare(model: nn.Module, files: CheckpointFiles) -> nn.Module:
    WeightSource(model, files)  # the names and shapes, checked before prepare()
    mark(model, files)
    return model


def empty_from_pretrained(model_class: Any, pretrained_model_name_or_path: str | Path, **kwargs: Any) -> nn.Module:
    """`model_class.from_pretrained(path, **kwargs)` without reading the weights: the model is built on the
    meta device from the checkpoint's config and `prepare()` fills it (see `load_at_prepare`).

    `model_class` is a transformers Auto class (`AutoModelForCausalLM`) or a model class
    (`LlamaForCausalLM`); `path` a local directory (nothing is downloaded). `dtype` works as in
    `from_pretrained`: "auto" (the default) is the checkpoint's own dtype. `attn_implementation` and
    `trust_remote_code` go to the model; other keyword arguments set config attributes
    (`num_labels=3`). The model is returned in training mode.
    """
    files = CheckpointFiles(pretrained_model_name_or_path, caller="empty_from_pretrained")
    dtype = kwargs.pop("dtype", "auto")
    model_kwargs = {k: kwargs.pop(k) for k in MODEL_KWARGS if k in kwargs}
    config = kwargs.pop("config", None)
    if config is None:
        from transformers import AutoConfig  # an optional dependency of zerofit: imported on use

        config, unused = AutoConfig.from_pretrained(str(files.directory), local_files_only=True,
                                                    return_unused_kwargs=True,
                                                    trust_remote_code=model_kwargs.get("trust_remote_code", False),
                                                    **kwargs)
        if unused:
            raise TypeError(f"empty_from_pretrained: {sorted(unused)} are neither attributes of "
                            f"{type(config).__name__} nor arguments of the model: remove them, or set them on the "
                            "config and pass config=")
    elif kwargs:
        raise TypeError(f"empty_from_pretrained: {sorted(kwargs)} given with config=: set them on the config")
    dtype = _resolve_dtype(dtype, config)
    with torch.device("meta"):
        if hasattr(model_class, "from_config"):  # an Auto class
            model = model_class.from_config(config, dtype=dtype, **model_kwargs)
        else:
            model = model_class(config, **{k: v for k, v in model_kwargs.items() if k != "trust_remote_code"})
    if model.dtype != dtype:
        model.to(dtype)  # on the meta device: no memory, no time
    model.train()
    return _fill_at_prepare(model, files)


def _resolve_dtype(dtype: Any, config: Any) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"empty_from_pretrained: dtype {dtype!r} is not a torch dtype: pass e.g. torch.bfloat16, "
                             "'bfloat16' or 'auto'")
        dtype = resolved
    return dtype
