"""Lightning's Trainer under torchrun (2 CPU ranks, gloo): automatic optimisation with
accumulate_grad_batches and clipping, manual optimisation (Lightning prepares the reducer itself),
static_graph (manual: Lightning calls reducer._delay_all_reduce()), a communication hook, and
gradsync's overlapped optimizer from configure_optimizers (automatic: Lightning passes
`step` a closure; with clipping)."""

from __future__ import annotations

import common
import lightning as L
import torch
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class HookOnCPU(DDPStrategy):
    """Lightning registers `ddp_comm_hook` on CUDA only; this does it on CPU too, the same way."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook)


class Lit(L.LightningModule):
    def __init__(self, manual: bool, overlap: bool = False) -> None:
        super().__init__()
        self.net = common.model()
        self.automatic_optimization = not manual
        self.overlap = overlap  # gradsync's wrapper: step each bucket as it lands
        self.seen: list[object] = []  # a list: a module attribute would make the wrapper a child

    def on_train_start(self) -> None:
        self.seen.append(self.trainer.strategy.model)  # unwrapped again at teardown

    def training_step(self, batch: dict, _index: int) -> torch.Tensor:
        loss = self.net(batch["x"], batch["labels"])["loss"]
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        if self.overlap:  # the strategy has wrapped the module before it asks for optimizers
            return self.trainer.strategy.model.overlap_optimizer(optimizer)
        return optimizer

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(common.Points(), batch_size=4, shuffle=False)


def fit(
    out_dir: str,
    impl: str,
    config: str,
    manual: bool = False,
    strategy: DDPStrategy | None = None,
    overlap: bool = False,
    **trainer_args: object,
) -> None:
    lit = Lit(manual, overlap and impl == "gradsync")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy or DDPStrategy(), max_steps=4, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, **trainer_args,
    )
    trainer.fit(lit)
    common.record(out_dir, "lightning", impl, config, lit.net, lit.net.losses, lit.seen[0])


if __name__ == "__main__":
    common.main(
        "lightning",
        {
            "automatic": lambda o, i: fit(
                o, i, "automatic", accumulate_grad_batches=2, gradient_clip_val=0.5
            ),
            "manual": lambda o, i: fit(o, i, "manual", manual=True),
            "overlap": lambda o, i: fit(o, i, "overlap", overlap=True, accumulate_grad_batches=2,
                                        gradient_clip_val=0.5),
            "overlap_manual": lambda o, i: fit(o, i, "overlap_manual", manual=True, overlap=True),
            "manual_static_graph": lambda o, i: fit(
                o, i, "manual_static_graph", manual=True, strategy=DDPStrategy(static_graph=True)
            ),
            # static_graph with accumulate_grad_batches: torch's own DDP fails (an internal assert
            # in its reducer, expect_autograd_hooks_), so there is nothing to compare with.
            "static_graph_hook": lambda o, i: fit(
                o,
                i,
                "static_graph_hook",
                gradient_clip_val=0.5,
                strategy=HookOnCPU(
                    static_graph=True, ddp_comm_hook=default_hooks.fp16_compress_hook
                ),
            ),
        },
    )
