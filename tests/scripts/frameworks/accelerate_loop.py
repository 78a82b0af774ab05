"""Accelerate's own loop under torchrun (2 CPU ranks, gloo): `accelerator.accumulate` with
clipping, and `no_sync` followed by `trigger_sync_in_backward` (which calls
`model.reducer.prepare_for_backward([])` itself); and gradsync's overlapped optimizer prepared
by Accelerate with an LR scheduler and clipping, against the plain optimizer under torch's
DDP."""

from __future__ import annotations

import common
import torch
from accelerate import Accelerator


def setup(steps: int) -> tuple[Accelerator, torch.nn.Module, common.Net, object, object]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=steps)
    net = common.model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(common.Points(), batch_size=4, shuffle=False)
    wrapped, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    return accelerator, wrapped, net, optimizer, loader


def accumulate(out_dir: str, impl: str) -> None:
    accelerator, model, net, optimizer, loader = setup(2)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(batch["x"], batch["labels"])["loss"]
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    common.record(out_dir, "accelerate", impl, "accumulate", net, net.losses, model)


def trigger_sync(out_dir: str, impl: str) -> None:
    accelerator, model, net, optimizer, loader = setup(1)
    batches = iter(loader)
    for a, b in zip(batches, batches):
        with accelerator.no_sync(model):
            loss_a = model(a["x"], a["labels"])["loss"]
            loss_b = model(b["x"], b["labels"])["loss"]
        accelerator.backward(loss_a)  # local only
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss_b)  # synchronises both
        optimizer.step()
        optimizer.zero_grad()
    common.record(out_dir, "accelerate", impl, "trigger_sync", net, net.losses, model)


def overlap(out_dir: str, impl: str) -> None:
    # The model prepared first: under gradsync it is gradsync's wrapper, whose
    # overlap_optimizer then goes to Accelerate in the optimizer's place.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = common.model()
    model = accelerator.prepare(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    if impl == "gradsync":
        optimizer = model.overlap_optimizer(optimizer)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    loader = torch.utils.data.DataLoader(common.Points(), batch_size=4, shuffle=False)
    optimizer, schedule, loader = accelerator.prepare(optimizer, schedule, loader)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(batch["x"], batch["labels"])["loss"]
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # reads every gradient: each bucket lands first
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    common.record(out_dir, "accelerate", impl, "overlap", net, net.losses, model)


if __name__ == "__main__":
    common.main("accelerate", {"accumulate": accumulate, "trigger_sync": trigger_sync,
                               "overlap": overlap})
