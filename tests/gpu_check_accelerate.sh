#!/bin/bash
# GPU check of the recipe loop on accelerate, for a machine with one CUDA GPU (not run by pytest;
# this project's CI has no GPU). Four tiny-llama runs at world size 1 on NCCL, 30 steps each:
#   fp16       ddp, fp16 autocast with accelerate's GradScaler (protected), accumulation 2
#   fsdp_acc   fsdp through accelerate's FSDP2 plugin, bf16 autocast, accumulation 2
#   fsdp_own   the same with the launcher's own shard() (forced here through sitecustomize)
#   bf16ddp    ddp, bf16, accumulation 2
# Expect rc=0 everywhere, the start line naming the GradScaler and the FSDP2 plugin, falling
# losses, and fsdp_acc's params_sha256 equal to fsdp_own's (fp32 gather and reduce, the same
# compute). Needs omegaconf and datasets: where they are missing, put copies of their packages
# (omegaconf, datasets, dill, multiprocess, _multiprocess: pure Python) in .devsite/ at the repo root.
#     bash tests/gpu_check_accelerate.sh        (logs in $OUT or /tmp/gpu_check)
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu_check}; mkdir -p "$OUT"
own=$(mktemp -d)
cat > "$own/sitecustomize.py" <<'PY'
import os
if os.environ.get("CL_OWN_SHARD") == "1":
    import launcher.accelerator as _a
    _a.accelerate_shards = lambda cfg, device: False
PY
export PYTHONPATH=$PWD/.devsite:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
PY=${PYTHON:-python3}
nvidia-smi -L
$PY -c "import torch, accelerate, transformers; print(torch.__version__, accelerate.__version__, transformers.__version__, torch.cuda.is_available())" || exit 4
common="distributed.device=auto distributed.backend=auto distributed.num_processes=1 checkpointless.spares=0 trainer.progress_bar=false trainer.max_steps=30 trainer.log_every=10 data.cache_dir=/tmp/gpu_check_cache"
run() {
  name=$1; shift
  echo "=== $name: $*"
  t0=$(date +%s)
  timeout 300 $PY -m launcher train tiny-llama $common run.output_dir=/tmp/gpu_check_$name "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "Accelerator|^step |done|Error|error" "$OUT/$name.log" | tail -8
  $PY - "$name" <<'PY'
import json, sys
n = sys.argv[1]
try:
    r = json.load(open(f"/tmp/gpu_check_{n}/report.json"))
    a = json.load(open(f"/tmp/gpu_check_{n}/results/rank0.json"))["accelerator"]
    print(n, r["status"], r["params_sha256"][:16], r["final_loss"], a)
except Exception as exc:
    print(n, "no report:", exc)
PY
}
run fp16 trainer.precision=fp16 trainer.grad_accum_steps=2
run fsdp_acc distributed.strategy=fsdp trainer.precision=bf16 trainer.grad_accum_steps=2 checkpointless.replication.factor=1
CL_OWN_SHARD=1 PYTHONPATH=$own:$PYTHONPATH run fsdp_own distributed.strategy=fsdp trainer.precision=bf16 trainer.grad_accum_steps=2 checkpointless.replication.factor=1
run bf16ddp trainer.precision=bf16 trainer.grad_accum_steps=2
