"""`TranslateConfig`, the config of `frawd translate train`: its fields, defaults, help
texts and checks, and nothing else.

It lives apart from the training job (translation.py, which imports torch and re-exports
it) because the CLI builds its flags from it: `frawd translate ... --help`, and a bad
flag's one-line error, must not wait for torch to load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import SEQ2SEQ_PRESETS, Seq2SeqConfig, get_config, typed_overrides
from ..errors import ConfigError, FrawdError
from ..tokenizer import BOS_ID, EOS_ID, PAD_ID, check_bpe_vocab_size
from .config import COMPILE_CHOICES, EVAL_INTERVAL_HELP, SCHEDULES, WARMUP_HELP, TrainConfig, _require, option


@dataclass
class TranslateConfig(TrainConfig):
    """`frawd translate train`: an encoder-decoder model on parallel text."""

    # a command-line flag for one of these clears a config file's other (--tokenizer over vocab_size: 8000)
    ALTERNATIVES: ClassVar[tuple[tuple[str, str], ...]] = (("tokenizer", "vocab_size"),)

    out: str = option("runs/translate", "Run directory: config, metrics, checkpoints, the best model.")
    src: str | None = option(None, "Training source sentences, one a line (gzip read transparently).")
    tgt: str | None = option(None, "Training target sentences, line i translating line i of --src.")
    valid_src: str | None = option(None, "Validation source sentences (validation loss and BLEU).")
    valid_tgt: str | None = option(None, "Validation target sentences (raw references for BLEU).")
    preset: str = option("aiayn-tiny", "Model preset: aiayn-tiny, aiayn-base, aiayn-big.", choices=SEQ2SEQ_PRESETS)
    model: dict = option({}, "Seq2SeqConfig field overrides (YAML mapping; on the command line --set F=V).")
    tokenizer: str | None = option(None, "A tokenizer.json (or a folder holding one) with FrawdLLM's special "
                                         "tokens, as `frawd tokenizer train` writes; default: a joint BPE "
                                         "tokenizer trained on both sides of the training text.")
    vocab_size: int | None = option(None, "Joint BPE vocabulary size (default: the preset's).")
    tokens_per_batch: int = option(4096, "Tokens per micro-batch (rows x longest side, padding included).")
    max_len: int = option(128, "Skip training pairs with a side longer than this many tokens.")
    label_smoothing: float = option(0.1, "Label smoothing of the training loss (the paper's 0.1).")
    bleu_sentences: int = option(500, "Validation sentences translated (greedy) for BLEU at each evaluation; "
                                      "0 = no BLEU during training.")
    # the paper's optimizer and schedule
    lr: float = option(1e-3, "Peak learning rate (noam: reached at the end of warmup).")
    schedule: str = option("noam", "Decay after warmup: noam (the paper's inverse square root), cosine, linear, "
                                   "wsd, constant.", choices=SCHEDULES)
    warmup_steps: int = option(1000, WARMUP_HELP)
    beta2: float = option(0.98, "AdamW beta2 (the paper's 0.98).")
    weight_decay: float = option(0.0, "AdamW weight decay, applied to matrices only.")
    compile: str | bool = option("false", "torch.compile the training step: true, false, auto (batches change "
                                          "shape, so compiling rarely pays here).", choices=COMPILE_CHOICES)
    eval_interval: int = option(500, EVAL_INTERVAL_HELP)
    sample_tokens: int = option(1, "Write translations of the first 3 validation sentences to samples.txt at "
                                   "each evaluation: 0 = none, any other value = on (greedy, to the length limit).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.model, dict):
            raise ConfigError(f"model must be a mapping of Seq2SeqConfig fields, got {self.model!r}")
        if self.preset not in SEQ2SEQ_PRESETS:
            raise ConfigError(f"preset must be one of {', '.join(SEQ2SEQ_PRESETS)}, got {self.preset!r}")
        self.model = typed_overrides(Seq2SeqConfig, self.model)  # (YAML reads 1e-6 as text)
        get_config(self.preset, **self.model)  # a bad field is named before any work
        # the model's vocabulary and special ids are its tokenizer's (set here, they were ignored)
        if "vocab_size" in self.model:
            raise ConfigError("model vocab_size: a translation model's vocabulary is its tokenizer's (it was "
                              "ignored): remove it; --vocab-size sets the size of the BPE tokenizer trained")
        for name, fixed in (("pad_token_id", PAD_ID), ("bos_token_id", BOS_ID), ("eos_token_id", EOS_ID)):
            if self.model.get(name, fixed) != fixed:
                raise ConfigError(f"model {name} {self.model[name]}: the tokenizer's is {fixed} (it was ignored): "
                                  f"remove {name}")
        for name in ("tokens_per_batch", "max_len"):
            _require(name, getattr(self, name), lambda v: v >= 1, "a positive integer")
        _require("bleu_sentences", self.bleu_sentences, lambda v: v >= 0, "an integer >= 0")
        _require("label_smoothing", self.label_smoothing, lambda v: 0 <= v < 1, "in [0, 1)")
        _require("vocab_size", self.vocab_size, lambda v: v is None or v >= 1, "a positive integer")
        if self.vocab_size is not None:  # (before the data is read, not after)
            try:
                check_bpe_vocab_size(self.vocab_size)
            except FrawdError as exc:
                raise ConfigError(str(exc)) from None
        if (self.valid_src is None) != (self.valid_tgt is None):
            raise ConfigError("give both --valid-src and --valid-tgt, or neither")
        if self.sample_prompt:  # a pretrain option (TrainConfig's); not a flag of translate train
            raise ConfigError("sample_prompt: translate train takes no prompt; its samples translate the first "
                              "validation sentences")
        # TrainConfig's, not a flag of translate train (config.yaml holds its default)
        if self.batch_size != TrainConfig.batch_size:
            raise ConfigError(f"batch_size: translate train cuts batches by token count, not sentences; use "
                              f"tokens_per_batch (--tokens-per-batch) instead of batch_size {self.batch_size!r}")
