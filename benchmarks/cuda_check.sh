#!/bin/bash
# Pretraining checks on a CUDA machine (not run by CI): the shakespeare recipe for 60 s with
# `device: auto`, `frawd eval` and `frawd generate` on the GPU, resume == uninterrupted (fp32),
# and the tiny preset's tokens/s. Run from the repository root, with torch (CUDA) and the
# package's dependencies importable; the package itself need not be installed.
#   bash benchmarks/cuda_check.sh [path/to/tinyshakespeare.txt]
D=${1:-../shared/data/tinyshakespeare.txt}
W=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
frawd() { python3 -c 'import sys; from frawdllm.cli import main; main(sys.argv[1:])' "$@"; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo "== 1. shakespeare recipe (device auto, bf16, compile), 60 s"
frawd pretrain --config configs/shakespeare_char.yaml --data "$D" --max-time 60s --out $W/sh --no-progress 2>&1 | tail -1
echo "== 2. frawd eval and generate on cuda"
frawd eval --model $W/sh/model --data "$D" --device cuda --max-batches 50 2>/dev/null
frawd generate --model $W/sh/model --prompt "ROMEO:" --max-new-tokens 80 --device cuda --seed 1 --stats 2>&1 | tail -3
echo "== 3. resume == uninterrupted, fp32 eager: 40 steps vs 20 + resume to 40"
R="--config configs/shakespeare_char.yaml --data $D --dtype fp32 --no-compile --max-time 1h --schedule constant
   --warmup-steps 0 --eval-interval 20 --log-interval 1 --sample-tokens 0 --no-progress"
frawd pretrain $R --max-steps 40 --out $W/a > $W/a.log 2>&1 || tail -3 $W/a.log
frawd pretrain $R --max-steps 20 --out $W/b > $W/b.log 2>&1 || tail -3 $W/b.log
frawd pretrain $R --max-steps 40 --out $W/b --resume > $W/b2.log 2>&1 || tail -3 $W/b2.log
python3 - $W <<'PY'
import json, sys
def losses(p): return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if "loss" in r}
a, b = losses(f"{sys.argv[1]}/a/metrics.jsonl"), losses(f"{sys.argv[1]}/b/metrics.jsonl")
steps = sorted(set(a) & set(b) & set(range(21, 41)))
print(f"resumed_steps_compared={len(steps)} max_abs_loss_diff={max(abs(a[s] - b[s]) for s in steps):.3g} "
      f"bitwise={all(a[s] == b[s] for s in steps)}")
PY
echo "== 4. tiny preset (bf16, compile, batch 64 x 256), 300 steps"
frawd pretrain --preset tiny --data "$D" --tokenizer char --max-steps 300 --batch-size 64 --compile \
    --eval-interval 0 --sample-tokens 0 --out $W/t --no-progress 2>&1 | tail -1
python3 - $W <<'PY'
import json, sys
rows = [r for r in map(json.loads, open(f"{sys.argv[1]}/t/metrics.jsonl")) if "tokens_per_s" in r][-5:]
print("tiny_tokens_per_s_last_steps=" + ",".join(str(round(r["tokens_per_s"])) for r in rows))
PY
rm -rf $W
