"""A typical accelerate script, shaped like accelerate's examples/nlp_example.py: a sequence
classifier trained for a few epochs over a shuffled DataLoader that accelerate shards, evaluated
after each epoch with gather_for_metrics and an accuracy computed by hand. The model is a tiny
BERT built from a config and the data is generated, so it runs offline in seconds on a CPU.

    torchrun --nproc_per_node 2 examples/accelerate_plain.py --cpu
    accelerate launch --cpu --num_processes 2 examples/accelerate_plain.py --cpu

accelerate_checkpointless.py is this script made fault tolerant; `diff` the two to see every line
that changes.
"""
import argparse
import hashlib
import json

import torch
from torch.optim import AdamW
from torch.utils.data import DataLoader
from transformers import (BertConfig, BertForSequenceClassification,
                          get_linear_schedule_with_warmup, set_seed)

from accelerate import Accelerator

MAX_GPU_BATCH_SIZE = 16
EVAL_BATCH_SIZE = 16
VOCAB, PAD = 64, 0


def make_split(size, seed):
    """Token sequences of 8 to 24 tokens; the label says whether the first token is a low one."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(size):
        ids = torch.randint(1, VOCAB, (int(torch.randint(8, 25, (1,), generator=g)),), generator=g)
        rows.append({"input_ids": ids, "labels": int(ids[0] < VOCAB // 2)})
    return rows


def collate_fn(examples):
    """Pad to the longest sequence of the batch, as tokenizer.pad(padding="longest") would."""
    longest = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), longest), PAD)
    attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for i, e in enumerate(examples):
        input_ids[i, : len(e["input_ids"])] = e["input_ids"]
        attention_mask[i, : len(e["input_ids"])] = 1
    labels = torch.tensor([e["labels"] for e in examples])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def get_dataloaders(accelerator: Accelerator, batch_size: int = 16):
    with accelerator.main_process_first():  # where the datasets would be tokenized
        train, validation = make_split(192, seed=1), make_split(100, seed=2)
    train_dataloader = DataLoader(train, shuffle=True, collate_fn=collate_fn, batch_size=batch_size,
                                  drop_last=True)
    eval_dataloader = DataLoader(validation, shuffle=False, collate_fn=collate_fn,
                                 batch_size=EVAL_BATCH_SIZE)
    return train_dataloader, eval_dataloader


def training_function(config, args):
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision)
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    set_seed(seed)
    train_dataloader, eval_dataloader = get_dataloaders(accelerator, batch_size)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2))
    model = model.to(accelerator.device)
    optimizer = AdamW(params=model.parameters(), lr=lr)
    lr_scheduler = get_linear_schedule_with_warmup(
        optimizer=optimizer, num_warmup_steps=10,
        num_training_steps=len(train_dataloader) * num_epochs)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    for epoch in range(num_epochs):
        model.train()
        for step, batch in enumerate(train_dataloader):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if step % 5 == 0:  # log the loss averaged over the ranks: a collective every 5 batches
                loss = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.print(f"epoch {epoch} batch {step}: loss {loss.item()!r}")

        model.eval()
        correct = total = 0
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            total += references.numel()
        eval_metric = {"accuracy": correct / total, "examples": total}
        accelerator.print(f"epoch {epoch}:", json.dumps(eval_metric))

    h = hashlib.sha256()
    for name, t in sorted(accelerator.unwrap_model(model).state_dict().items()):
        h.update(name.encode() + t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    print(json.dumps({"rank": accelerator.process_index, "params_sha256": h.hexdigest()}),
          flush=True)
    del model  # torch's DDP wrapper holds the process group: drop it before the group goes
    accelerator.free_memory()
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default=None,
                        choices=["no", "fp16", "bf16", "fp8"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": 3, "seed": 42, "batch_size": 8}
    training_function(config, args)


if __name__ == "__main__":
    main()
