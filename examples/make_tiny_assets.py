"""Tiny models and data for running every example offline: no download, a few seconds on a CPU.

    python examples/make_tiny_assets.py out/tiny

writes, for each task, a checkpoint `from_pretrained` loads (config, weights and tokenizer) and the
train/validation files the scripts' `--train_file` / `--validation_file` read through `load_dataset`:

    out/tiny/clm/{model/, train.txt, validation.txt}          GPT-2 (2 layers, width 32)
    out/tiny/cls/{model/, train.json, validation.json}        BERT with 3 labels, as an MNLI checkpoint has
    out/tiny/seq2seq/{model/, train.json, validation.json}    BART chatbot, context -> response

The data are the short English texts in examples/data/; the tokenizers are word-level, trained on
them here. docs/recipes.md runs the examples on these folders, and so do the tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"

# task -> (the shipped file each split is copied from, the name the split gets in the task's folder)
FILES = {
    "clm": {"train.txt": "text_train.txt", "validation.txt": "text_validation.txt"},
    "cls": {"train.json": "mrpc_train.json", "validation.json": "mrpc_validation.json"},
    "seq2seq": {"train.json": "conversations_train.json", "validation.json": "conversations_validation.json"},
}


def _texts() -> list[str]:
    """Every text of every task, so one vocabulary covers them all (no unknown words in any split)."""
    texts = [(DATA / name).read_text(encoding="utf-8") for name in ("text_train.txt", "text_validation.txt")]
    for name in ("mrpc_train.json", "mrpc_validation.json", "conversations_train.json",
                 "conversations_validation.json"):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            texts.extend(str(v) for v in json.loads(line).values())
    return texts


def _tokenizer(special: list[str], template: tuple[str, str] | None, max_length: int):
    """A word-level tokenizer over the data's words, optionally wrapping inputs in special tokens."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    tok.train_from_iterator(_texts(), trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", *special]))
    if template is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=template[0], pair=template[1], special_tokens=[(t, tok.token_to_id(t)) for t in special])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=max_length)


def _gpt2():
    import transformers

    tok = _tokenizer(["<eos>"], None, 64)
    tok.eos_token = "<eos>"
    config = transformers.GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    return transformers.GPT2LMHeadModel(config), tok


def _bert():
    import transformers

    tok = _tokenizer(["[CLS]", "[SEP]"], ("[CLS] $A [SEP]", "[CLS] $A [SEP] $B:1 [SEP]:1"), 128)
    tok.cls_token, tok.sep_token = "[CLS]", "[SEP]"
    # three labels, as an MNLI checkpoint has: the recipe's --ignore_mismatched_sizes swaps the head for two
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128, num_labels=3, pad_token_id=tok.pad_token_id))
    return model, tok


def _bart():
    import transformers

    tok = _tokenizer(["<s>", "</s>"], ("<s> $A </s>", "<s> $A </s> </s> $B </s>"), 64)
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=len(tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.eos_token_id, forced_eos_token_id=tok.eos_token_id))
    model.generation_config.max_length = 64  # BART's default (20) would cut the recipe's beams short
    return model, tok


def build(out: Path) -> dict[str, Path]:
    """Write the three tasks' folders under `out` (created); returns task -> its folder."""
    import torch

    folders = {}
    for task, make in (("clm", _gpt2), ("cls", _bert), ("seq2seq", _bart)):
        torch.manual_seed(0)  # the same weights on every run, whatever was built before
        model, tokenizer = make()
        folder = out / task
        model.save_pretrained(folder / "model")
        tokenizer.save_pretrained(folder / "model")
        for name, source in FILES[task].items():
            shutil.copyfile(DATA / source, folder / name)
        folders[task] = folder
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write the assets into (created; existing files replaced)")
    for task, folder in build(parser.parse_args().out).items():
        print(f"{task:8s} {folder}/model  " + "  ".join(f"{folder}/{name}" for name in FILES[task]))


if __name__ == "__main__":
    main()
