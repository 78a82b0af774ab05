"""Small models that exercise the shapes DDP meets: many small parameters, a shared (tied)
parameter, a frozen one, an unused branch, convolutions, complex and double parameters. Each
takes a (batch, 8) float input."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "make_batches"]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ManySmall(nn.Module):
    """60 parameter tensors of a few dozen elements each."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(30))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Tied(nn.Module):
    """One weight used twice in forward (input projection and its transpose)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.mid = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.mid(self.proj(x)))
        return h @ self.proj.weight


class Frozen(nn.Module):
    """The first layer does not train."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.embed.requires_grad_(False)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


class UnusedBranch(nn.Module):
    """`spare` never takes part in forward: needs find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 16)
        self.spare = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.used(x)))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, 1, 2, 4)
        h = torch.relu(self.conv2(torch.relu(self.conv1(h))))
        return self.fc(h.flatten(1))


MODELS = {
    "mlp": MLP,
    "many_small": ManySmall,
    "tied": Tied,
    "frozen": Frozen,
    "unused_branch": UnusedBranch,
    "conv": ConvNet,
}


def make_batches(
    steps: int, world_size: int, per_rank: int = 4, seed: int = 1
) -> list[torch.Tensor]:
    """`steps` global batches of `world_size * per_rank` rows; rank r takes rows r*per_rank..."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(world_size * per_rank, 8, generator=g) for _ in range(steps)]


class WithBatchNorm(nn.Module):
    """Buffers (running statistics) that differ per rank until DDP broadcasts them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


MODELS["batchnorm"] = WithBatchNorm


class SparseEmbedding(nn.Module):
    """An embedding with sparse gradients, fed by indices derived from the float input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x.abs() * 7).long().clamp(max=49)
        return self.head(self.embed(idx).mean(dim=1))


MODELS["sparse_embedding"] = SparseEmbedding


class ComplexAndDouble(nn.Module):
    """A complex weight (a spectral layer's), a float64 layer and a float32 one: a bucket per
    dtype, the complex one reduced as torch's DDP reduces it."""

    def __init__(self) -> None:
        super().__init__()
        self.spectral = nn.Parameter(torch.randn(8, 8, dtype=torch.cfloat) / 8)
        self.wide = nn.Linear(8, 16).double()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x.to(torch.cfloat) @ self.spectral).abs()
        return self.out(torch.tanh(self.wide(h.double())).float())


MODELS["complex"] = ComplexAndDouble
