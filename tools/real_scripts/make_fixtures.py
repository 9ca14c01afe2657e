"""Build the offline fixtures that public training scripts load in tools/real_scripts/run_all.sh.

    python tools/real_scripts/make_fixtures.py OUT_DIR

Writes, under OUT_DIR (nothing is downloaded; everything comes from the text this repository ships):

    tokenizer.json          a byte-level BPE trained on src/zerofit/demo/*.txt and examples/data/*
    tiny-llama/             LlamaForCausalLM from a config, with that tokenizer (bos/eos/pad, chat template)
    tiny-bert/              BertForSequenceClassification (2 labels), same BPE wrapped in [CLS] ... [SEP]
    tiny-bart/              BartForConditionalGeneration, same BPE wrapped in bos ... eos
    data/                   mrpc_{train,validation}.csv and text_{train,validation}.txt, copied
    sft/{train,test}.jsonl  conversations as `messages` lists (TRL's conversational SFT format)
    dpo/{train,test}.jsonl  prompt / chosen / rejected strings (TRL's preference format; reward.py reads it too)
    kto/{train,test}.jsonl  prompt / completion / label rows (TRL's unpaired preference format), half of them wanted
    prompts/train.jsonl     prompt strings alone (what RLOO / GRPO sample completions for)
    rewards.py              vowel_share, a rule-based reward for `--reward_funcs rewards.vowel_share`
                            (TRL's rloo.py / grpo.py import a dotted path from the working directory)
    instruct/train.jsonl    instruction / output pairs (PEFT's instruction-tuning examples)
    translation/{train,validation}.jsonl  {"translation": {"en": context, "de": response}} pairs
    accuracy/accuracy.py    a local `evaluate` metric: `evaluate.load("accuracy")` looks for
                            ./accuracy/accuracy.py before the hub, so runs started in OUT_DIR stay offline
    sacrebleu/sacrebleu.py  the same for `evaluate.load("sacrebleu")`, over the installed sacrebleu package

The models are tiny (hidden size 64, two layers) so each script runs a few steps in seconds on CPU;
the weights are random but seeded, so two builds give the same files.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
DEMO = ROOT / "src" / "zerofit" / "demo"

VOCAB_SIZE = 1024
MAX_LENGTH = 128
LM_SPECIALS = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>", "unk_token": "<|unk|>"}
CLS_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
# One line per turn, each closed by the eos token so a trained model learns where a reply ends.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# A metric module in the shape `evaluate.load` reads from a local folder; written by make_fixtures.py.
ACCURACY_MODULE = '''"""Accuracy, as a local evaluate module (written by tools/real_scripts/make_fixtures.py)."""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their reference.",
            citation="",
            inputs_description="predictions and references: lists of integers of equal length",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        hits = [float(p == r) for p, r in zip(predictions, references)]
        weights = sample_weight if sample_weight is not None else [1.0] * len(hits)
        total = sum(h * w for h, w in zip(hits, weights))
        return {"accuracy": total / sum(weights) if normalize else total}
'''


SACREBLEU_MODULE = '''"""Corpus BLEU, as a local evaluate module (written by tools/real_scripts/make_fixtures.py)."""

import datasets
import evaluate
import sacrebleu


class Sacrebleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="sacrebleu's corpus BLEU.",
            citation="",
            inputs_description="predictions: list of strings; references: list of lists of strings",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Sequence(datasets.Value("string"))}),
        )

    def _compute(self, predictions, references):
        columns = [list(c) for c in zip(*references)]  # sacrebleu wants one list per reference position
        bleu = sacrebleu.corpus_bleu(predictions, columns)
        return {"score": bleu.score, "counts": bleu.counts, "totals": bleu.totals,
                "sys_len": bleu.sys_len, "ref_len": bleu.ref_len}
'''


REWARDS_MODULE = '''"""Rule-based rewards for TRL's online scripts (written by tools/real_scripts/make_fixtures.py)."""


def vowel_share(completions, **kwargs):
    """The share of a completion's letters that are vowels (no reward model needed). It differs between the
    few-token samples of a random model, so the group advantages are not all zero and the policy moves."""
    out = []
    for completion in completions:
        letters = [c for c in str(completion).lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out
'''


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def corpus() -> list[str]:
    """Every line of prose the repository ships for tests and the demo."""
    lines = []
    for path in sorted(DEMO.glob("*.txt")) + sorted(DATA.glob("*.txt")):
        lines.extend(path.read_text(encoding="utf-8").splitlines())
    for path in sorted(DATA.glob("*.json")):
        for row in _read_jsonl(path):
            lines.extend(v for v in row.values() if isinstance(v, str))
    return [line for line in lines if line.strip()]


def train_bpe():
    """A byte-level BPE over corpus(); every special token either model needs is in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [*LM_SPECIALS.values(), *CLS_SPECIALS.values(), "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=specials, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return tok


def lm_tokenizer(bpe):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=bpe.__class__.from_str(bpe.to_str()),
                                  model_max_length=MAX_LENGTH, **LM_SPECIALS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def cls_tokenizer(bpe):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw = bpe.__class__.from_str(bpe.to_str())
    raw.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, raw.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    return PreTrainedTokenizerFast(tokenizer_object=raw, model_max_length=MAX_LENGTH,
                                   pad_token=LM_SPECIALS["pad_token"], unk_token=LM_SPECIALS["unk_token"],
                                   **CLS_SPECIALS)


def seq2seq_tokenizer(bpe):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    raw = bpe.__class__.from_str(bpe.to_str())
    bos, eos = LM_SPECIALS["bos_token"], LM_SPECIALS["eos_token"]
    raw.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} $B:1 {eos}:1",
        special_tokens=[(t, raw.token_to_id(t)) for t in (bos, eos)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, model_max_length=MAX_LENGTH, **LM_SPECIALS)


def build_models(out: Path, bpe) -> None:
    import torch
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertConfig,
        BertForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
    )

    lm_tok = lm_tokenizer(bpe)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(lm_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=lm_tok.pad_token_id, bos_token_id=lm_tok.bos_token_id, eos_token_id=lm_tok.eos_token_id))
    llama.generation_config.pad_token_id = lm_tok.pad_token_id
    llama.save_pretrained(out / "tiny-llama")
    lm_tok.save_pretrained(out / "tiny-llama")

    cls_tok = cls_tokenizer(bpe)
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(
        vocab_size=len(cls_tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=MAX_LENGTH, num_labels=2,
        pad_token_id=cls_tok.pad_token_id))
    bert.save_pretrained(out / "tiny-bert")
    cls_tok.save_pretrained(out / "tiny-bert")

    s2s_tok = seq2seq_tokenizer(bpe)
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(BartConfig(
        vocab_size=len(s2s_tok), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=MAX_LENGTH,
        pad_token_id=s2s_tok.pad_token_id, bos_token_id=s2s_tok.bos_token_id, eos_token_id=s2s_tok.eos_token_id,
        decoder_start_token_id=s2s_tok.eos_token_id, forced_eos_token_id=s2s_tok.eos_token_id))
    bart.generation_config.max_length = 32
    bart.save_pretrained(out / "tiny-bart")
    s2s_tok.save_pretrained(out / "tiny-bart")


def build_data(out: Path) -> None:
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name in ("mrpc_train.csv", "mrpc_validation.csv", "text_train.txt", "text_validation.txt"):
        shutil.copyfile(DATA / name, data / name)

    splits = {"train": _read_jsonl(DATA / "conversations_train.json"),
              "test": _read_jsonl(DATA / "conversations_validation.json")}
    for split, rows in splits.items():
        _write_jsonl(out / "sft" / f"{split}.jsonl", [
            {"messages": [{"role": "user", "content": r["context"]}, {"role": "assistant", "content": r["response"]}]}
            for r in rows])
        # the rejected reply is another conversation's: fluent but off-topic, so the preference is learnable
        _write_jsonl(out / "dpo" / f"{split}.jsonl", [
            {"prompt": r["context"], "chosen": " " + r["response"],
             "rejected": " " + rows[(i + 1) % len(rows)]["response"]}
            for i, r in enumerate(rows)])
        # every other row pairs the prompt with another conversation's reply and marks it unwanted
        _write_jsonl(out / "kto" / f"{split}.jsonl", [
            {"prompt": r["context"], "completion": " " + rows[(i + (i % 2)) % len(rows)]["response"],
             "label": i % 2 == 0}
            for i, r in enumerate(rows)])
    _write_jsonl(out / "prompts" / "train.jsonl", [{"prompt": r["context"]} for r in splits["train"]])
    for split, rows in (("train", splits["train"]), ("validation", splits["test"])):
        _write_jsonl(out / "translation" / f"{split}.jsonl",
                     [{"translation": {"en": r["context"], "de": r["response"]}} for r in rows])
    _write_jsonl(out / "instruct" / "train.jsonl", [
        {"instruction": r["context"], "output": r["response"]} for r in splits["train"] + splits["test"]])

    (out / "accuracy").mkdir(exist_ok=True)
    (out / "accuracy" / "accuracy.py").write_text(ACCURACY_MODULE, encoding="utf-8")
    (out / "sacrebleu").mkdir(exist_ok=True)
    (out / "sacrebleu" / "sacrebleu.py").write_text(SACREBLEU_MODULE, encoding="utf-8")
    (out / "rewards.py").write_text(REWARDS_MODULE, encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the fixtures into (created)")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    bpe = train_bpe()
    bpe.save(str(out / "tokenizer.json"))
    build_models(out, bpe)
    build_data(out)
    print(f"fixtures in {out}: vocabulary {bpe.get_vocab_size()}, models tiny-llama, tiny-bert and tiny-bart")


if __name__ == "__main__":
    main()
