"""`frawd export --format hf` and `frawd import --from-hf`, checked with stock `transformers`.

Exported directories are loaded with `AutoModelForCausalLM` / `AutoTokenizer` exactly as a
user would (no trust_remote_code) and must compute our logits (1e-4, fp32), generate our
greedy tokens, tokenize like us and render our chat template. Imported checkpoints must
reproduce the logits of the transformers model they came from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from frawdllm import FrawdLLM, get_config
from frawdllm.cli import main
from frawdllm.tokenizer import byte_tokenizer, render_chat_text, train_tokenizer
from interop_helpers import SMALL, random_ids, randomize_, small_model

transformers = pytest.importorskip("transformers")
TOL = 1e-4
VOCAB = 320  # a trained BPE tokenizer needs 7 specials + 256 bytes + some merges
SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
SAMPLE = "ROMEO: But soft, what light through yonder window breaks?\n  It is the east; é, ß, 猫 and 🦙 too."
CHAT = [
    {"role": "system", "content": "You speak like a Shakespearean actor."},
    {"role": "user", "content": "What light through yonder window breaks?"},
    {"role": "assistant", "content": "It is the east, and Juliet is the sun."},
    {"role": "user", "content": "And the moon?\nTell me."},
]


@pytest.fixture(scope="module")
def tokenizer():
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    text = SHAKESPEARE.read_text(encoding="utf-8")[:40_000]
    return train_tokenizer([text[i:i + 2000] for i in range(0, len(text), 2000)], "bpe", VOCAB)


def make_model_dir(tmp_path: Path, tokenizer, variant: str, **changes) -> tuple[FrawdLLM, Path]:
    model = small_model(variant, vocab_size=VOCAB, **changes)
    directory = tmp_path / f"ours-{variant}"
    model.save_pretrained(directory, tokenizer=tokenizer)
    return model, directory


def export(model_dir: Path, out: Path, *extra: str) -> None:
    main(["export", "--model", str(model_dir), "--out", str(out), *extra])


def entries(directory: Path) -> set[str]:
    return set(os.listdir(directory))


def naive_greedy(model: FrawdLLM, prompt: list[int], n_new: int, eos_id: int) -> list[int]:
    """Reference decoding: re-run the whole sequence, take the argmax, stop at eos."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            logits, _ = model(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] == eos_id:
                break
    return ids


# ---- export -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variant, arch",
    [("gpt2-tied", "GPT2LMHeadModel"), ("gpt2-untied", "GPT2LMHeadModel"), ("gpt2-nobias", "GPT2LMHeadModel"),
     ("llama-gqa", "LlamaForCausalLM"), ("llama-mqa-untied", "LlamaForCausalLM"),
     ("llama-bias-gqa", "LlamaForCausalLM")],
)
def test_exported_directory_loads_in_stock_transformers_with_our_logits(tmp_path, tokenizer, variant, arch):
    model, model_dir = make_model_dir(tmp_path, tokenizer, variant)
    export(model_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf_model).__name__ == arch
    assert hf_model.config.tie_word_embeddings == model.config.tie_embeddings
    ids = random_ids(VOCAB)
    with torch.no_grad():
        ours, _ = model(ids)
        theirs = hf_model(ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"export hf {variant}: max_abs_diff={diff:.3e}")
    assert diff < TOL


@pytest.mark.parametrize("variant", ["gpt2-tied", "llama-gqa"])
def test_transformers_greedy_generate_yields_our_greedy_tokens(tmp_path, tokenizer, variant):
    model, model_dir = make_model_dir(tmp_path, tokenizer, variant)
    export(model_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = tokenizer.encode("ROMEO: But soft")
    n_new = SMALL["context_length"] - len(prompt)
    ours = naive_greedy(model, prompt, n_new, model.config.eos_token_id)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
    assert theirs[0].tolist() == ours
    assert len(ours) > len(prompt) + 5  # it really generated


@pytest.mark.parametrize("variant", ["gpt2-untied", "llama-mqa-untied"])
def test_transformers_greedy_generate_yields_our_engine_tokens(tmp_path, tokenizer, variant):
    infer = pytest.importorskip("frawdllm.infer")  # the KV-cache engine of the inference issue
    model, model_dir = make_model_dir(tmp_path, tokenizer, variant)
    export(model_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = tokenizer.encode("JULIET: O Romeo")
    n_new = SMALL["context_length"] - len(prompt)
    engine = infer.Engine(model, tokenizer, weights="fp32")  # exact fp32: the parity under test
    done = engine.generate([prompt], infer.SamplingParams(temperature=0.0, max_new_tokens=n_new))
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
    assert theirs[0].tolist() == prompt + done[0].tokens
    assert len(done[0].tokens) > 5


@pytest.mark.parametrize("kind", ["bpe", "char", "byte"])
def test_exported_tokenizer_encodes_and_decodes_like_ours(tmp_path, tokenizer, kind):
    if kind == "char":  # characters never seen (é, 猫, 🦙) are <|unk|> on both sides
        tokenizer = train_tokenizer([SHAKESPEARE.read_text(encoding="utf-8")[:20_000]], "char")
    elif kind == "byte":
        tokenizer = byte_tokenizer()
    _, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    export(model_dir, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer.encode(SAMPLE)
    assert hf_tok(SAMPLE)["input_ids"] == ids
    assert hf_tok.decode(ids) == tokenizer.decode(ids)
    if kind != "char":
        assert tokenizer.decode(ids) == SAMPLE
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token, hf_tok.unk_token) == (
        "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>")
    context = json.loads((model_dir / "config.json").read_text())["context_length"]
    assert hf_tok.model_max_length == context  # (truncation=True cuts at the context, not at 1e30)
    assert hf_tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [2, 3, 0]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_exported_chat_template_renders_our_chat_text_and_ids(tmp_path, tokenizer, add_generation_prompt):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    export(model_dir, tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = hf_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == render_chat_text(CHAT, add_generation_prompt)
    ids = hf_tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == tokenizer.render_chat(CHAT, add_generation_prompt)


def test_export_carries_special_ids_and_sampling_defaults_into_generation_config(tmp_path, tokenizer):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    (model_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 40, "top_p": 0.9}))
    export(model_dir, tmp_path / "hf")
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (2, 3, 0)
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p) == (True, 0.7, 40, 0.9)


def test_sampling_defaults_mean_the_same_on_both_sides_and_come_back_on_import(tmp_path, tokenizer):
    """Our defaults sample at temperature 1 without top-k; transformers' are greedy, and
    top-k 50 when sampling: the export says do_sample and top_k 0; the import reads
    transformers' defaults back (its bos/eos-only file leaves ours alone)."""
    from frawdllm.infer import SamplingParams
    from frawdllm.modeldir import load_generation_config

    _, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    export(model_dir, tmp_path / "plain")  # no generation_config.json: our defaults
    gen = transformers.GenerationConfig.from_pretrained(tmp_path / "plain")
    assert (gen.do_sample, gen.temperature, gen.top_k) == (True, 1.0, 0)
    for sampling in ({"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 40}, {"temperature": 0, "top_k": 5}):
        (model_dir / "generation_config.json").write_text(json.dumps(sampling))
        export(model_dir, tmp_path / "hf", "--overwrite")
        main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), "--overwrite"])
        assert SamplingParams.from_dict(load_generation_config(tmp_path / "back")) == \
            SamplingParams.from_dict(sampling).replace(**({"top_k": 0} if sampling["temperature"] == 0 else {}))
    hf_gen = tmp_path / "hf" / "generation_config.json"
    hf_gen.write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 3}))  # (a Hub GPT-2's)
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ids"), "--overwrite"])
    assert load_generation_config(tmp_path / "ids") == {}
    hf_gen.write_text(json.dumps({"do_sample": True, "top_p": 0.8}))
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "k50")])
    assert load_generation_config(tmp_path / "k50") == {"temperature": 1.0, "top_k": 50, "top_p": 0.8}


def test_stop_settings_samples_and_max_new_tokens_reach_transformers_generate_and_come_back(tmp_path, tokenizer):
    """generation_config.json says our stop tokens (eos_token_id list), max_new_tokens (else
    transformers stops at 20 tokens in all), stop strings and samples per prompt: transformers'
    plain `generate()` gives our greedy tokens; the import maps them back, and export ->
    import -> export writes the same bytes."""
    from frawdllm.infer import Engine, SamplingParams
    from frawdllm.modeldir import load_generation_config

    model, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    hf_dir, gen_file = tmp_path / "hf", "generation_config.json"
    prompt = tokenizer.encode("ROMEO: But")
    engine = Engine(model, tokenizer, weights="fp32")
    n_new = SMALL["context_length"] - len(prompt)
    assert len(prompt) + n_new > 20
    ours = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=n_new))[0].tokens
    stop_at = next(k for k in range(3, len(ours)) if ours[k] not in ours[:k])
    for sampling in ({"temperature": 0, "max_new_tokens": n_new},
                     {"temperature": 0, "max_new_tokens": n_new, "stop_token_ids": [ours[stop_at]]}):
        (model_dir / gen_file).write_text(json.dumps(sampling))
        export(model_dir, hf_dir, "--overwrite")
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt]))[0, len(prompt):].tolist()
        assert theirs == engine.generate([prompt], SamplingParams.from_dict(sampling))[0].tokens
    assert len(theirs) == stop_at + 1
    (model_dir / gen_file).write_text(json.dumps({"temperature": 0}))
    export(model_dir, hf_dir, "--overwrite")
    assert transformers.GenerationConfig.from_pretrained(hf_dir).max_new_tokens == SamplingParams().max_new_tokens

    sampling = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 3, "num_samples": 3, "stop": ["xyz", "\n"],
                "stop_token_ids": [5, 3]}
    (model_dir / gen_file).write_text(json.dumps(sampling))
    export(model_dir, hf_dir, "--overwrite")
    gen = transformers.GenerationConfig.from_pretrained(hf_dir)
    assert (gen.eos_token_id, gen.stop_strings, gen.num_return_sequences, gen.max_new_tokens) == \
        ([3, 5], ["xyz", "\n"], 3, 3)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        rows = hf_model.generate(torch.tensor([prompt]), tokenizer=transformers.AutoTokenizer.from_pretrained(hf_dir))
    assert rows.shape[0] == 3
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "back")])
    assert SamplingParams.from_dict(load_generation_config(tmp_path / "back")) == \
        SamplingParams.from_dict({**sampling, "stop_token_ids": [5]})  # (3 is the model's eos)
    export(tmp_path / "back", tmp_path / "again")
    assert (tmp_path / "again" / gen_file).read_bytes() == (hf_dir / gen_file).read_bytes()


def test_import_without_a_generation_config_stops_at_each_of_config_jsons_end_ids(tmp_path, tokenizer):
    """transformers' generate() reads config.json's eos_token_id list when the checkpoint has no
    generation_config.json: the ids besides the model's eos become stop_token_ids (they were dropped)."""
    from frawdllm.modeldir import load_generation_config

    _, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    hf_dir = tmp_path / "hf"
    export(model_dir, hf_dir)
    (hf_dir / "generation_config.json").unlink()
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": [3, 5]}))
    theirs = transformers.GenerationConfig.from_model_config(transformers.AutoConfig.from_pretrained(hf_dir))
    assert theirs.eos_token_id == [3, 5]
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "back")])
    assert load_generation_config(tmp_path / "back") == {"stop_token_ids": [5]}


def test_import_of_a_greedy_max_length_or_beam_config_stays_greedy_and_names_what_it_ignores(tmp_path, capsys):
    """transformers generates greedily without do_sample, and its max_length counts the prompt.
    A file setting only max_length or num_beams imported as nothing (our sampling defaults), so
    HF -> FrawdLLM -> HF turned a greedy model into a sampler, and what we cannot honour was
    dropped without a word. A max_length reaching the context maps (generation runs until the
    context is full, where transformers' greedy tokens are ours); the rest is named in one line."""
    from cli_helpers import run_cli
    from frawdllm.export.hf import to_hf_config
    from frawdllm.infer import Engine, SamplingParams
    from frawdllm.modeldir import load_generation_config

    tok = byte_tokenizer()  # (the engine decodes what it generates)
    cfg = small_model("llama-gqa", vocab_size=tok.vocab_size).config
    hf_model = randomize_(transformers.AutoModelForCausalLM.from_config(to_hf_config(cfg)), seed=11).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    gen_file, ids = tmp_path / "hf" / "generation_config.json", {"bos_token_id": 2, "eos_token_id": 3}
    gen_file.write_text(json.dumps({"max_length": cfg.context_length + 8, **ids}))
    code, _, err = run_cli(capsys, "import", "--from-hf", tmp_path / "hf", "--out", tmp_path / "ours")
    assert code == 0 and "ignored" not in err, err
    sampling = load_generation_config(tmp_path / "ours")
    assert sampling == {"temperature": 0, "max_new_tokens": cfg.context_length}
    prompt = random_ids(cfg.vocab_size, batch=1, length=5, seed=3)
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval().generate(
            prompt, attention_mask=torch.ones_like(prompt))[0, 5:].tolist()
    engine = Engine(FrawdLLM.from_pretrained(tmp_path / "ours").eval(), tok, weights="fp32")
    ours = engine.generate([prompt[0].tolist()], SamplingParams.from_dict(sampling))[0].tokens
    assert 5 + len(ours) > cfg.context_length and ours == theirs[:len(ours)]

    gen_file.write_text(json.dumps({"num_beams": 4, "no_repeat_ngram_size": 3, "max_length": 20, **ids}))
    code, _, err = run_cli(capsys, "import", "--from-hf", tmp_path / "hf", "--out", tmp_path / "beams")
    assert code == 0 and load_generation_config(tmp_path / "beams") == {"temperature": 0}
    named = [line for line in err.splitlines() if "ignored" in line]
    assert len(named) == 1 and all(f"{k}=" in named[0] for k in ("num_beams", "no_repeat_ngram_size", "max_length"))


def test_bfloat16_export_stores_bfloat16_weights_close_to_ours(tmp_path, tokenizer):
    model, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    export(model_dir, tmp_path / "hf", "--dtype", "bfloat16")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        from safetensors.torch import load_file

        stored = load_file(tmp_path / "hf" / "model.safetensors")
        assert {t.dtype for t in stored.values()} == {torch.bfloat16}
        export(model_dir, tmp_path / "short", "--dtype", "bf16")  # (the other commands' spelling)
        assert (tmp_path / "short" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
        ours = model.embed.tok.weight
        assert torch.equal(hf_model.model.embed_tokens.weight, ours.to(torch.bfloat16).float())
    # config.json says so (transformers' dtype="auto" reads it first), and so loads bf16
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto").dtype == torch.bfloat16


# ---- errors and atomicity -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize(
    "variant, changes, option, fix",
    [
        ("gpt2-tied", {"pos_encoding": "sinusoidal"}, "pos_encoding='sinusoidal'", "--set pos_encoding=learned"),
        ("gpt2-tied", {"norm_placement": "post"}, "norm_placement='post'", "--set norm_placement=pre"),
        ("llama-gqa", {"use_rmsnorm": False}, "use_rmsnorm=False", "--set use_rmsnorm=true"),
        ("llama-gqa", {"norm_placement": "post"}, "norm_placement='post'", "--set norm_placement=pre"),
    ],
)
def test_unexportable_variant_is_one_clear_error_and_writes_nothing(
    tmp_path, tokenizer, capsys, fmt, variant, changes, option, fix
):
    _, model_dir = make_model_dir(tmp_path, tokenizer, variant, **changes)
    before = entries(tmp_path)
    with pytest.raises(SystemExit) as info:
        export(model_dir, tmp_path / "out", "--format", fmt)
    assert info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("frawd: error:") and "\n" not in err
    assert option in err and fix in err
    assert entries(tmp_path) == before  # no --out, no temporary folder left behind


@pytest.mark.parametrize("fmt", ["hf", "gguf", "marian"])
def test_a_weight_beyond_float16s_range_is_refused_not_written_as_inf(tmp_path, tokenizer, capsys, fmt):
    """A weight of 1e6 was written as inf (transformers' logits all NaN; GGUF with only numpy's
    overflow warning): one line naming the tensor, nothing written, bfloat16 still exports."""
    from frawdllm import Seq2SeqTransformer

    if fmt == "marian":
        model = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=VOCAB, n_embd=32, n_head=2, n_layer=1,
                                              n_encoder_layer=1))
        model_dir, fmt = tmp_path / "mt", "hf"
        model.save_pretrained(model_dir, tokenizer=tokenizer)
    else:
        model, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)[0, 0] = -1e6
    model.save_pretrained(model_dir, tokenizer=tokenizer)
    before = entries(tmp_path)
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    with pytest.raises(SystemExit) as info:
        export(model_dir, out, "--format", fmt, "--dtype", "fp16")
    err = capsys.readouterr().err.strip()
    assert info.value.code == 1 and err.startswith("frawd: error:") and "\n" not in err, err
    assert "holds 1e+06, beyond float16's range (at most 65504); it would be written as inf" in err, err
    assert entries(tmp_path) == before
    export(model_dir, out, "--format", fmt, "--dtype", "bf16")
    assert out.exists()


def test_hf_export_to_a_gguf_file_name_is_refused(tmp_path, tokenizer, capsys):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    before = entries(tmp_path)
    with pytest.raises(SystemExit) as info:
        export(model_dir, tmp_path / "model.gguf", "--format", "hf")
    assert info.value.code != 0
    assert "--format gguf" in capsys.readouterr().err
    assert entries(tmp_path) == before


def test_generation_config_maps_min_p_and_a_max_length_at_the_context_both_ways():
    """min_p reaches transformers' file (and comes back); one sample writes no
    num_return_sequences (settings at their off value are left out); a max_length that
    reaches the context, at its bound, maps to max_new_tokens."""
    from frawdllm.export.hf_dir import generation_config, sampling_from_hf

    cfg = get_config("tiny")
    out = generation_config(cfg, {"temperature": 0.8, "top_p": 0.9, "min_p": 0.1})
    assert out["min_p"] == 0.1 and out["top_p"] == 0.9 and "num_return_sequences" not in out
    back = sampling_from_hf(out, cfg.eos_token_id, cfg.context_length)
    assert (back["temperature"], back["top_p"], back["min_p"]) == (0.8, 0.9, 0.1)
    assert sampling_from_hf({"max_length": 64}, 3, 64) == {"max_new_tokens": 64, "temperature": 0}


def test_format_defaults_to_gguf_for_a_gguf_out_and_hf_otherwise(tmp_path, tokenizer):
    pytest.importorskip("gguf")
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    export(model_dir, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes()[:4] == b"GGUF"
    export(model_dir, tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()


def test_export_failing_midway_leaves_no_out_and_no_temporary_files(tmp_path, tokenizer, monkeypatch):
    import frawdllm.export.hf_dir as hf_dir

    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    real_write = hf_dir.write_hf_dir

    def write_then_crash(model, tok, directory, *args, **kwargs):
        real_write(model, tok, directory, *args, **kwargs)
        assert (directory / "model.safetensors").is_file()  # the crash comes after real writes
        raise OSError("disk full")

    monkeypatch.setattr(hf_dir, "write_hf_dir", write_then_crash)
    before = entries(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        hf_dir.export_hf(model_dir, tmp_path / "out")
    assert entries(tmp_path) == before


def test_export_killed_by_sigterm_leaves_nothing(tmp_path, tokenizer, monkeypatch, capsys):
    """SIGTERM (kill, timeout) left a hidden temporary folder; it now tidies up like Ctrl-C."""
    import signal

    import frawdllm.export.hf_dir as hf_dir

    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    real_write = hf_dir.write_hf_dir

    def write_then_killed(model, tok, directory, *args, **kwargs):
        real_write(model, tok, directory, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(hf_dir, "write_hf_dir", write_then_killed)
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_DFL)  # (pytest may have its own handler)
    before = entries(tmp_path)
    try:
        with pytest.raises(SystemExit) as info:
            export(model_dir, tmp_path / "out")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert info.value.code == 130 and entries(tmp_path) == before


def test_existing_out_is_refused_unless_overwrite_then_replaced_whole(tmp_path, tokenizer, capsys):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(SystemExit):
        export(model_dir, out)
    assert "not empty" in capsys.readouterr().err and entries(out) == {"keep.txt"}
    export(model_dir, out, "--overwrite")
    assert "keep.txt" not in entries(out) and "model.safetensors" in entries(out)
    assert not [name for name in entries(tmp_path) if name.startswith(".")]  # no old/temp folders


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_overwrite_never_deletes_the_model_being_exported(tmp_path, tokenizer, capsys, monkeypatch, fmt):
    """--out the model's own folder, or a folder holding it, or the current folder: refused
    in one line with --overwrite, the model untouched (it was deleted, exit 0)."""
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    before = entries(model_dir)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    for out, says in ((model_dir, f"{model_dir} is the input: replacing"),
                      (tmp_path, f"{tmp_path} holds {model_dir}, the input: replacing"), (Path("."), "current folder")):
        with pytest.raises(SystemExit):
            export(model_dir, out, "--format", fmt, "--overwrite")
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
        assert entries(model_dir) == before and entries(tmp_path / "work") == {"notes.txt"}


# ---- import -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["gpt2-untied", "llama-gqa", "llama-bias-gqa"])
def test_import_of_a_random_transformers_checkpoint_reproduces_its_logits(tmp_path, variant):
    from frawdllm.export.hf import to_hf_config
    from frawdllm.export.hf_dir import read_hf_dir

    hf_config = to_hf_config(small_model(variant).config)
    hf_model = randomize_(transformers.AutoModelForCausalLM.from_config(hf_config), seed=11).eval()
    hf_model.save_pretrained(tmp_path / "hf")
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    model = FrawdLLM.from_pretrained(tmp_path / "ours").eval()
    ids = random_ids(hf_config.vocab_size, seed=5)
    with torch.no_grad():
        diff = (model(ids)[0] - hf_model(ids).logits).abs().max().item()
        # the Python API's reader builds the same model without writing a directory
        direct = (read_hf_dir(tmp_path / "hf").eval()(ids)[0] - hf_model(ids).logits).abs().max().item()
    print(f"import hf {variant}: max_abs_diff={diff:.3e} read_hf_dir={direct:.3e}")
    assert diff < TOL and direct < TOL


@pytest.mark.parametrize("variant", ["gpt2-untied", "llama-mqa-untied"])
def test_import_keeps_a_distinct_head_that_config_says_is_tied_as_transformers_does(tmp_path, variant, capsys):
    """config.json says tie_word_embeddings but the safetensors hold another lm_head.weight:
    transformers keeps that head, so must we (tying it changed the logits by up to 1.4); a
    head equal to the embedding stays tied."""
    from frawdllm.export.hf import to_hf_config

    hf_config = to_hf_config(small_model(variant).config)
    randomize_(transformers.AutoModelForCausalLM.from_config(hf_config), seed=11).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model = FrawdLLM.from_pretrained(tmp_path / "ours").eval()
    ids = random_ids(hf_config.vocab_size, seed=5)
    with torch.no_grad():
        assert (model(ids)[0] - hf_model(ids).logits).abs().max().item() < TOL
    assert not model.config.tie_embeddings and "imported untied" in capsys.readouterr().err

    weights = load_file(tmp_path / "hf" / "model.safetensors")  # the head stored twice, equal
    weights["lm_head.weight"] = hf_model.get_input_embeddings().weight.detach().clone()
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "tied")])
    assert "untied" not in capsys.readouterr().err and FrawdLLM.from_pretrained(tmp_path / "tied").config.tie_embeddings


def bos_template_checkpoint(directory: Path) -> Path:
    """A transformers Llama checkpoint whose tokenizer's post-processor starts every text with
    <s> (as TinyLlama's and Llama 3's do), saved with transformers' own tokenizer class."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    text = SHAKESPEARE.read_text(encoding="utf-8")[:20_000]
    backend.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, bos_token_id=0,
                                      eos_token_id=1)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # large weights: where the prompt starts matters to the argmax
        for p in hf_model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3)
    hf_model.save_pretrained(directory)
    return directory


def test_a_tokenizer_template_bos_leads_our_prompts_as_in_transformers_and_both_exports(tmp_path, capsys):
    """`frawd generate` of an imported model whose tokenizer adds <s> gives transformers'
    greedy tokens (it left the <s> out); the HF export keeps the template, GGUF says
    add_bos_token."""
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    gguf = pytest.importorskip("gguf")
    hf_dir = bos_template_checkpoint(tmp_path / "hf")
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")])
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    prompt = hf_tokenizer("ROMEO:", return_tensors="pt")
    assert prompt["input_ids"][0, 0] == 0
    with torch.no_grad():
        theirs = hf_model.generate(**prompt, do_sample=False, max_new_tokens=10)[0, prompt["input_ids"].shape[1]:]
    capsys.readouterr()
    main(["generate", "--model", str(tmp_path / "ours"), "--prompt", "ROMEO:", "--temperature", "0",
          "--max-new-tokens", "10", "--native", "off", "--json"])
    ours = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert ours["tokens"] == theirs.tolist() and ours["prompt_tokens"] == prompt["input_ids"].shape[1]

    export(tmp_path / "ours", tmp_path / "again")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "again")("ROMEO:")["input_ids"] == \
        prompt["input_ids"][0].tolist()
    export(tmp_path / "ours", tmp_path / "g", "--format", "gguf")
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True


def test_a_chat_that_writes_its_bos_gets_no_second_one_from_the_tokenizer_template(tmp_path):
    """A tokenizer with our specials whose template also adds <|bos|>: a text prompt starts
    with one <|bos|>; a chat (our template writes <|bos|>) with one too, in `render_chat`,
    in transformers' apply_chat_template, and in llama.cpp (which adds BOS itself when
    add_bos_token, so the GGUF template must not write it)."""
    from tokenizers import processors

    from frawdllm.infer import Engine
    from frawdllm.tokenizer import BOS_ID, Tokenizer

    backend = byte_tokenizer().backend
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", BOS_ID)])
    tok = Tokenizer(backend)
    model = small_model("llama-gqa", vocab_size=tok.vocab_size)
    assert Engine(model, tok, weights="fp32").encode("hi") == [BOS_ID] + tok.encode("hi")
    chat = tok.render_chat(CHAT)
    assert chat[0] == BOS_ID and chat[1] != BOS_ID
    model.save_pretrained(tmp_path / "ours", tokenizer=tok)
    export(tmp_path / "ours", tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert (ids["input_ids"] if not isinstance(ids, list) else ids) == chat
    gguf = pytest.importorskip("gguf")
    export(tmp_path / "ours", tmp_path / "g", "--format", "gguf")
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True
    import jinja2

    template = jinja2.Template(reader.fields["tokenizer.chat_template"].contents())
    assert "<|bos|>" + template.render(messages=CHAT, add_generation_prompt=True) == render_chat_text(CHAT)


def test_import_reads_sharded_checkpoints_and_keeps_the_tokenizer(tmp_path, tokenizer):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "llama-gqa")
    export(model_dir, tmp_path / "hf")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    (tmp_path / "sharded" / "tokenizer.json").write_text((tmp_path / "hf" / "tokenizer.json").read_text())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    main(["import", "--from-hf", str(tmp_path / "sharded"), "--out", str(tmp_path / "back")])
    back = FrawdLLM.from_pretrained(tmp_path / "back")
    for key, tensor in FrawdLLM.from_pretrained(model_dir).state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    from frawdllm.tokenizer import Tokenizer

    assert Tokenizer.load(tmp_path / "back").encode(SAMPLE) == tokenizer.encode(SAMPLE)


def test_import_refuses_pickle_weights_without_reading_them(tmp_path, capsys):
    from frawdllm.export.hf import to_hf_config

    hf_dir = tmp_path / "hf"
    to_hf_config(get_config("tiny-llama", **SMALL)).save_pretrained(hf_dir)
    (hf_dir / "pytorch_model.bin").write_bytes(b"not even a pickle: it must never be opened")
    with pytest.raises(SystemExit):
        main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")])
    err = capsys.readouterr().err
    assert "never unpickles" in err and "safe_serialization=True" in err
    assert not (tmp_path / "ours").exists()


def test_import_refuses_a_corrupt_tokenizer_and_leaves_no_output(tmp_path, tokenizer, capsys):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    export(model_dir, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text("{")  # copied blindly, it broke `frawd generate` later
    with pytest.raises(SystemExit):
        main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    err = capsys.readouterr().err
    assert "not a valid tokenizer.json" in err and err.count("\n") == 1
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("index, says", [('{"weight_map": []}', "not a safetensors index"),
                                         ("[]", "not a safetensors index"),
                                         ('{"weight_map": {"a": 5}}', "not a safetensors index"),
                                         ('{"weight_map": {"a": "../../secret.safetensors"}}', "not a file in")])
def test_import_refuses_a_bad_safetensors_index_in_one_line(tmp_path, tokenizer, capsys, index, says):
    """A malformed model.safetensors.index.json (it was a traceback), or one naming a shard
    outside the folder (it was read), is one line naming the index."""
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    export(model_dir, tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "model-00001.safetensors")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(index)
    with pytest.raises(SystemExit):
        main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")])
    err = capsys.readouterr().err
    assert says in err and "model.safetensors.index.json" in err and err.count("\n") == 1, err
    assert not (tmp_path / "ours").exists()


def test_import_never_deletes_the_checkpoint_it_reads(tmp_path, tokenizer, capsys):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    export(model_dir, tmp_path / "hf")
    before = entries(tmp_path / "hf")
    with pytest.raises(SystemExit):
        main(["import", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "hf"), "--overwrite"])
    assert "the input" in capsys.readouterr().err and entries(tmp_path / "hf") == before


def test_import_names_a_missing_folder_and_a_frawdllm_directory(tmp_path, tokenizer, capsys):
    _, model_dir = make_model_dir(tmp_path, tokenizer, "gpt2-tied")
    for source, message in ((tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: not found"),
                            (model_dir, f"{model_dir}: a FrawdLLM model directory already")):
        with pytest.raises(SystemExit):
            main(["import", "--from-hf", str(source), "--out", str(tmp_path / "ours")])
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert not (tmp_path / "ours").exists()


def test_import_without_tokenizer_json_says_what_was_left_out_and_how_to_get_it(tmp_path, capsys):
    """A checkpoint with only a slow tokenizer's vocab.json and merges.txt imported without a
    tokenizer and said nothing; now one warning names the files and the fix, which works."""
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    end = vocab["<|endoftext|>"] = len(vocab)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "vocab.json").write_text(json.dumps(vocab))
    (hf_dir / "merges.txt").write_text("#version: 0.2\n")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(vocab), n_embd=32, n_layer=1, n_head=2, n_positions=16, bos_token_id=end, eos_token_id=end,
    )).save_pretrained(hf_dir)
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ours")])
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "no tokenizer.json (only vocab.json, merges.txt" in warned[0], warned
    assert not (tmp_path / "ours" / "tokenizer.json").exists()
    transformers.AutoTokenizer.from_pretrained(hf_dir).save_pretrained(hf_dir)  # the fix it names
    assert f"AutoTokenizer.from_pretrained({str(hf_dir)!r}).save_pretrained({str(hf_dir)!r})" in warned[0]
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ours"), "--overwrite"])
    assert "warning" not in capsys.readouterr().err and (tmp_path / "ours" / "tokenizer.json").is_file()
    for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):  # no tokenizer at all
        (hf_dir / name).unlink(missing_ok=True)
    main(["import", "--from-hf", str(hf_dir), "--out", str(tmp_path / "bare")])
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "no tokenizer.json (nor any other tokenizer file)" in warned[0], warned


def test_export_of_a_transformers_folder_or_a_training_run_names_what_to_give_instead(tmp_path, capsys):
    from frawdllm.export.hf import to_hf_config

    hf_dir, run, mistral = tmp_path / "hf", tmp_path / "run", tmp_path / "mistral"
    to_hf_config(get_config("tiny-llama", **SMALL)).save_pretrained(hf_dir)
    transformers.MistralConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(mistral)
    small_model("gpt2-tied").save_pretrained(run / "model")
    for model_dir, says in ((hf_dir, f"convert it first: frawd import --from-hf {hf_dir} --out"),
                            (mistral, "(model_type 'mistral'), not a FrawdLLM model directory; frawd import reads "
                                      "model_type gpt2 and llama only"),  # (not advice that fails next)
                            (run, f"a training run keeps its model in model/: give {run / 'model'}")):
        with pytest.raises(SystemExit):
            export(model_dir, tmp_path / "out")
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()
