"""A typical data-parallel script: torch's DDP wrapper, a DataLoader over a DistributedSampler,
epochs, a LambdaLR schedule.

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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = int(os.environ.get("EPOCHS", "3"))
WORKERS = int(os.environ.get("LOADER_WORKERS", "0"))

g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 32, generator=g)
dataset = TensorDataset(x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2)

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=WORKERS)

for epoch in range(EPOCHS):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
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
