"""Run by test_harness: gradsync.init_process_group as two torchrun restart attempts would call
it, on one agent store: the second attempt must not see what the first left there."""

import datetime
import os

import torch.distributed as dist

import gradsync

timeout = datetime.timedelta(seconds=30)
agent = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timeout)  # torchrun's agent store
os.environ.update({
    "TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": str(agent.port), "RANK": "0", "WORLD_SIZE": "1",
})
seen = []
for attempt in ("0", "1"):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = attempt
    gradsync.init_process_group("gloo", timeout=timeout)
    store = dist.distributed_c10d._get_default_store()
    seen.append(store.check(["address-of-rank-0"]))
    store.set("address-of-rank-0", f"written by attempt {attempt}")
    dist.destroy_process_group()
print(
    "seen before writing, per attempt:",
    seen,
    "keys in the agent store:",
    agent.num_keys(),
    flush=True,
)
