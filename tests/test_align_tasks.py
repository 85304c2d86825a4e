"""What the DPO and SFT tasks compute beside the loss: the precomputed reference's val metrics,
--eval-batches, FLOPs with and without the live reference, a batch's tokens, the sample
prompts and their greedy answers, the precompute's deadline, LoRA's memory check, and an
example that exactly fills a row."""

import pytest
import torch

from frawdllm.align.dpo import DPOConfig, DPOTask, load_pairs
from frawdllm.align.sft import SFTConfig, SFTTask, load_examples, prompt_of

from align_helpers import byte_tokenizer, tiny_model, word_chats, word_prefs, write_jsonl


def dpo_cfg(tmp_path, **kw):
    base = dict(data=str(write_jsonl(tmp_path / "p.jsonl", word_prefs(40))), out=str(tmp_path / "run"),
                progress=False, max_steps=1, device="cpu", dtype="fp32", compile="false", sample_tokens=0,
                batch_size=4, val_fraction=0.3)
    return DPOConfig(**{**base, **kw})


def moved(model):
    """The policy moved away from its reference (so rewards are not all zero)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model


# ---- dpo.py -------------------------------------------------------------------------------------

def test_precomputed_reference_gives_the_live_references_val_metrics(tmp_path):
    """--precompute-ref scores the held-out pairs too: evaluate must read the val split's
    reference log-probs (the train split's, indexed by val positions, give other rewards)."""
    tok = byte_tokenizer()
    results = {}
    for pre in (False, True):
        cfg = dpo_cfg(tmp_path, precompute_ref=pre)
        train, val, _ = load_pairs(cfg, tok, 64)
        assert len(val) >= 4
        model = tiny_model()
        task = DPOTask(train, val, model, tok, cfg, 64)
        moved(model)
        with torch.no_grad():
            results[pre] = task.evaluate(model, torch.device("cpu"))
    assert results[True].keys() == results[False].keys()
    for key, live in results[False].items():
        assert results[True][key] == pytest.approx(live, abs=1e-5), key


def test_evaluate_reads_only_eval_batches_of_the_held_out_pairs(tmp_path):
    """--eval-batches 1 --batch-size 4: val metrics are those of the first 4 held-out pairs
    (what `evaluation_key` hashes), not of all of them."""
    tok = byte_tokenizer()
    cfg = dpo_cfg(tmp_path, eval_batches=1)
    train, val, _ = load_pairs(cfg, tok, 64)
    assert len(val) > 4
    model = tiny_model()
    task = DPOTask(train, val, model, tok, cfg, 64)
    moved(model)
    with torch.no_grad():
        got = task.evaluate(model, torch.device("cpu"))
        loss, metrics = task.loss(model, task._batch(val, [0, 1, 2, 3], "val"))
    assert got["val_loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert got["val_rewards/margins"] == pytest.approx(metrics["rewards/margins"].item(), rel=1e-6, abs=1e-9)


def test_flops_per_token_count_the_live_reference_only_when_it_runs(tmp_path):
    """The live reference adds its forward (2N of a 6N step); --precompute-ref frees it, so
    MFU must not count it."""
    tok = byte_tokenizer()
    flops = {}
    for pre in (False, True):
        cfg = dpo_cfg(tmp_path, precompute_ref=pre)
        train, val, _ = load_pairs(cfg, tok, 64)
        model = tiny_model()
        flops[pre] = DPOTask(train, val, model, tok, cfg, 64).flops_per_token
    assert flops[False] - flops[True] == tiny_model().config.flops_per_token(64) // 3


# ---- sft.py / job.py ----------------------------------------------------------------------------

def sft_task(tmp_path, **kw):
    tok = byte_tokenizer()
    base = dict(data=str(write_jsonl(tmp_path / "c.jsonl", word_chats(60))), out=str(tmp_path / "run"),
                batch_size=2, val_fraction=0.3, progress=False, device="cpu", dtype="fp32", compile="false",
                sample_tokens=4)
    cfg = SFTConfig(**{**base, **kw})
    train, val, _ = load_examples(cfg, tok, 64)
    return SFTTask(train, val, tiny_model(), tok, cfg, 64), val, cfg


def test_a_batchs_tokens_are_its_examples_not_its_padding(tmp_path):
    task, _, _ = sft_task(tmp_path, pack=False)
    batch = task.next_batch()
    padding = int((batch["documents"] < 0).sum())
    assert padding > 0  # (short chats in 64-token rows)
    assert task.batch_tokens(batch) == batch["documents"].numel() - padding


def test_val_loss_reads_only_eval_batches(tmp_path):
    task, val, cfg = sft_task(tmp_path, pack=False, eval_batches=2)
    assert len(val) > 2 * cfg.batch_size  # (more held-out rows than 2 batches)
    assert len(task.val_batches) == 2


def test_sample_prompts_are_the_first_held_out_prompts_up_to_the_assistant_turn(tmp_path):
    """samples.txt answers `sample_count` held-out prompts, each ending in <|assistant|> (not
    the whole conversation, whose answer is already there)."""
    from frawdllm.tokenizer import ASSISTANT_ID

    task, val, cfg = sft_task(tmp_path, sample_count=3)
    assert len(val) > 3
    assert task.sample_prompts == [prompt_of(e) for e in val[:3]]
    assert all(p[-1] == ASSISTANT_ID for p in task.sample_prompts)


def test_samples_are_the_greedy_answers(tmp_path):
    """sample_texts decodes greedily (`sample_count` help: "answered (greedy)"): the argmax of
    the model at each step, whatever the RNG."""
    from frawdllm.align.job import sample_texts
    from frawdllm.tokenizer import EOS_ID

    tok = byte_tokenizer()
    model = tiny_model().eval()
    with torch.no_grad():  # (no special token wins the argmax: the greedy answer has text)
        model.lm_head.weight[:7] = 0
    prompt = tok.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            nxt = int(model(torch.tensor([ids]))[0][0, -1].argmax())
            if nxt == EOS_ID:
                break
            ids.append(nxt)
    expected = tok.decode(prompt) + tok.decode(ids[len(prompt):], skip_special_tokens=True)  # (as the engine's text)
    assert len(expected) > len(tok.decode(prompt))
    for seed in (0, 1):
        torch.manual_seed(seed)
        assert sample_texts(model, tok, [prompt], 6) == [expected]


def test_a_precompute_that_has_scored_every_pair_is_never_refused(tmp_path, monkeypatch):
    """The refusal is a projection of work still to do; once every pair is scored (here one
    slow batch, finished past the budget) nothing is left to refuse: the loop's own
    --max-time ends the run."""
    from frawdllm.align import dpo as dpo_module

    tok = byte_tokenizer()
    cfg = dpo_cfg(tmp_path, data=str(write_jsonl(tmp_path / "four.jsonl", word_prefs(4))), val_fraction=0.0,
                  precompute_ref=True, max_time="10s")
    train, val, _ = load_pairs(cfg, tok, 64)
    assert len(train) == 4 and not val  # one batch
    clock = [100.0]

    def ticking():  # each reading 2 s later
        clock[0] += 2.0
        return clock[0]

    monkeypatch.setattr(dpo_module.time, "perf_counter", ticking)
    task = DPOTask(train, val, tiny_model(), tok, cfg, 64, started_at=clock[0] - 9.0)  # (1 s left)
    assert task.ref_logps["train"].shape == (2, 4)


def test_lora_runs_check_memory_for_frozen_base_weights(tmp_path, monkeypatch):
    """check_init sizes a LoRA run's memory with the base frozen (no AdamW moments nor
    gradients for it): without, a LoRA run that fits is refused as too big."""
    from frawdllm.align import job

    from align_helpers import model_dir

    seen = []
    monkeypatch.setattr(job, "check_training_fits", lambda *a, **k: seen.append(k.get("frozen")))
    data = str(write_jsonl(tmp_path / "c.jsonl", word_chats(10)))
    for rank in (0, 4):
        cfg = SFTConfig(init=str(model_dir(tmp_path)), data=data, out=str(tmp_path / f"run{rank}"), lora_rank=rank,
                        device="cpu", max_steps=1)
        job.check_init(cfg)
    assert seen == [False, True]


def test_an_example_that_exactly_fills_a_row_is_not_truncated(tmp_path):
    """A row of `length` inputs holds length + 1 ids (the last is only a target): such an
    example keeps its last token (the answer's <|eos|>) and is not counted as truncated."""
    from frawdllm.align.examples import chat_messages, tokenize_chat

    tok = byte_tokenizer()
    record = word_chats(1)[0]
    full = tokenize_chat(tok, chat_messages(record, "x"), "assistant")
    length = len(full.ids) - 1
    cfg = SFTConfig(data=str(write_jsonl(tmp_path / "one.jsonl", [record])), out=str(tmp_path / "run"),
                    val_fraction=0.0, progress=False)
    train, _, summary = load_examples(cfg, tok, length)
    assert summary.truncated == 0
    assert train[0].ids == full.ids and train[0].trained == full.trained
