"""Lightning Fabric under torchrun (2 CPU ranks, gloo): gradient accumulation with
`fabric.no_backward_sync` (which raises TypeError for anything that is not a DDP instance)."""

from __future__ import annotations

import common
import torch
from lightning.fabric import Fabric


def accumulate(out_dir: str, impl: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    net = common.model()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(common.Points(), batch_size=4))
    for i, batch in enumerate(loader):
        boundary = i % 2 == 1
        with fabric.no_backward_sync(model, enabled=not boundary):
            fabric.backward(model(batch["x"], batch["labels"])["loss"])
        if boundary:
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
            optimizer.step()
            optimizer.zero_grad()
    common.record(
        out_dir, "fabric", impl, "no_backward_sync", net, net.losses, model._forward_module
    )


if __name__ == "__main__":
    common.main("fabric", {"no_backward_sync": accumulate})
