"""Seq2SeqTransformer -> transformers MarianMTModel: the same logits (1e-4), and a clear
refusal naming every option that does not map."""

import pytest
import torch

from frawdllm import Seq2SeqTransformer, get_config
from frawdllm.errors import ConfigError
from frawdllm.export.marian import marian_mismatches, to_marian_model

pytest.importorskip("transformers")


def assert_same_logits(model, hf):
    """Our model and its Marian export give the same logits, a padded source row included."""
    src = torch.randint(4, 60, (2, 9))
    mask = torch.ones_like(src, dtype=torch.bool)
    mask[1, 6:] = False
    tgt = torch.randint(4, 60, (2, 7))
    with torch.no_grad():
        ours = model(src, tgt, src_mask=mask)[0]
        theirs = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_marian_export_gives_the_same_logits(activation):
    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=2, n_encoder_layer=2, mlp_hidden=64,
                     context_length=64, activation=activation)
    model = Seq2SeqTransformer(cfg).eval()
    hf = to_marian_model(model)
    assert_same_logits(model, hf)


def test_options_that_do_not_map_are_all_named():
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, norm_placement="pre", pos_encoding="rope",
                     n_kv_head=2, tie_embeddings=False)
    bad = " ".join(marian_mismatches(cfg))
    for name in ("norm_placement", "pos_encoding", "n_kv_head", "tie_embeddings"):
        assert name in bad
    with pytest.raises(ConfigError, match="does not map to MarianMTModel"):
        to_marian_model(Seq2SeqTransformer(cfg))


def test_frawd_export_writes_a_marian_directory_transformers_loads(tmp_path, capsys):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from cli_helpers import run_cli
    from frawdllm.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    tok = byte_tokenizer()
    cfg = get_config("aiayn-tiny", vocab_size=tok.vocab_size, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1,
                     mlp_hidden=64, context_length=64)
    model = Seq2SeqTransformer(cfg).eval()
    model.save_pretrained(tmp_path / "m", tokenizer=tok)
    code, out, err = run_cli(capsys, "export", "--model", tmp_path / "m", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 0, err
    assert "MarianMTModel" in out and "AutoModelForSeq2SeqLM" in out
    assert "Writing model shards" not in out + err and out.count("\r") == err.count("\r") == 0  # no progress bar
    hf = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    src = torch.tensor([hf_tok("Ein Hund.")["input_ids"]])
    assert src.tolist()[0] == tok.encode("Ein Hund.")
    tgt = torch.tensor([[cfg.bos_token_id, 40, 41]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, decoder_input_ids=tgt).logits, model(src, tgt)[0],
                                   atol=1e-4, rtol=1e-4)


def test_frawd_export_refuses_a_seq2seq_model_that_does_not_map(tmp_path, capsys):
    from cli_helpers import run_cli

    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1,
                     norm_placement="pre")
    Seq2SeqTransformer(cfg).save_pretrained(tmp_path / "m")
    code, _, err = run_cli(capsys, "export", "--model", tmp_path / "m", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 1 and "norm_placement='pre'" in err and not (tmp_path / "hf").exists()
    # each item names the field to change and the value it needs
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_kv_head=2, n_layer=1, n_encoder_layer=1)
    Seq2SeqTransformer(cfg).save_pretrained(tmp_path / "gqa")
    code, _, err = run_cli(capsys, "export", "--model", tmp_path / "gqa", "--format", "hf", "--out", tmp_path / "hf")
    assert code == 1 and "n_kv_head=2 (Marian has no grouped-query attention: needs n_kv_head=4)" in err, err


@pytest.mark.parametrize("out", ["x.gguf", "gguf_dir"])
def test_gguf_export_of_a_translation_model_points_to_hf(tmp_path, capsys, out):
    from cli_helpers import run_cli

    pytest.importorskip("gguf")
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1)
    Seq2SeqTransformer(cfg).save_pretrained(tmp_path / "m")
    code, _, err = run_cli(capsys, "export", "--model", tmp_path / "m", "--format", "gguf", "--out", tmp_path / out)
    assert code == 1 and err.strip().splitlines() == [
        f"frawd: error: {tmp_path / 'm'}: GGUF export is for decoder-only models; an encoder-decoder translation "
        "model exports with --format hf (MarianMTModel)"]
    assert not (tmp_path / out).exists()


def test_the_multi30k_recipe_does_not_map_and_the_docs_and_help_say_so(capsys):
    """configs/multi30k.yaml trains pre-LN: refused by the Marian export, which the export
    docs, the module docstring and `frawd export --help` (AutoModelForSeq2SeqLM) tell."""
    from pathlib import Path

    import yaml

    import frawdllm.export.marian as marian
    from cli_helpers import run_cli

    root = Path(__file__).resolve().parents[1]
    recipe = yaml.safe_load((root / "configs" / "multi30k.yaml").read_text())
    cfg = get_config(recipe["preset"], vocab_size=recipe["vocab_size"], **recipe["model"])
    assert "norm_placement='pre'" in " ".join(marian_mismatches(cfg))
    assert "scale_embeddings=False" in " ".join(marian_mismatches(get_config("aiayn-tiny", scale_embeddings=False)))
    docs = (root / "docs" / "seq2seq.md").read_text()
    export_section = docs[docs.index("## Export to Hugging Face"): docs.index("## Benchmark")]
    assert "configs/multi30k.yaml" in export_section and "scale_embeddings" in export_section
    assert "scale_embeddings=False" in marian.__doc__ and "multi30k.yaml" in marian.__doc__
    code, out, _ = run_cli(capsys, "export", "--help")
    assert code == 0 and "AutoModelForSeq2SeqLM.from_pretrained(OUT)" in out


def test_transformers_generate_on_the_export_decodes_as_frawd_does():
    """Our decoding never emits PAD or BOS after BOS; the export did not say so, and
    transformers' greedy generate on an untrained model repeated BOS where ours did not."""
    from frawdllm.infer.translate import greedy_decode

    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=2, n_encoder_layer=2, mlp_hidden=64,
                     context_length=64)
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # make BOS and PAD the untrained model's favourite next tokens
        model.embed.tok.weight[[cfg.bos_token_id, cfg.pad_token_id]] *= 8
    hf = to_marian_model(model)
    src = torch.randint(4, 60, (3, 9))
    ours = greedy_decode(model, src, max_steps=10)
    theirs = hf.generate(input_ids=src, num_beams=1, do_sample=False, max_new_tokens=9)[:, 1:].tolist()
    for row, their_row in zip(ours, theirs):  # (transformers forces EOS as the last of its 9)
        assert len(row) >= 8 and their_row[:8] == row[:8] and cfg.bos_token_id not in their_row, (row, their_row)


def test_transformers_generate_without_length_arguments_stops_where_frawd_does(tmp_path):
    """Our decoding's cap is the context (BOS + context_length - 1 tokens); the export wrote no
    max_length, so a plain generate() stopped at transformers' 20 tokens in all and cut long
    translations. A model that never chooses EOS runs to the cap on both sides."""
    from transformers import AutoModelForSeq2SeqLM, GenerationConfig

    from frawdllm.infer.translate import greedy_decode

    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1, mlp_hidden=64,
                     context_length=40)
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # EOS's logit is then 0, below the favourite's: never chosen
        model.embed.tok.weight[cfg.eos_token_id] = 0
    src = torch.randint(4, 60, (2, 9))
    ours = greedy_decode(model, src)
    assert [len(row) for row in ours] == [cfg.context_length - 1] * 2  # (9 + 50 tokens would be more)
    to_marian_model(model).save_pretrained(tmp_path)
    with torch.no_grad():
        theirs = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval().generate(input_ids=src).tolist()
    for row, their_row in zip(ours, theirs):  # BOS, then ours, the last one replaced by a forced EOS
        assert their_row == [cfg.bos_token_id] + row[:-1] + [cfg.eos_token_id]
    assert GenerationConfig.from_pretrained(tmp_path).max_length == cfg.context_length



@pytest.mark.parametrize("field, value", [("norm_placement", "pre"), ("pos_encoding", "learned"),
                                          ("scale_embeddings", False), ("use_rmsnorm", True),
                                          ("tie_embeddings", False), ("bias", False), ("norm_eps", 1e-6)])
def test_each_option_marian_cannot_express_is_named_alone(field, value):
    """Marian's LayerNorm eps is fixed at 1e-5 (and so on): a model that differs in one option
    only is refused, naming that option (norm_eps=1e-6 exported silently, with other logits)."""
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, **{field: value})
    bad = marian_mismatches(cfg)
    assert len(bad) == 1 and bad[0].startswith(f"{field}="), bad
    assert marian_mismatches(get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4)) == []


def test_a_gelu_model_exports_with_the_tanh_gelu_it_computes():
    """Our seq2seq GELU is the tanh approximation (transformers' gelu_new), not the exact erf
    GELU: with pre-activations near 2.7 the two differ by 5e-4 each."""
    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=1, mlp_hidden=64,
                     context_length=64, activation="gelu")
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # large pre-activations, and an MLP output that outweighs the residual
        for name, p in model.named_parameters():
            if "mlp.up.weight" in name:
                p.mul_(40)
            if "mlp.down.weight" in name:
                p.mul_(50)
    hf = to_marian_model(model)
    assert hf.config.activation_function == "gelu_new"
    src, tgt = torch.randint(4, 60, (2, 9)), torch.randint(4, 60, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, decoder_input_ids=tgt).logits, model(src, tgt)[0],
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_trained_looking_model_exports_with_the_same_logits(activation):
    """A fresh model's biases are 0 and its LayerNorm gains 1, so a bias or gain exported
    unpermuted (or dropped) gave the same logits: give every parameter random values first,
    as training would."""
    torch.manual_seed(0)
    cfg = get_config("aiayn-tiny", vocab_size=60, n_embd=32, n_head=4, n_layer=1, n_encoder_layer=3, mlp_hidden=64,
                     context_length=64, activation=activation, dropout=0.3)  # (depths that differ)
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # biases, LayerNorm gains and shifts
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
            elif "qkv" in name or "cross.q" in name or "cross.kv" in name:
                p.mul_(10)  # peaked attention: a fresh model's is nearly uniform, which hid a swapped k/v
    hf = to_marian_model(model)
    # what generate() pads finished rows with and fine-tuning's dropout are the model's own
    assert (hf.config.pad_token_id, hf.config.dropout) == (cfg.pad_token_id, 0.3)
    assert_same_logits(model, hf)
