"""`frawd sft`: supervised fine-tuning, the first step from a base model to a chat model.

The model sees whole conversations in the chat template and learns only the assistant's
tokens (examples.py says which); examples are packed several to a row with attention kept
inside each one (packing.py). The held-out split's loss on assistant tokens is the
validation loss; samples.txt holds the model's greedy answers to held-out prompts.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor, nn

from ..model.gpt import IGNORE_INDEX
from ..tokenizer import ASSISTANT_ID, Tokenizer
from ..train.distributed import Share
from ..train.loop import TrainResult, content_hash
from ..train.losses import linear_cross_entropy
from .config import SFTConfig
from .examples import Example, LoadSummary, chat_messages, load_records, tokenize_chat, truncate
from . import lora
from .job import FinetuneTask, run_finetune
from .packing import DocumentMask, PackedLoader, fixed_batches


def packed_hidden(model: nn.Module, batch: dict[str, Tensor]) -> Float[Tensor, "B T D"]:
    return model.hidden_states(batch["tokens"], batch["positions"], DocumentMask(batch["documents"]))


def sft_loss(model: nn.Module, batch: dict[str, Tensor]) -> Float[Tensor, ""]:
    """Mean cross-entropy over the batch's trained tokens."""
    hidden = packed_hidden(model, batch)  # (B, T, D)
    return linear_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, batch["targets"].flatten())


def prompt_of(example: Example) -> list[int]:
    """The prompt of a held-out sample: the ids up to the <|assistant|> that opens the first
    trained reply (with --train-on all, where every token is trained, the first reply's),
    else those before the first trained token."""
    ids = example.ids
    if not any(example.trained):
        return ids
    first = example.trained.index(True)
    if first > 0 and ids[first - 1] == ASSISTANT_ID:
        return ids[:first]
    opens = ids.index(ASSISTANT_ID, first) if ASSISTANT_ID in ids[first:] else None
    return ids[:opens + 1] if opens is not None else ids[:first]


def load_examples(cfg: SFTConfig, tokenizer: Tokenizer, length: int) -> tuple[list[Example], list[Example],
                                                                             LoadSummary]:
    """The chat examples of `cfg.data`, tokenized with their loss masks and cut to `length` + 1
    ids: train, val, counts."""
    def convert(record, where):
        # length + 1 ids give `length` inputs (the last id is only a target)
        return truncate(tokenize_chat(tokenizer, chat_messages(record, where), cfg.train_on), length + 1)

    return load_records(cfg, convert, "examples")


class SFTTask(FinetuneTask):
    """Next-token loss on the trained parts of chat examples (`--train-on`), packed into rows."""

    def __init__(self, train: list[Example], val: list[Example], model: nn.Module, tokenizer: Tokenizer,
                 cfg: SFTConfig, length: int) -> None:
        super().__init__(model, tokenizer, cfg, [prompt_of(e) for e in val])
        self.length = length
        self.loader = PackedLoader(train, cfg.batch_size, length, cfg.seed, pack=cfg.pack,
                                   share=Share.of_this_rank(cfg.batch_size, cfg.grad_accum))
        self.val_batches = fixed_batches(val, cfg.batch_size, length, pack=cfg.pack)[:cfg.eval_batches]
        self.flops_per_token = lora.flops_per_token(model, length)

    def next_batch(self) -> dict[str, Tensor]:
        return self.loader.next_batch()

    def batch_tokens(self, batch: dict[str, Tensor]) -> int:
        return int((batch["documents"] >= 0).sum())  # padding is no work done

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
        """This micro-batch's part of the step's token-weighted mean loss: the sum over its
        trained tokens over the batch's `normalizer` (`PackedLoader`), so a step's
        micro-batches (and ranks) make the mean over all its trained tokens."""
        trained = (batch["targets"] != IGNORE_INDEX).sum()
        return sft_loss(model, batch) * (trained / batch["normalizer"])

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """`val_loss`: the mean loss over the held-out batches' trained tokens."""
        from ..train.loop import to_device

        total, count = 0.0, 0
        for batch in self.val_batches:
            batch = to_device(batch, device)
            n = int((batch["targets"] != IGNORE_INDEX).sum())
            total += float(sft_loss(model, batch)) * n
            count += n
        return {"val_loss": total / count} if count else {}

    def evaluation_key(self) -> dict:
        """The held-out rows `evaluate` reads (other --data, --val-fraction, --max-length,
        --eval-batches... make others) and which of their tokens carry the loss."""
        rows = [part for batch in self.val_batches for part in (batch["tokens"], batch["documents"])]
        return {"validation examples": content_hash(*rows), "train_on": self.cfg.train_on}


def run_sft(cfg: SFTConfig, callbacks: list | None = None, started_at: float | None = None) -> TrainResult:
    """`frawd sft`: an SFTTask on `load_examples`'s examples through the shared loop (`run_finetune`)."""
    return run_finetune(cfg, "sft", load_examples, SFTTask, "examples", callbacks, started_at)
