"""Values torch's DDP accepts that are not quite what its signature says (a flag given as 0, 1,
None or numpy's bool; an empty device_ids): gradsync trains with them to the same parameters,
torch's DDP side by side on the same groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from gradsync import DistributedDataParallel as GradsyncDDP
from gradsync.testing import run_threaded, seeded

ACCEPTED = [
    ("find_unused_parameters", 1),
    ("find_unused_parameters", None),
    ("find_unused_parameters", np.True_),
    ("gradient_as_bucket_view", 1),
    ("static_graph", 0),
    ("static_graph", None),
    ("broadcast_buffers", 0),
    ("init_sync", 1),
    ("skip_all_reduce_unused_params", 1),
    ("bucket_cap_mb", 0),
    ("device_ids", []),
    ("dim", 5),
]


@pytest.mark.parametrize(("keyword", "value"), ACCEPTED, ids=[f"{k}={v!r}" for k, v in ACCEPTED])
def test_a_value_torch_accepts_trains_as_torch_ddp(keyword, value):
    def body(rank, group):
        results = []
        for wrapper in (TorchDDP, GradsyncDDP):
            model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), 0)
            ddp = wrapper(model, process_group=group, **{keyword: value})
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                ddp(
                    torch.linspace(-1, 1, 12).reshape(3, 4) * (rank + step + 1)
                ).pow(2).sum().backward()
                opt.step()
                opt.zero_grad()
            results.append([p.detach().clone() for p in model.parameters()])
        return results

    for theirs, ours in run_threaded(body, 2, timeout=30):
        assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
