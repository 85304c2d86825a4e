"""`frawd export --format gguf`, read back with the `gguf` package's own GGUFReader.

Expected tensor names, layouts and metadata are written out here by hand from llama.cpp's
conventions (not taken from the exporter), and the q/k row permutation is checked against
a hand-written llama.cpp-style rotation: interleaved pairs (x[2i], x[2i+1]).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM
from frawdllm.cli import main
from frawdllm.export.hf_dir import CHAT_TEMPLATE
from frawdllm.model.embeddings import apply_rope, rope_tables
from frawdllm.tokenizer import byte_tokenizer, render_chat_text, train_tokenizer
from interop_helpers import small_model

gguf = pytest.importorskip("gguf")
SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"
CONTROL, NORMAL, USER_DEFINED, UNUSED = 3, 1, 4, 5  # llama.cpp token types


@pytest.fixture(scope="module")
def tokenizer():
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    text = SHAKESPEARE.read_text(encoding="utf-8")[:40_000]
    return train_tokenizer([text[i:i + 2000] for i in range(0, len(text), 2000)], "bpe", 320)


def export_gguf(tmp_path: Path, model: FrawdLLM, tokenizer, *extra: str):
    model_dir = tmp_path / "ours"
    model.save_pretrained(model_dir, tokenizer=tokenizer)
    main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "g"), *extra])
    return gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))


def field(reader, key: str):
    return reader.fields[key].contents()


def llama_cpp_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Row order llama.cpp expects for q/k: in each head, rows i and i + hd/2 side by side."""
    hd = weight.shape[0] // n_heads
    order = [h * hd + (j // 2 if j % 2 == 0 else hd // 2 + j // 2) for h in range(n_heads) for j in range(hd)]
    return weight[order]


def expected_tensors(model: FrawdLLM) -> dict[str, torch.Tensor]:
    """Every tensor llama.cpp reads, by its GGUF name, in (out, in) layout."""
    cfg, sd = model.config, model.state_dict()
    if cfg.pos_encoding == "learned":  # gpt2
        out = {"token_embd.weight": sd["embed.tok.weight"], "position_embd.weight": sd["embed.pos.weight"],
               "output_norm.weight": sd["norm.weight"], "output_norm.bias": sd["norm.bias"],
               "output.weight": sd["lm_head.weight"]}
        for i in range(cfg.n_layer):
            for ours, theirs in (("norm1", "attn_norm"), ("attn.qkv", "attn_qkv"), ("attn.proj", "attn_output"),
                                 ("norm2", "ffn_norm"), ("mlp.up", "ffn_up"), ("mlp.down", "ffn_down")):
                for p in ("weight", "bias"):
                    out[f"blk.{i}.{theirs}.{p}"] = sd[f"blocks.{i}.{ours}.{p}"]
        return out
    out = {"token_embd.weight": sd["embed.tok.weight"], "output_norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    q, kv, h = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim
    for i in range(cfg.n_layer):
        b = f"blocks.{i}."
        out[f"blk.{i}.attn_norm.weight"] = sd[b + "norm1.weight"]
        out[f"blk.{i}.ffn_norm.weight"] = sd[b + "norm2.weight"]
        for p in ("weight", "bias") if cfg.bias else ("weight",):
            qkv, up = sd[f"{b}attn.qkv.{p}"], sd[f"{b}mlp.up.{p}"]
            out[f"blk.{i}.attn_q.{p}"] = llama_cpp_rows(qkv[:q], cfg.n_head)
            out[f"blk.{i}.attn_k.{p}"] = llama_cpp_rows(qkv[q:q + kv], cfg.n_kv_head)
            out[f"blk.{i}.attn_v.{p}"] = qkv[q + kv:]
            out[f"blk.{i}.attn_output.{p}"] = sd[f"{b}attn.proj.{p}"]
            out[f"blk.{i}.ffn_gate.{p}"] = up[:h]
            out[f"blk.{i}.ffn_up.{p}"] = up[h:]
            out[f"blk.{i}.ffn_down.{p}"] = sd[f"{b}mlp.down.{p}"]
    return out


@pytest.mark.parametrize("variant", ["gpt2-tied", "gpt2-untied", "llama-gqa", "llama-mqa-untied", "llama-bias-gqa"])
def test_gguf_holds_every_tensor_with_llama_cpp_name_shape_and_values(tmp_path, tokenizer, variant):
    model = small_model(variant, vocab_size=320)
    reader = export_gguf(tmp_path, model, tokenizer)
    expected = expected_tensors(model)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        want = expected[t.name]
        assert list(t.shape) == list(reversed(want.shape)), t.name  # GGUF lists dims fastest first
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(t.data.copy()), want), t.name


@pytest.mark.parametrize("variant", ["llama-gqa", "llama-bias-gqa", "llama-mqa-untied"])
def test_gguf_q_k_rows_give_our_attention_scores_under_llama_cpp_rotation(tmp_path, tokenizer, variant):
    model = small_model(variant, vocab_size=320)
    cfg = model.config
    reader = export_gguf(tmp_path, model, tokenizer)
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    x = torch.randn(cfg.context_length, cfg.n_embd, generator=torch.Generator().manual_seed(0))
    hd, group = cfg.head_dim, cfg.n_head // cfg.n_kv_head

    def llama_cpp_qk(name: str, n_heads: int) -> torch.Tensor:
        y = x @ tensors[f"blk.0.{name}.weight"].T
        if f"blk.0.{name}.bias" in tensors:
            y = y + tensors[f"blk.0.{name}.bias"]
        y = y.view(-1, n_heads, hd)  # (T, heads, hd)
        pos = torch.arange(cfg.context_length, dtype=torch.float64)[:, None, None]
        theta = pos * cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (T, 1, hd/2)
        cos, sin = theta.cos().float(), theta.sin().float()
        even, odd = y[..., 0::2], y[..., 1::2]
        out = torch.empty_like(y)
        out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
        return out.transpose(0, 1)  # (heads, T, hd)

    q_cpp, k_cpp = llama_cpp_qk("attn_q", cfg.n_head), llama_cpp_qk("attn_k", cfg.n_kv_head)
    with torch.no_grad():
        q, k, _ = model.blocks[0].attn.qkv(x).split([cfg.n_head * hd, cfg.n_kv_head * hd, cfg.n_kv_head * hd], -1)
        cos, sin = rope_tables(cfg.context_length, hd, cfg.rope_theta)
        q = apply_rope(q.view(1, -1, cfg.n_head, hd).transpose(1, 2), cos, sin)[0]
        k = apply_rope(k.view(1, -1, cfg.n_kv_head, hd).transpose(1, 2), cos, sin)[0]
    kv_of = torch.arange(cfg.n_head) // group
    ours = q @ k[kv_of].transpose(1, 2)  # (heads, T, T) attention scores
    theirs = q_cpp @ k_cpp[kv_of].transpose(1, 2)
    assert (ours - theirs).abs().max() < 1e-4 * ours.abs().max()


@pytest.mark.parametrize("variant", ["gpt2-tied", "llama-gqa"])
def test_gguf_metadata_describes_the_model(tmp_path, tokenizer, variant):
    model = small_model(variant, vocab_size=320, rope_theta=5000.0, norm_eps=1e-6)
    cfg = model.config
    reader = export_gguf(tmp_path, model, tokenizer)
    arch = "gpt2" if variant.startswith("gpt2") else "llama"
    expected = {
        "general.architecture": arch, "general.name": "ours", "general.file_type": 0,
        f"{arch}.context_length": cfg.context_length, f"{arch}.embedding_length": cfg.n_embd,
        f"{arch}.feed_forward_length": cfg.ffn_dim, f"{arch}.block_count": cfg.n_layer,
        f"{arch}.attention.head_count": cfg.n_head, f"{arch}.vocab_size": 320,
    }
    if arch == "gpt2":
        expected[f"{arch}.attention.layer_norm_epsilon"] = pytest.approx(1e-6)
    else:
        expected.update({
            "llama.attention.head_count_kv": cfg.n_kv_head,
            "llama.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
            "llama.rope.freq_base": 5000.0, "llama.rope.dimension_count": cfg.head_dim,
            "llama.attention.key_length": cfg.head_dim, "llama.attention.value_length": cfg.head_dim,
        })
    for key, value in expected.items():
        assert field(reader, key) == value, key
    model_keys = {k for k in reader.fields if k.startswith(arch + ".")}
    assert model_keys == {k for k in expected if k.startswith(arch + ".")}


def test_a_runs_best_model_is_named_after_the_run(tmp_path, tokenizer):
    """Every trained model was named "model" (the folder RUN/model)."""
    model = small_model("llama-gqa", vocab_size=320)
    model.save_pretrained(tmp_path / "shakespeare" / "model", tokenizer=tokenizer)
    main(["export", "--model", str(tmp_path / "shakespeare" / "model"), "--out", str(tmp_path / "s.gguf")])
    assert field(gguf.GGUFReader(str(tmp_path / "s.gguf")), "general.name") == "shakespeare"


def test_gguf_embeds_the_tokenizer_and_chat_template(tmp_path, tokenizer):
    vocab = tokenizer.vocab_size + 3  # an embedding larger than the vocabulary: padded entries
    model = small_model("llama-gqa", vocab_size=vocab)
    reader = export_gguf(tmp_path, model, tokenizer)
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[: tokenizer.vocab_size] == [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
    assert len(tokens) == vocab and tokens[-1] == f"[PAD{vocab - 1}]"
    types = field(reader, "tokenizer.ggml.token_type")
    assert types == [CONTROL] * 7 + [NORMAL] * (tokenizer.vocab_size - 7) + [UNUSED] * 3
    merges = json.loads((tmp_path / "ours" / "tokenizer.json").read_text())["model"]["merges"]
    assert field(reader, "tokenizer.ggml.merges") == [m if isinstance(m, str) else " ".join(m) for m in merges]
    assert len(merges) > 0
    assert (field(reader, "tokenizer.ggml.model"), field(reader, "tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    ids = {k: field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding", "unknown")}
    assert ids == {"bos": 2, "eos": 3, "padding": 0, "unknown": 1}
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    assert field(reader, "tokenizer.ggml.add_eos_token") is False  # (llama.cpp would end every prompt with it)
    template = field(reader, "tokenizer.chat_template")
    assert template == CHAT_TEMPLATE
    jinja2 = pytest.importorskip("jinja2")
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = jinja2.Environment().from_string(template).render(messages=chat, add_generation_prompt=True)
    assert rendered == render_chat_text(chat, True)


def test_byte_tokenizer_exports_as_byte_level_bpe_without_merges(tmp_path):
    tok = byte_tokenizer()
    reader = export_gguf(tmp_path, small_model("llama-gqa", vocab_size=tok.vocab_size), tok)
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens[7:] == [tok.id_to_token(7 + b) for b in range(256)] and tokens[7 + ord("A")] == "A"
    # llama.cpp needs the merges key; the stand-in merge joins two control tokens, which
    # byte-level BPE (single-character symbols, no other merges) can never form.
    assert field(reader, "tokenizer.ggml.merges") == ["<|pad|> <|pad|>"]


def test_export_prints_one_line_and_no_progress_bar_off_a_terminal(tmp_path, capsys):
    tok = byte_tokenizer()
    export_gguf(tmp_path, small_model("llama-gqa", vocab_size=tok.vocab_size), tok)
    out, err = capsys.readouterr()
    assert out == f"exported {tmp_path / 'ours'} as GGUF (float32) to {tmp_path / 'g' / 'model.gguf'}\n"
    assert err == ""  # neither our bar nor gguf's "Writing" bar: stderr is no terminal here


@pytest.mark.parametrize("dtype, qtype", [("float16", "F16"), ("bfloat16", "BF16")])
def test_half_precision_gguf_rounds_matrices_and_keeps_norms_float32(tmp_path, tokenizer, dtype, qtype):
    model = small_model("llama-gqa", vocab_size=320)
    reader = export_gguf(tmp_path, model, tokenizer, "--dtype", dtype)
    expected = expected_tensors(model)
    assert field(reader, "general.file_type") == {"F16": 1, "BF16": 32}[qtype]
    for t in reader.tensors:
        want = expected[t.name]
        if want.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            continue
        assert t.tensor_type.name == qtype, t.name
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        assert torch.equal(values, want.to(getattr(torch, dtype)).float()), t.name


def test_char_tokenizer_is_refused_for_gguf_and_nothing_is_written(tmp_path, capsys):
    tok = train_tokenizer(["To be, or not to be: that is the question."], "char")
    model_dir = tmp_path / "ours"
    small_model("llama-gqa", vocab_size=64).save_pretrained(model_dir, tokenizer=tok)
    before = set(os.listdir(tmp_path))
    with pytest.raises(SystemExit):
        main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err
    assert "char" in err and "--format hf" in err
    assert set(os.listdir(tmp_path)) == before


def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_by_name(tmp_path, capsys):
    """An imported SentencePiece-style tokenizer ('\u2581' for spaces, byte fallback: Llama 2,
    Mistral) was written as GPT-2 byte-level BPE: llama.cpp then tokenized and decoded text
    wrongly, without a word."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, trainers

    from frawdllm.tokenizer import SPECIAL_TOKENS, Tokenizer

    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n" * 20
    spm = Backend(models.BPE(byte_fallback=True, unk_token="<|unk|>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    spm.train_from_iterator([text], trainers.BpeTrainer(vocab_size=120, special_tokens=list(SPECIAL_TOKENS)))
    llama3ish = Backend(models.BPE())  # a regex split before byte-level: llama.cpp's pre-tokenizer is another
    llama3ish.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(r"\d{1,3}", "isolated"),
                                                       pre_tokenizers.ByteLevel(use_regex=False)])
    llama3ish.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS),
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_level = Backend(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS),
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    nfc, prefix_space, no_regex = (Backend.from_str(byte_level.to_str()) for _ in range(3))
    nfc.normalizer = normalizers.NFC()
    prefix_space.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    no_regex.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for backend, reason in [(spm, "is SentencePiece-style"),
                            (llama3ish, "splits text another way (pre-tokenizer Sequence of Split, ByteLevel)"),
                            (nfc, "normalizes text first (NFC)"),
                            (prefix_space, "splits text another way (a ByteLevel pre-tokenizer with add_prefix_space"),
                            (no_regex, "splits text another way (a ByteLevel pre-tokenizer without GPT-2's regex")]:
        tok = Tokenizer(backend)
        model_dir = tmp_path / "ours"
        small_model("llama-gqa", vocab_size=tok.vocab_size).save_pretrained(model_dir, tokenizer=tok)
        with pytest.raises(SystemExit):
            main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "g")])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and reason in err[0] and "--format hf" in err[0], err
        assert not (tmp_path / "g").exists()


def with_added_token(tokenizer, content: str, **flags):
    """`tokenizer` with one more token added as transformers' `add_tokens` adds it (not special)."""
    from tokenizers import AddedToken, Tokenizer as Backend

    from frawdllm.tokenizer import Tokenizer

    backend = Backend.from_str(tokenizer.backend.to_str())
    backend.add_tokens([AddedToken(content, special=False, normalized=False, **flags)])
    return Tokenizer(backend)


def test_an_added_token_that_is_not_special_is_matched_whole_by_llama_cpp(tmp_path, tokenizer, capsys):
    """It was written as a NORMAL token, so llama.cpp split "<tool>" into pieces where we and
    transformers read one token (another prompt, without a word)."""
    tok = with_added_token(tokenizer, "<tool>")
    text = "call <tool> now, <tool>"
    tool = tok.token_to_id("<tool>")
    assert tool == tokenizer.vocab_size and tok.encode(text).count(tool) == 2
    reader = export_gguf(tmp_path, small_model("llama-gqa", vocab_size=tok.vocab_size), tok)
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[tool] == USER_DEFINED and types[:tool] == [CONTROL] * 7 + [NORMAL] * (tool - 7)
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(tmp_path / "g" / "model.gguf"), vocab_only=True, verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)
    finally:
        llm.close()


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_an_added_token_with_spacing_rules_gguf_cannot_hold_is_refused(tmp_path, tokenizer, capsys, flag):
    tok = with_added_token(tokenizer, "<tool>", **{flag: True})
    model_dir = tmp_path / "ours"
    small_model("llama-gqa", vocab_size=tok.vocab_size).save_pretrained(model_dir, tokenizer=tok)
    with pytest.raises(SystemExit):
        main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "g")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "added token '<tool>'" in err[0] and "--format hf" in err[0], err
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("prefix", [["<|bos|>"], ["<|user|>"], ["<|bos|>", "<|user|>"]])
def test_add_bos_token_only_where_the_template_starts_with_bos_alone(tmp_path, tokenizer, capsys, prefix):
    """llama.cpp can add one id, bos_token_id, before a prompt: any other prefix of the
    tokenizer's template is a warning and add_bos_token false."""
    from tokenizers import Tokenizer as Backend, processors

    from frawdllm.tokenizer import Tokenizer

    backend = Backend.from_str(tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(prefix) + " $A", special_tokens=[(t, tokenizer.token_to_id(t)) for t in prefix])
    tok = Tokenizer(backend)
    reader = export_gguf(tmp_path, small_model("llama-gqa", vocab_size=tok.vocab_size), tok)
    alone = prefix == ["<|bos|>"]
    assert field(reader, "tokenizer.ggml.add_bos_token") is alone
    assert ("which GGUF cannot say" in capsys.readouterr().err) is not alone


def test_gguf_out_may_name_the_file_itself(tmp_path, tokenizer):
    model_dir = tmp_path / "ours"
    small_model("gpt2-tied", vocab_size=320).save_pretrained(model_dir, tokenizer=tokenizer)
    out = tmp_path / "exports" / "tiny.gguf"
    main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(out)])
    assert os.listdir(out.parent) == ["tiny.gguf"]
    assert field(gguf.GGUFReader(str(out)), "general.architecture") == "gpt2"
    upper = tmp_path / "exports" / "TINY.GGUF"  # (any case: a file, not a folder of that name)
    main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(upper)])
    assert upper.is_file() and sorted(os.listdir(out.parent)) == ["TINY.GGUF", "tiny.gguf"]


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
def test_a_special_id_outside_the_tokenizer_is_refused_by_both_exports(tmp_path, capsys, fmt):
    """bos_token_id 400 with a 263-token byte tokenizer (vocabulary padded to 512): the HF
    export refused it, GGUF wrote an unused padding token as bos."""
    tok = byte_tokenizer()
    model_dir = tmp_path / "ours"
    small_model("llama-gqa", vocab_size=512, bos_token_id=400).save_pretrained(model_dir, tokenizer=tok)
    with pytest.raises(SystemExit):
        main(["export", "--model", str(model_dir), "--format", fmt, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "bos_token_id 400 is not in the tokenizer's vocabulary" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_folder_named_like_a_gguf_file_is_refused_before_any_work(tmp_path, tokenizer, capsys):
    model_dir = tmp_path / "ours"
    small_model("gpt2-tied", vocab_size=320).save_pretrained(model_dir, tokenizer=tokenizer)
    (tmp_path / "x.gguf").mkdir()
    with pytest.raises(SystemExit):
        main(["export", "--model", str(model_dir), "--format", "gguf", "--out", str(tmp_path / "x.gguf"),
              "--overwrite"])
    err = capsys.readouterr().err
    assert "is a folder" in err and ".tmp" not in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["ours", "x.gguf"]


# ---- llama.cpp itself (where llama-cpp-python is installed: it compiles from source) --------
SAMPLE = "ROMEO: But soft, what light through yonder window breaks?\n  It is the east; é, ß, 猫 and 🦙 too."
# Llama: llama.cpp with a float32 KV cache computes what we compute (measured ~3e-6).
# GPT-2: ggml's CPU GELU reads a float16 table (input and output rounded to float16);
# measured ~1.1e-3 here, and emulating that rounding on our side removes most of the gap.
# A mapping error is far larger (leaving out the q/k row permutation: 0.47).
LLAMA_CPP_TOL = {"llama": 1e-4, "gpt2": 3e-3}


@pytest.mark.parametrize(
    "variant, kind",
    [("llama-gqa", "bpe"), ("llama-mqa-untied", "bpe"), ("llama-bias-gqa", "byte"),
     ("gpt2-tied", "bpe"), ("gpt2-untied", "byte")],
)
def test_llama_cpp_runs_the_gguf_with_our_tokens_and_logits(tmp_path, tokenizer, variant, kind):
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = tokenizer if kind == "bpe" else byte_tokenizer()
    model = small_model(variant, vocab_size=tok.vocab_size)
    export_gguf(tmp_path, model, tok)
    n_ctx = model.config.context_length
    llm = llama_cpp.Llama(model_path=str(tmp_path / "g" / "model.gguf"), n_ctx=n_ctx, logits_all=True,
                          n_threads=2, verbose=False, type_k=0, type_v=0)  # 0: float32 KV cache
    try:
        assert llm.tokenize(SAMPLE.encode(), add_bos=False, special=False) == tok.encode(SAMPLE)
        ids = tok.encode(SAMPLE)[:n_ctx]
        llm.eval(ids)
        theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    finally:
        llm.close()
    with torch.no_grad():
        ours = model(torch.tensor([ids]))[0][0]
    diff = (ours - theirs).abs().max().item()
    print(f"llama.cpp {variant} ({kind}): max_abs_diff={diff:.3e}")
    assert diff < LLAMA_CPP_TOL[variant.split("-")[0]]
