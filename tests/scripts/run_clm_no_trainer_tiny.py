"""A causal-LM "no_trainer" script in the shape of transformers' examples/pytorch/language-modeling/
run_clm_no_trainer.py, shrunk to run on CPU in seconds: a tiny GPT-2 built from a config, trained on
the characters of a text file (`--train_file`; the tests use zerofit's shipped demo text).

It is written for Hugging Face Accelerate; the only zerofit change is the three import lines marked
"zerofit:" (test_accelerator_script.py checks that nothing else names zerofit).

    zerofit launch --cpu --num_processes 2 --config_file stage2.yaml run_clm_no_trainer_tiny.py --output_dir out
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

from zerofit import Accelerator  # zerofit: was `from accelerate import Accelerator`
from zerofit.logging import get_logger  # zerofit: was `from accelerate.logging import get_logger`
from zerofit.utils import set_seed  # zerofit: was `from accelerate.utils import set_seed`

logger = get_logger(__name__)


def parse_args():
    parser = argparse.ArgumentParser(description="Train a tiny causal language model on characters")
    parser.add_argument("--train_file", type=str, required=True, help="a plain text file")
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", type=str, default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=2)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--with_tracking", action="store_true")
    parser.add_argument("--report_to", type=str, default="all")
    return parser.parse_args()


def char_blocks(path: str, block_size: int):
    """group_texts on characters: the text as token ids, cut into blocks; labels are the inputs."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    ids = [vocab.index(c) for c in text]
    total = (len(ids) // block_size) * block_size
    blocks = [ids[i:i + block_size] for i in range(0, total, block_size)]
    rows = [{"input_ids": b, "attention_mask": [1] * block_size, "labels": b} for b in blocks]
    split = len(rows) * 9 // 10
    return rows[:split], rows[split:], len(vocab)


def main():
    args = parse_args()
    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = args.report_to
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_log_kwargs)

    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        level=logging.INFO)
    logger.info(accelerator.state, main_process_only=False)
    if args.seed is not None:
        set_seed(args.seed)
    if accelerator.is_main_process and args.output_dir is not None:
        os.makedirs(args.output_dir, exist_ok=True)
    accelerator.wait_for_everyone()

    with accelerator.main_process_first():
        train_dataset, eval_dataset, vocab_size = char_blocks(args.train_file, args.block_size)
    config = GPT2Config(vocab_size=vocab_size, n_positions=args.block_size, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)

    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=default_data_collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator,
                                 batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)

    overrode_max_train_steps = False
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if args.max_train_steps is None:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
        overrode_max_train_steps = True
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type, optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes,
    )

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)

    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", vars(args))

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {len(train_dataset)}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch_size}")
    logger.info(f"  Total optimization steps = {args.max_train_steps}")
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = 0
    first_loss = None

    for epoch in range(args.num_train_epochs):
        model.train()
        total_loss = 0
        for _step, batch in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                if first_loss is None:
                    first_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for _step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            loss = outputs.loss
            losses.append(accelerator.gather_for_metrics(loss.repeat(args.per_device_eval_batch_size)))
        losses = torch.cat(losses)
        try:
            eval_loss = torch.mean(losses)
            perplexity = math.exp(eval_loss)
        except OverflowError:
            perplexity = float("inf")
        logger.info(f"epoch {epoch}: perplexity: {perplexity} eval_loss: {eval_loss}")
        if args.with_tracking:
            accelerator.log({"perplexity": perplexity, "eval_loss": eval_loss,
                             "train_loss": total_loss.item() / len(train_dataloader), "epoch": epoch,
                             "step": completed_steps}, step=completed_steps)

    if args.with_tracking:
        accelerator.end_training()

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                        save_function=accelerator.save)
        if accelerator.is_main_process:
            with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
                json.dump({"perplexity": perplexity, "first_train_loss": first_loss, "eval_count": len(losses),
                           "eval_dataset": len(eval_dataset), "completed_steps": completed_steps,
                           "last_lr": lr_scheduler.get_last_lr()[0],
                           "distributed_type": str(accelerator.distributed_type.value)}, f)


if __name__ == "__main__":
    main()
