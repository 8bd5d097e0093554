"""A typical data-parallel script: torch's DDP wrapper, a DistributedSampler, a LambdaLR schedule.

    torchrun --nproc_per_node 4 examples/train_ddp.py
    python -m checkpointless --nproc 4 --spares 1 --fault kill:2:12 examples/train_ddp_checkpointless.py

train_ddp_checkpointless.py is this script made fault tolerant; `diff` the two to see every line
that changes (the README counts them).
"""
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset

MAX_STEPS = int(os.environ.get("MAX_STEPS", "30"))
BATCH = 32

g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 32, generator=g)
dataset = TensorDataset(x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
per_epoch = len(sampler) // BATCH


def batch(step):
    """The batch of a step: the sampler's order for its epoch, sliced at the step."""
    sampler.set_epoch(step // per_epoch)
    order = list(sampler)
    at = (step % per_epoch) * BATCH
    return dataset[order[at:at + BATCH]]


for step in range(MAX_STEPS):
    torch.manual_seed(step * 131 + rank)  # dropout of a step depends on (step, rank) only
    xb, yb = batch(step)
    loss = F.mse_loss(model(xb), yb)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()

h = hashlib.sha256()
for name, t in sorted(model.module.state_dict().items()):
    h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
print(json.dumps({"rank": rank, "loss": loss.item(), "params_sha256": h.hexdigest()}), flush=True)
dist.destroy_process_group()
