"""Write what a user's fine-tune starts from, with nothing downloaded: a GPT-2-architecture checkpoint with random
weights (`save_pretrained`, so the script loads it with `from_pretrained`), its word-level tokenizer, and a text
train / validation split of random sentences over that tokenizer's words.

    python tools/gpu/gpt2_checkpoint.py OUT_DIR [--size xl|medium|tiny] [--lines 2000]

Writes OUT_DIR/model (config.json, model.safetensors, tokenizer files), OUT_DIR/train.txt and
OUT_DIR/validation.txt. Sizes are GPT-2's own (xl: 48 layers x 1600, 1.5 B parameters with GPT-2's
vocabulary; the vocabulary here is the tokenizer's few thousand words, so the body is GPT-2 XL's and the
embedding is small); tiny is for the CPU dry run.
"""

from __future__ import annotations

import argparse
import os
import random

SIZES = {"xl": (1600, 48, 25), "large": (1280, 36, 20), "medium": (1024, 24, 16), "tiny": (64, 2, 2)}
"""n_embd, n_layer, n_head."""
WORDS = 4000


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randrange(20, 80))) + " ." for _ in range(count)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--size", choices=sorted(SIZES), default="xl")
    p.add_argument("--lines", type=int, default=2000, help="train lines (validation gets a tenth)")
    args = p.parse_args(argv)

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    os.makedirs(args.out, exist_ok=True)
    train, valid = sentences(args.lines, 0), sentences(max(args.lines // 10, 20), 1)
    for name, lines in (("train.txt", train), ("validation.txt", valid)):
        with open(os.path.join(args.out, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(train + valid, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<eos>", bos_token="<eos>",
                                  model_max_length=1024)
    hidden, layers, heads = SIZES[args.size]
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024, vocab_size=len(tok),
                        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    path = os.path.join(args.out, "model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    print(f"gpt2_checkpoint: wrote {path}: GPT-2 {args.size}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
          f"parameters, vocabulary {len(tok)}; {len(train)} train / {len(valid)} validation lines", flush=True)


if __name__ == "__main__":
    main()
