"""The three tables of the Accelerate + DeepSpeed ZeRO blog, as workloads built from configs.

Each workload names a model architecture (random weights, built from a transformers config: no hub),
the synthetic batches of the right shapes, the sizes an "epoch" is projected over, the batch every
method is also timed at ("equal batch"), and the methods compared on one machine. `tiny=True` gives
the same architecture at toy sizes, so the harness itself runs on CPU in the test suite.

[Note: same start, same data]
Every method builds its model under the same seed on the same device and draws batch `i` from a
generator seeded with `i`, and dropout is off: the first loss at the equal batch is the same
computation in every row, so the rows' first losses must agree (to bf16 rounding under bf16).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    key: str
    """Short name on the command line: cls, seq2seq, clm."""
    table: int
    """The blog's table number."""
    title: str
    task: str
    seq: int
    """Tokens per sample (source and target for seq2seq)."""
    train_examples: int
    """Samples in one training epoch: the train time per epoch is projected over these."""
    eval_examples: int
    epoch_note: str
    equal_batch: int
    """Micro-batch every method is also timed at, from the same initial weights."""
    search_eval_batch: bool
    """Search the largest eval batch too (the blog's Table 2 reports it); else eval at the train batch."""
    methods: tuple[str, ...]
    """Rows on one GPU (several-GPU rows are the same names run with more processes)."""
    seed_result: str
    """What the Accelerate + DeepSpeed ZeRO blog reported, for orientation (other hardware: 2 x 24 GB Titan RTX)."""
    build_config: Callable[[bool], Any]

    def build_model(self, tiny: bool, device: torch.device | str) -> nn.Module:
        """The model with seeded random weights on `device` (see [Note: same start, same data])."""
        config = self.build_config(tiny)
        torch.manual_seed(SEED)
        with torch.device(device):
            return _model_class(self.task, config)(config)

    def batch(self, size: int, index: int, tiny: bool, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Synthetic batch number `index` of `size` samples (the same in every process and method)."""
        g = torch.Generator().manual_seed(1_000_003 * (SEED + 1) + index)
        config = self.build_config(tiny)
        vocab = config.vocab_size
        seq = self.sequence_length(tiny)
        ids = torch.randint(3, vocab, (size, seq), generator=g)
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if self.task == "cls":
            out["labels"] = torch.randint(0, config.num_labels, (size,), generator=g)
        elif self.task == "seq2seq":
            out["labels"] = torch.randint(3, vocab, (size, seq), generator=g)
        else:
            out = {"input_ids": ids, "labels": ids}
        return {k: v.to(device) for k, v in out.items()}

    def sequence_length(self, tiny: bool) -> int:
        return 16 if tiny else self.seq

    def tokens_per_sample(self, tiny: bool) -> int:
        """Tokens a sample feeds the model (source plus target for seq2seq): the tokens/s unit."""
        return self.sequence_length(tiny) * (2 if self.task == "seq2seq" else 1)


def _model_class(task: str, config: Any) -> type[nn.Module]:
    import transformers

    if task == "clm" and isinstance(config, transformers.LlamaConfig):
        return transformers.LlamaForCausalLM
    return {"cls": transformers.DebertaV2ForSequenceClassification,
            "seq2seq": transformers.BlenderbotForConditionalGeneration,
            "clm": transformers.GPT2LMHeadModel}[task]


def _deberta_v2_xlarge(tiny: bool) -> Any:
    from transformers import DebertaV2Config

    # microsoft/deberta-v2-xlarge's architecture (about 0.9 B parameters), dropout off
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=512,
                 pooler_hidden_size=32) if tiny else \
        dict(hidden_size=1536, num_hidden_layers=24, num_attention_heads=24, intermediate_size=6144,
             vocab_size=128100, pooler_hidden_size=1536)
    return DebertaV2Config(**sizes, max_position_embeddings=512, relative_attention=True, max_relative_positions=-1,
                           position_buckets=256, pos_att_type=["p2c", "c2p"], position_biased_input=False,
                           norm_rel_ebd="layer_norm", share_att_key=True, conv_kernel_size=3, conv_act="gelu",
                           layer_norm_eps=1e-7, type_vocab_size=0, hidden_act="gelu", num_labels=2,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pooler_dropout=0.0)


def _blenderbot_400m_distill(tiny: bool) -> Any:
    from transformers import BlenderbotConfig

    # facebook/blenderbot-400M-distill's architecture (about 0.37 B parameters), dropout off
    sizes = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=512) if tiny else \
        dict(d_model=1280, encoder_layers=2, decoder_layers=12, encoder_attention_heads=32,
             decoder_attention_heads=32, encoder_ffn_dim=5120, decoder_ffn_dim=5120, vocab_size=8008)
    return BlenderbotConfig(**sizes, max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
                            activation_dropout=0.0, use_cache=False)


def _gpt2_xl(tiny: bool) -> Any:
    from transformers import GPT2Config

    sizes = dict(n_embd=32, n_layer=2, n_head=2, vocab_size=512) if tiny else \
        dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257)
    end = sizes["vocab_size"] - 1
    return GPT2Config(**sizes, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                      bos_token_id=end, eos_token_id=end)


def _llama_7b(tiny: bool) -> Any:
    from transformers import LlamaConfig

    # meta-llama/Llama-2-7b's architecture (about 6.7 B parameters)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, vocab_size=512) if tiny else \
        dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000)
    return LlamaConfig(**sizes, max_position_embeddings=4096, attention_dropout=0.0, use_cache=False,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


BLOG = "the Accelerate + DeepSpeed ZeRO blog measured, on 2 x 24 GB Titan RTX"

WORKLOADS: dict[str, Workload] = {w.key: w for w in (
    Workload(key="cls", table=1, title="DeBERTa-v2-xlarge architecture, sequence classification, 128 tokens",
             task="cls", seq=128, train_examples=3668, eval_examples=408,
             epoch_note="epoch = MRPC's 3,668 train / 408 eval samples", equal_batch=8, search_eval_batch=False,
             methods=("ddp", "zerofit-s2", "zerofit-s2-offload", "deepspeed-s2", "deepspeed-s2-offload", "fsdp2"),
             seed_result=f"{BLOG}: DDP largest batch 8, 103.57 s/epoch; ZeRO-2 batch 40, 28.98 s/epoch",
             build_config=_deberta_v2_xlarge),
    Workload(key="seq2seq", table=2, title="BlenderBot-400M-distill architecture, seq2seq, 128 + 128 tokens",
             task="seq2seq", seq=128, train_examples=10000, eval_examples=1000,
             epoch_note="epoch = a nominal 10,000 train / 1,000 eval samples", equal_batch=8, search_eval_batch=True,
             methods=("ddp", "zerofit-s2", "zerofit-s2-offload", "deepspeed-s2", "deepspeed-s2-offload", "fsdp2"),
             seed_result=f"{BLOG}: ZeRO-2 trains at batch 200 (DDP at a fraction of it)",
             build_config=_blenderbot_400m_distill),
    Workload(key="clm", table=3, title="GPT-2 XL architecture, causal LM, 128 tokens", task="clm", seq=128,
             train_examples=10000, eval_examples=1000,
             epoch_note="epoch = a nominal 10,000 train / 1,000 eval samples", equal_batch=16, search_eval_batch=False,
             methods=("ddp", "zerofit-s2-offload", "zerofit-s3-offload", "deepspeed-s3-offload", "fsdp2-offload"),
             seed_result=f"{BLOG}: DDP out of memory at batch 1; ZeRO-3 + CPU offload batch 16, 6,608 s/epoch",
             build_config=_gpt2_xl),
    Workload(key="llama7b", table=4, title="Llama-2-7B architecture, causal LM, 512 tokens", task="clm", seq=512,
             train_examples=10000, eval_examples=1000,
             epoch_note="epoch = a nominal 10,000 train / 1,000 eval samples", equal_batch=4, search_eval_batch=False,
             methods=("ddp", "zerofit-s1", "zerofit-s2", "zerofit-s3", "deepspeed-s2", "deepspeed-s3", "fsdp2"),
             seed_result="not one of the blog's tables: the several-GPU scaling workload (`--equal_only`)",
             build_config=_llama_7b),
)}

TINY_METHODS = ("ddp", "zerofit-s1", "zerofit-s2", "zerofit-s3", "deepspeed-s2", "fsdp2")
"""The rows `--tiny` runs by default on CPU (DeepSpeed is reported as skipped where it is not installed)."""


def resolve_tables(names: list[str]) -> list[Workload]:
    """Workloads by key or table number ("cls" or "1"), in the order given."""
    by_number = {str(w.table): w for w in WORKLOADS.values()}
    out = []
    for name in names:
        w = WORKLOADS.get(name) or by_number.get(name)
        if w is None:
            choices = ", ".join(f"{w.key} ({w.table})" for w in WORKLOADS.values())
            raise ValueError(f"--tables: unknown table {name!r}; choose from {choices}")
        out.append(w)
    return out
