"""A small data-parallel training loop in plain PyTorch (no transformers).

    torchrun --nproc_per_node 4 examples/train_plain.py
    python -m checkpointless --nproc 4 --spares 1 --fault kill:2:10 examples/train_checkpointless.py

train_checkpointless.py is this loop made fault tolerant by changing a few lines: a worker killed
mid-run is replaced by a warm spare that receives the state from a peer, and the final parameters
are bit for bit those of the run without the failure.
"""
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MAX_STEPS = int(os.environ.get("MAX_STEPS", "40"))
SEED = 0


def batch(step, rank):
    """The data a rank trains on at a step depends on (step, rank) alone."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(64, 32, generator=g)
    return x, torch.sin(3 * x[:, :1]) + x[:, 1:2] ** 2


def train_step(step):
    torch.manual_seed(SEED * 7919 + step * 131 + rank)  # dropout depends on (step, rank) only
    x, y = batch(step, rank)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    losses.append(loss.item())


def digest(module):
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


torch.manual_seed(SEED)
model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
losses = []
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for step in range(MAX_STEPS):
    train_step(step)
result = {"rank": rank, "first_loss": losses[0], "last_loss": losses[-1],
          "params_sha256": digest(model)}
print(json.dumps(result), flush=True)
dist.destroy_process_group()
