"""German -> English on Multi30k within a wall-clock budget, scored with sacreBLEU on test 2016.

Trains `configs/multi30k.yaml` (aiayn-tiny through `frawd translate train`'s code path:
the shared loop, the joint BPE tokenizer, token-count batches) for `--budget` minus the
time the test translation needs, then translates test 2016 (1,000 sentences) greedily and
with beam search (beam 4, alpha 0.6) and scores both with sacreBLEU (cased, 13a
tokenization, detokenized output against the raw references: its defaults).

Before that, the same process measures training throughput of what `frawd translate
train` runs for this recipe (aiayn-tiny with the recipe's model settings, the trainer's
loss `TranslationTask.loss`: label-smoothed cross-entropy and the nll metric from one
fused pass, its AdamW; eager: the recipe has `compile: false`) against `transformers`'
`MarianMTModel` of the same dimensions (3+3 post-LN layers: Marian has no pre-LN, width
256, 4 heads, d_ff 1024, ReLU, sinusoidal positions, scaled and shared embeddings), eager,
with `F.cross_entropy(label_smoothing=0.1)` on its logits. Both: the same token-count
batches of the real data, forward + loss + backward + fused AdamW + clipping, steps
interleaved (ours, theirs, theirs, ours, ...), each figure the median step; tokens are
real (non-padding) target tokens; in fp32 and under bf16 autocast (where the CPU has
native bf16). Dropout: ours applies the recipe's 0.1 to embeddings, sub-layer outputs
and attention weights; `marian` is configured the same (dropout 0.1, attention_dropout
0.1: the same function), `marian_noattndrop` leaves out attention dropout (less work:
PyTorch then takes its fused CPU attention). `--only-throughput` runs just that part,
`--skip-throughput` skips it. That part runs first and outside the budget: the budget's
clock starts after it (`wall_s=` is the time the budget covers). The run directory is
temporary (removed at the end) unless `--out` names one.

    .venv/bin/python benchmarks/multi30k.py --budget 60m       # the issue's setting
Prints key=value lines, `bleu_beam=` last.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import ArgumentParser, cpu_features_line, duration, positive_int, require, run_main

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("FRAWD_SHARED_DATA") or ROOT.parent / "shared" / "data") / "multi30k"


def say(key: str, value) -> None:
    print(f"{key}={value}", flush=True)


def marian_like(cfg, attention_dropout: float):
    from transformers import MarianConfig, MarianMTModel

    hf = MarianConfig(
        vocab_size=cfg.vocab_size, d_model=cfg.n_embd, encoder_layers=cfg.n_encoder_layer,
        decoder_layers=cfg.n_layer, encoder_attention_heads=cfg.n_head, decoder_attention_heads=cfg.n_head,
        encoder_ffn_dim=cfg.ffn_dim, decoder_ffn_dim=cfg.ffn_dim, activation_function="relu",
        dropout=cfg.dropout, attention_dropout=attention_dropout, activation_dropout=0.0,
        max_position_embeddings=cfg.context_length, scale_embedding=True, pad_token_id=cfg.pad_token_id,
        eos_token_id=cfg.eos_token_id, decoder_start_token_id=cfg.bos_token_id, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, attn_implementation="sdpa")
    return MarianMTModel(hf)


def throughput(train_cfg, model_cfg, pairs, dtype: str, steps: int) -> dict[str, float]:
    """Median training tokens/s of ours and of Marian (with and without attention dropout),
    steps interleaved on the same batches."""
    import torch
    import torch.nn.functional as F

    from frawdllm import Seq2SeqTransformer
    from frawdllm.model import IGNORE_INDEX
    from frawdllm.train.optim import build_optimizer
    from frawdllm.train.translation import TranslationTask, collate, token_batches

    torch.manual_seed(0)
    task = TranslationTask(model_cfg, None, pairs, None, train_cfg.tokens_per_batch,
                           label_smoothing=train_cfg.label_smoothing)

    def hf_loss(model, b):
        logits = model(input_ids=b["src"], attention_mask=b["src_mask"].long(), decoder_input_ids=b["tgt_in"]).logits
        return F.cross_entropy(logits.float().flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                               label_smoothing=train_cfg.label_smoothing)

    ours = Seq2SeqTransformer(model_cfg).train()
    sides = {"ours": (ours, lambda m, b: task.loss(m, b)[0], build_optimizer(ours, train_cfg))}
    for name, attention_dropout in (("marian", model_cfg.dropout), ("marian_noattndrop", 0.0)):
        theirs = marian_like(model_cfg, attention_dropout).train()
        sides[name] = (theirs, hf_loss, torch.optim.AdamW(theirs.parameters(), lr=train_cfg.lr,
                                                          betas=(0.9, train_cfg.beta2), fused=True))
    batches = [collate([pairs[i] for i in b])
               for b in token_batches(pairs, train_cfg.tokens_per_batch, random.Random(0))]
    times: dict[str, list[float]] = {name: [] for name in sides}
    tokens: dict[str, list[int]] = {name: [] for name in sides}
    for step in range(steps + 2):
        batch = batches[step % len(batches)]
        n = int((batch["labels"] != IGNORE_INDEX).sum())
        for name in (list(sides) if step % 2 == 0 else reversed(sides)):
            model, loss_fn, optimizer = sides[name]
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = loss_fn(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 2:  # two warm-up steps
                times[name].append(time.perf_counter() - start)
                tokens[name].append(n)
    # per-step rates, then the median: robust to a noisy neighbour
    return {name: statistics.median(t / s for t, s in zip(tokens[name], times[name])) for name in sides}


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=duration, default="60m",
                        help="Wall-clock budget of training + test translation (its clock starts after the "
                             "throughput part), e.g. 90m, 1h; at least 180s [default: 60m].")
    parser.add_argument("--config", default=str(ROOT / "configs" / "multi30k.yaml"),
                        help="The recipe [default: configs/multi30k.yaml].")
    parser.add_argument("--out", default=None, help="Run directory, kept (default: a temporary one, removed).")
    parser.add_argument("--beam", type=positive_int, default=4, help="Beam size of the beam-search BLEU [default: 4].")
    parser.add_argument("--throughput-steps", type=positive_int, default=20,
                        help="Timed training steps per side and dtype of the throughput part [default: 20].")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only-throughput", action="store_true",
                       help="Run only the training-throughput comparison against Marian (no BLEU).")
    which.add_argument("--skip-throughput", action="store_true",
                       help="Skip the training-throughput comparison: train and score BLEU only.")
    args = parser.parse_args()
    if not args.skip_throughput:
        require("transformers", "frawdllm[hf]")  # Marian, the throughput part's reference
    if not args.only_throughput:
        training_budget(args.budget)  # refused before any work, not after the throughput part
    out = args.out or tempfile.mkdtemp(prefix="multi30k-")
    try:
        run(args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)


def training_budget(budget: str) -> float:
    """The seconds to train of a --budget: the test translation keeps about a tenth of it
    (at least 2 minutes), training gets the rest (at least 1 minute, else bad input)."""
    from frawdllm.errors import FrawdError
    from frawdllm.train.config import parse_duration

    budget_s = parse_duration(budget)
    reserve = max(120.0, 0.1 * budget_s)
    if budget_s - reserve < 60:
        raise FrawdError(f"--budget {budget} leaves {max(budget_s - reserve, 0):.0f} s to train after the test "
                         f"translation's {reserve:.0f} s; give at least {reserve + 60:.0f}s")
    return budget_s - reserve


def run(args, out: str) -> None:
    import torch

    from frawdllm.config import get_config
    from frawdllm.data.parallel import encode_pairs, read_parallel
    from frawdllm.train.config import build_config
    from frawdllm.train.device import cpu_has_bf16
    from frawdllm.train.translation import TranslateConfig, corpus_bleu, run_translation_training, translate_texts

    print(cpu_features_line())
    say("torch_threads", torch.get_num_threads())
    data = {"src": DATA / "train.de.gz", "tgt": DATA / "train.en.gz", "valid_src": DATA / "val.de.gz",
            "valid_tgt": DATA / "val.en.gz"}  # wherever the data is ($FRAWD_SHARED_DATA), not the recipe's paths
    cfg = build_config(TranslateConfig, args.config, {"out": out, "overwrite": True, "progress": False,
                                                      **{k: str(v) for k, v in data.items()}})
    if not args.skip_throughput:
        from frawdllm.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer

        src, tgt = read_parallel(cfg.src, cfg.tgt)
        tok = train_tokenizer((s for side in (src, tgt) for s in side if s.strip()), "bpe", cfg.vocab_size)
        pairs = encode_pairs(tok, src, tgt, cfg.max_len).pairs
        model_cfg = get_config(cfg.preset, **{**cfg.model, "vocab_size": tok.vocab_size, "pad_token_id": PAD_ID,
                                               "bos_token_id": BOS_ID, "eos_token_id": EOS_ID})  # as the trainer's
        for dtype in ("fp32", "bf16"):
            if dtype == "bf16" and not cpu_has_bf16():
                continue  # emulated bf16 would only measure the emulation
            rates = throughput(cfg, model_cfg, pairs, dtype, args.throughput_steps)
            for name, rate in rates.items():
                say(f"train_tokens_per_s_{name}_{dtype}", round(rate))
            say(f"train_speedup_vs_marian_noattndrop_{dtype}", round(rates["ours"] / rates["marian_noattndrop"], 3))
            say(f"train_speedup_vs_marian_{dtype}", round(rates["ours"] / rates["marian"], 3))
        if args.only_throughput:
            return
    started = time.perf_counter()  # the budget's clock: training + test translation (not the part above)
    train_s = training_budget(args.budget)
    test_src, test_ref = read_parallel(DATA / "test_2016_flickr.de.gz", DATA / "test_2016_flickr.en.gz")
    cfg.max_time = f"{train_s:.0f}s"
    say("train_budget_s", round(train_s))
    cpu_start = time.process_time()
    result = run_translation_training(cfg, started_at=started)
    say("train_cpu_s", round(time.process_time() - cpu_start))  # CPU time it got (a busy machine gives less)
    say("train_steps", result.steps)
    say("train_tokens", result.tokens)
    say("tokens_per_s", round(result.tokens_per_s))
    say("best_val_loss", round(result.best_val_loss, 4) if result.best_val_loss is not None else "nan")
    from frawdllm.modeldir import load_model
    from frawdllm.tokenizer import Tokenizer

    model = load_model(Path(out) / "model").eval()
    tokenizer = Tokenizer.load(Path(out) / "model" / "tokenizer.json")
    start = time.perf_counter()
    greedy = translate_texts(model, tokenizer, test_src, beam_size=1)
    say("greedy_s", round(time.perf_counter() - start, 1))
    start = time.perf_counter()
    beam = translate_texts(model, tokenizer, test_src, beam_size=args.beam, alpha=0.6)
    say("beam_s", round(time.perf_counter() - start, 1))
    say("wall_s", round(time.perf_counter() - started))  # what the budget covers
    say("bleu_greedy", round(corpus_bleu(greedy, test_ref).score, 2))
    say("bleu_beam", round(corpus_bleu(beam, test_ref).score, 2))


if __name__ == "__main__":
    run_main(main)
