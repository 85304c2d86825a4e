"""A tiny model directory with a byte tokenizer, and example files, for the SFT/DPO tests."""

import json

import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.tokenizer import train_tokenizer

STYLES = {"llama": dict(preset="tiny-llama"), "gpt2": dict(preset="tiny")}


def tiny_model(style="llama", context_length=64, seed=0):
    spec = dict(STYLES[style])
    cfg = get_config(spec.pop("preset"), n_layer=2, n_embd=32, n_head=4, vocab_size=263,
                     context_length=context_length, dropout=0.0, **spec)
    torch.manual_seed(seed)
    return FrawdLLM(cfg)


def byte_tokenizer():
    return train_tokenizer(["x"], kind="byte")


def model_dir(tmp_path, style="llama", context_length=64, seed=0):
    path = tmp_path / f"base-{style}"
    tiny_model(style, context_length, seed).save_pretrained(path, tokenizer=byte_tokenizer())
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def word_chats(n=60):
    """Short prompt/response records (deterministic)."""
    words = ["apple", "river", "stone", "cloud", "ember", "frost", "maple", "pearl", "quilt", "tiger"]
    return [{"prompt": f"reverse {words[i % 10]}{i}", "response": f"{words[i % 10][::-1]}{i}"} for i in range(n)]


def word_prefs(n=40):
    return [{"prompt": r["prompt"], "chosen": r["response"].upper(), "rejected": r["response"]}
            for r in word_chats(n)]
