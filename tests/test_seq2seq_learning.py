"""A tiny encoder-decoder learns to reverse random symbol sequences through the shared
training loop, to at least 99% exact match on unseen sequences. (Copying, the easier task,
was tested too: 15 s of the suite that reversing, which needs the same cross-attention
plus positions, already covers.)"""

import random
import time

import pytest
import torch

from frawdllm import Seq2SeqTransformer, get_config
from frawdllm.infer.translate import translate_ids
from frawdllm.train.config import TrainConfig
from frawdllm.train.loop import Trainer
from frawdllm.train.translation import TranslationTask

SYMBOLS = range(7, 17)  # ten symbols after the tokenizer's seven special ids
# The learning rate anneals (cosine, to a tenth of the peak) so that the last steps settle:
# with the paper's inverse square root (noam) the exact match still swung by a few percent
# from one check to the next, and where it stood after a fixed step count depended on the
# CPU's rounding (reverse at 1000 steps: 1.0 on an AMD EPYC, 0.915 on an Intel Xeon, where
# 1200-1800 steps gave 0.995-1.0 and 2000 0.98). With cosine, on the Xeon: reverse 1.0 after
# 800, 1000 and 1200 steps, copy 1.0 after 600 and 800.
STEPS = {"copy": 800, "reverse": 1000}


def _pairs(n: int, reverse: bool, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    out = []
    for _ in range(n):
        seq = [rng.choice(SYMBOLS) for _ in range(rng.randint(3, 8))]
        out.append((seq, seq[::-1] if reverse else list(seq)))
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task", ["reverse"])
def test_tiny_model_learns_the_task(task, tmp_path, shape_checks_for_first_steps):
    rng = random.Random(0)
    train, test = _pairs(4000, task == "reverse", rng), _pairs(200, task == "reverse", rng)
    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=17, n_embd=64, n_head=4, n_layer=2, n_encoder_layer=2,
                     mlp_hidden=128, dropout=0.0, context_length=32, norm_placement="pre")
    model = Seq2SeqTransformer(cfg)
    task_ = TranslationTask(cfg, None, train, None, tokens_per_batch=512, label_smoothing=0.0, bleu_sentences=0,
                            samples=0)
    train_cfg = TrainConfig(out=str(tmp_path / "run"), max_steps=STEPS[task], lr=2e-3, schedule="cosine",
                            warmup_steps=100,
                            beta2=0.98, weight_decay=0.0, dtype="fp32", compile="false", progress=False,
                            eval_interval=0, sample_tokens=0, peak_tflops=1.0)
    start = time.perf_counter()
    Trainer(model, task_, train_cfg).fit()
    assert shape_checks_for_first_steps[0] == STEPS[task]  # (the checks were on in the first ones)
    hyps = translate_ids(model, [src for src, _ in test], beam_size=1)
    exact = sum(h == tgt for h, (_, tgt) in zip(hyps, test)) / len(test)
    print(f"{task}: exact match {exact:.3f} in {time.perf_counter() - start:.1f} s")
    assert exact >= 0.99
