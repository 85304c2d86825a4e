#!/bin/bash
# Pretraining checks on a CUDA machine (not run by CI): the shakespeare recipe for 60 s with
# `device: auto`, `frawd eval` and `frawd generate` on the GPU, resume == uninterrupted (fp32),
# the tiny preset's tokens/s; then (issue 15) bf16 + compile throughput and MFU of the `base` and
# `100m` presets against the card's bf16 dense peak (PEAK_TFLOPS, default 989 = H100/H200 SXM;
# target: mfu_100m >= 0.45), decode tokens/s at batch 1 and 64 against transformers, and 300
# steps of `frawd pretrain --nproc 1 --parallel fsdp`. Run from the repository root, with torch (CUDA) and the
# package's dependencies importable; the package itself need not be installed. The last line
# printed is the headline, mfu_100m= (step 5's figure, repeated).
#   bash benchmarks/cuda_check.sh [path/to/tinyshakespeare.txt]
# A failing step stops the script with a non-zero exit; its temporary folder is removed.
set -euo pipefail
usage="usage: bash benchmarks/cuda_check.sh [-h] [path/to/tinyshakespeare.txt]

Pretraining, decoding and FSDP checks on a CUDA GPU (see the comment at the top of this file).
The text defaults to ../shared/data/tinyshakespeare.txt; PEAK_TFLOPS (default 989) and BATCH
(default 32) set step 5's peak and batch size."
case "${1:-}" in
  -h|--help) echo "$usage"; exit 0 ;;
  -*) echo "cuda_check.sh: error: unknown option $1 (see --help)" >&2; exit 2 ;;
esac
if [ $# -gt 1 ]; then echo "cuda_check.sh: error: one argument at most, the text file (see --help)" >&2; exit 2; fi
D=${1:-../shared/data/tinyshakespeare.txt}
if [ ! -f "$D" ]; then echo "cuda_check.sh: error: text file not found: $D (see --help)" >&2; exit 1; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! python3 -c "import torch" 2>/dev/null; then
  echo "cuda_check.sh: error: python3 cannot import torch; run this where torch (CUDA) is installed" >&2
  exit 1
fi
if ! python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "cuda_check.sh: error: no CUDA GPU here (torch.cuda.is_available() is False); these checks need one" >&2
  exit 1
fi
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
trap 'echo "cuda_check.sh: error: the step above failed (line $LINENO); stopping" >&2' ERR
frawd() { python3 -c 'import sys; from frawdllm.cli import main; main(sys.argv[1:])' "$@"; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
echo "== 1. shakespeare recipe (device auto, bf16, compile), 60 s"
frawd pretrain --config configs/shakespeare_char.yaml --data "$D" --max-time 60s --out $W/sh --no-progress 2>&1 \
    | tail -1
echo "== 2. frawd eval and generate on cuda"
frawd eval --model $W/sh/model --data "$D" --device cuda --max-batches 50 2>$W/eval.err \
    || { cat $W/eval.err >&2; false; }
frawd generate --model $W/sh/model --prompt "ROMEO:" --max-new-tokens 80 --device cuda --seed 1 --stats 2>&1 | tail -3
echo "== 3. resume == uninterrupted, fp32 eager: 40 steps vs 20 + resume to 40"
R="--config configs/shakespeare_char.yaml --data $D --dtype fp32 --no-compile --max-time 1h --schedule constant
   --warmup-steps 0 --eval-interval 20 --log-interval 1 --sample-tokens 0 --no-progress"
frawd pretrain $R --max-steps 40 --out $W/a > $W/a.log 2>&1 || { tail -3 $W/a.log; false; }
frawd pretrain $R --max-steps 20 --out $W/b > $W/b.log 2>&1 || { tail -3 $W/b.log; false; }
frawd pretrain $R --max-steps 40 --out $W/b --resume > $W/b2.log 2>&1 || { tail -3 $W/b2.log; false; }
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
echo "== 5. bf16 + compile training throughput and MFU of base and 100m (peak ${PEAK_TFLOPS:=989} TFLOP/s)"
for P in base 100m; do
  frawd pretrain --preset $P --data "$D" --tokenizer char --set vocab_size=$([ $P = 100m ] && echo 32000 || echo 8192) \
      --dtype bf16 --compile true --batch-size ${BATCH:-32} --max-steps 150 --eval-interval 0 --sample-tokens 0 \
      --log-interval 10 --peak-tflops $PEAK_TFLOPS --out $W/$P --no-progress 2>&1 | tail -1
  python3 - $W/$P $P <<'PY' | tee $W/$P.figures
import json, statistics, sys
rows = [r for r in map(json.loads, open(f"{sys.argv[1]}/metrics.jsonl")) if "mfu" in r][-5:]
name = sys.argv[2]
print(f"tokens_per_s_{name}={statistics.median(r['tokens_per_s'] for r in rows):.0f}")
print(f"mfu_{name}={statistics.median(r['mfu'] for r in rows):.3f}")
PY
done
echo "== 6. decode tokens/s, batch 1 and 64, against transformers (base, bf16)"
python3 benchmarks/cuda_decode.py --preset base
echo "== 7. frawd pretrain --nproc 1 --parallel fsdp, 300 steps (bf16)"
frawd pretrain --nproc 1 --parallel fsdp --preset tiny --data "$D" --tokenizer char --dtype bf16 --max-steps 300 \
    --batch-size 64 --eval-interval 100 --out $W/fsdp --no-progress > $W/fsdp.log 2>&1 \
    || { tail -3 $W/fsdp.log; false; }
echo "fsdp_run_exit=0"
echo "fsdp_last_line=$(tail -1 $W/fsdp.log)"
echo "fsdp_checkpoints=$(ls $W/fsdp/checkpoints | tr '\n' ' ')"
echo "== the headline (target: mfu_100m >= 0.45), from step 5"
grep '^mfu_100m=' $W/100m.figures
