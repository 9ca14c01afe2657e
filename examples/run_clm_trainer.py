"""Causal language modelling with transformers' Trainer on zerofit: an ordinary Trainer script whose one
changed line is the Trainer import. Its arguments are Trainer's own (`TrainingArguments`) plus the
model and data ones below; the sharding and offload come from the config given to `zerofit launch`.

    zerofit launch --config_file examples/configs/zerofit/zero3.yaml examples/run_clm_trainer.py \
        --model_name_or_path gpt2 --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 \
        --block_size 128 --per_device_train_batch_size 8 --num_train_epochs 1 --save_steps 500 \
        --output_dir out/trainer

It trains, evaluates (perplexity) when there is a validation split, writes `checkpoint-N/` every
`--save_steps` (resume with `--resume_from_checkpoint out/trainer/checkpoint-N`; merge one with
`zerofit merge`) and saves the final model with `save_model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, TrainingArguments, default_data_collator

from zerofit.integrations.transformers import Trainer  # was: from transformers import Trainer


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "pretrained model directory or hub id"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer, if not the model's"})


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "dataset name (or local builder path)"})
    dataset_config_name: str | None = field(default=None, metadata={"help": "configuration of the dataset"})
    train_file: str | None = field(default=None, metadata={"help": "a .txt file with the training text"})
    validation_file: str | None = field(default=None, metadata={"help": "a .txt file with the validation text"})
    block_size: int = field(default=128, metadata={"help": "tokens per training sequence"})

    def __post_init__(self) -> None:
        if self.dataset_name is None and self.train_file is None:
            raise ValueError("pass --dataset_name (a dataset) or --train_file (a .txt file)")


def raw_datasets(data: DataArguments):
    if data.dataset_name is not None:
        return load_dataset(data.dataset_name, data.dataset_config_name)
    files = {"train": data.train_file}
    if data.validation_file is not None:
        files["validation"] = data.validation_file
    return load_dataset("text", data_files=files)


def lm_datasets(raw, tokenizer, training_args: TrainingArguments, block_size: int):
    """Tokenize, concatenate and cut into `block_size` blocks whose labels are their inputs."""
    def tokenize(examples):
        return tokenizer(examples["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // block_size) * block_size  # the short tail is dropped
        blocks = {k: [t[i:i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        blocks["labels"] = [list(b) for b in blocks["input_ids"]]
        return blocks

    # rank 0 tokenizes and fills the datasets cache; the others then read it
    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
        return tokenized.map(group_texts, batched=True)


def main() -> None:
    model_args, data_args, training_args = HfArgumentParser(
        (ModelArguments, DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    block_size = min(data_args.block_size, tokenizer.model_max_length)
    datasets = lm_datasets(raw_datasets(data_args), tokenizer, training_args, block_size)

    trainer = Trainer(model=model, args=training_args, train_dataset=datasets["train"],
                      eval_dataset=datasets.get("validation"), processing_class=tokenizer,
                      data_collator=default_data_collator)
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()  # every rank takes part: the weights are gathered from their shards
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    trainer.save_state()
    if "validation" in datasets:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
