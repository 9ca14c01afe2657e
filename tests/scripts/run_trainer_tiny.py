"""A Trainer script as transformers' examples are written (TrainingArguments from the command line, train,
`save_metrics`, `save_model`, `save_state`), on the tiny GPT-2 and token data of tests/trainer_cases.py, with
zerofit's one import. Each process prints one `world:` line of what its TrainingArguments count."""

import json
import os
import sys

import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import trainer_cases  # noqa: E402

from zerofit.integrations.transformers import Trainer  # noqa: E402  (was: from transformers import Trainer)


def main() -> None:
    (args,) = transformers.HfArgumentParser(transformers.TrainingArguments).parse_args_into_dataclasses()
    seen = {"rank": int(os.environ.get("RANK", "0")), "world_size": args.world_size,
            "process_index": args.process_index, "should_save": args.should_save, "device": str(args.device)}
    print("world: " + json.dumps(seen), flush=True)
    trainer = Trainer(model=trainer_cases.tiny_gpt2(), args=args, train_dataset=trainer_cases.token_data())
    result = trainer.train()
    trainer.save_metrics("train", result.metrics)  # on every process, as run_clm.py calls it
    trainer.save_model()
    trainer.save_state()


if __name__ == "__main__":
    main()
