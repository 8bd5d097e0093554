"""train_ddp.py made fault tolerant: the diff to the torchrun script is the whole change.

    python -m checkpointless --nproc 4 --spares 1 --fault kill:2:12 examples/train_ddp_checkpointless.py

A worker killed mid-epoch is replaced by a warm spare that receives the model, optimizer, schedule
and the loader's position from a peer, and starts at the next batch of that epoch; the run ends
with the bits of the same script run without a failure.
"""
import hashlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import checkpointless
from checkpointless import DistributedDataParallel as DDP

EPOCHS = int(os.environ.get("EPOCHS", "3"))
WORKERS = int(os.environ.get("LOADER_WORKERS", "0"))

g = torch.Generator().manual_seed(0)
x = torch.randn(1024, 32, generator=g)
dataset = TensorDataset(x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2)

job = checkpointless.join()  # a spare waits here, warm, until it is handed a failed rank
rank, world = job.rank, job.world_size
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=WORKERS)
job.protect(model=model, optimizer=opt, scheduler=sched, loader=loader)

for epoch in job.epochs(EPOCHS):  # after a recovery, resumes at the agreed epoch
    sampler.set_epoch(epoch)
    for xb, yb in job.batches(loader):  # ... and at the agreed batch of it
        with job.step():  # a peer's failure in here is recovered and the step redone
            loss = F.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()

h = hashlib.sha256()
for name, t in sorted(model.module.state_dict().items()):
    h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
result = {"rank": rank, "loss": loss.item(), "params_sha256": h.hexdigest()}
print(json.dumps(result), flush=True)
job.finish(result)
