"""`frawd info` reports the exact parameter count of the built model; bad input is one line."""

import re
import subprocess
import sys

from frawdllm import FrawdLLM, get_config

from cli_helpers import run_cli


def frawd(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from frawdllm.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def frawd_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`frawd ARGS` run in this process (no fresh interpreter's `import torch`), as `frawd` gives it back."""
    code, out, err = run_cli(capsys, *args)
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_info_prints_the_built_models_parameter_count(capsys):
    result = frawd_here(capsys, "info", "--preset", "tiny")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"parameters:\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert count == sum(p.numel() for p in FrawdLLM(get_config("tiny")).parameters())


def test_info_prints_the_mlp_width_the_model_has(capsys):
    """`mlp_hidden None` (derived from n_embd: 4 x, or 8/3 x rounded for SwiGLU) said nothing."""
    for preset in ("tiny", "tiny-llama", "aiayn-tiny"):
        result = frawd_here(capsys, "info", "--preset", preset)
        width = int(re.search(r"^  mlp_hidden\s+(\S+)$", result.stdout, re.M).group(1))
        model = FrawdLLM(get_config(preset)) if preset != "aiayn-tiny" else None
        if model is not None:
            assert width == model.blocks[0].mlp.down.in_features
        else:
            assert width == get_config(preset).mlp_hidden == 1024


def test_info_set_overrides_a_field(capsys):
    result = frawd_here(capsys, "info", "--preset", "tiny", "--set", "n_layer=2", "--set", "tie_embeddings=false")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"parameters:\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert count == get_config("tiny", n_layer=2, tie_embeddings=False).num_parameters


def test_bad_input_is_one_line_and_nonzero_exit():
    for args in (["info", "--preset", "huge"], ["info", "--set", "n_head=7"], ["info", "--set", "n_layer"],
                 ["info", "--seq-len", "100000"]):
        result = frawd(*args)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("frawd: error:"), result.stderr


def test_info_ranks_shows_each_ranks_share_of_the_training_memory(capsys):
    result = frawd_here(capsys, "info", "--preset", "tiny", "--ranks", "4")
    assert result.returncode == 0, result.stderr
    n = sum(p.numel() for p in FrawdLLM(get_config("tiny")).parameters())
    rows = {m.group(1): [float(v) for v in m.groups()[1:]] for m in
            re.finditer(r"^\s+(ddp|fsdp)\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) MiB\s+([\d.]+) MiB", result.stdout,
                        re.M)}
    mib = 2 ** 20
    # fp32 weights and gradients (4 bytes each), AdamW's two moments (8 bytes): whole under DDP, 1/4 under FSDP
    for name, share in (("ddp", 1), ("fsdp", 4)):
        expected = [4 * n / share / mib, 4 * n / share / mib, 8 * n / share / mib, 16 * n / share / mib]
        assert rows[name] == [round(e, 1) for e in expected]
