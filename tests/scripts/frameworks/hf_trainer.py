"""HF Trainer under torchrun (2 CPU ranks, gloo): gradient accumulation, clipping, find_unused."""

from __future__ import annotations

import tempfile

import common
from transformers import Trainer, TrainingArguments


def train(out_dir: str, impl: str, find_unused: bool) -> None:
    net = common.model(spare=find_unused)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=4, learning_rate=0.05, seed=0, data_seed=0, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        ddp_find_unused_parameters=find_unused, dataloader_num_workers=0,
    )
    trainer = Trainer(model=net, args=args, train_dataset=common.Points())
    trainer.train()
    config = "find_unused" if find_unused else "default"
    common.record(out_dir, "hf_trainer", impl, config, net, net.losses, trainer.model_wrapped)


if __name__ == "__main__":
    common.main("hf_trainer", {
        "default": lambda out, impl: train(out, impl, False),
        "find_unused": lambda out, impl: train(out, impl, True),
    })
