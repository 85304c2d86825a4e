"""Compiled training computes eager's loss and gradients, on every CPU.

torch 2.13's inductor miscompiled the backward of the block region the layers share
(gradients up to ~4000x too large, the loss unchanged; see frawdllm/train/compile.py).
These run in a fresh interpreter: the test session's run-time type checks cannot be
traced by dynamo.
"""

import subprocess
import sys

import pytest

SCRIPT = r"""
import copy, json, sys
import torch
from frawdllm import FrawdLLM, get_config
from frawdllm.train.compile import compile_step
from frawdllm.train.losses import linear_cross_entropy

STYLES = {
    "gpt2": dict(preset="tiny"),
    "llama": dict(preset="tiny-llama"),
    "post_ln": dict(preset="tiny", norm_placement="post"),
}

def plain_loss(model, x, y):
    return model(x, y)[1]

def fused_loss(model, x, y):  # what pretraining runs (PretrainTask.loss)
    return linear_cross_entropy(model.hidden_states(x).flatten(0, 1), model.lm_head.weight, y.flatten())

def loss_and_grads(model, fn, x, y):
    model.zero_grad(set_to_none=True)
    loss = fn(model, x, y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

results = {}
for style, spec in STYLES.items():
    spec = dict(spec)
    cfg = get_config(spec.pop("preset"), n_layer=3, n_embd=64, n_head=4, vocab_size=256, context_length=32,
                     dropout=0.0, **spec)
    torch.manual_seed(0)
    model = FrawdLLM(cfg)
    x = torch.randint(0, 256, (2, 32)); y = torch.randint(0, 256, (2, 32))
    for name, fn in (("plain", plain_loss), ("fused", fused_loss)):
        eager_loss, eager = loss_and_grads(model, fn, x, y)
        compiled_loss, compiled = loss_and_grads(model, compile_step(fn), x, y)
        worst = max(((compiled[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in eager.items())
        results[f"{style}/{name}"] = {"loss_rel": abs(compiled_loss - eager_loss) / abs(eager_loss),
                                      "worst_grad_rel": worst, "n_grads": len(compiled)}
# a plain torch.compile of the model (no compile_step) must be right too
torch.manual_seed(0)
model = FrawdLLM(get_config("tiny-llama", n_layer=3, n_embd=64, n_head=4, vocab_size=256, context_length=32))
x = torch.randint(0, 256, (2, 32)); y = torch.randint(0, 256, (2, 32))
eager_loss, eager = loss_and_grads(model, plain_loss, x, y)
compiled_loss, compiled = loss_and_grads(model, torch.compile(plain_loss), x, y)
worst = max(((compiled[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in eager.items())
results["llama/torch.compile"] = {"loss_rel": abs(compiled_loss - eager_loss) / abs(eager_loss),
                                  "worst_grad_rel": worst, "n_grads": len(compiled)}
print(json.dumps(results))
"""


@pytest.mark.timeout(900)  # six compiles; slow on a loaded machine
def test_compiled_training_gives_eagers_loss_and_every_gradient():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(results) == 7
    for case, figures in results.items():
        assert figures["n_grads"] > 10, case
        assert figures["loss_rel"] < 1e-5, (case, figures)
        assert figures["worst_grad_rel"] < 1e-4, (case, figures)



QUIET_SCRIPT = r"""
import warnings
from frawdllm import FrawdLLM, get_config
from frawdllm.infer.engine import Engine
from frawdllm.tokenizer import byte_tokenizer
from frawdllm.train.compile import compile_step

message = "TypedStorage is deprecated. It will be removed in the future"
def warn_all():
    warnings.warn_explicit(message, UserWarning, "select_algorithm.py", 1, module="torch._inductor.select_algorithm")
    warnings.warn_explicit(message, UserWarning, "mine.py", 1, module="mine")
    warnings.warn_explicit("another", UserWarning, "select_algorithm.py", 2, module="torch._inductor.select_algorithm")

tokenizer = byte_tokenizer()
model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=tokenizer.vocab_size))
for label, make in (("none", lambda: None), ("engine", lambda: Engine(model, tokenizer, compile=True)),
                    ("train", lambda: compile_step(lambda x: x))):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make()  # (both compile lazily: nothing is compiled here)
        warn_all()
    print(label, [w.filename for w in seen if w.filename in ("select_algorithm.py", "mine.py")])
"""


def test_inductors_own_deprecation_warning_is_silenced_for_compiled_runs():
    """torch 2.13's inductor calls `tensor.storage()` while it tunes matmuls, and a
    `generate --compile` printed "TypedStorage is deprecated ... use tensor.untyped_storage()",
    advice meant for torch's developers. Compiled decoding and training silence that one
    warning from inductor's modules, and nothing else. (A fresh interpreter, as above.)"""
    from cli_helpers import script_lines

    assert script_lines(QUIET_SCRIPT) == [
        "none ['select_algorithm.py', 'mine.py', 'select_algorithm.py']",
        "engine ['mine.py', 'select_algorithm.py']",
        "train ['mine.py', 'select_algorithm.py']",
    ]
