"""Import a GGUF file (llama.cpp's format) as a FrawdLLM model directory: `gguf.py` backwards.

llama.cpp's `llama` and `gpt2` architectures are the two transformers families FrawdLLM
imports, so the file's hyperparameters are read as the transformers config they stand for
and go through the same checks as `frawd import --from-hf` (`from_hf_config`), and its
tensors are renamed to transformers' names (the `gguf` package's name map, inverted) and go
through `from_hf_state_dict`. Two things differ from a transformers checkpoint:

- llama.cpp rotates neighbouring pairs (x[2i], x[2i+1]) where we rotate (x[i], x[i+hd/2]):
  the rows of q and k are put back from that order (the inverse of `interleave_rope_rows`).
- Tensors may be stored in half precision or quantized (Q8_0, Q4_K, ...): the `gguf`
  package dequantizes each to float32, the model directory's precision.

The tokenizer is rebuilt where the file holds GPT-2-style byte-level BPE (`tokenizer.ggml.model`
gpt2 with the gpt-2 pre-tokenizer: what `frawd export --format gguf` writes): its tokens,
merges, control tokens (special) and user-defined tokens. Another tokenizer (SentencePiece's
`llama`, another pre-tokenizer) has no exact equivalent here: the model is imported without
one, with a warning, as an HF checkpoint without tokenizer.json is.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from ..config import ModelConfig
from ..errors import FrawdError
from ..io import atomic_dir
from ..model import FrawdLLM
from ..modeldir import _some, tables_too_large
from ..tokenizer import Tokenizer
from .hf import from_hf_config, from_hf_state_dict, tensor_layout

_ARCHITECTURES = ("llama", "gpt2")
# llama.cpp's token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def unpair_rope_rows(weight: Float[Tensor, "rows *rest"], n_heads: int) -> Float[Tensor, "rows *rest"]:
    """Rows of q or k (weight or bias) from llama.cpp's neighbour-pairs layout back to the
    rotate-half layout: per head, row 2i -> i and row 2i + 1 -> i + hd/2."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _float32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-5, not 9.99999975e-06)."""
    return float(str(np.float32(value)))


class _File:
    """A GGUF file's metadata and tensors, read through the `gguf` package."""

    def __init__(self, path: Path) -> None:
        import gguf

        if not path.exists():
            raise FrawdError(f"{path}: not found")
        if not path.is_file():
            raise FrawdError(f"{path} is not a file; --from-gguf takes one .gguf file")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise FrawdError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # noqa: BLE001 - a truncated or damaged file, whatever the reader says of it
            detail = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if "GGMLQuantizationType" in str(exc):  # (a newer llama.cpp's tensor type)
                raise FrawdError(f"{path}: it stores a tensor type the installed gguf package does not know "
                                 f"({detail}); a newer gguf (pip install -U gguf) may read it") from None
            raise FrawdError(f"{path}: cannot read it as GGUF ({detail})") from None
        self.path = path
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.get_field(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FrawdError(f"{self.path}: no {key} in its metadata")
        return value

    def count(self, key: str, default: int | None = None) -> int:
        """A size from the metadata: one whole number of at least 1 (a per-layer list, as
        some architectures store head counts, has no FrawdLLM equivalent)."""
        value = self.get(key, default) if default is not None else self.need(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FrawdError(f"{self.path}: {key} is {value!r}; FrawdLLM needs one whole number of at least 1")
        return value

    def tensor(self, name: str) -> Tensor:
        """The tensor `name` as float32, in PyTorch's (out, in) layout."""
        from gguf import quants

        t = self.tensors[name]
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise FrawdError(f"{self.path}: tensor {name} is stored as {t.tensor_type.name}, which the gguf "
                             "package cannot dequantize") from None
        return torch.from_numpy(array.astype("float32", copy=True))


def _hf_config(file: _File) -> SimpleNamespace:
    """The transformers config the file's metadata stands for."""
    arch = file.need("general.architecture")
    if arch not in _ARCHITECTURES:
        raise FrawdError(f"{file.path}: architecture {arch!r} cannot be imported; supported: "
                         f"{', '.join(_ARCHITECTURES)} (llama.cpp's names for Llama and GPT-2)")
    if "token_embd.weight" not in file.tensors:
        raise FrawdError(f"{file.path}: no token_embd.weight tensor")
    vocab_size = int(file.tensors["token_embd.weight"].shape[-1])  # (ggml order: (n_embd, vocab))
    size = {key: file.count(f"{arch}.{key}") for key in (
        "context_length", "embedding_length", "feed_forward_length", "block_count", "attention.head_count")}
    ids = {name: file.get(f"tokenizer.ggml.{key}_token_id") for name, key in (
        ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding"))}
    for name, value in ids.items():  # (named as the file names them: it has no config.json to edit)
        if value is not None and not 0 <= value < vocab_size:
            raise FrawdError(f"{file.path}: tokenizer.ggml.{name.split('_')[0].replace('pad', 'padding')}_token_id "
                             f"{value} is outside the vocabulary ({vocab_size} tokens)")
    if ids["eos_token_id"] is None and ids["bos_token_id"] is None:
        raise FrawdError(f"{file.path}: no tokenizer.ggml.eos_token_id (nor bos) in its metadata: generation "
                         "would not know where a text ends")
    blocks = {name.split(".")[1] for name in file.tensors if name.startswith("blk.")}
    if len(blocks) != size["block_count"]:  # (before the name map is built: it takes a while per block)
        raise FrawdError(f"{file.path}: {arch}.block_count {size['block_count']:,} but its tensors hold "
                         f"{len(blocks):,} blocks")
    tied = "output.weight" not in file.tensors
    if arch == "gpt2":
        if not tied:  # (the export writes a tied head out, stored as the embedding is: llama.cpp's gpt2 reads one)
            head, embedding = file.tensors["output.weight"], file.tensors["token_embd.weight"]
            tied = head.tensor_type == embedding.tensor_type and np.array_equal(head.data, embedding.data)
        return SimpleNamespace(
            model_type="gpt2", activation_function="gelu_new", scale_attn_weights=True,  # (what llama.cpp computes)
            scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, vocab_size=vocab_size,
            n_embd=size["embedding_length"], n_layer=size["block_count"], n_head=size["attention.head_count"],
            n_positions=size["context_length"], n_inner=size["feed_forward_length"],
            layer_norm_epsilon=_float32(file.need("gpt2.attention.layer_norm_epsilon")), tie_word_embeddings=tied,
            **ids)
    n_head = size["attention.head_count"]
    head_dim = size["embedding_length"] // n_head
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = file.get(f"llama.{key}")
        if value is not None and int(value) != head_dim:
            raise FrawdError(f"{file.path}: llama.{key} {value} is not the head size {head_dim} "
                             "(embedding_length / head_count), which FrawdLLM computes")
    scaling = file.get("llama.rope.scaling.type")
    factor = file.get("llama.rope.scaling.factor", file.get("llama.rope.scale_linear"))  # (the older name)
    attention = file.get("llama.rope.scaling.attn_factor")
    if scaling != "none" and (scaling not in (None, "linear") or factor not in (None, 1.0)  # (llama.cpp: linear
                              or attention not in (None, 1.0)):                              # when only a factor)
        shown = ", ".join(f"{k} {v!r}" for k, v in (("type", scaling), ("factor", factor), ("attn_factor", attention))
                          if v is not None)
        raise FrawdError(f"{file.path}: RoPE scaling ({shown}) is not supported; only plain RoPE imports")
    if "rope_freqs.weight" in file.tensors:
        raise FrawdError(f"{file.path}: holds rope_freqs.weight (Llama 3's RoPE scaling), which FrawdLLM does "
                         "not compute")
    return SimpleNamespace(
        model_type="llama", hidden_act="silu", head_dim=head_dim, hidden_size=size["embedding_length"],
        num_attention_heads=n_head, num_key_value_heads=file.count("llama.attention.head_count_kv", n_head),
        num_hidden_layers=size["block_count"], max_position_embeddings=size["context_length"],
        intermediate_size=size["feed_forward_length"], vocab_size=vocab_size,
        rms_norm_eps=_float32(file.need("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32(file.get("llama.rope.freq_base", 10000.0)),
        attention_bias="blk.0.attn_q.bias" in file.tensors, mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        tie_word_embeddings=tied, **ids)


def _weights(file: _File, cfg: ModelConfig) -> dict[str, Tensor]:
    """The file's tensors under transformers' names and layouts (q/k rows un-paired)."""
    import gguf

    arch = gguf.MODEL_ARCH.GPT2 if cfg.pos_encoding == "learned" else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    state, used = {}, set()
    for m in tensor_layout(cfg):
        for hf_name in m.theirs:
            name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name not in file.tensors:
                raise FrawdError(f"{file.path}: no {name} tensor, which a {arch.name.lower()} model of "
                                 f"{cfg.n_layer} layers has")
            tensor = file.tensor(name)
            if ".q_proj." in hf_name:
                tensor = unpair_rope_rows(tensor, cfg.n_head)
            elif ".k_proj." in hf_name:
                tensor = unpair_rope_rows(tensor, cfg.n_kv_head)
            state[hf_name] = tensor.t().contiguous() if m.transpose else tensor
            used.add(name)
    if cfg.tie_embeddings:
        used.add("output.weight")  # (a tied gpt2 head, written out: equal to token_embd)
    extra = sorted(set(file.tensors) - used)
    if extra:
        raise FrawdError(f"{file.path}: holds tensors a FrawdLLM model has no place for: {_some(extra)}")
    return state


def _tokenizer(file: _File, vocab_size: int) -> Tokenizer | None:
    """The file's tokenizer, where it is GPT-2-style byte-level BPE; else None, said."""
    from tokenizers import AddedToken, Tokenizer as Backend, models, processors

    from ..tokenizer import _byte_level, byte_tokenizer

    kind, pre = file.get("tokenizer.ggml.model"), file.get("tokenizer.ggml.pre")
    if kind in (None, "none"):
        warnings.warn(f"{file.path} holds no tokenizer: imported without one (token ids only)")
        return None
    if kind != "gpt2" or pre != "gpt-2":  # (no pre, or "default": llama.cpp splits text its own way)
        warnings.warn(f"{file.path}: its tokenizer (tokenizer.ggml.model {kind!r}, pre {pre!r}) has no exact "
                      "FrawdLLM equivalent (GPT-2-style byte-level BPE only): imported without one (token ids only)")
        return None
    tokens, types = file.need("tokenizer.ggml.tokens"), file.need("tokenizer.ggml.token_type")
    if len(types) != len(tokens):  # (llama.cpp refuses such a file)
        raise FrawdError(f"{file.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    while tokens and types[-1] == _UNUSED and tokens[-1] == f"[PAD{len(tokens) - 1}]":
        tokens, types = tokens[:-1], types[:-1]  # (the export pads a larger embedding so)
    control = [t for t, kind_ in zip(tokens, types) if kind_ == _CONTROL]
    user = [t for t, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED]
    merges = [tuple(m.split(" ", 1)) for m in file.get("tokenizer.ggml.merges", [])]
    merges = [m for m in merges if not (len(m) == 2 and m[0] in control and m[1] in control)]  # (the byte kind's)
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        warnings.warn(f"{file.path}: its token list repeats a token: imported without a tokenizer (token ids only)")
        return None
    bos = file.get("tokenizer.ggml.bos_token_id") if file.get("tokenizer.ggml.add_bos_token") else None
    try:
        plain_bytes = byte_tokenizer().backend
        if not merges and not user and vocab == plain_bytes.get_vocab(with_added_tokens=True):
            backend, made = plain_bytes, "byte"  # what the export of the byte kind holds: that tokenizer itself
        else:
            backend, made = Backend(models.BPE(vocab=vocab, merges=merges)), "bpe"
            _byte_level(backend, use_regex=True)
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        if bos is not None:  # llama.cpp starts every prompt with BOS: so will we
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
        tok = Tokenizer(backend, made)
    except Exception as exc:  # noqa: BLE001 - malformed merges, a BOS id outside the list, ...
        warnings.warn(f"{file.path}: its tokenizer cannot be rebuilt ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}): imported without one (token ids only)")
        return None
    return tok.check_fits(vocab_size, file.path)


def read_gguf(path: str | Path) -> tuple[FrawdLLM, Tokenizer | None]:
    """The model (float32) and tokenizer (or None) a GGUF file holds."""
    file = _File(Path(path))
    hf_config = _hf_config(file)
    try:
        cfg = from_hf_config(hf_config)
    except FrawdError as exc:
        raise FrawdError(f"{file.path}: {exc}") from None
    problem = tables_too_large(cfg, file.path.stat().st_size)
    if problem:
        raise FrawdError(f"{file.path}: {problem}; refusing to build them")
    model = FrawdLLM(cfg)
    try:  # (a shape the metadata does not give fails in the reshapes and concatenations too)
        model.load_state_dict(from_hf_state_dict(_weights(file, cfg), cfg))
    except (RuntimeError, ValueError) as exc:
        raise FrawdError(f"{file.path}: its tensors do not match its metadata "
                         f"({str(exc).splitlines()[-1].strip()})") from None
    return model.eval(), _tokenizer(file, cfg.vocab_size)


def import_gguf(path: str | Path, out: str | Path, overwrite: bool = False) -> FrawdLLM:
    """Convert a GGUF file into a FrawdLLM model directory `out`."""
    model, tokenizer = read_gguf(path)  # (before --out is touched: nothing is written on a refusal)
    with atomic_dir(out, overwrite=overwrite, keep=(Path(path),)) as tmp:
        model.save_pretrained(tmp, tokenizer=tokenizer)
    return model


__all__ = ["import_gguf", "read_gguf", "unpair_rope_rows"]
