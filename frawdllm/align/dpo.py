"""`frawd dpo`: direct preference optimisation (Rafailov et al., 2023).

For a prompt x with a chosen answer y_w and a rejected one y_l, the policy pi (being
trained) and a frozen reference pi_ref (the starting model) give summed log-probabilities
of each answer's tokens. With the implicit rewards r = beta * (log pi(y|x) - log pi_ref(y|x)):

    sigmoid (DPO):  loss = -log sigmoid(r_w - r_l)
    ipo (IPO):      loss = (d_w - d_l - 1 / (2 beta))^2              (Azar et al., 2023)

so the policy raises the chosen answer's likelihood relative to the rejected one's, and
beta bounds how far it may move from the reference. For IPO d = (log pi(y|x) -
log pi_ref(y|x)) / len(y), per completion token, as TRL computes it (agreed with the IPO
authors: the summed form grows with answer length). Chosen and rejected answers go
through the model in one forward pass (stacked on the batch axis). Logged as TRL names
and computes them: rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected (means over the batch, from the summed
log-probs under IPO too, as TRL 1.x does; `test_dpo_loss_and_metrics_match_trl`).

The reference is a frozen copy of the starting model on the same device (a
`frozen_modules` of the task), or with `--precompute-ref` its log-probs are computed once
before training (in fp32) and the copy is freed. Under torchrun every rank keeps a whole
copy of the reference, with `--parallel fsdp` too: it only runs forward passes, needs no
collective and no sharding (it costs one model's weights per rank, bf16/fp32 as loaded;
`--precompute-ref` frees it after each rank has scored the pairs).
"""

from __future__ import annotations

import copy
import functools
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..errors import FrawdError
from ..model.gpt import IGNORE_INDEX
from ..tokenizer import Tokenizer
from ..train import distributed
from ..train.device import pick_device
from ..train.distributed import Share
from ..train.loop import TrainResult, content_hash, to_device
from .config import LOSSES, DPOConfig  # noqa: F401 (re-exported: they live in config.py, torch-free)
from .dealer import StepDealer
from .examples import LoadSummary, NothingToLearn, Pair, load_records, preference, tokenize_pair
from . import lora
from .job import FinetuneTask, run_finetune


# ---- the loss ----------------------------------------------------------------------------------

def dpo_loss(policy_chosen: Float[Tensor, "B"], policy_rejected: Float[Tensor, "B"],
             ref_chosen: Float[Tensor, "B"], ref_rejected: Float[Tensor, "B"], beta: float,
             loss_type: str = "sigmoid", lengths: tuple[Int[Tensor, "B"], Int[Tensor, "B"]] | None = None,
             ) -> tuple[Float[Tensor, ""], dict[str, Tensor]]:
    """The batch's mean loss and its metrics, from summed log-probs of each answer
    (`lengths`: the answers' token counts, chosen and rejected; IPO needs them)."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    # the log-ratio gap, unscaled (the logged rewards/margins is beta times it)
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin)
    elif loss_type == "ipo":
        if lengths is None:
            raise ValueError("IPO needs the answers' lengths")
        per_token = (policy_chosen - ref_chosen) / lengths[0].clamp(min=1) \
            - (policy_rejected - ref_rejected) / lengths[1].clamp(min=1)
        losses = (per_token - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss {loss_type!r}")
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": policy_chosen.detach().mean(),
        "logps/rejected": policy_rejected.detach().mean(),
    }
    return losses.mean(), metrics


def sequence_logps(model: nn.Module, tokens: Int[Tensor, "N T"], targets: Int[Tensor, "N T"]) -> Float[Tensor, "N"]:
    """Summed log-probabilities of each row's targets (-100 = not counted), in fp32."""
    logits = model(tokens)[0].float()  # (N, T, V)
    nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(targets.shape).sum(dim=1)


# ---- batches ---------------------------------------------------------------------------------

def collate_pairs(pairs: list[Pair], indices: list[int], length: int) -> dict[str, Tensor]:
    """2B right-padded rows, the chosen answers first, then the rejected; targets only on
    the answers' tokens. Causal attention never lets a token see the padding after it."""
    rows = [pairs[i].prompt + pairs[i].chosen for i in indices] + [pairs[i].prompt + pairs[i].rejected
                                                                    for i in indices]
    starts = [len(pairs[i].prompt) for i in indices] * 2
    tokens = np.zeros((len(rows), length), dtype=np.int64)  # (the padding's id is never seen nor scored)
    targets = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    for r, (ids, start) in enumerate(zip(rows, starts)):
        n = len(ids) - 1
        tokens[r, :n] = ids[:-1]
        targets[r, start - 1:n] = ids[start:]  # target i is ids[i+1]: the answer's first at start - 1
    return {"tokens": torch.from_numpy(tokens), "targets": torch.from_numpy(targets),
            "index": torch.tensor(indices, dtype=torch.int64),
            "lengths": torch.tensor([len(ids) - 1 for ids in rows], dtype=torch.int64)}


class PairLoader(StepDealer):
    """Batches of pair indices, reshuffled each epoch (seeded); resumable. Each optimizer
    step takes the next `share.step_rows` pairs of that order and this rank its part of
    them (`distributed.Share`; default: `batch_size` pairs a step, one process). The loss
    is a mean over pairs and every part has as many pairs, so the mean over ranks is
    the one-process batch's mean."""

    def __init__(self, n: int, batch_size: int, seed: int, share: Share | None = None) -> None:
        self.n = n
        super().__init__(seed, share or Share(batch_size, 1))

    def epoch_units(self) -> list[int]:
        return [int(i) for i in self.epoch_order(self.n)]

    def next_indices(self) -> list[int]:
        return self.next_units()


# ---- the task --------------------------------------------------------------------------------

def without_dropout(model: nn.Module) -> None:
    """Turn the model's dropout off (its config keeps the setting, for a later run). DPO
    compares the policy's log-probs with the reference's, which runs in eval mode: with
    dropout the policy's were noisy, and step 1, where the two are the same model, did not
    give the loss ln 2 and zero rewards. TRL's DPOTrainer does the same (disable_dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(getattr(module, "dropout", None), float):  # attention's dropout on its weights
            module.dropout = 0.0


class _Scoring:
    """The precompute's progress against --max-time: once a second of it (or two batches)
    shows that scoring every pair ends past the budget, it is refused in one line (it scored
    767 pairs in 63 s of a 30 s budget, then made a step, silently)."""

    def __init__(self, total: int, started_at: float | None, max_time_s: float | None) -> None:
        self.total, self.done, self.batches, self.began = total, 0, 0, time.perf_counter()
        self.deadline = None if started_at is None or not max_time_s else started_at + max_time_s
        self.max_time_s = max_time_s

    def scored(self, pairs: int) -> None:
        self.done, self.batches = self.done + pairs, self.batches + 1
        now = time.perf_counter()
        if self.deadline is None or self.done >= self.total or (self.batches < 2 and now - self.began < 1.0):
            return
        ends = now + (now - self.began) / self.done * (self.total - self.done)
        if ends > self.deadline:
            whole = ends - self.began
            raise FrawdError(f"--precompute-ref: scoring the {self.total:,} pairs under the reference takes ~{whole:.0f} "
                             f"s here, past --max-time {self.max_time_s:g} s ({self.deadline - self.began:.0f} s "
                             "were left): give a larger --max-time, or leave --precompute-ref out (the reference "
                             "then scores each batch beside the policy)")


class DPOTask(FinetuneTask):
    """DPO (or IPO) on preference pairs against a frozen copy of the starting model, live or
    its log-probs precomputed (`--precompute-ref`)."""

    bar_metrics = ("rewards/accuracies", "rewards/margins")
    loss_unit = "mean over preference pairs"

    def __init__(self, train: list[Pair], val: list[Pair], model: nn.Module, tokenizer: Tokenizer,
                 cfg: DPOConfig, length: int, started_at: float | None = None) -> None:
        super().__init__(model, tokenizer, cfg, [p.prompt for p in val])
        self.train_pairs, self.val_pairs, self.length, self.beta = train, val, length, cfg.beta
        self.loss_type = cfg.loss_type
        self.loader = PairLoader(len(train), cfg.batch_size, cfg.seed,
                                 share=Share.of_this_rank(cfg.batch_size, cfg.grad_accum))
        without_dropout(model)  # (before the copy: the reference runs in eval mode anyway)
        self.flops_per_token = lora.flops_per_token(model, length)  # the policy's forward and backward: 6N
        if not cfg.precompute_ref:  # + the reference's forward: 2N, a third of a plain model's step
            self.flops_per_token += model.config.flops_per_token(length) // 3
        reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.reference: nn.Module | None = reference
        self.ref_logps: dict[str, Tensor] = {}
        if cfg.precompute_ref:
            device = distributed.current().device or pick_device(cfg.device)  # every rank: all pairs
            reference.to(device)
            from tqdm import tqdm

            self._scoring = _Scoring(len(train) + len(val), started_at, cfg.max_time_s)
            shown = cfg.progress and distributed.current().is_main and len(train) + len(val) > 0
            with tqdm(total=len(train) + len(val), desc="reference log-probs (--precompute-ref)", unit="pair",
                      dynamic_ncols=True, leave=False, disable=not shown) as bar:  # (one bar: both splits)
                self.ref_logps = {"train": self._reference_logps(train, reference, device, bar),
                                  "val": self._reference_logps(val, reference, device, bar)}
            self.reference = None  # freed: the loop never sees it

    def _reference_logps(self, pairs: list[Pair], reference: nn.Module, device: torch.device,
                         bar: Any) -> Float[Tensor, "2 n"]:
        """(2, n) summed log-probs (chosen, rejected) of every pair under the reference, fp32
        (a forward of every pair before the first step, inside --max-time; `bar` counts them)."""
        out = torch.zeros(2, len(pairs))
        with torch.no_grad():
            for start in range(0, len(pairs), self.cfg.batch_size):
                indices = list(range(start, min(start + self.cfg.batch_size, len(pairs))))
                batch = to_device(collate_pairs(pairs, indices, self.length), device)
                logps = sequence_logps(reference, batch["tokens"], batch["targets"]).float().cpu()
                out[:, start:start + len(indices)] = logps.view(2, -1)
                bar.update(len(indices))
                self._scoring.scored(len(indices))
        return out

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {"reference": self.reference} if self.reference is not None else {}

    def next_batch(self) -> dict[str, Tensor]:
        return self._batch(self.train_pairs, self.loader.next_indices(), "train")

    def _batch(self, pairs: list[Pair], indices: list[int], split: str) -> dict[str, Tensor]:
        batch = collate_pairs(pairs, indices, self.length)
        if self.ref_logps:
            batch["ref_logps"] = self.ref_logps[split][:, indices].reshape(-1)  # (2B,) chosen first
        return batch

    def batch_tokens(self, batch: dict[str, Tensor]) -> int:
        return int(batch["lengths"].sum())  # (not the tokens != 0: id 0 is a real token in GPT-2's vocabulary)

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        logps = sequence_logps(model, batch["tokens"], batch["targets"])  # (2B,) one pass for both answers
        if "ref_logps" in batch:
            ref = batch["ref_logps"]
        else:
            with torch.no_grad():
                ref = sequence_logps(self.reference, batch["tokens"], batch["targets"])
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = ref.chunk(2)
        lengths = (batch["targets"] != IGNORE_INDEX).sum(dim=1).chunk(2)
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.loss_type, lengths)

    def evaluation_key(self) -> dict:
        """The held-out pairs `evaluate` reads (other --data, --val-fraction, --max-length,
        --eval-batches... make others) and the loss it computes on them."""
        pairs = self.val_pairs[:self.cfg.batch_size * self.cfg.eval_batches]
        return {"validation pairs": content_hash([[p.prompt, p.chosen, p.rejected] for p in pairs]),
                "beta": self.beta, "loss_type": self.loss_type}

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The held-out pairs' loss and metrics (`val_loss`, `val_rewards/accuracies`, ...)."""
        sums: dict[str, float] = {}
        count = 0
        size = self.cfg.batch_size
        for start in range(0, min(len(self.val_pairs), size * self.cfg.eval_batches), size):
            indices = list(range(start, min(start + size, len(self.val_pairs))))
            batch = to_device(self._batch(self.val_pairs, indices, "val"), device)
            loss, metrics = self.loss(model, batch)
            for key, value in {"loss": loss, **metrics}.items():
                sums[key] = sums.get(key, 0.0) + float(value) * len(indices)
            count += len(indices)
        return {f"val_{key}": value / count for key, value in sums.items()} if count else {}


def load_pairs(cfg: DPOConfig, tokenizer: Tokenizer, length: int) -> tuple[list[Pair], list[Pair], LoadSummary]:
    """The preference pairs of `cfg.data`, tokenized to fit rows of `length` inputs: train, val, counts."""
    def convert(record, where):
        # a row holds prompt + answer minus its last token: length + 1 ids
        pair, cut = tokenize_pair(tokenizer, *preference(record, where), max_len=length + 1)
        if pair.chosen == pair.rejected:  # no preference left: loss ln 2 and no gradient, whatever the weights
            how = (f"are the same once cut to fit {length}-token rows (they differ only after that)" if cut
                   else "tokenize to the same ids")
            raise NothingToLearn(f"{where}: 'chosen' and 'rejected' {how}")
        return pair, cut

    return load_records(cfg, convert, "pairs")


def run_dpo(cfg: DPOConfig, callbacks: list | None = None, started_at: float | None = None) -> TrainResult:
    """`frawd dpo`: a DPOTask on `load_pairs`'s pairs through the shared loop (`run_finetune`)."""
    started_at = time.perf_counter() if started_at is None else started_at
    return run_finetune(cfg, "dpo", load_pairs, functools.partial(DPOTask, started_at=started_at), "pairs",
                        callbacks, started_at)
