"""DPO: the loss and metrics against hand computations and TRL's DPOTrainer, the reference
(live and precomputed) and `frawd dpo` end to end."""

import math
import re
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from frawdllm.align.dpo import DPOConfig, DPOTask, collate_pairs, dpo_loss, load_pairs, sequence_logps
from frawdllm.train.rundir import read_metrics

from align_helpers import byte_tokenizer, model_dir, tiny_model, word_prefs, write_jsonl
from cli_helpers import run_cli

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def logps(seed, n=6):
    gen = torch.Generator().manual_seed(seed)
    return [-(torch.rand(n, generator=gen) * 20 + 1) for _ in range(4)]


def test_dpo_loss_equals_a_hand_computation():
    pc, pr, rc, rr = [torch.tensor(v) for v in ([-3.0, -5.0], [-4.0, -2.0], [-3.5, -4.0], [-3.0, -3.0])]
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.1)
    # pair 1: rewards 0.1 * 0.5 = 0.05 and 0.1 * -1 = -0.1; pair 2: -0.1 and 0.1
    by_hand = (math.log(1 + math.exp(-0.15)) + math.log(1 + math.exp(0.2))) / 2
    assert loss.item() == pytest.approx(by_hand, abs=1e-6)
    assert metrics["rewards/chosen"].item() == pytest.approx((0.05 - 0.1) / 2)
    assert metrics["rewards/rejected"].item() == pytest.approx((-0.1 + 0.1) / 2)
    assert metrics["rewards/accuracies"].item() == 0.5
    assert metrics["rewards/margins"].item() == pytest.approx((0.15 - 0.2) / 2)
    assert metrics["logps/chosen"].item() == -4.0 and metrics["logps/rejected"].item() == -3.0
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, loss_type="ipo",
                      lengths=(torch.tensor([2, 4]), torch.tensor([1, 2])))
    # per-token log-ratio differences: 0.5/2 - (-1)/1 = 1.25 and -1/4 - 1/2 = -0.75; 1/(2 beta) = 5
    assert ipo.item() == pytest.approx(((1.25 - 5) ** 2 + (-0.75 - 5) ** 2) / 2)


def test_policy_equal_to_reference_gives_ln2_and_zero_rewards():
    pc, pr, _, _ = logps(0)
    loss, metrics = dpo_loss(pc, pr, pc.clone(), pr.clone(), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["rewards/chosen"].item() == 0 and metrics["rewards/margins"].item() == 0
    assert metrics["rewards/accuracies"].item() == 0  # a tie is not a preference (TRL: chosen > rejected)


class FakeHFModel:
    """What TRL's DPOTrainer reads from a model's output, made from given per-token log-probs."""

    training = True

    def __init__(self, token_logps):
        self.token_logps = token_logps

    def __call__(self, **kwargs):
        shape = self.token_logps.shape
        return SimpleNamespace(log_probs=self.token_logps, entropy=torch.zeros(shape),
                               mean_logits=torch.zeros(shape), is_top1=torch.zeros(shape, dtype=torch.bool))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_metrics_match_trl(loss_type):
    """TRL's own DPOTrainer._compute_loss on the same log-probs (reference log-probs given,
    as with its precompute_ref_log_probs)."""
    trl = pytest.importorskip("trl.trainer.dpo_trainer")
    B, T = 4, 9
    gen = torch.Generator().manual_seed(1)
    completion_mask = torch.zeros(2 * B, T, dtype=torch.long)
    lengths = torch.randint(1, T - 2, (2 * B,), generator=gen)
    for r, n in enumerate(lengths):
        completion_mask[r, T - n:] = 1  # the answer: the last n tokens
    token_logps = -torch.rand(2 * B, T - 1, generator=gen) * 3 * completion_mask[:, 1:]
    ref_c, ref_r = -torch.rand(B, generator=gen) * 10, -torch.rand(B, generator=gen) * 10
    beta = 0.2
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(model=FakeHFModel(token_logps), accelerator=accelerator, aux_loss_enabled=False,
                              ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
                              loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                              use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                              _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    trl_loss = trl.DPOTrainer._compute_loss(trainer, trainer.model, inputs, False)
    summed = token_logps.sum(dim=1)
    loss, metrics = dpo_loss(*summed.chunk(2), ref_c, ref_r, beta, loss_type,
                             lengths=completion_mask.sum(dim=1).chunk(2))
    assert loss.item() == pytest.approx(trl_loss.item(), rel=1e-6)
    for name in METRICS:
        assert metrics[name].item() == pytest.approx(trainer._metrics["train"][name][0], rel=1e-6, abs=1e-7), name


def test_sequence_logps_sum_the_answers_tokens_only():
    tok = byte_tokenizer()
    model = tiny_model().eval()
    from frawdllm.align.examples import tokenize_pair

    pair, _ = tokenize_pair(tok, [{"role": "user", "content": "hi"}], "ABC", "abcd", 64)
    batch = collate_pairs([pair], [0], 32)
    with torch.no_grad():
        got = sequence_logps(model, batch["tokens"], batch["targets"])
        for row, answer in enumerate((pair.chosen, pair.rejected)):
            ids = torch.tensor([pair.prompt + answer])
            logp = F.log_softmax(model(ids)[0][0].float(), dim=-1)
            by_hand = sum(logp[len(pair.prompt) - 1 + k, t] for k, t in enumerate(answer))
            assert got[row].item() == pytest.approx(by_hand.item(), abs=1e-4)


def test_each_epoch_draws_a_new_order_of_the_same_pairs_and_a_resume_draws_it_again():
    from frawdllm.align.dpo import PairLoader

    loader = PairLoader(10, batch_size=5, seed=3)
    epochs = [[i for _ in range(2) for i in loader.next_units()] for _ in range(2)]  # 2 steps an epoch
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10)) and epochs[0] != epochs[1]
    assert epochs[0] == [int(i) for i in np.random.default_rng([3, 0]).permutation(10)]
    resumed = PairLoader(10, batch_size=5, seed=3)
    resumed.load_state_dict({"epoch": 1, "position": 0})
    assert [i for _ in range(2) for i in resumed.next_units()] == epochs[1]


def test_a_pair_that_exactly_fills_max_len_is_not_truncated():
    from frawdllm.align.examples import tokenize_pair

    tok, messages = byte_tokenizer(), [{"role": "user", "content": "hi"}]
    prompt = tok.render_chat(messages, add_generation_prompt=True)
    fits = len(prompt) + len("abcd") + 1  # the longer answer and its EOS
    pair, truncated = tokenize_pair(tok, messages, "ABC", "abcd", fits)
    assert not truncated and pair.prompt == prompt and len(pair.rejected) == 5
    assert tokenize_pair(tok, messages, "ABC", "abcd", fits - 1)[1]


def test_a_pairs_tokens_are_counted_whatever_their_ids():
    """Tokens were counted as ids != 0, but id 0 is a real token in GPT-2's vocabulary ("!")."""
    from frawdllm.align.dpo import DPOTask
    from frawdllm.align.examples import Pair

    pair = Pair(prompt=[5, 0, 0], chosen=[0, 7], rejected=[0])
    batch = collate_pairs([pair], [0], 8)
    assert DPOTask.batch_tokens(None, batch) == (5 - 1) + (4 - 1)  # each row's input tokens


def dpo_args(base, data, *extra):
    return ["dpo", "--init", base, "--data", data, "--batch-size", "4", "--lr", "1e-3", "--dtype", "fp32",
            "--compile", "false", "--device", "cpu", "--log-interval", "1", "--eval-interval", "3",
            "--eval-batches", "2", "--sample-tokens", "6", "--no-progress", "--val-fraction", "0.2", *extra]


def test_dpo_cli_starts_at_ln2_logs_trl_metrics_and_learns_the_preference(tmp_path, capsys):
    base = model_dir(tmp_path)
    records = word_prefs(40)
    for r in records[::2]:  # half the prompts as messages
        r["prompt"] = [{"role": "system", "content": "answer"}, {"role": "user", "content": r["prompt"]}]
    data = write_jsonl(tmp_path / "prefs.jsonl", records)
    code, _, err = run_cli(capsys, *dpo_args(base, data, "--max-steps", "12", "--out", tmp_path / "run"))
    assert code == 0, err
    train = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert all(name in r for r in train for name in METRICS)
    evals = [r for r in read_metrics(tmp_path / "run") if "val_loss" in r]
    assert evals[0]["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["val_rewards/accuracies"] > 0.9 and evals[-1]["val_loss"] < math.log(2)
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def test_a_model_with_dropout_starts_at_ln2_too(tmp_path, capsys):
    """With --init's dropout on, the policy's log-probs had dropout noise against the eval-mode
    reference: step 1 logged 0.687 and accuracies 0.875 where policy == reference. DPO trains
    without dropout (TRL's disable_dropout); the saved model keeps its dropout setting."""
    import dataclasses
    import json

    from frawdllm import FrawdLLM

    model = FrawdLLM(dataclasses.replace(tiny_model("gpt2").config, dropout=0.3))  # (dropout on attention too)
    model.save_pretrained(tmp_path / "base", tokenizer=byte_tokenizer())
    data = write_jsonl(tmp_path / "prefs.jsonl", word_prefs(20))
    code, _, err = run_cli(capsys, *dpo_args(tmp_path / "base", data, "--max-steps", "1", "--out", tmp_path / "run"))
    assert code == 0, err
    first = [r for r in read_metrics(tmp_path / "run") if "loss" in r][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert json.loads((tmp_path / "run" / "model" / "config.json").read_text())["dropout"] == 0.3


def test_precomputed_reference_gives_the_live_references_first_steps(tmp_path, capsys):
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "prefs.jsonl", word_prefs(30))
    runs = {}
    for name, extra in (("live", ()), ("pre", ("--precompute-ref",))):
        code, _, err = run_cli(capsys, *dpo_args(base, data, "--max-steps", "3", "--out", tmp_path / name, *extra))
        assert code == 0, err
        runs[name] = [r for r in read_metrics(tmp_path / name) if "loss" in r]
    for live, pre in zip(runs["live"], runs["pre"]):
        assert pre["loss"] == pytest.approx(live["loss"], abs=1e-5)
        assert pre["rewards/margins"] == pytest.approx(live["rewards/margins"], abs=1e-5)
    assert runs["live"][-1]["loss"] != runs["live"][0]["loss"]  # the steps did move the policy


def test_the_task_keeps_its_reference_frozen_outside_the_optimizer(tmp_path):
    from frawdllm.train.loop import Trainer

    tok = byte_tokenizer()
    model = tiny_model()
    cfg = DPOConfig(data=str(write_jsonl(tmp_path / "p.jsonl", word_prefs(20))), out=str(tmp_path / "run"),
                    progress=False, max_steps=2, device="cpu", dtype="fp32", compile="false", sample_tokens=0,
                    val_fraction=0.0, lr=1e-2)
    train, val, _ = load_pairs(cfg, tok, 64)
    task = DPOTask(train, val, model, tok, cfg, 64)
    before = {k: v.clone() for k, v in task.reference.state_dict().items()}
    trainer = Trainer(model, task, cfg)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in optimized for p in task.reference.parameters())
    trainer.fit()
    assert all(torch.equal(before[k], v) for k, v in task.reference.state_dict().items())
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_tasks_ipo_loss_normalises_by_each_answers_trained_tokens(tmp_path):
    """IPO divides each log-ratio by its answer's length: the tokens that carry loss, not
    the whole row (the prompt's tokens too)."""
    tok = byte_tokenizer()
    model = tiny_model()
    cfg = DPOConfig(data=str(write_jsonl(tmp_path / "p.jsonl", word_prefs(20))), out=str(tmp_path / "run"),
                    progress=False, max_steps=2, device="cpu", dtype="fp32", compile="false", sample_tokens=0,
                    val_fraction=0.0, loss_type="ipo")
    train, val, _ = load_pairs(cfg, tok, 64)
    task = DPOTask(train, val, model, tok, cfg, 64)
    with torch.no_grad():  # the policy moves away from its reference
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    batch = task._batch(train, [0, 1, 2, 3], "train")
    pc, pr = sequence_logps(model, batch["tokens"], batch["targets"]).chunk(2)
    with torch.no_grad():
        rc, rr = sequence_logps(task.reference, batch["tokens"], batch["targets"]).chunk(2)
    answers = [len(p.chosen) for p in train[:4]], [len(p.rejected) for p in train[:4]]
    by_hand = sum(((pc[i] - rc[i]) / answers[0][i] - (pr[i] - rr[i]) / answers[1][i] - 1 / (2 * cfg.beta)) ** 2
                  for i in range(4)) / 4
    loss, _ = task.loss(model, batch)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)


def test_a_precompute_that_cannot_end_within_max_time_is_refused_at_once(tmp_path, monkeypatch):
    """--precompute-ref scored 767 pairs in 63 s of a 30 s budget, then made a step; now the
    first second (or two batches) projects the whole scoring against the budget."""
    import time

    from frawdllm.align import dpo as dpo_module
    from frawdllm.errors import FrawdError

    tok = byte_tokenizer()
    cfg = DPOConfig(data=str(write_jsonl(tmp_path / "p.jsonl", word_prefs(40))), out=str(tmp_path / "run"),
                    progress=False, max_time="10s", device="cpu", dtype="fp32", compile="false", sample_tokens=0,
                    batch_size=4, precompute_ref=True)
    train, val, _ = load_pairs(cfg, tok, 64)
    clock = [100.0]  # each perf_counter reading is 0.5 s later: a batch of 4 pairs takes ~0.5 s

    def ticking():
        clock[0] += 0.5
        return clock[0]

    monkeypatch.setattr(dpo_module.time, "perf_counter", ticking)
    with pytest.raises(FrawdError, match=r"^--precompute-ref: scoring the 40 pairs under the reference takes ~\d+ s "
                                         r"here, past --max-time 10 s \(\d s were left\): give a larger --max-time, "
                                         r"or leave --precompute-ref out"):
        DPOTask(train, val, tiny_model(), tok, cfg, 64, started_at=clock[0] - 8.0)  # (2 s left)
    monkeypatch.setattr(dpo_module.time, "perf_counter", time.perf_counter)
    task = DPOTask(train, val, tiny_model(), tok, cfg, 64, started_at=time.perf_counter())  # (10 s: enough)
    assert task.ref_logps["train"].shape == (2, len(train))


def test_the_precomputes_bar_counts_the_pairs_its_refusal_counts(tmp_path, capsys):
    """The bar read 0/766 (the training pairs, then a second bar for the held-out ones)
    where the refusal said "scoring the 788 pairs"."""
    tok = byte_tokenizer()
    cfg = DPOConfig(data=str(write_jsonl(tmp_path / "p.jsonl", word_prefs(40))), out=str(tmp_path / "run"),
                    progress=True, max_steps=1, device="cpu", dtype="fp32", compile="false", sample_tokens=0,
                    batch_size=4, precompute_ref=True, val_fraction=0.2)
    train, val, _ = load_pairs(cfg, tok, 64)
    assert train and val
    DPOTask(train, val, tiny_model(), tok, cfg, 64)
    totals = set(re.findall(r"\| *\d+/(\d+) ", capsys.readouterr().err))
    assert totals == {str(len(train) + len(val))}, totals


def test_pairs_with_no_preference_or_an_answered_prompt_are_bad_records(tmp_path):
    from frawdllm.errors import FrawdError

    good = word_prefs(10)
    same = {"prompt": "say hi", "chosen": "hi", "rejected": "hi"}
    answered = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                "chosen": "a", "rejected": "b"}
    for bad, message in ((same, "'chosen' and 'rejected' are the same text"),
                         (answered, "'prompt' ends with an assistant turn")):
        data = write_jsonl(tmp_path / "prefs.jsonl", [*good[:4], bad, *good[4:]])
        cfg = DPOConfig(data=str(data), val_fraction=0.0)
        with pytest.raises(FrawdError, match=f"prefs.jsonl:5: {message}"):
            load_pairs(cfg, byte_tokenizer(), 64)
        cfg = DPOConfig(data=str(data), val_fraction=0.0, skip_bad_lines=True)
        train, _, summary = load_pairs(cfg, byte_tokenizer(), 64)
        assert len(train) == 10 and summary.skipped == 1 and message in summary.line("pairs")


def test_empty_or_one_message_conversations_are_bad_pairs():
    """An empty prompt list was an IndexError (a traceback in `frawd dpo`) without its check;
    whole conversations of one message each share no prompt."""
    from frawdllm.align.examples import BadExample, preference

    def said(record):
        with pytest.raises(BadExample) as caught:
            preference(record, "p:1")
        return str(caught.value)

    assert said({"prompt": [], "chosen": "a", "rejected": "b"}) == "p:1: 'prompt' must be a non-empty list of messages"
    assert said({"chosen": [], "rejected": [{"role": "assistant", "content": "b"}]}) \
        == "p:1: 'chosen' must be a non-empty list of messages"
    alone = said({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]})
    assert alone.startswith("p:1: without 'prompt', 'chosen' and 'rejected' must be conversations that differ only "
                            "in their last message"), alone


def test_characters_a_char_tokenizer_lacks_are_counted_in_the_answers_too(tmp_path):
    from frawdllm.tokenizer import train_tokenizer

    tok = train_tokenizer(["abcq "], kind="char")
    pairs = [{"prompt": "q", "chosen": "ab", "rejected": "ba"}] * 3 + [{"prompt": "q", "chosen": "ab\u00e9",
                                                                       "rejected": "bc"}]
    cfg = DPOConfig(data=str(write_jsonl(tmp_path / "p.jsonl", pairs)), val_fraction=0.0)
    *_, summary = load_pairs(cfg, tok, 64)
    assert (summary.unknown, summary.unknown_examples) == (1, 1)
    assert "1 character(s) outside the tokenizer's vocabulary became <|unk|> (in 1 pair;" in summary.line("pairs")


def test_no_built_in_pair_rejects_its_own_answer():
    from frawdllm.align import stdlib_corpus
    from frawdllm.align.stdlib_corpus import Function, rejected_answer

    prefs = list(stdlib_corpus.records("stdlib-prefs"))
    assert len(prefs) == len(stdlib_corpus.functions())  # one pair per function
    same = [where for where, r, _ in prefs if r["chosen"] == r["rejected"]]
    assert not same, same
    train, val, summary = load_pairs(DPOConfig(data="stdlib-prefs"), byte_tokenizer(), 64)  # not one bad record
    assert summary.skipped == 0 and summary.examples + summary.dropped == len(prefs)  # (dropped: same once cut)
    # the rule itself: bodies equal to this one's are passed over (odd hash: another function's body)
    odd = next(f"f{i}" for i in range(100) if stdlib_corpus._hash(f"m:f{i}") % 2)
    fn, twin, other = (Function(f"m:{name}", f"{name}(x)", "d", "d", f"def {name}(x):\n    {body}", 1)
                       for name, body in ((odd, "return False"), ("g", "return False"), ("h", "return x")))
    assert rejected_answer(fn, [twin, other]) == f"def {odd}(x):\n    return x"
    assert rejected_answer(fn, [twin]) is None


def test_the_pair_summary_prints_without_progress(tmp_path, capsys):
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "prefs.jsonl", [*word_prefs(10), {"prompt": "a", "chosen": "b", "rejected": "b"}])
    code, out, err = run_cli(capsys, *dpo_args(base, data, "--max-steps", "1", "--skip-bad-lines", "--out",
                                               tmp_path / "run"))
    assert code == 0, err
    assert "dpo data: 10 pairs" in err and "1 bad record skipped (first: " in err and "prefs.jsonl:11" in err


def test_pairs_whose_answers_are_the_same_once_cut_are_dropped_and_counted(tmp_path):
    """They trained nothing (loss ln 2, margins 0) and were counted as ordinary pairs."""
    from frawdllm.errors import FrawdError

    stem = "the cat sat on the mat " * 4
    samehead = [{"prompt": f"q{i}", "chosen": stem + "yes", "rejected": stem + "no"} for i in range(3)]
    data = write_jsonl(tmp_path / "prefs.jsonl", [*word_prefs(10), *samehead])
    train, _, summary = load_pairs(DPOConfig(data=str(data), val_fraction=0.0), byte_tokenizer(), 64)
    assert len(train) == 10 and all(p.chosen != p.rejected for p in train)
    assert summary.dropped == 3 and "; 3 dropped with nothing to learn (first: " in summary.line("pairs")
    assert "prefs.jsonl:11: 'chosen' and 'rejected' are the same once cut to fit 64-token rows" in summary.line("pairs")
    train, _, summary = load_pairs(DPOConfig(data=str(data), val_fraction=0.0), byte_tokenizer(), 256)
    assert len(train) == 13 and summary.dropped == 0  # with room for the difference they are kept
    only = write_jsonl(tmp_path / "only.jsonl", samehead)
    with pytest.raises(FrawdError, match="holds no usable pairs: all 3 had nothing to learn"):
        load_pairs(DPOConfig(data=str(only), val_fraction=0.0), byte_tokenizer(), 64)


def test_an_sft_run_or_config_given_to_dpo_is_named_as_such(tmp_path, capsys):
    """It used to say "unknown DPOConfig field(s): pack, train_on; known: <50 names>"."""
    from frawdllm.align.sft import SFTConfig
    from frawdllm.train.config import dump_yaml
    from frawdllm.train.rundir import rerun_line

    run = tmp_path / "sft-run"
    run.mkdir()
    cfg = SFTConfig(init="base", out=str(run), max_steps=1)
    (run / "config.yaml").write_text(dump_yaml(cfg, rerun_line("sft", run)))
    code, _, err = run_cli(capsys, "dpo", "--out", run, "--resume")
    assert code == 1 and err.count("\n") == 1, err
    assert f"--out {run} holds a frawd sft run, not a frawd dpo run; continue it with frawd sft --out {run} --resume" \
        in err
    hand_written = tmp_path / "mine.yaml"  # no rerun line: known by its sft-only fields
    hand_written.write_text("train_on: last\npack: false\nmax_steps: 1\n")
    for config in (run / "config.yaml", hand_written):
        code, _, err = run_cli(capsys, "dpo", "--config", config, "--out", tmp_path / "new")
        assert code == 1 and err.count("\n") == 1, err
        assert f"--config {config} is a config of frawd sft, not of frawd dpo; give it to frawd sft" in err
    assert not (tmp_path / "new").exists()
    stray = tmp_path / "stray.yaml"  # an sft config with one pretrain key: not pretrain's (it knows no init)
    stray.write_text("init: base\nmax_steps: 2\nlora_rank: 4\npreset: tiny\n")
    code, _, err = run_cli(capsys, "sft", "--config", stray, "--out", tmp_path / "new")
    assert code == 1 and err.count("\n") == 1 and "is a config of frawd" not in err and "preset" in err, err


def test_trl_preference_shapes_give_the_same_pair():
    """TRL's conversational shapes were refused ("'chosen' must be a string (list)"): an
    explicit prompt with one-message answers, and an implicit prompt (whole conversations
    sharing all but their last message)."""
    from frawdllm.align.examples import BadExample, preference

    user = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi?"}]
    want = (user, "Hello!", "Go away.")
    shapes = [
        {"prompt": user, "chosen": "Hello!", "rejected": "Go away."},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "assistant", "content": "Go away."}]},
        {"chosen": user + [{"role": "assistant", "content": "Hello!"}],
         "rejected": user + [{"role": "assistant", "content": "Go away."}]},
        {"prompt": None, "chosen": user + [{"role": "assistant", "content": "Hello!"}],  # (a Parquet row's null)
         "rejected": user + [{"role": "assistant", "content": "Go away."}]},
    ]
    for record in shapes:
        assert preference(record, "r:1") == want, record
    for bad, message in [
        ({"chosen": user + [{"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]},
         "differ only in their last message"),
        ({"prompt": user, "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
         "'chosen' as messages must be one assistant message"),
        ({"question": "q", "good": "a", "bad": "b", "chosen": None},  # (was "'chosen' must be a string (missing)")
         re.escape("""r:1: expected "prompt", "chosen" and "rejected" (fields: 'question', 'good', 'bad')""")),
        ({"prompt": "q", "chosen": 5, "rejected": "b"}, "'chosen' must be a string \\(int\\)"),
    ]:
        with pytest.raises(BadExample, match=message):
            preference(bad, "r:1")
