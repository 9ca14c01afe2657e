"""Encoder-decoder chatbot fine-tuning on zerofit, with the command line of Accelerate's no_trainer
examples: train on (context, response) pairs, answer the validation contexts with beam search, and
report BLEU (sacrebleu), train/eval time per epoch and peak GPU memory.

    zerofit launch --config_file examples/configs/zerofit/zero3_offload.yaml examples/run_seq2seq_no_trainer.py \
        --model_name_or_path facebook/blenderbot-400M-distill --dataset_name smangrul/MuDoConv \
        --max_source_length 128 --source_prefix "chatbot: " --max_target_length 64 --val_max_target_length 64 \
        --val_min_target_length 20 --n_train 10000 --n_val 1000 --pad_to_max_length --num_beams 10 \
        --per_device_train_batch_size 200 --per_device_eval_batch_size 100 --learning_rate 1e-6 \
        --num_warmup_steps 100 --seed 25 --output_dir out/chatbot

Generation runs under every stage, ZeRO-3 included: zerofit marks the model so that transformers keeps
all ranks in step while their beams finish at different lengths (see zerofit.frontend.accelerator).
"""

from __future__ import annotations

import argparse
import os

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
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from zerofit import Accelerator
from zerofit.logging import get_logger
from zerofit.utils import set_seed

logger = get_logger(__name__)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Finetune a seq2seq model as a chatbot")
    add_common_args(parser)
    add = parser.add_argument
    add("--text_column", type=str, default="context", help="column with the input (the conversation so far)")
    add("--summary_column", type=str, default="response", help="column with the target reply")
    add("--source_prefix", type=str, default="", help="text put before every input, e.g. 'chatbot: '")
    add("--max_source_length", type=int, default=128)
    add("--max_target_length", type=int, default=64, help="target tokens kept for training")
    add("--val_max_target_length", type=int, default=None, help="longest generated reply (default: max_target_length)")
    add("--val_min_target_length", type=int, default=1, help="shortest generated reply")
    add("--n_train", type=int, default=None, help="use only the first N training examples")
    add("--n_val", type=int, default=None, help="use only the first N validation examples")
    add("--pad_to_max_length", action="store_true", help="pad to the max lengths (else to each batch's longest)")
    add("--num_beams", type=int, default=1, help="beams for generation during evaluation")
    add("--ignore_pad_token_for_loss", type=bool, default=True, help="label padding does not count in the loss")
    args = parser.parse_args()
    if args.dataset_name is None and args.train_file is None:
        parser.error("pass --dataset_name or --train_file")
    if args.model_name_or_path is None:
        parser.error("pass --model_name_or_path")
    args.val_max_target_length = args.val_max_target_length or args.max_target_length
    return args


def evaluate(accelerator, model, eval_dataloader, tokenizer, args) -> dict[str, float]:
    import sacrebleu

    model.eval()
    predictions, references = [], []
    label_pad = -100 if args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    for batch in eval_dataloader:
        with torch.no_grad():
            # every rank runs generate() even under ZeRO-3, where each forward gathers parameters
            generated = accelerator.unwrap_model(model).generate(
                batch["input_ids"], attention_mask=batch["attention_mask"], num_beams=args.num_beams,
                max_length=args.val_max_target_length, min_length=args.val_min_target_length)
        # ranks produce different lengths: pad before gathering
        generated = accelerator.pad_across_processes(generated, dim=1, pad_index=tokenizer.pad_token_id)
        labels = accelerator.pad_across_processes(batch["labels"], dim=1, pad_index=label_pad)
        generated, labels = accelerator.gather_for_metrics((generated, labels))
        labels = torch.where(labels == -100, tokenizer.pad_token_id, labels)
        predictions += [t.strip() for t in tokenizer.batch_decode(generated, skip_special_tokens=True)]
        references += [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
    bleu = sacrebleu.corpus_bleu(predictions, [references])
    lengths = [len(p.split()) for p in predictions]
    return {"bleu": bleu.score, "gen_len": sum(lengths) / max(len(lengths), 1), "eval_samples": len(predictions)}


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

    if args.dataset_name is not None:
        raw = load_dataset(args.dataset_name, args.dataset_config_name, trust_remote_code=args.trust_remote_code)
    else:
        builder, files = data_files(args)
        raw = load_dataset(builder, data_files=files)
    for split, limit in (("train", args.n_train), ("validation", args.n_val)):
        if limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))

    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path,
                                        trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path,
                                              use_fast=not args.use_slow_tokenizer,
                                              trust_remote_code=args.trust_remote_code)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path, config=config,
                                                  trust_remote_code=args.trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))  # before prepare(): ZeRO-3 shards the embedding there
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model config has no decoder_start_token_id: set it in the checkpoint's config.json")

    padding = "max_length" if args.pad_to_max_length else False

    def preprocess(examples):
        inputs = [args.source_prefix + text for text in examples[args.text_column]]
        model_inputs = tokenizer(inputs, max_length=args.max_source_length, padding=padding, truncation=True)
        labels = tokenizer(text_target=examples[args.summary_column], max_length=args.max_target_length,
                           padding=padding, truncation=True)["input_ids"]
        if padding and args.ignore_pad_token_for_loss:
            # padded label positions must not count in the loss
            labels = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in labels]
        model_inputs["labels"] = labels
        return model_inputs

    with accelerator.main_process_first():
        processed = raw.map(preprocess, batched=True, num_proc=args.preprocessing_num_workers,
                            remove_columns=raw["train"].column_names, load_from_cache_file=not args.overwrite_cache,
                            desc="Running tokenizer on dataset")
    train_dataset, eval_dataset = processed["train"], processed["validation"]

    # the collator builds decoder_input_ids from the labels with the model's own shift rule
    collator = DataCollatorForSeq2Seq(tokenizer, model=model,
                                      label_pad_token_id=-100 if args.ignore_pad_token_for_loss
                                      else tokenizer.pad_token_id,
                                      pad_to_multiple_of=8 if accelerator.mixed_precision != "no" else None)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=collator, batch_size=args.per_device_eval_batch_size)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = prepare_for_training(
        accelerator, args, model, train_dataloader, eval_dataloader, "seq2seq_no_trainer")

    results = Results(accelerator, args, task="seq2seq-chatbot", metric="bleu")
    results.data["num_beams"] = args.num_beams
    logger.info(f"***** Running training: {len(train_dataset)} pairs, total batch "
                f"{results.data['total_train_batch_size']}, {args.max_train_steps} steps *****")
    train_and_evaluate(accelerator, args, model, optimizer, lr_scheduler, train_dataloader,
                       lambda: evaluate(accelerator, model, eval_dataloader, tokenizer, args), results, tokenizer)


if __name__ == "__main__":
    main()
