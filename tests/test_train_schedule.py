"""Schedules, durations, config layering and optimizer groups: the loop's small parts."""

import math
import re

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.errors import ConfigError
from frawdllm.train.config import PretrainConfig, TrainConfig, build_config, parse_duration
from frawdllm.train.optim import build_optimizer, param_groups
from frawdllm.train.schedule import LRSchedule


def nanogpt_lr(it: int, peak: float, floor: float, warmup: int, decay_iters: int) -> float:
    """nanoGPT's get_lr (train.py), written out independently."""
    if it < warmup:
        return peak * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return floor
    ratio = (it - warmup) / (decay_iters - warmup)
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (peak - floor)


def test_cosine_schedule_matches_nanogpt_after_warmup_at_key_steps():
    peak, warmup, total = 1e-3, 10, 110
    sched = LRSchedule(peak, "cosine", warmup_steps=warmup, min_lr_ratio=0.1)
    for step in range(total + 1):
        lr = sched(step, step / total)
        if step >= warmup:  # nanoGPT's warmup differs by one step in its denominator
            assert lr == pytest.approx(nanogpt_lr(step, peak, 1e-4, warmup, total), rel=1e-12)
    assert sched(warmup, warmup / total) == pytest.approx(peak)
    assert sched(60, 60 / total) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way: the mean
    assert sched(total, 1.0) == pytest.approx(1e-4)  # the floor


def test_warmup_rises_linearly_to_the_peak():
    sched = LRSchedule(2.0, "cosine", warmup_steps=4)
    assert [sched(s, 0.0) for s in range(4)] == [0.5, 1.0, 1.5, 2.0]


def test_linear_wsd_and_constant_values_at_key_points():
    lin = LRSchedule(1.0, "linear", warmup_steps=0, min_lr_ratio=0.0)
    assert [lin(0, p) for p in (0.0, 0.25, 0.5, 1.0)] == pytest.approx([1.0, 0.75, 0.5, 0.0])
    wsd = LRSchedule(1.0, "wsd", warmup_steps=0, min_lr_ratio=0.1, decay_fraction=0.2)
    assert wsd(0, 0.5) == 1.0 and wsd(0, 0.8) == pytest.approx(1.0)  # stable until the last 20%
    assert wsd(0, 0.9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert wsd(0, 1.0) == pytest.approx(0.1)
    const = LRSchedule(1.0, "constant", warmup_steps=0, min_lr_ratio=0.1)
    assert const(0, 0.99) == 1.0


def test_noam_is_the_papers_formula():
    """lr(s) = d^-0.5 min(s^-0.5, s warmup^-1.5) for 1-based step s, which is `noam` with
    peak = (d warmup)^-0.5, whatever the budget's progress."""
    d, warmup = 512, 4000
    schedule = LRSchedule(peak=(d * warmup) ** -0.5, kind="noam", warmup_steps=warmup)
    for step in (0, 1, 999, 3998, 3999, 4000, 10_000, 99_999):
        s = step + 1
        paper = d ** -0.5 * min(s ** -0.5, s * warmup ** -1.5)
        assert schedule(step, progress=0.5) == pytest.approx(paper, rel=1e-12)
    assert schedule(3999, progress=0.0) == pytest.approx(7e-4, rel=0.02)  # the paper's peak


def test_decay_spans_from_end_of_warmup_to_end_of_budget_with_time_progress():
    sched = LRSchedule(1.0, "linear", warmup_steps=2, min_lr_ratio=0.0)
    sched(0, 0.0), sched(1, 0.1)
    assert sched(2, 0.2) == pytest.approx(1.0)  # warmup ended at progress 0.2
    assert sched(3, 0.6) == pytest.approx(0.5)  # half way from 0.2 to 1.0
    assert sched.state_dict() == {"warmup_end_progress": 0.2}


@pytest.mark.parametrize("text, seconds", [("90", 90), ("100s", 100), ("5m", 300), ("1.5h", 5400),
                                           ("1h30m", 5400), ("2m 30s", 150), (45, 45)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "5 minutes", "m", "-3s", "0", "5m5m", "1m1h", "1h30", "30s1m"])
def test_parse_duration_rejects_nonsense(bad):
    with pytest.raises(ConfigError):
        parse_duration(bad)


def test_config_file_is_overridden_by_flags_and_model_overrides_merge(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 3e-3\nbatch_size: 7\nmax_time: 100s\nmodel:\n  n_layer: 3\n  n_embd: 64\n")
    cfg = build_config(PretrainConfig, path, {"batch_size": 9, "lr": None}, {"n_embd": 32})
    assert cfg.lr == 3e-3 and isinstance(cfg.lr, float)  # YAML reads 3e-3 as a string; coerced
    assert cfg.batch_size == 9 and cfg.max_time_s == 100
    assert cfg.model == {"n_layer": 3, "n_embd": 32}


@pytest.mark.parametrize("cls", ["TranslateConfig", "PretrainConfig"])
def test_min_lr_ratio_given_with_a_schedule_without_a_floor_is_refused(tmp_path, cls):
    # (noam, translate train's default, ignored --min-lr-ratio 0.5: the rate fell to 1% of the peak)
    from frawdllm.train.translation_config import TranslateConfig

    cls = {"TranslateConfig": TranslateConfig, "PretrainConfig": PretrainConfig}[cls]
    for schedule, why in (("noam", "decays as 1/sqrt(step), with no floor"), ("constant", "does not decay")):
        with pytest.raises(ConfigError, match=re.escape(f"--min-lr-ratio 0.5: the {schedule} schedule {why}; leave "
                                                        "it out, or choose a schedule that decays to it")):
            build_config(cls, None, {"min_lr_ratio": 0.5, "schedule": schedule})
    assert build_config(cls, None, {"min_lr_ratio": 0.5, "schedule": "cosine"}).min_lr_ratio == 0.5
    # so is --decay-fraction with a schedule that has no decay phase of its own (all but wsd)
    for schedule in ("cosine", "linear", "noam", "constant"):
        with pytest.raises(ConfigError, match=re.escape(f"--decay-fraction 0.5: only the wsd schedule has a decay "
                                                        f"phase (the {schedule} schedule's shape spans the whole run)")):
            build_config(cls, None, {"decay_fraction": 0.5, "schedule": schedule})
    assert build_config(cls, None, {"decay_fraction": 0.5, "schedule": "wsd"}).decay_fraction == 0.5
    # a config file may hold both (a run's config.yaml, rerun, lists every field), and a
    # --schedule over a file's cosine and floor is the user's choice
    (tmp_path / "c.yaml").write_text("schedule: noam\nmin_lr_ratio: 0.5\n")
    assert build_config(cls, tmp_path / "c.yaml", {}).schedule == "noam"
    (tmp_path / "d.yaml").write_text("schedule: cosine\nmin_lr_ratio: 0.5\n")
    assert build_config(cls, tmp_path / "d.yaml", {"schedule": "noam"}).schedule == "noam"


def test_a_flag_for_one_of_two_alternatives_clears_the_config_files_other(tmp_path):
    # (configs/multi30k.yaml's vocab_size: 8000 with --tokenizer was refused, blaming a
    # --vocab-size never given, and nothing on the command line could clear it)
    from frawdllm.train.translation_config import TranslateConfig

    (tmp_path / "v.yaml").write_text("vocab_size: 8000\nlr: 0.002\n")
    cfg = build_config(TranslateConfig, tmp_path / "v.yaml", {"tokenizer": "tok.json"})
    assert (cfg.tokenizer, cfg.vocab_size, cfg.lr) == ("tok.json", None, 0.002)
    (tmp_path / "t.yaml").write_text("tokenizer: tok.json\n")
    cfg = build_config(TranslateConfig, tmp_path / "t.yaml", {"vocab_size": 500})
    assert (cfg.tokenizer, cfg.vocab_size) == (None, 500)
    both = build_config(TranslateConfig, tmp_path / "v.yaml", {"tokenizer": "tok.json", "vocab_size": 500})
    assert (both.tokenizer, both.vocab_size) == ("tok.json", 500)  # (both given: refused by check_translation)
    assert build_config(TranslateConfig, tmp_path / "v.yaml", {}).vocab_size == 8000


def test_config_errors_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch_sise: 3\n")
    with pytest.raises(ConfigError, match="batch_sise"):
        build_config(PretrainConfig, path, {})
    with pytest.raises(ConfigError, match="schedule"):
        TrainConfig(schedule="cosin")
    with pytest.raises(ConfigError, match="grad_accum"):
        TrainConfig(grad_accum=0)
    with pytest.raises(ConfigError, match="resume"):
        TrainConfig(resume=True, overwrite=True)


def test_weight_decay_applies_to_matrices_and_embeddings_only_on_request():
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=50, context_length=16))
    decay, no_decay = (g["params"] for g in param_groups(model, 0.1, decay_embeddings=False))
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in decay} == {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight",
                                             "blocks.0.mlp.up.weight", "blocks.0.mlp.down.weight"}
    assert {"embed.tok.weight", "embed.pos.weight"} <= {names[id(p)] for p in no_decay}
    assert all(p.dim() == 1 for p in no_decay if names[id(p)].startswith("blocks"))
    with_emb = param_groups(model, 0.1, decay_embeddings=True)[0]["params"]
    assert {"embed.tok.weight", "embed.pos.weight"} <= {names[id(p)] for p in with_emb}
    # every parameter once (the tied head is the token embedding)
    opt = build_optimizer(model, TrainConfig())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert isinstance(opt, torch.optim.AdamW)
    # the optimizer takes the config's groups, betas and CPU's fused kernel
    assert {names[id(p)] for p in opt.param_groups[0]["params"]} == {names[id(p)] for p in decay}
    assert opt.defaults["betas"] == (TrainConfig().beta1, TrainConfig().beta2) != (TrainConfig().beta2,
                                                                                     TrainConfig().beta1)
    assert opt.defaults["fused"] is True
    embeddings = build_optimizer(model, TrainConfig(decay_embeddings=True)).param_groups[0]["params"]
    assert "embed.tok.weight" in {names[id(p)] for p in embeddings}
