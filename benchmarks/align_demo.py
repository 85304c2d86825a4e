"""From a base model to a chat model, offline, in minutes: SFT then DPO, measured.

(a) A synthetic task. A small model is pretrained briefly on standard-library text (byte
    tokens), then asked "reverse <word>" for random words (3 letters by default, see
    --min-letters/--max-letters) in the chat template:
    it starts near 0% exact match. SFT on other words must reach at least 90% exact match
    on held-out words (greedy). Then preference pairs whose chosen answer follows a rule
    the SFT model does not follow (the reversed word in UPPER case; rejected: lower case)
    train DPO from the SFT model: held-out preference accuracy (the implicit reward of the
    chosen answer above the rejected's) must reach 90%, and the share of upper-case
    answers among sampled ones (temperature 1) must rise by at least 30 points. The KL
    to the reference (the SFT model) is estimated on those samples.
(b) stdlib-instruct on the `make demo` model (configs/demo_stdlib.yaml; --demo-model DIR
    reuses one, else it is trained here): the share of held-out "Write a Python function"
    requests whose greedy answer parses with `ast.parse` and defines a function, before and
    after SFT on stdlib-instruct, and after DPO on stdlib-prefs.

Every figure is a share of held-out prompts, printed as key=value lines (the headline,
sft_acc_after, last; with --skip-synthetic, which has no (a) figures, part (b)'s headline,
stdlib_parse_after_dpo, last). Run it under `flock /tmp/bench.lock` on a shared machine.

    .venv/bin/python benchmarks/align_demo.py [--demo-model runs/demo/model] [--skip-stdlib]
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ArgumentParser, cpu_features_line, duration, positive_float, positive_int, run_main

ROOT = Path(__file__).resolve().parent.parent


def say(message: str) -> None:
    print(f"[align_demo] {message}", file=sys.stderr, flush=True)


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


TEST_WORDS = 200  # held out: the words the after-training accuracy is measured on


def random_words(n: int, rng: random.Random, lengths: tuple[int, int], exclude: set[str] = frozenset()) -> list[str]:
    words: list[str] = []
    seen = set(exclude)
    while len(words) < n:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(*lengths)))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def chat_prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.render_chat([{"role": "user", "content": text}], add_generation_prompt=True)


def answers(model_dir: Path, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> list[str]:
    from frawdllm.infer import Engine, SamplingParams
    from frawdllm.modeldir import load_model
    from frawdllm.tokenizer import Tokenizer

    tok = Tokenizer.load(model_dir)
    engine = Engine(load_model(model_dir), tok)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    out: list[str] = []
    for i in range(0, len(prompts), 64):
        out += [c.text for c in engine.generate([chat_prompt(tok, p) for p in prompts[i:i + 64]], params)]
    return out


def common(out: Path, **extra) -> dict:
    return dict(out=str(out), overwrite=True, progress=False, device="cpu", seed=0, sample_tokens=0, **extra)


# ---- (a) the synthetic task ---------------------------------------------------------------------------

def part_a(work: Path, args) -> dict[str, float]:
    import torch

    from frawdllm.align.dpo import DPOConfig, collate_pairs, run_dpo, sequence_logps
    from frawdllm.align.examples import tokenize_pair
    from frawdllm.align.sft import SFTConfig, run_sft
    from frawdllm.data.sources import stdlib_files
    from frawdllm.modeldir import load_model
    from frawdllm.tokenizer import Tokenizer
    from frawdllm.train import PretrainConfig, run_pretraining

    figures: dict[str, float] = {}
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "stdlib_head.txt"
    text, size = [], 0
    for path in stdlib_files():
        body = path.read_text(encoding="utf-8", errors="replace")
        text.append(body)
        size += len(body)
        if size > 1_000_000:
            break
    corpus.write_text("\n\n".join(text), encoding="utf-8")
    say(f"(a) pretraining a small base model on {size / 1e6:.1f} MB of stdlib text ({args.pretrain_steps} steps)")
    run_pretraining(PretrainConfig(
        **common(work / "base"), data=str(corpus), tokenizer="byte", doc_split="file", val_fraction=0.01,
        preset="tiny-llama", model={"n_layer": 3, "n_embd": 96, "n_head": 4, "context_length": 64},
        batch_size=32, lr=3e-3, warmup_steps=20, max_steps=args.pretrain_steps, eval_interval=0,
        eval_batches=4, dtype="fp32", compile="false"))
    base = work / "base" / "model"

    rng = random.Random(0)
    lengths = (args.min_letters, args.max_letters)
    test_words = random_words(TEST_WORDS, rng, lengths)
    train_words = random_words(args.sft_examples, rng, lengths, exclude=set(test_words))
    sft_data = write_jsonl(work / "reverse.jsonl", [{"prompt": f"reverse {w}", "response": w[::-1]}
                                                  for w in train_words])
    test_prompts = [f"reverse {w}" for w in test_words]

    def exact(model_dir: Path) -> float:
        got = answers(model_dir, test_prompts, 8)
        return sum(a == w[::-1] for a, w in zip(got, test_words)) / len(test_words)

    figures["sft_acc_before"] = exact(base)
    say(f"(a) SFT on {len(train_words)} reversals ({args.sft_steps} steps)")
    started = time.perf_counter()
    run_sft(SFTConfig(**common(work / "sft"), init=str(base), data=sft_data, val_fraction=0.02,
                      batch_size=16, lr=3e-3, warmup_steps=20, max_steps=args.sft_steps, eval_interval=0,
                      eval_batches=4, dtype="fp32", compile="false"))
    figures["sft_seconds"] = round(time.perf_counter() - started, 1)
    sft = work / "sft" / "model"
    figures["sft_acc_after"] = exact(sft)

    # DPO: chosen follows the rule (upper case), rejected is what the SFT model says
    pref_words = random_words(args.dpo_examples, rng, lengths, exclude=set(test_words) | set(train_words))
    prefs = [{"prompt": f"reverse {w}", "chosen": w[::-1].upper(), "rejected": w[::-1]} for w in pref_words]
    dpo_data = write_jsonl(work / "prefs.jsonl", prefs)

    def rate(model_dir: Path) -> tuple[float, list[str]]:
        got = answers(model_dir, test_prompts, 8, temperature=1.0, seed=1)
        return sum(a.isupper() for a in got) / len(got), got

    figures["dpo_rate_before"], _ = rate(sft)
    say(f"(a) DPO on {len(prefs)} upper-case preferences ({args.dpo_steps} steps)")
    started = time.perf_counter()
    run_dpo(DPOConfig(**common(work / "dpo"), init=str(sft), data=dpo_data, val_fraction=0.0, batch_size=16,
                      lr=args.dpo_lr, beta=0.1, warmup_steps=10, max_steps=args.dpo_steps, eval_interval=0,
                      dtype="fp32", compile="false"))
    figures["dpo_seconds"] = round(time.perf_counter() - started, 1)
    dpo = work / "dpo" / "model"
    figures["dpo_rate_after"], sampled = rate(dpo)

    # held-out preference accuracy and the KL to the reference, from summed log-probs
    tok = Tokenizer.load(dpo)
    policy, reference = load_model(dpo).eval(), load_model(sft).eval()
    pairs = [tokenize_pair(tok, [{"role": "user", "content": f"reverse {w}"}], w[::-1].upper(), w[::-1], 64)[0]
             for w in test_words]
    with torch.no_grad():
        batch = collate_pairs(pairs, list(range(len(pairs))), 64)
        margin = sequence_logps(policy, batch["tokens"], batch["targets"]) \
            - sequence_logps(reference, batch["tokens"], batch["targets"])
        chosen, rejected = margin.chunk(2)
        figures["dpo_pref_acc"] = round(float((chosen > rejected).float().mean()), 4)
        # KL(policy || reference) per answer, estimated on the policy's own samples
        samples = [tokenize_pair(tok, [{"role": "user", "content": p}], s, s, 64)[0]
                   for p, s in zip(test_prompts, sampled)]
        batch = collate_pairs(samples, list(range(len(samples))), 64)
        n = len(samples)
        kl = sequence_logps(policy, batch["tokens"][:n], batch["targets"][:n]) \
            - sequence_logps(reference, batch["tokens"][:n], batch["targets"][:n])
        figures["dpo_kl"] = round(float(kl.mean()), 3)
    return figures


# ---- (b) stdlib-instruct on the demo model -------------------------------------------------------------

def part_b(work: Path, args) -> dict[str, float]:
    from frawdllm.align import stdlib_corpus
    from frawdllm.align.dpo import DPOConfig, run_dpo
    from frawdllm.align.examples import is_held_out
    from frawdllm.align.sft import SFTConfig, run_sft
    from frawdllm.train import PretrainConfig, build_config, run_pretraining

    figures: dict[str, float] = {}
    work.mkdir(parents=True, exist_ok=True)
    demo = work / "demo_model"
    if args.demo_model:
        shutil.copytree(args.demo_model, demo)
        say(f"(b) using a copy of {args.demo_model}")
    else:
        say("(b) training the make-demo model (configs/demo_stdlib.yaml, 3 minutes)")
        cfg = build_config(PretrainConfig, ROOT / "configs" / "demo_stdlib.yaml",
                           {"out": str(work / "demo"), "overwrite": True, "progress": False})
        run_pretraining(cfg)
        shutil.copytree(work / "demo" / "model", demo)
    held = [fn for fn in stdlib_corpus.functions() if is_held_out(fn.key, 0.05)]
    requests = [stdlib_corpus.write_request(fn) for fn in held]
    figures["stdlib_heldout_requests"] = len(requests)

    def parses(model_dir: Path) -> float:
        got = answers(model_dir, requests, 96)
        return sum(stdlib_corpus.defines_function(a) for a in got) / len(got)

    figures["stdlib_parse_before"] = parses(demo)
    say(f"(b) SFT on stdlib-instruct ({args.stdlib_sft_time})")
    run_sft(SFTConfig(**common(work / "stdlib_sft"), init=str(demo), data="stdlib-instruct", batch_size=16,
                      lr=1e-3, warmup_steps=20, max_time=args.stdlib_sft_time, eval_interval=0, eval_batches=4))
    figures["stdlib_parse_after_sft"] = parses(work / "stdlib_sft" / "model")
    say(f"(b) DPO on stdlib-prefs ({args.stdlib_dpo_time})")
    run_dpo(DPOConfig(**common(work / "stdlib_dpo"), init=str(work / "stdlib_sft" / "model"), data="stdlib-prefs",
                      batch_size=8, lr=1e-4, warmup_steps=10, max_time=args.stdlib_dpo_time, eval_interval=0,
                      eval_batches=4))
    figures["stdlib_parse_after_dpo"] = parses(work / "stdlib_dpo" / "model")
    return figures


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-model", default=None,
                        help="a `make demo` model directory to reuse (copied) [default: train one here]")
    parser.add_argument("--skip-stdlib", action="store_true", help="run part (a) only")
    parser.add_argument("--skip-synthetic", action="store_true",
                        help="run part (b) only: its headline, stdlib_parse_after_dpo, is then the last line")
    parser.add_argument("--pretrain-steps", type=positive_int, default=400,
                        help="(a) base-model steps: enough for it to learn to copy from its context [default: 400]")
    parser.add_argument("--min-letters", type=positive_int, default=3,
                        help="(a) shortest word of the synthetic task [default: 3]")
    parser.add_argument("--max-letters", type=positive_int, default=3,
                        help="(a) longest word of the synthetic task [default: 3]")
    parser.add_argument("--sft-examples", type=positive_int, default=6000,
                        help="(a) SFT examples (reversals of other words than the test's) [default: 6000]")
    parser.add_argument("--sft-steps", type=positive_int, default=600, help="(a) SFT steps [default: 600]")
    parser.add_argument("--dpo-examples", type=positive_int, default=1000,
                        help="(a) DPO preference pairs [default: 1000]")
    parser.add_argument("--dpo-steps", type=positive_int, default=40, help="(a) DPO steps [default: 40]")
    parser.add_argument("--dpo-lr", type=positive_float, default=5e-4,
                        help="(a) DPO learning rate [default: 5e-4]")
    parser.add_argument("--stdlib-sft-time", type=duration, default="3m",
                        help="(b) SFT time on stdlib-instruct, e.g. 90s, 3m [default: 3m]")
    parser.add_argument("--stdlib-dpo-time", type=duration, default="90s",
                        help="(b) DPO time on stdlib-prefs [default: 90s]")
    parser.add_argument("--work", default=None, help="working folder (default: a temporary one, removed)")
    args = parser.parse_args()
    if args.skip_stdlib and args.skip_synthetic:
        parser.error("--skip-stdlib and --skip-synthetic together leave nothing to run")
    if args.demo_model is not None and not (Path(args.demo_model) / "config.json").is_file():
        parser.error(f"--demo-model {args.demo_model} is not a model directory (no config.json)")
    if args.min_letters > args.max_letters:
        parser.error(f"--min-letters ({args.min_letters}) is above --max-letters ({args.max_letters})")
    possible = sum(26 ** n for n in range(args.min_letters, args.max_letters + 1))
    wanted = TEST_WORDS + args.sft_examples + args.dpo_examples  # (all different: random_words draws until then)
    if wanted > possible:
        parser.error(f"{TEST_WORDS} test + --sft-examples {args.sft_examples} + --dpo-examples "
                     f"{args.dpo_examples} different words need {wanted:,}, but words of {args.min_letters}.."
                     f"{args.max_letters} letters are only {possible:,}: allow longer words or ask for fewer examples")
    temporary = []  # folders this script makes: removed at the end, also on failure
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a fresh kernel cache, as on a first run
        temporary.append(tempfile.mkdtemp(prefix="frawd-inductor-"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = temporary[-1]

    import torch

    if args.work is None:
        temporary.append(tempfile.mkdtemp(prefix="frawd-align-"))
    work = Path(args.work or temporary[-1])
    started = time.perf_counter()
    figures: dict[str, float] = {}
    try:
        work.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(sys.stderr):  # (the runs' own lines: stdout holds only the figures)
            if not args.skip_synthetic:
                figures.update(part_a(work / "a", args))
            if not args.skip_stdlib:
                figures.update(part_b(work / "b", args))
    finally:
        for folder in temporary:
            shutil.rmtree(folder, ignore_errors=True)
    print(cpu_features_line())
    print(f"torch_threads={torch.get_num_threads()}")
    print(f"total_seconds={time.perf_counter() - started:.0f}")
    # the headline last: sft_acc_after, or part (b)'s stdlib_parse_after_dpo where (a) did not run
    order = ["stdlib_heldout_requests", "stdlib_parse_before", "stdlib_parse_after_sft", "stdlib_parse_after_dpo",
             "sft_seconds", "dpo_seconds", "dpo_kl", "dpo_rate_before", "dpo_rate_after", "dpo_pref_acc",
             "sft_acc_before", "sft_acc_after"]
    for key in order:
        if key in figures:
            print(f"{key}={figures[key]}")


if __name__ == "__main__":
    run_main(main)
