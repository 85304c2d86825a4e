"""`frawd import --from-gguf`: a GGUF file back as a FrawdLLM model directory.

Our own exports come back bit for bit (weights, config, tokenizer); a file quantized by
llama.cpp itself (Q8_0) imports to a model whose logits are llama.cpp's on that file; what
has no FrawdLLM equivalent is one clear line, and nothing is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM
from frawdllm.tokenizer import Tokenizer, byte_tokenizer, train_tokenizer
from cli_helpers import run_cli
from interop_helpers import small_model

gguf = pytest.importorskip("gguf")
SHAKESPEARE = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tinyshakespeare.txt"


@pytest.fixture(scope="module")
def text():
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not present")
    return SHAKESPEARE.read_text(encoding="utf-8")[:40_000]


@pytest.fixture(scope="module")
def bpe(text):
    return train_tokenizer([text[i:i + 2000] for i in range(0, len(text), 2000)], "bpe", 320)


def exported(tmp_path: Path, model: FrawdLLM, tokenizer, *extra: str) -> Path:
    from frawdllm.export.gguf import export_gguf

    model.save_pretrained(tmp_path / "ours", tokenizer=tokenizer)
    dtype = {"fp16": "float16"}.get(extra[-1], "float32") if extra else "float32"
    return export_gguf(tmp_path / "ours", tmp_path / "m.gguf", dtype=dtype)


def imported(tmp_path: Path, path: Path, capsys, said: str = "") -> Path:
    """`path` imported; stderr is `said` (nothing, for a file with a tokenizer we read)."""
    out = tmp_path / "back"
    code, stdout, err = run_cli(capsys, "import", "--from-gguf", path, "--out", out)
    assert code == 0 and err == said, err
    assert stdout.startswith(f"imported {path} to {out}: ")
    return out


@pytest.mark.parametrize("variant", ["gpt2-tied", "gpt2-untied", "llama-gqa", "llama-mqa-untied", "llama-bias-gqa"])
@pytest.mark.parametrize("kind", ["bpe", "byte"])
def test_our_export_comes_back_bit_for_bit(tmp_path, bpe, text, variant, kind, capsys):
    tok = bpe if kind == "bpe" else byte_tokenizer()
    model = small_model(variant, vocab_size=tok.vocab_size + 3)  # (+3: the export pads the token list)
    back = imported(tmp_path, exported(tmp_path, model, tok), capsys)
    again = FrawdLLM.from_pretrained(back)
    assert again.config == model.config
    ours, theirs = model.state_dict(), again.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    tok_back = Tokenizer.load(back)
    assert tok_back.fingerprint == tok.fingerprint and tok_back.kind == tok.kind
    assert tok_back.encode(text[:5000]) == tok.encode(text[:5000])


def test_rope_theta_and_norm_epsilon_come_back(tmp_path, bpe, capsys):
    """Llama 3, Mistral and Qwen files rotate with theta 5e5-1e6: read as the default 10000,
    every position would be rotated wrongly."""
    model = small_model("llama-gqa", vocab_size=bpe.vocab_size, rope_theta=500000.0, norm_eps=1e-6)
    again = FrawdLLM.from_pretrained(imported(tmp_path, exported(tmp_path, model, bpe), capsys))
    assert (again.config.rope_theta, again.config.norm_eps) == (500000.0, 1e-6) and again.config == model.config


def test_half_precision_comes_back_as_the_rounded_weights(tmp_path, bpe, capsys):
    model = small_model("llama-gqa", vocab_size=bpe.vocab_size)
    again = FrawdLLM.from_pretrained(imported(tmp_path, exported(tmp_path, model, bpe, "--dtype", "fp16"), capsys))
    for name, value in model.state_dict().items():
        rounded = value.half().float() if value.ndim == 2 else value  # (norms stay float32 in the file)
        assert torch.equal(again.state_dict()[name], rounded), name


def test_an_added_token_and_a_bos_adding_template_come_back(tmp_path, bpe, text, capsys):
    """A user-defined token is matched whole again; llama.cpp's add_bos_token becomes the
    tokenizer's own prefix, as an imported Llama's template gives it."""
    from tokenizers import AddedToken, Tokenizer as Backend, processors

    backend = Backend.from_str(bpe.backend.to_str())
    backend.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 2)])
    tok = Tokenizer(backend)
    model = small_model("llama-gqa", vocab_size=tok.vocab_size)
    tok_back = Tokenizer.load(imported(tmp_path, exported(tmp_path, model, tok), capsys))
    sample = "call <tool> now: " + text[:300]
    assert tok_back.encode(sample) == tok.encode(sample) and tok.token_to_id("<tool>") in tok.encode(sample)
    assert tok_back.prompt_prefix == tok.prompt_prefix == [2]


def test_a_model_without_a_tokenizer_comes_back_with_its_special_ids(tmp_path, capsys):
    """Token ids only: the file still holds the bos, eos and pad ids, so it imports again (it
    was refused: "no tokenizer.ggml.eos_token_id (nor bos)")."""
    model = small_model("llama-gqa", vocab_size=300)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 5, 7, 1
    path = exported(tmp_path, model, None)
    fields = gguf.GGUFReader(str(path)).fields
    assert {key: int(fields[f"tokenizer.ggml.{key}_token_id"].contents()) for key in ("bos", "eos", "padding")} == \
        {"bos": 5, "eos": 7, "padding": 1}
    back = imported(tmp_path, path, capsys, said=f"warning: {path} holds no tokenizer: imported without one "
                                                  "(token ids only)\n")
    again = FrawdLLM.from_pretrained(back)
    assert again.config == model.config and not (back / "tokenizer.json").exists()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("command", ["generate", "eval", "export"])
@pytest.mark.parametrize("given", ["file", "folder"])
def test_a_gguf_given_as_a_model_says_to_import_it(tmp_path, capsys, command, given):
    """A GGUF file, or `frawd export --format gguf`'s folder, where a model directory goes."""
    path = exported(tmp_path, small_model("llama-gqa", vocab_size=300), None)
    model = path if given == "file" else path.parent  # (tmp_path: ours/ beside m.gguf, and no config.json)
    rest = {"generate": ["--prompt", "hi"], "eval": ["--data", str(path)], "export": ["--out", str(tmp_path / "x")]}
    code, _, err = run_cli(capsys, command, "--model", model, *rest[command])
    assert code == 1 and err.count("\n") == 1, err
    assert err.endswith(f"; convert it first: frawd import --from-gguf {path} --out NEW_DIR\n"), err


def q8_0_values(raw) -> torch.Tensor:
    """A Q8_0 tensor's values by the format's definition: blocks of a float16 scale d and 32
    int8 quants q, each value d * q (ggml-common.h's block_q8_0)."""
    import numpy as np

    blocks = np.asarray(raw, dtype=np.uint8).reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy((d * q).reshape(raw.shape[0], -1))


@pytest.mark.parametrize("variant", ["llama-gqa", "gpt2-untied"])
def test_a_file_llama_cpp_quantized_imports_its_values_and_computes_near_llama_cpp(tmp_path, bpe, text, variant,
                                                                                     capsys):
    """Q8_0, written by llama.cpp's own quantizer: the imported weights are the file's values
    by the format's definition, and the logits are nearer llama.cpp's on that file than the
    float32 model's are (llama.cpp also rounds activations to 8 bits: ~0.05-0.07 of logits up
    to ~3 here; a wrong mapping is off by about the logits themselves)."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    model = small_model(variant, vocab_size=bpe.vocab_size)
    source, quantized = exported(tmp_path, model, bpe), tmp_path / "q8.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, 1
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(quantized).encode(), ctypes.byref(params)) == 0
    capsys.readouterr()  # (llama.cpp's log of the quantizing)
    stored = {t.name: t for t in gguf.GGUFReader(str(quantized)).tensors}
    assert stored["blk.0.ffn_down.weight"].tensor_type.name == "Q8_0"
    again = FrawdLLM.from_pretrained(imported(tmp_path, quantized, capsys))
    assert torch.equal(again.state_dict()["blocks.0.mlp.down.weight"], q8_0_values(stored["blk.0.ffn_down.weight"].data))
    ids = bpe.encode(text)[: model.config.context_length]
    llm = llama_cpp.Llama(model_path=str(quantized), n_ctx=len(ids), logits_all=True, n_threads=1,
                          verbose=False, type_k=0, type_v=0)
    try:
        llm.eval(ids)
        theirs = torch.from_numpy(llm.scores[: len(ids)].copy())
    finally:
        llm.close()
    with torch.no_grad():
        ours, float32 = again(torch.tensor([ids]))[0][0], model(torch.tensor([ids]))[0][0]
    gap = (ours - theirs).abs().max().item()
    assert gap < 0.05 * float32.abs().max().item() and gap < (float32 - theirs).abs().max().item(), gap


def rewritten(source: Path, target: Path, arch: str | None = None, fields: dict | None = None,
              drop: tuple[str, ...] = (), extra: dict | None = None, drop_fields: tuple[str, ...] = ()) -> Path:
    """A copy of a GGUF file with its architecture, some metadata values or tensors changed."""
    reader = gguf.GGUFReader(str(source))
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(target), arch or old_arch)
    fields = fields or {}  # key: a new value of the same type, or (value, type, array item type)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", *drop_fields) \
                or field.name in fields:
            continue
        name = field.name.replace(f"{old_arch}.", f"{arch}.", 1) if arch else field.name
        writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for key, value in fields.items():
        if isinstance(value, tuple):
            writer.add_key_value(key, *value)
        else:
            types = reader.fields[key].types
            writer.add_key_value(key, value, types[0], types[-1] if len(types) > 1 else None)
    for t in reader.tensors:
        if t.name not in drop:
            writer.add_tensor(t.name, t.data.copy())
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def refused(capsys, tmp_path, path: Path) -> str:
    out = tmp_path / "back"
    code, stdout, err = run_cli(capsys, "import", "--from-gguf", path, "--out", out)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert not out.exists()
    return err


def test_what_has_no_frawdllm_equivalent_is_one_line_and_nothing_written(tmp_path, bpe, capsys):
    import numpy as np

    source = exported(tmp_path, small_model("llama-gqa", vocab_size=bpe.vocab_size), bpe)
    (tmp_path / "text.gguf").write_text("not a model")
    assert "not a GGUF file (it starts with b'not '" in refused(capsys, tmp_path, tmp_path / "text.gguf")
    (tmp_path / "cut.gguf").write_bytes(source.read_bytes()[:2000])
    assert "cannot read it as GGUF" in refused(capsys, tmp_path, tmp_path / "cut.gguf")
    (tmp_path / "dir.gguf").mkdir()
    assert "dir.gguf is not a file; --from-gguf takes one .gguf file" in refused(capsys, tmp_path, tmp_path / "dir.gguf")
    assert "not found" in refused(capsys, tmp_path, tmp_path / "missing.gguf")
    phi = rewritten(source, tmp_path / "phi.gguf", arch="phi2")
    assert "architecture 'phi2' cannot be imported; supported: llama, gpt2" in refused(capsys, tmp_path, phi)
    scaled = rewritten(source, tmp_path / "scaled.gguf", fields={"llama.rope.scaling.type": ("yarn", gguf.GGUFValueType.STRING, None)})
    assert "RoPE scaling (type 'yarn') is not supported" in refused(capsys, tmp_path, scaled)
    # llama.cpp scales linearly by a factor given alone (or by its older name), and q.k by attn_factor
    for i, (key, said) in enumerate((("llama.rope.scaling.factor", "(factor 4.0)"),
                                     ("llama.rope.scale_linear", "(factor 4.0)"),
                                     ("llama.rope.scaling.attn_factor", "(attn_factor 4.0)"))):
        scaled = rewritten(source, tmp_path / f"scaled{i}.gguf", fields={key: (4.0, gguf.GGUFValueType.FLOAT32, None)})
        assert f"RoPE scaling {said} is not supported" in refused(capsys, tmp_path, scaled), key
    more = rewritten(source, tmp_path / "more.gguf", extra={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    assert "holds tensors a FrawdLLM model has no place for: blk.0.attn_sinks.weight" in refused(capsys, tmp_path, more)
    less = rewritten(source, tmp_path / "less.gguf", drop=("blk.1.ffn_down.weight",))
    assert "no blk.1.ffn_down.weight tensor" in refused(capsys, tmp_path, less)
    headless = rewritten(source, tmp_path / "headless.gguf", drop=("token_embd.weight",))
    assert "headless.gguf: no token_embd.weight tensor" in refused(capsys, tmp_path, headless)
    raw = bytearray(source.read_bytes())  # a tensor type a newer llama.cpp may write: the info's type field
    at = raw.index(b"output_norm.weight") + len(b"output_norm.weight")  # (then n_dims, the dims, the type)
    at += 4 + 8 * int.from_bytes(raw[at:at + 4], "little")
    raw[at:at + 4] = (200).to_bytes(4, "little")
    (tmp_path / "newer.gguf").write_bytes(raw)
    assert "it stores a tensor type the installed gguf package does not know" in \
        refused(capsys, tmp_path, tmp_path / "newer.gguf")


def test_metadata_that_disagrees_with_the_tensors_is_one_line(tmp_path, bpe, capsys):
    """Sizes the tensors do not have failed inside the reshapes (a traceback); a zero or a
    per-layer list of head counts too."""
    source = exported(tmp_path, small_model("llama-gqa", vocab_size=bpe.vocab_size), bpe)
    kv = gguf.GGUFReader(str(source)).fields["llama.attention.head_count_kv"].contents()
    cases = [({"llama.attention.head_count_kv": 1 if kv != 1 else 2}, "its tensors do not match its metadata"),
             ({"llama.embedding_length": 48}, "llama.rope.dimension_count 16 is not the head size 12"),
             ({"llama.attention.head_count": 0}, "llama.attention.head_count is 0; FrawdLLM needs one whole number"),
             ({"llama.attention.head_count_kv": (True, gguf.GGUFValueType.BOOL, None)},
              "llama.attention.head_count_kv is True; FrawdLLM needs one whole number"),
             ({"llama.block_count": 1}, "llama.block_count 1 but its tensors hold 2 blocks"),
             ({"llama.block_count": 10**6}, "llama.block_count 1,000,000 but its tensors hold 2 blocks"),  # (at once)
             ({"tokenizer.ggml.bos_token_id": 9999}, "tokenizer.ggml.bos_token_id 9999 is outside the vocabulary"),
             ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type has 2 entries for 320 tokens")]
    for i, (fields, said) in enumerate(cases):
        bad = rewritten(source, tmp_path / f"bad{i}.gguf", fields=fields)
        assert said in refused(capsys, tmp_path, bad), fields
    vocab = bpe.vocab_size
    for i, key in enumerate(("bos", "eos", "padding")):  # (the first id past the vocabulary)
        past = rewritten(source, tmp_path / f"past{i}.gguf", fields={f"tokenizer.ggml.{key}_token_id": vocab})
        assert f"tokenizer.ggml.{key}_token_id {vocab} is outside the vocabulary ({vocab} tokens)" in \
            refused(capsys, tmp_path, past)
    reader = gguf.GGUFReader(str(source))
    tokens, types = (reader.fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "token_type"))
    longer = rewritten(source, tmp_path / "longer.gguf", fields={"tokenizer.ggml.tokens": tokens + ["zq", "zr"],
                                                                "tokenizer.ggml.token_type": types + [1, 1]})
    assert f"{longer}: the tokenizer has {vocab + 2} ids but the model only {vocab}" in refused(capsys, tmp_path, longer)
    no_ids = rewritten(source, tmp_path / "no_ids.gguf", drop_fields=("tokenizer.ggml.bos_token_id",
                                                                     "tokenizer.ggml.eos_token_id"))
    assert "no tokenizer.ggml.eos_token_id (nor bos) in its metadata" in refused(capsys, tmp_path, no_ids)
    per_layer = rewritten(source, tmp_path / "per_layer.gguf", fields={"llama.attention.head_count_kv": (
        [2, 2], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)})
    assert "llama.attention.head_count_kv is [2, 2]" in refused(capsys, tmp_path, per_layer)


def test_what_llama_cpp_writes_for_plain_rope_and_an_eos_alone_imports(tmp_path, bpe, capsys):
    """Scaling type "none" (llama.cpp's converters write it), a linear factor of 1 and an
    attn_factor of 1 are plain RoPE; a file with eos and no bos takes eos for both."""
    model = small_model("llama-gqa", vocab_size=bpe.vocab_size)
    source = exported(tmp_path, model, bpe)
    f32 = gguf.GGUFValueType.FLOAT32
    for i, fields in enumerate(({"llama.rope.scaling.type": ("none", gguf.GGUFValueType.STRING, None),
                                 "llama.rope.scaling.factor": (8.0, f32, None)},
                                {"llama.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING, None),
                                 "llama.rope.scaling.factor": (1.0, f32, None),
                                 "llama.rope.scaling.attn_factor": (1.0, f32, None)})):
        shutil.rmtree(tmp_path / "back", ignore_errors=True)
        again = FrawdLLM.from_pretrained(imported(tmp_path, rewritten(source, tmp_path / f"r{i}.gguf", fields=fields),
                                                  capsys))
        assert again.config == model.config, fields
    shutil.rmtree(tmp_path / "back")
    eos_only = rewritten(source, tmp_path / "eos.gguf", drop_fields=("tokenizer.ggml.bos_token_id",))
    cfg = FrawdLLM.from_pretrained(imported(tmp_path, eos_only, capsys)).config
    assert cfg.bos_token_id == cfg.eos_token_id == model.config.eos_token_id


def test_an_existing_out_is_kept_unless_overwrite(tmp_path, bpe, capsys):
    source = exported(tmp_path, small_model("llama-gqa", vocab_size=bpe.vocab_size), bpe)
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "import", "--from-gguf", source, "--out", out)
    assert code == 1 and "exists and is not empty" in err and (out / "keep.txt").read_text() == "mine", err
    code, _, err = run_cli(capsys, "import", "--from-gguf", source, "--out", out, "--overwrite")
    assert code == 0 and (out / "model.safetensors").is_file() and not (out / "keep.txt").exists(), err


def test_a_tokenizer_without_an_equivalent_imports_the_model_alone_with_a_warning(tmp_path, bpe, capsys):
    model = small_model("llama-gqa", vocab_size=bpe.vocab_size)
    spm = rewritten(exported(tmp_path, model, bpe), tmp_path / "spm.gguf",
                    fields={"tokenizer.ggml.model": "llama"})  # (SentencePiece's)
    back = tmp_path / "back"
    code, _, err = run_cli(capsys, "import", "--from-gguf", spm, "--out", back)
    assert code == 0 and "its tokenizer (tokenizer.ggml.model 'llama', pre 'gpt-2') has no exact" in err
    assert "imported without one (token ids only)" in err
    assert not (back / "tokenizer.json").exists()
    merges = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.merges"].contents()
    torn = rewritten(tmp_path / "m.gguf", tmp_path / "torn.gguf", fields={"tokenizer.ggml.merges": ["nospace"] + merges})
    code, _, err = run_cli(capsys, "import", "--from-gguf", torn, "--out", tmp_path / "back2")
    assert code == 0 and "its tokenizer cannot be rebuilt (" in err and "imported without one" in err, err
    assert not (tmp_path / "back2" / "tokenizer.json").exists()
    assert not (back / "tokenizer.json").exists()
    again = FrawdLLM.from_pretrained(back)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_a_pre_tokenizer_other_than_gpt2s_leaves_the_tokenizer_out(tmp_path, bpe, capsys):
    """Without tokenizer.ggml.pre (or with "default") llama.cpp splits text its own way
    (punctuation runs, digits by three): taken for GPT-2's, the ids differed, silently."""
    source = exported(tmp_path, small_model("llama-gqa", vocab_size=bpe.vocab_size), bpe)
    for i, changed in enumerate(({"fields": {"tokenizer.ggml.pre": "default"}},
                                 {"drop_fields": ("tokenizer.ggml.pre",)})):
        out = tmp_path / f"back{i}"
        code, _, err = run_cli(capsys, "import", "--from-gguf", rewritten(source, tmp_path / f"p{i}.gguf", **changed),
                               "--out", out)
        assert code == 0 and "has no exact FrawdLLM equivalent" in err and not (out / "tokenizer.json").exists(), err


def test_llama_cpps_bos_comes_back_for_a_byte_tokenizer_too(tmp_path, capsys):
    """The byte kind came back as our byte tokenizer, without the BOS llama.cpp adds."""
    tok = byte_tokenizer()
    source = exported(tmp_path, small_model("llama-gqa", vocab_size=tok.vocab_size), tok)
    bos = rewritten(source, tmp_path / "bos.gguf", fields={"tokenizer.ggml.add_bos_token": True})
    back = Tokenizer.load(imported(tmp_path, bos, capsys))
    assert back.prompt_prefix == [2] and back.encode("hi") == tok.encode("hi") and back.kind == "byte"


def test_import_takes_exactly_one_source(tmp_path, capsys):
    for args in ([], ["--from-hf", "a", "--from-gguf", "b.gguf"]):
        code, _, err = run_cli(capsys, "import", *args, "--out", tmp_path / "o")
        assert code == 2 and "give one of --from-hf DIR and --from-gguf FILE" in err
