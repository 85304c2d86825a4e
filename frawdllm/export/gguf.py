"""GGUF export for llama.cpp: one file holding hyperparameters, weights and tokenizer.

Llama-style models become llama.cpp's `llama` architecture, GPT-2 style ones `gpt2`
(`hf.hf_architecture` decides, and refuses the rest). Tensor names come from the `gguf`
package's own map from transformers names, so they are the names llama.cpp reads.
Two layout details differ from ours:

- RoPE pairs. We (like transformers) rotate (x[i], x[i + hd/2]); llama.cpp's `llama`
  rotates neighbours (x[2i], x[2i+1]). Permuting the rows of q and k inside each head,
  new row 2i = old row i and new row 2i+1 = old row i + hd/2, gives the same
  scores: q.k is unchanged when both sides are permuted alike, and v is untouched.
- llama.cpp's `gpt2` reads an explicit `output.weight`, so a tied head is written out.

The tokenizer goes in as llama.cpp's byte-level BPE (`gpt2` model, GPT-2 pre-tokenizer):
our `bpe` and `byte` kinds are exactly that; a tokenizer that splits text otherwise (an
imported SentencePiece-style one) is refused. Special tokens are control tokens, and the
chat template is the Jinja one of the transformers export. add_bos_token says whether the
tokenizer's own template starts a text with BOS (`Tokenizer.prompt_prefix`: an imported
Llama-style one's does, ours do not).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float
import torch
from torch import Tensor

from ..config import ModelConfig, Seq2SeqConfig
from ..errors import FrawdError
from ..io import atomic_dir, atomic_path
from ..model import FrawdLLM
from ..modeldir import load_config, plain_state
from ..tokenizer import Tokenizer
from ..train.rundir import BEST_MODEL_DIR
from .hf import GPT2, hf_architecture, hf_parts
from .hf_dir import CHAT_TEMPLATE, DTYPES, cast_within_range, load_for_export, special_token

GGUF_FILE = "model.gguf"
_TEMPLATE_BOS = "{{ '<|bos|>' }}"  # how CHAT_TEMPLATE starts


def interleave_rope_rows(weight: Float[Tensor, "rows *rest"], n_heads: int) -> Float[Tensor, "rows *rest"]:
    """Rows of q or k (weight or bias) from the rotate-half layout to llama.cpp's
    neighbour-pairs layout: per head, row i -> 2i and row i + hd/2 -> 2i + 1."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: FrawdLLM) -> list[tuple[str, Tensor]]:
    """(llama.cpp name, tensor) for every tensor of the file, in nn.Linear (out, in) layout."""
    import gguf

    cfg: ModelConfig = model.config
    is_gpt2 = hf_architecture(cfg) == GPT2
    arch = gguf.MODEL_ARCH.GPT2 if is_gpt2 else gguf.MODEL_ARCH.LLAMA
    names = gguf.get_tensor_name_map(arch, cfg.n_layer)
    state = plain_state(model, "cannot export to GGUF")
    out: list[tuple[str, Tensor]] = []
    for hf_name, part, _ in hf_parts(state, cfg):  # ignore transposition: GGUF wants (out, in)
        if ".q_proj." in hf_name:
            part = interleave_rope_rows(part, cfg.n_head)
        elif ".k_proj." in hf_name:
            part = interleave_rope_rows(part, cfg.n_kv_head)
        out.append((names.get_name(hf_name, try_suffixes=(".weight", ".bias")), part))
    if is_gpt2 and cfg.tie_embeddings:
        out.append(("output.weight", state["embed.tok.weight"]))
    return out


def _hyperparameters(writer: Any, cfg: ModelConfig, name: str, file_type: int) -> None:
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_vocab_size(cfg.vocab_size)
    if hf_architecture(cfg) == GPT2:
        writer.add_layer_norm_eps(cfg.norm_eps)
        return
    writer.add_head_count_kv(cfg.n_kv_head)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)


def _tokenizer(writer: Any, tokenizer: Tokenizer | None, cfg: ModelConfig) -> None:
    import gguf

    if tokenizer is None:
        writer.add_tokenizer_model("none")  # llama.cpp can still run token ids
        # (it reads no special ids without a vocabulary; `frawd import --from-gguf` needs them)
        _special_ids(writer, cfg)
        return
    if tokenizer.kind == "char":
        raise FrawdError(
            "GGUF embeds byte-level BPE tokenizers (kinds bpe, byte); this model's tokenizer is char-level. "
            "Export --format hf instead, or train with a bpe/byte tokenizer"
        )
    setup = json.loads(tokenizer.backend.to_str())
    problem = _not_gpt2_byte_level(setup)
    if problem:
        raise FrawdError(f"GGUF embeds tokenizers as llama.cpp's byte-level BPE with GPT-2's pre-tokenizer, and this "
                         f"model's tokenizer {problem}: llama.cpp would split text into other tokens. "
                         "Export --format hf instead")
    added = setup.get("added_tokens", [])
    special = {t["id"] for t in added if t.get("special")}
    # A non-special added token (transformers' `add_tokens`) is matched whole in any text:
    # llama.cpp does that for USER_DEFINED tokens, as its convert_hf_to_gguf.py writes them;
    # as NORMAL tokens their text was split by BPE. It reads no lstrip/rstrip/single_word.
    user_defined = {t["id"] for t in added if not t.get("special")}
    odd = [t["content"] for t in added if t["id"] in user_defined
           and any(t.get(flag) for flag in ("lstrip", "rstrip", "single_word"))]
    if odd:
        raise FrawdError(f"the tokenizer's added token {odd[0]!r} takes the spaces around it or matches only whole "
                         "words (lstrip/rstrip/single_word), which GGUF cannot say: llama.cpp would split text into "
                         "other tokens. Export --format hf instead")
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        token = tokenizer.id_to_token(i)
        if token is None:  # the model's embedding is larger than the vocabulary
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if i in special else
                         gguf.TokenType.USER_DEFINED if i in user_defined else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in setup["model"].get("merges", [])]
    if not merges:
        # The byte kind has no merges, but llama.cpp requires the key and gguf cannot write an
        # empty array: a merge of two control tokens stands in. BPE symbols start as single
        # characters and no other merge can build a longer one, so it never applies.
        stand_in = next((t for t in tokens if len(t) > 1), "<|pad|>")
        merges = [f"{stand_in} {stand_in}"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for what in ("bos_token_id", "eos_token_id", "pad_token_id"):  # (refused as the HF export refuses them)
        special_token(tokenizer, getattr(cfg, what), what)
    _special_ids(writer, cfg)
    if tokenizer.token_to_id("<|unk|>") is not None:
        writer.add_unk_token_id(tokenizer.token_to_id("<|unk|>"))
    add_bos = _adds_bos(tokenizer, cfg)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if tokenizer.has_frawd_specials():  # (llama.cpp adds the BOS itself when add_bos: not twice)
        writer.add_chat_template(CHAT_TEMPLATE.removeprefix(_TEMPLATE_BOS) if add_bos else CHAT_TEMPLATE)


def _special_ids(writer: Any, cfg: ModelConfig) -> None:
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)


def _adds_bos(tokenizer: Tokenizer, cfg: ModelConfig) -> bool:
    """Whether llama.cpp should start a prompt with bos_token_id: when the tokenizer's own
    template does (an imported Llama's; none of ours). Another prefix it cannot say: a warning."""
    prefix = tokenizer.prompt_prefix
    if prefix and prefix != [cfg.bos_token_id]:
        warnings.warn(f"the tokenizer's template starts a prompt with ids {prefix}, which GGUF cannot say "
                      f"(only bos_token_id {cfg.bos_token_id} alone): llama.cpp will not add them")
    return prefix == [cfg.bos_token_id]


def _not_gpt2_byte_level(setup: dict) -> str | None:
    """Why a tokenizer.json (our bpe and byte kinds qualify; imported ones may not) is not
    what llama.cpp's `gpt2` tokenizer computes, or None."""
    model, normalizer = setup.get("model") or {}, setup.get("normalizer")
    pre = setup.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"is a {model.get('type')} model"
    spaces_as_u2581 = "\u2581" in json.dumps(normalizer, ensure_ascii=False)
    if model.get("byte_fallback") or pre.get("type") == "Metaspace" or spaces_as_u2581:
        return "is SentencePiece-style (spaces as '\u2581', byte fallback)"
    if normalizer:
        return f"normalizes text first ({normalizer.get('type')})"
    if pre.get("type") != "ByteLevel":
        inner = ", ".join(str(p.get("type")) for p in pre.get("pretokenizers", []))
        what = f"pre-tokenizer {pre['type']}" + (f" of {inner}" if inner else "") if pre else "no pre-tokenizer"
        return f"splits text another way ({what})"
    if pre.get("add_prefix_space"):
        return "splits text another way (a ByteLevel pre-tokenizer with add_prefix_space: a space before every text)"
    if pre.get("use_regex") is False and model.get("merges"):
        return "splits text another way (a ByteLevel pre-tokenizer without GPT-2's regex split)"
    return None


def write_gguf(model: FrawdLLM, tokenizer: Tokenizer | None, path: str | Path, dtype: str = "float32",
               name: str = "frawdllm", progress: bool = False) -> None:
    """Write `model` (and its tokenizer) as one GGUF file at `path` (not atomically: see `export_gguf`).

    float16/bfloat16 apply to the matrices; norms, biases and 1-D tensors stay float32,
    as llama.cpp expects. `progress`: a bar over the tensors on a terminal, gone when done
    (gguf's own "Writing" bar stays off)."""
    import gguf
    from gguf.quants import quantize
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise FrawdError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    cfg: ModelConfig = model.config
    arch = "gpt2" if hf_architecture(cfg) == GPT2 else "llama"
    qtype = {"float32": gguf.GGMLQuantizationType.F32, "float16": gguf.GGMLQuantizationType.F16,
             "bfloat16": gguf.GGMLQuantizationType.BF16}[dtype]
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    writer = gguf.GGUFWriter(str(path), arch)
    _hyperparameters(writer, cfg, name, int(file_type))
    _tokenizer(writer, tokenizer, cfg)
    tensors = gguf_tensors(model)
    bar = tqdm(tensors, desc="converting", unit="tensor", leave=False, dynamic_ncols=True,
               disable=None if progress else True)  # None: only on a terminal
    for tensor_name, tensor in bar:
        data = tensor.detach().float().cpu().numpy()
        kind = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind != gguf.GGMLQuantizationType.F32:
            cast_within_range(tensor_name, torch.from_numpy(data), dtype)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor_name, np.ascontiguousarray(data))
            continue
        writer.add_tensor(tensor_name, quantize(data, kind), raw_dtype=kind)  # bf16 comes as bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def _model_name(model_dir: Path) -> str:
    """general.name: the folder's name, or the run's for a run's best model (RUN/model: every
    trained model was called "model")."""
    folder = model_dir.resolve()
    return folder.parent.name if folder.name == BEST_MODEL_DIR and folder.parent.name else folder.name


def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "float32", overwrite: bool = False,
                progress: bool = False) -> Path:
    """Export a FrawdLLM model directory to GGUF. `out` ending in .gguf is the file itself;
    otherwise it is a new directory holding `model.gguf`. Returns the file's path, which
    appears only once complete."""
    model_dir, out = Path(model_dir), Path(out)
    cfg = load_config(model_dir)
    if isinstance(cfg, Seq2SeqConfig):
        raise FrawdError(f"{model_dir}: GGUF export is for decoder-only models; an encoder-decoder translation "
                         f"model exports with --format hf (MarianMTModel)")
    hf_architecture(cfg)  # refuse unexportable configs before touching --out
    if out.suffix.lower() == ".gguf":
        if out.is_dir():
            raise FrawdError(f"{out} is a folder; give a new file path ending in .gguf, or a folder name without it")
        if out.exists() and not overwrite:
            raise FrawdError(f"{out} exists; choose a new path (or --overwrite)")
        model, tokenizer, _ = load_for_export(model_dir)
        with atomic_path(out, replace=overwrite) as tmp:  # (another export to `out` meanwhile: refused)
            write_gguf(model, tokenizer, tmp, dtype, _model_name(model_dir), progress)
        return out
    with atomic_dir(out, overwrite=overwrite, keep=(model_dir,)) as tmp:
        model, tokenizer, _ = load_for_export(model_dir)
        write_gguf(model, tokenizer, tmp / GGUF_FILE, dtype, _model_name(model_dir), progress)
    return out / GGUF_FILE


__all__ = ["GGUF_FILE", "interleave_rope_rows", "gguf_tensors", "write_gguf", "export_gguf"]
