"""`frawd info` reports the exact parameter count of the built model; bad input is one line."""

import re
import subprocess
import sys

from frawdllm import FrawdLLM, get_config


def frawd(*args: str) -> subprocess.CompletedProcess:
    code = "import sys; from frawdllm.cli import main; main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


def test_info_prints_the_built_models_parameter_count():
    result = frawd("info", "--preset", "tiny")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"parameters:\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert count == sum(p.numel() for p in FrawdLLM(get_config("tiny")).parameters())


def test_info_set_overrides_a_field():
    result = frawd("info", "--preset", "tiny", "--set", "n_layer=2", "--set", "tie_embeddings=false")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"parameters:\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert count == get_config("tiny", n_layer=2, tie_embeddings=False).num_parameters


def test_bad_input_is_one_line_and_nonzero_exit():
    for args in (["info", "--preset", "huge"], ["info", "--set", "n_head=7"], ["info", "--set", "n_layer"]):
        result = frawd(*args)
        assert result.returncode == 1
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("frawd: error:"), result.stderr
