"""Sequence classification (GLUE-style sentence pairs) on zerofit, with the command line of Accelerate's
no_trainer example: fine-tune, report accuracy and F1, train/eval time per epoch and peak GPU memory.

    zerofit launch --config_file examples/configs/zerofit/zero2.yaml examples/run_cls_no_trainer.py \
        --model_name_or_path microsoft/deberta-v2-xlarge-mnli --task_name mrpc --ignore_mismatched_sizes \
        --max_length 128 --per_device_train_batch_size 40 --learning_rate 2e-5 --num_train_epochs 3 \
        --output_dir out/mrpc

`--train_file/--validation_file` (CSV or JSON lines with the task's columns and `label`) replace
`--task_name` for local data.
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
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    default_data_collator,
)

from zerofit import Accelerator
from zerofit.logging import get_logger
from zerofit.utils import set_seed

logger = get_logger(__name__)

# the text columns of each GLUE task (facts of the dataset, not choices of this script)
TASK_TO_KEYS = {
    "cola": ("sentence", None), "mnli": ("premise", "hypothesis"), "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"), "qqp": ("question1", "question2"), "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None), "stsb": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Finetune a transformers model on a text classification task")
    add_common_args(parser)
    parser.add_argument("--task_name", type=str, default=None, choices=sorted(TASK_TO_KEYS),
                        help="the GLUE task to train on (loads nyu-mll/glue)")
    parser.add_argument("--max_length", type=int, default=128, help="tokens per example after tokenization")
    parser.add_argument("--pad_to_max_length", action="store_true",
                        help="pad every example to --max_length (else pad each batch to its longest)")
    parser.add_argument("--ignore_mismatched_sizes", action="store_true",
                        help="load a checkpoint whose classifier head has another number of labels")
    args = parser.parse_args()
    if args.task_name is None and args.train_file is None:
        parser.error("pass --task_name or --train_file")
    if args.model_name_or_path is None:
        parser.error("pass --model_name_or_path")
    return args


def f1_binary(predictions: torch.Tensor, references: torch.Tensor) -> float:
    """F1 of the positive class (scikit-learn's default for binary labels), used when sklearn is missing."""
    true_pos = ((predictions == 1) & (references == 1)).sum().item()
    predicted, actual = (predictions == 1).sum().item(), (references == 1).sum().item()
    return 0.0 if predicted + actual == 0 else 2 * true_pos / (predicted + actual)


def classification_metrics(predictions: torch.Tensor, references: torch.Tensor, num_labels: int) -> dict[str, float]:
    accuracy = (predictions == references).float().mean().item()
    try:
        from sklearn.metrics import f1_score
    except ImportError:
        f1 = f1_binary(predictions, references) if num_labels == 2 else float("nan")
    else:
        average = "binary" if num_labels == 2 else "macro"
        f1 = float(f1_score(references.cpu().numpy(), predictions.cpu().numpy(), average=average))
    return {"accuracy": accuracy, "f1": f1}


def evaluate(accelerator, model, eval_dataloader, num_labels: int) -> dict[str, float]:
    model.eval()
    all_predictions, all_references = [], []
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(**batch).logits
        predictions, references = accelerator.gather_for_metrics((logits.argmax(dim=-1), batch["labels"]))
        all_predictions.append(predictions)
        all_references.append(references)
    return classification_metrics(torch.cat(all_predictions), torch.cat(all_references), num_labels)


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

    if args.task_name is not None:
        raw = load_dataset("nyu-mll/glue", args.task_name)
        keys = TASK_TO_KEYS[args.task_name]
    else:
        builder, files = data_files(args)
        raw = load_dataset(builder, data_files=files)
        columns = [c for c in raw["train"].column_names if c not in ("label", "idx")]
        keys = ("sentence1", "sentence2") if {"sentence1", "sentence2"} <= set(columns) else (columns + [None])[:2]
    eval_split = "validation_matched" if args.task_name == "mnli" else "validation"
    label_feature = raw["train"].features["label"]
    labels = getattr(label_feature, "names", None) or sorted(set(raw["train"]["label"]))
    num_labels = len(labels)

    config = AutoConfig.from_pretrained(args.config_name or args.model_name_or_path, num_labels=num_labels,
                                        finetuning_task=args.task_name, trust_remote_code=args.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or args.model_name_or_path,
                                              use_fast=not args.use_slow_tokenizer,
                                              trust_remote_code=args.trust_remote_code)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path, config=config, ignore_mismatched_sizes=args.ignore_mismatched_sizes,
        trust_remote_code=args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    # string labels (from CSV/JSON) become ids in sorted order; ClassLabel columns are ids already
    label_to_id = None if hasattr(label_feature, "names") else {v: i for i, v in enumerate(labels)}
    if label_to_id is not None:
        model.config.label2id = {str(k): v for k, v in label_to_id.items()}
        model.config.id2label = {v: str(k) for k, v in label_to_id.items()}

    def preprocess(examples):
        texts = (examples[keys[0]],) if keys[1] is None else (examples[keys[0]], examples[keys[1]])
        result = tokenizer(*texts, padding="max_length" if args.pad_to_max_length else False,
                           max_length=args.max_length, truncation=True)
        result["labels"] = ([label_to_id[v] for v in examples["label"]] if label_to_id is not None
                            else examples["label"])
        return result

    with accelerator.main_process_first():
        processed = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names,
                            load_from_cache_file=not args.overwrite_cache, desc="Running tokenizer on dataset")
    train_dataset, eval_dataset = processed["train"], processed[eval_split]

    if args.pad_to_max_length:
        collator = default_data_collator
    else:
        # multiples of 8 keep fp16/bf16 tensor cores busy on GPUs
        collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if accelerator.mixed_precision != "no"
                                           else None)
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=collator,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_dataset, collate_fn=collator, batch_size=args.per_device_eval_batch_size)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = prepare_for_training(
        accelerator, args, model, train_dataloader, eval_dataloader, "glue_no_trainer")

    results = Results(accelerator, args, task=f"classification:{args.task_name or 'files'}", metric="accuracy")
    logger.info(f"***** Running training: {len(train_dataset)} examples, {num_labels} labels, "
                f"total batch {results.data['total_train_batch_size']}, {args.max_train_steps} steps *****")
    train_and_evaluate(accelerator, args, model, optimizer, lr_scheduler, train_dataloader,
                       lambda: evaluate(accelerator, model, eval_dataloader, num_labels), results, tokenizer)


if __name__ == "__main__":
    main()
