"""Peak memory of FSDP2 workers with the sharded init, without the launcher (torch + transformers
only): a 0.4B Llama (hidden 1024, 24 layers) on N CPU ranks, built on the meta device, sharded,
each rank filling its shard (models/init.py), then 2 AdamW steps on random tokens.

    MALLOC_MMAP_THRESHOLD_=1048576 CUDA_VISIBLE_DEVICES= python tests/support/scripts/sharded_memory_probe.py 8

Prints per rank: the resident set after imports, the init time, the high-water mark above it,
and that figure over the full model's fp32 bytes (a rank that ever held the whole model would
be at >= 1). Measured on a 16-core machine, 8 ranks: 0.74 with the threshold, 0.82-0.97 with
glibc's default (its heap keeps freed FSDP buffers).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from transformers import LlamaForCausalLM  # noqa: E402,F401  imported before the baseline

from models import build_model  # noqa: E402
from models.init import EmptyBuild, materialize  # noqa: E402


def status():
    return {line.split(":")[0]: int(line.split()[1]) * 1024
            for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM"))}


def main(rank, world):
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29633")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    base, t0 = status()["VmRSS"], time.time()
    config = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64,
                  tie_word_embeddings=False)
    with EmptyBuild() as built:
        model = build_model("llama", config=config, vocab_size=257)
    rules = built.rules(model)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    materialize(model, rules, 0, "cpu")
    init_s = time.time() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randint(0, 257, (1, 32), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in model.parameters())
    above = status()["VmHWM"] - base
    print(f"rank {rank}: {n:,} params, baseline {base / 1e9:.3f} GB, init {init_s:.1f} s, "
          f"peak above baseline {above / 1e9:.3f} GB = {above / (4 * n):.3f} of the full fp32 "
          "model", flush=True)


if __name__ == "__main__":
    import torch.multiprocessing as mp
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    mp.spawn(main, args=(world,), nprocs=world)
