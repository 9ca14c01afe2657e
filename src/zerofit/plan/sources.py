"""Where the planner gets a model from: a spec string becomes a model whose tensors hold no data.

A spec is one of
- a local `config.json`, or a directory holding one (a saved Hugging Face model);
- a transformers config class with sizes: `GPT2Config:n_layer=48,n_embd=1600,n_head=25`;
- a model name for `from_pretrained`, read only through the local cache when the Hub is unreachable.

The model is built under a `FakeTensorMode` in the compute dtype: parameters have shapes and dtypes
but no storage, so a 70 B model costs nothing, and its forward can run (see `zerofit.plan.activations`).
Fake tensors rather than meta tensors because transformers checks data-dependent conditions (packed
sequences, all-ones masks) only when it cannot tell that it is tracing; with fake tensors it can.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerofit.errors import ZerofitError


class ModelSpecError(ZerofitError, ValueError):
    """The model spec given to the planner cannot be turned into a model (the message says how to fix it)."""


ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", "attn_dropout")


@dataclass(frozen=True)
class FakeModel:
    """A model built without data, the mode its tensors belong to, and how to feed it."""

    model: nn.Module
    mode: Any
    """The FakeTensorMode the parameters were created in (inputs must be made in it too)."""
    vocab_size: int | None
    """Token ids are drawn below this (None: the model takes float features)."""
    num_labels: int | None
    """Sequence classification heads take one label per sample."""
    description: str


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # allow_non_fake_inputs: buffers created by plain code (position ids) may be real CPU tensors
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build parameters directly in `dtype`: converting fake parameters afterwards is not supported."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def parse_overrides(text: str, where: str) -> dict[str, Any]:
    """`a=1,b=x,c=[1,2]` -> {'a': 1, 'b': 'x', 'c': [1, 2]} (Python literals where they parse, else text)."""
    out: dict[str, Any] = {}
    depth, part, parts = 0, "", []
    for ch in text:
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(part)
            part = ""
        else:
            part += ch
    parts.append(part)
    for item in (p.strip() for p in parts):
        if not item:
            continue
        if "=" not in item:
            raise ModelSpecError(f"{where}: {item!r} is not key=value: write sizes like n_layer=48,n_embd=1600")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def load_hf_config(spec: str, *, allow_download: bool = False):
    """A transformers config from a spec (see the module doc); raises ModelSpecError with the fix."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is a dependency of every recipe
        raise ModelSpecError(f"--model {spec!r} needs transformers: pip install transformers") from e
    if os.path.isfile(spec) or os.path.isdir(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        if not os.path.isfile(path):
            raise ModelSpecError(f"--model {spec!r} is a directory without config.json: point it at a saved model")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelSpecError(f"--model {spec!r}: {path} is not readable JSON ({e})") from e
        model_type = data.get("model_type")
        if not model_type:
            raise ModelSpecError(f"--model {spec!r}: {path} has no model_type: it is not a transformers config")
        return transformers.AutoConfig.for_model(**data)
    name, _, sizes = spec.partition(":")
    if name.endswith("Config") and name.isidentifier():
        cls = getattr(transformers, name, None)
        if cls is None or not isinstance(cls, type):
            raise ModelSpecError(f"--model {spec!r}: transformers has no {name}: use a class such as GPT2Config, "
                                 "LlamaConfig or BertConfig")
        return _config_with_sizes(cls, parse_overrides(sizes, f"--model {spec!r}"), spec)
    if sizes:
        raise ModelSpecError(f"--model {spec!r}: sizes after ':' need a config class name, like "
                             "GPT2Config:n_layer=48,n_embd=1600,n_head=25")
    try:
        return transformers.AutoConfig.from_pretrained(spec, local_files_only=not allow_download)
    except (OSError, ValueError) as e:
        raise ModelSpecError(
            f"--model {spec!r} is not a local config and its config is not in the local Hugging Face cache "
            "(zerofit estimate works offline): pass a config.json path, a saved model directory, or a config "
            "class with sizes such as GPT2Config:n_layer=48,n_embd=1600,n_head=25") from e


def _config_with_sizes(cls: type, sizes: dict[str, Any], spec: str):
    """`cls(**sizes)`, refusing what a config class would silently keep: a misspelt key (stored as an
    unused attribute, so the model is built with the default) and a word where a number goes."""
    default = cls()
    known = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}))
    for key, value in sizes.items():
        number = getattr(default, key, None)
        if isinstance(number, (int, float)) and not isinstance(number, bool) and not isinstance(value, (int, float)):
            raise ModelSpecError(f"--model {spec!r}: {key}={value!r} is not a number: write "
                                 f"{'an integer' if isinstance(number, int) else 'a number'} such as {key}={number!r} "
                                 "(the default)")
    try:
        config = cls(**sizes)
    except Exception as e:  # noqa: BLE001 - transformers raises TypeError, ValueError or its own validation errors
        raise ModelSpecError(f"--model {spec!r}: {cls.__name__} refuses these sizes ({e}): fix the value it "
                             "names") from e
    # A key the class does not know ends up as a new entry of to_dict(); keys it renames on the way in
    # (rope_theta into rope_parameters, num_labels into id2label) do not, so they are accepted.
    unknown = sorted(set(config.to_dict()) - set(default.to_dict()))
    if unknown:
        problems = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            problems.append(f"{key} (did you mean {close[0]}?)" if close else key)
        raise ModelSpecError(f"--model {spec!r}: {cls.__name__} has no field {', '.join(problems)}: fix the "
                             f"spelling; its fields are listed by {cls.__name__}().to_dict()")
    return config


def _auto_class(config, task: str):
    import transformers

    names = {"causal-lm": ["AutoModelForCausalLM"], "classification": ["AutoModelForSequenceClassification"],
             "seq2seq": ["AutoModelForSeq2SeqLM"], "base": ["AutoModel"]}[task]
    if task == "causal-lm":
        names += ["AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel"]
    for name in names:
        auto = getattr(transformers, name)
        if type(config) in auto._model_mapping:
            return auto
    raise ModelSpecError(f"{type(config).__name__} has no {task} model in transformers: pick another --task")


def build_fake_model(spec: str, *, dtype: torch.dtype, task: str = "causal-lm",
                     allow_download: bool = False) -> FakeModel:
    """The model named by `spec`, built in `dtype` under a fresh FakeTensorMode (no memory, seconds)."""
    config = load_hf_config(spec, allow_download=allow_download)
    return fake_from_config(config, dtype=dtype, task=task, description=spec)


def fake_from_config(config, *, dtype: torch.dtype, task: str = "causal-lm", description: str = "",
                     model_class: type | None = None) -> FakeModel:
    """A data-free replica of a transformers model class built from `config` (training mode, no cache)."""
    if hasattr(config, "use_cache"):
        config.use_cache = False
    for key in ATTENTION_DROPOUT_KEYS:  # see [Note: trace vs GPU] in zerofit.plan.activations
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    cls = model_class or _auto_class(config, task)
    mode = fake_mode()
    with mode, _default_dtype(dtype):
        model = cls(config) if model_class is not None else cls.from_config(config)
    model.train()
    vocab = getattr(config, "vocab_size", None)
    labels = getattr(config, "num_labels", None) if task == "classification" else None
    return FakeModel(model=model, mode=mode, vocab_size=vocab, num_labels=labels,
                     description=description or type(config).__name__)


def replica_of(model: nn.Module, dtype: torch.dtype) -> FakeModel | None:
    """A data-free replica of a prepared transformers model (for its activations), or None for other modules."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    config = type(config).from_dict(config.to_dict())
    classification = "ForSequenceClassification" in type(model).__name__
    try:
        return fake_from_config(config, dtype=dtype, task="classification" if classification else "causal-lm",
                                description=type(model).__name__, model_class=type(model))
    except Exception:  # noqa: BLE001 - an unusual model only loses the activation term, never the run
        return None
