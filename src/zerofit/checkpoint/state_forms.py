"""Optimizer state in a checkpoint as the run stored it (fp32, bf16, or 8-bit codes with block scales), and
loading it into a run that stores it in another form.

[Note: state forms in a checkpoint]
A checkpoint holds each per-element optimizer state key K in the form the saving run kept it between steps
(`precision.optimizer_state`, [Note: narrow optimizer state] in zerofit.engine.state_codec): fp32 tensors
"K/<parameter>" (as always), bf16 tensors, or uint8 codes "K/<parameter>" beside fp32 block scales
"K.absmax/<parameter>" ([Note: per-block state] in zerofit.engine.state). Narrow state is written as is:
saving neither widens it (which would cost 3 to 4 times its bytes on disk) nor changes its values, so a
run that resumes in the same form continues bit for bit as if never stopped. `common.json` names the form
of every key that is not fp32 (`optimizer.state_forms`); a checkpoint with fp32 state is written exactly
as before this existed.

A run whose form differs (fp32 -> 8bit, 8bit -> fp32, bf16 -> 8bit, ...) reads the saved form into host
buffers of its own fragments, widens each fragment to fp32 and narrows it to its own form once, on the
device its state lives on; the main process says so in one warning naming both forms. Fragments start
on a block boundary of their parameter, so narrowing one fragment gives the codes and scales a whole
parameter's encoding has there: the result is what the loading run would store had it held the widened
state itself.
"""

from __future__ import annotations

import warnings

import torch

from zerofit.checkpoint.chunks import Chunk
from zerofit.engine.state import SCALE_SUFFIX, Fragment, is_scale_key
from zerofit.engine.state_codec import Codec, Stored, blocks

FP32 = "fp32"


def loading_codec(engine) -> Codec:
    """The form `engine` stores its optimizer state in."""
    return Codec(getattr(engine.precision, "optimizer_state", FP32))


def form_of(key: str, tensors: dict[str, torch.Tensor]) -> str:
    """The stored form of per-element key `key` of one fragment, told by its tensors."""
    if key + SCALE_SUFFIX in tensors and tensors[key].dtype == torch.uint8:
        return "8bit"
    return "bf16" if tensors[key].dtype == torch.bfloat16 else FP32


def narrow_forms(frags: list[Fragment]) -> dict[str, str]:
    """{state key: form} of the per-element keys these fragments hold in a form other than fp32."""
    out: dict[str, str] = {}
    for f in frags:
        for key in f.tensors:
            if key not in ("master", "param") and not is_scale_key(key) and (form := form_of(key, f.tensors)) != FP32:
                out[key] = form
    return out


def merge_forms(parts: list[dict[str, str]], where: str) -> dict[str, str]:
    """Every rank's `narrow_forms`, as one (the ranks of one run store a key alike)."""
    out: dict[str, str] = {}
    for part in parts:
        for key, form in part.items():
            if out.setdefault(key, form) != form:
                raise ValueError(f"{where}: optimizer state {key!r} is stored as {out[key]} on one rank and as "
                                 f"{form} on another (an engine bug: please report it)")
    return out


class StateLoad:
    """The chunks a rank reads its optimizer state from, and the widening and narrowing of the keys saved in
    another form than this run stores them in (see the note)."""

    def __init__(self, saved_forms: dict[str, str], codec: Codec, state_keys: list[str]):
        self.saved = {key: Codec(saved_forms.get(key, FP32)) for key in state_keys}
        self.codec = codec
        self._pending: list[tuple[Fragment, str, Stored]] = []
        """(fragment, key, its saved form read into host memory) to widen and narrow after the read."""

    def converted(self) -> dict[str, str]:
        """{key: saved form} of the keys read in another form than this run's."""
        return {k: c.kind for k, c in self.saved.items() if c.kind != self.codec.kind}

    def chunks(self, f: Fragment) -> dict[str, Chunk]:
        """The chunks fragment `f`'s state is read from: its own state tensors where the forms agree, host
        buffers in the saved form where they differ."""
        out: dict[str, Chunk] = {}
        for key, saved in self.saved.items():
            if key not in f.tensors:
                continue
            if saved.kind == self.codec.kind:
                tensors = {k: f.tensors[k] for k in (key, key + SCALE_SUFFIX) if k in f.tensors}
            else:
                buf = saved.empty(f.length, "cpu")
                self._pending.append((f, key, buf))
                tensors = {key: buf.codes} | ({key + SCALE_SUFFIX: buf.scale} if buf.scale is not None else {})
            for k, t in tensors.items():
                start, numel = f.span(k)
                out[f"{k}/{f.name}"] = Chunk(t, start, numel)
        return out

    def finish(self, path, is_main: bool) -> None:
        """Widen and narrow what is still pending, and say once what was converted (after every read)."""
        self.convert()
        converted = self.converted()
        if converted and is_main:
            said = ", ".join(f"{k} ({form})" for k, form in sorted(converted.items()))
            warnings.warn(f"{path}: optimizer state stored as {'/'.join(sorted(set(converted.values())))} in the "
                          f"checkpoint, as {self.codec.kind} in this run (precision.optimizer_state): {said} "
                          f"widened to fp32 and stored as {self.codec.kind} once at load", stacklevel=3)

    def convert(self) -> None:
        """Widen and narrow what was read in another form (after its chunks are read)."""
        with torch.no_grad():
            for f, key, buf in self._pending:
                dst = f.tensors[key]
                device = dst.device
                saved = self.saved[key]
                wide = torch.empty(f.length, dtype=torch.float32, device=device)
                saved.decode(Stored(buf.codes.to(device), None if buf.scale is None else buf.scale.to(device)),
                             wide, key)
                scale = f.tensors.get(key + SCALE_SUFFIX)
                if self.codec.scaled:
                    assert scale is not None and scale.numel() == blocks(f.length), (f.name, key)
                self.codec.encode(wide, Stored(dst, scale if self.codec.scaled else None), key)
        self._pending.clear()
