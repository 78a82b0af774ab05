"""HF Trainer under torchrun (2 CPU ranks, gloo): gradient accumulation, clipping, find_unused;
and gradsync's overlapped optimizer put in place of the Trainer's by a callback, once the
Trainer has wrapped the model (with the same accumulation and clipping)."""

from __future__ import annotations

import tempfile

import common
from transformers import Trainer, TrainerCallback, TrainingArguments


class Overlap(TrainerCallback):
    """Under gradsync, once the Trainer has built its optimizer and wrapped the model (in
    Accelerate's prepare), the optimizer inside Accelerate's wrapper is overlapped; its
    LR scheduler keeps stepping the same param_groups."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        accelerated = self.trainer.optimizer  # accelerate's AcceleratedOptimizer
        model = self.trainer.model_wrapped  # gradsync's wrapper, under the patch
        accelerated.optimizer = model.overlap_optimizer(accelerated.optimizer)

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
        stepped = self.trainer.optimizer.optimizer
        assert stepped._acknowledged is not None, "the Trainer never stepped the overlapped one"


def train(out_dir: str, impl: str, find_unused: bool, overlap: bool = False) -> None:
    net = common.model(spare=find_unused)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, max_steps=4, learning_rate=0.05, seed=0, data_seed=0, use_cpu=True,
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        ddp_find_unused_parameters=find_unused, dataloader_num_workers=0,
    )
    trainer = Trainer(model=net, args=args, train_dataset=common.Points())
    if overlap and impl == "gradsync":
        trainer.add_callback(Overlap(trainer))
    trainer.train()
    config = "overlap" if overlap else "find_unused" if find_unused else "default"
    common.record(out_dir, "hf_trainer", impl, config, net, net.losses, trainer.model_wrapped)


if __name__ == "__main__":
    common.main("hf_trainer", {
        "default": lambda out, impl: train(out, impl, False),
        "find_unused": lambda out, impl: train(out, impl, True),
        "overlap": lambda out, impl: train(out, impl, False, overlap=True),
    })
