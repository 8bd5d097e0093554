#!/bin/bash
# one-shot device check: environment probe, sharded init on CUDA, the 0.4B/8-worker memory run
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MALLOC_MMAP_THRESHOLD_=1048576 TOKENIZERS_PARALLELISM=false
PY=$(command -v python3 || command -v python)
echo "python: $PY"; nproc; free -g | head -2
$PY -c "import torch, transformers, peft, datasets, omegaconf, safetensors; print('versions', torch.__version__, transformers.__version__, torch.cuda.is_available())" || { echo "NO ENV"; exit 3; }
$PY -m pip install -e . --no-deps --no-build-isolation -q >/dev/null 2>&1 || true
cat > /tmp/gpu_init.py <<'PY'
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from launcher.recipes import load
from launcher.model_setup import build, shard, full_state
from checkpointless.digest import state_sha256
ov = ["model.config.num_hidden_layers=2", "data.seq_len=32", "distributed.device=cuda"]
dev = torch.device("cuda", 0)
_, m, _ = build(load("tiny-llama", ov), dev)
whole = state_sha256(m.state_dict())
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29611", rank=0, world_size=1)
cfg = load("tiny-llama", ov + ["distributed.strategy=fsdp", "distributed.num_processes=1", "trainer.precision=bf16", "model.gradient_checkpointing=true"])
_, f, sampler = build(cfg, dev)
shard(f, cfg)
sharded = state_sha256(full_state(f, "fsdp"))
batch = {k: v.to(dev) for k, v in sampler.batch(0, 0, 1, 0).items()}
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = f(**batch).loss
loss.backward()
p = next(f.parameters())
print("GPU whole==sharded(fp32 master):", whole == sharded, "param", p.dtype, "grad", p.grad.dtype, "loss", float(loss))
PY
timeout 120 $PY /tmp/gpu_init.py 2>&1 | grep -v Warning | tail -5
W="model.config.hidden_size=1024 model.config.intermediate_size=4096 model.config.num_attention_heads=16 model.config.num_key_value_heads=16 model.config.max_position_embeddings=64"
R="distributed.strategy=fsdp distributed.num_processes=8 distributed.device=cpu distributed.threads_per_worker=2 trainer.micro_batch_size=1 data.seq_len=32 data.synthetic_docs=200 trainer.save_model=false optim.warmup_steps=1 trainer.log_every=1 checkpointless.heartbeat_timeout_s=120 checkpointless.pg_timeout_s=900 trainer.progress_bar=false"
start=$(date +%s)
timeout 360 $PY -m launcher train tiny-llama $W model.config.num_hidden_layers=24 $R trainer.max_steps=2 checkpointless.spares=0 checkpointless.replication.factor=1 run.output_dir=$OUT/big data.cache_dir=/tmp/cache > $OUT/big.log 2>&1
echo "big rc=$? in $(( $(date +%s) - start )) s"; tail -3 $OUT/big.log
$PY - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/big/report.json"))
m = r.get("memory") or {}
full = (r.get("full_params") or 0) * 4
print("status", r.get("status"), "full_params", r.get("full_params"), "full fp32 GB", full / 1e9)
for k, peak in (m.get("peak_rss_bytes_by_rank") or {}).items():
    b = m["baseline_rss_bytes_by_rank"][k]
    print(k, "baseline GB", round(b / 1e9, 3), "peak GB", round(peak / 1e9, 3), "above", round((peak - b) / 1e9, 3), "ratio", round((peak - b) / full, 3), "state GB", round(m["model_state_bytes_by_rank"][k] / 1e9, 3))
print("digests agree:", len(set(r.get("params_sha256_by_rank", {}).values())) == 1)
PY
rm -rf $OUT/big/results
