"""Causal language modelling (GPT-2 style) on zerofit, with the command line of Accelerate's no_trainer
example: train on a text dataset, report perplexity, train/eval time per epoch and peak GPU memory.

    zerofit launch --config_file examples/configs/zerofit/zero3_offload.yaml examples/run_clm_no_trainer.py \
        --config_name gpt2-xl --tokenizer_name gpt2-xl --dataset_name wikitext \
        --dataset_config_name wikitext-2-raw-v1 --block_size 128 --per_device_train_batch_size 16 \
        --learning_rate 5e-4 --output_dir out/clm

Only the DDP-vs-ZeRO choice lives in the config file; the script is the same for every stage.
"""

from __future__ import annotations

import argparse
import math
import os
from itertools import chain

import torch
from common import (
    Results,
    add_common_args,
    data_files,
    prepare_for_training,
    setup_logging,
    train_and_evaluate,
)
from datasets import load_dataset
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, default_data_collator

from zerofit import Accelerator
from zerofit.logging import get_logger
from zerofit.utils import set_seed

logger = get_logger(__name__)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Finetune or train a causal language model on a text dataset")
    add_common_args(parser)
    parser.add_argument("--validation_split_percentage", type=int, default=5,
                        help="share of the train split used for validation when the dataset has none")
    parser.add_argument("--block_size", type=int, default=None, help="tokens per training sequence")
    parser.add_argument("--no_keep_linebreaks", action="store_true", help="drop line breaks of .txt files")
    args = parser.parse_args()
    if args.dataset_name is None and args.train_file is None:
        parser.error("pass --dataset_name or --train_file")
    if args.model_name_or_path is None and args.config_name is None:
        parser.error("pass --model_name_or_path (fine-tune) or --config_name (train from scratch)")
    return args


def raw_datasets(args: argparse.Namespace):
    if args.dataset_name is not None:
        raw = load_dataset(args.dataset_name, args.dataset_config_name, trust_remote_code=args.trust_remote_code)
    else:
        builder, files = data_files(args)
        extra = {"keep_linebreaks": not args.no_keep_linebreaks} if builder == "text" else {}
        raw = load_dataset(builder, data_files=files, **extra)
    if "validation" not in raw:
        # carve the validation set off the front of train, as the official example does
        pct = args.validation_split_percentage
        name, cfg, files = args.dataset_name, args.dataset_config_name, None
        if name is None:
            name, files = data_files(args)
        raw["validation"] = load_dataset(name, cfg, data_files=files, split=f"train[:{pct}%]")
        raw["train"] = load_dataset(name, cfg, data_files=files, split=f"train[{pct}%:]")
    return raw


def lm_datasets(args: argparse.Namespace, raw, tokenizer, accelerator, block_size: int):
    text_column = "text" if "text" in raw["train"].column_names else raw["train"].column_names[0]

    def tokenize(examples):
        return tokenizer(examples[text_column])

    def group_texts(examples):
        # concatenate everything, then cut into block_size chunks; the short tail is dropped
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // block_size) * block_size
        blocks = {k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        blocks["labels"] = [list(b) for b in blocks["input_ids"]]
        return blocks

    with accelerator.main_process_first():
        tokenized = raw.map(tokenize, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, load_from_cache_file=not args.overwrite_cache,
                            desc="Running tokenizer on dataset")
        return tokenized.map(group_texts, batched=True, num_proc=args.preprocessing_num_workers,
                             load_from_cache_file=not args.overwrite_cache, desc=f"Grouping texts in {block_size}")


def evaluate(accelerator, model, eval_dataloader, args) -> dict[str, float]:
    model.eval()
    losses = []
    for batch in eval_dataloader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
    eval_loss = torch.cat(losses).mean().item()
    try:
        perplexity = math.exp(eval_loss)
    except OverflowError:
        perplexity = float("inf")
    return {"eval_loss": eval_loss, "perplexity": perplexity}


def main() -> None:
    args = parse_args()
    tracking = {"log_with": args.report_to, "project_dir": args.output_dir} if args.with_tracking else {}
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **tracking)
    setup_logging()
    logger.info(accelerator.state, main_process_only=False)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    raw = raw_datasets(args)
    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path,
                                        trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path,
                                              use_fast=not args.use_slow_tokenizer,
                                              trust_remote_code=args.trust_remote_code)
    if args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, config=config,
                                                     trust_remote_code=args.trust_remote_code)
    else:
        logger.info("Training new model from scratch")
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
    # grow the embedding when the tokenizer has more tokens (before prepare(): ZeRO-3 shards it there)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))

    max_positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 1024)
    block_size = min(args.block_size or 1024, tokenizer.model_max_length, max_positions)
    datasets = lm_datasets(args, raw, tokenizer, accelerator, block_size)
    train_dataset, eval_dataset = datasets["train"], datasets["validation"]
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = prepare_for_training(
        accelerator, args, model, train_dataloader, eval_dataloader, "clm_no_trainer")

    results = Results(accelerator, args, task="causal-lm", metric="perplexity")
    logger.info(f"***** Running training: {len(train_dataset)} blocks of {block_size}, "
                f"total batch {results.data['total_train_batch_size']}, {args.max_train_steps} steps *****")
    train_and_evaluate(accelerator, args, model, optimizer, lr_scheduler, train_dataloader,
                       lambda: evaluate(accelerator, model, eval_dataloader, args), results, tokenizer)


if __name__ == "__main__":
    main()
