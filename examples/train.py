# examples/train.py -- run with: torchrun --nproc-per-node 2 examples/train.py
import torch, torch.distributed as dist
import gradsync

dist.init_process_group("gloo")                      # "nccl" on GPUs
model = gradsync.DistributedDataParallel(torch.nn.Linear(10, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x in torch.randn(100, 8, 10):
    opt.zero_grad()
    model(x).pow(2).mean().backward()                # gradients averaged across ranks here
    opt.step()
print(f"rank {dist.get_rank()}: trained 100 steps", flush=True)
del model, opt                                       # release the group before it is destroyed
dist.barrier()                                       # let no rank leave while others still send
dist.destroy_process_group()
