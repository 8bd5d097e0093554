"""A GPT training loop in the shape of the most-copied ones, under torchrun, unchanged:

    torchrun --standalone --nproc_per_node 4 examples/gpt_prefetch.py

Like them it draws the next step's batch during the current step (`X, Y = get_batch("train")`
right after the forward: on a GPU the copy overlaps the backward) from the global random
generator, and rank 0 evaluates every EVAL_INTERVAL steps inside the loop. Its fault-tolerant port
is examples/gpt_prefetch_checkpointless.py: the README's change, plus the one line that a step
must draw its own batch (README, "A step must be replayable").
"""
import hashlib
import json
import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

MAX_ITERS = int(os.environ.get("MAX_ITERS", "40"))
LOG_INTERVAL = int(os.environ.get("LOG_INTERVAL", "10"))
EVAL_INTERVAL, EVAL_ITERS = 10, 2
BATCH, BLOCK, N_LAYER, N_HEAD, N_EMBD = 8, 32, 2, 2, 32
LR, MIN_LR, WARMUP = 3e-3, 3e-4, 5

# a corpus made here: words drawn from a small vocabulary, as bytes
words = "the spare takes over a lost rank and the job trains on without a restart".split()
g = torch.Generator().manual_seed(0)
text = " ".join(words[i] for i in torch.randint(len(words), (4000,), generator=g).tolist())
data = torch.tensor(list(text.encode()), dtype=torch.long)
train_data, val_data = data[:int(0.9 * len(data))], data[int(0.9 * len(data)):]


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - BLOCK, (BATCH,))
    x = torch.stack([d[i:i + BLOCK] for i in ix])
    y = torch.stack([d[i + 1:i + 1 + BLOCK] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.qkv, self.proj = nn.Linear(N_EMBD, 3 * N_EMBD), nn.Linear(N_EMBD, N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(),
                                 nn.Linear(4 * N_EMBD, N_EMBD), nn.Dropout(0.1))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if
                                           self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(256, N_EMBD), nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f, self.head = nn.LayerNorm(N_EMBD), nn.Linear(N_EMBD, 256, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, 256), targets.view(-1))
        return logits, loss


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            _, losses[k] = model.module(*get_batch(split))
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < WARMUP:
        return LR * (it + 1) / WARMUP
    ratio = (it - WARMUP) / max(1, MAX_ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1337 + rank)
model = DDP(GPT())
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)

X, Y = get_batch("train")  # the first batch
for it in range(MAX_ITERS):
    lr = get_lr(it)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if it % EVAL_INTERVAL == 0 and rank == 0:
        losses = estimate_loss()
        print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
              flush=True)
    logits, loss = model(X, Y)
    X, Y = get_batch("train")  # the next step's batch, drawn while this one trains
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if it % LOG_INTERVAL == 0 and rank == 0:
        print(f"iter {it}: loss {loss.item():.4f}", flush=True)

h = hashlib.sha256()
for name, t in sorted(model.module.state_dict().items()):
    h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
result = {"rank": rank, "loss": loss.item(), "params_sha256": h.hexdigest()}
print(json.dumps(result), flush=True)
dist.destroy_process_group()
