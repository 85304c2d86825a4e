"""Hostile and broken model directories: each is refused with one FrawdError line, before
the loader allocates more than the weights file's size plus 200 MB, by every command.

The zoo is built from one small valid directory; each entry breaks one thing. Peak memory
is measured in a fresh subprocess (ru_maxrss) against the same process loading nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.errors import FrawdError
from frawdllm.modeldir import (CONFIG_FILE, GENERATION_CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE,
                               load_config, load_generation_config, load_model)
from frawdllm.tokenizer import byte_tokenizer
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
MB = 2**20

# name -> change to config.json (a dict merged in)
CONFIG_ZOO = {
    "vocab-2**24": {"vocab_size": 2**24},
    "layers-500": {"n_layer": 500},
    "embd-vocab-2**40": {"n_embd": 2**40, "vocab_size": 2**40},
    "embd-vocab-2**30": {"n_embd": 2**30, "vocab_size": 2**30, "n_head": 2**10},
    "context-2**28-rope": {"context_length": 2**28, "pos_encoding": "rope"},
    "bias-no": {"bias": "no"},
    "norm-eps-nan": {"norm_eps": float("nan")},
    "norm-eps-inf": {"norm_eps": float("inf")},
    "pad-token-half": {"pad_token_id": 0.5},
    "format-version-str": {"format_version": "1"},
    "format-version-float": {"format_version": 1.0},
    "format-version-bool": {"format_version": True},
    "format-version-2": {"format_version": 2},
    "n-head-str": {"n_head": "4"},
    "rope-theta-list": {"rope_theta": [1]},
    "dropout-null": {"dropout": None},
    "unknown-field": {"flash": True},
    "pos-encoding-bad": {"pos_encoding": "alibi"},
    "vocab-negative": {"vocab_size": -1},
}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> a broken model directory (plus "good", the valid one they derive from)."""
    root = tmp_path_factory.mktemp("zoo")
    good = root / "good"
    torch.manual_seed(0)
    tok = byte_tokenizer()
    FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=4,
                        context_length=32)).save_pretrained(good, tokenizer=tok)
    config = json.loads((good / CONFIG_FILE).read_text())
    dirs = {"good": good}

    def clone(name):
        d = root / name
        d.mkdir()
        for f in good.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        dirs[name] = d
        return d

    for name, change in CONFIG_ZOO.items():
        d = clone(name)
        (d / CONFIG_FILE).write_text(json.dumps({**config, **change}))
    d = clone("no-format-version")
    (d / CONFIG_FILE).write_text(json.dumps({k: v for k, v in config.items() if k != "format_version"}))
    clone("config-list").joinpath(CONFIG_FILE).write_text("[1, 2]")
    clone("config-not-utf8").joinpath(CONFIG_FILE).write_bytes(b'{"vocab_size": "\xff"}')
    clone("config-missing").joinpath(CONFIG_FILE).unlink()
    clone("weights-missing").joinpath(WEIGHTS_FILE).unlink()
    d = clone("weights-truncated")
    (d / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes()[:1000])
    d = clone("weights-header-huge")  # a header length of 2**60 bytes
    (d / WEIGHTS_FILE).write_bytes((2**60).to_bytes(8, "little") + b"{}")
    d = clone("weights-int64")
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(4, dtype=torch.int64)}, str(d / WEIGHTS_FILE))
    d = clone("weights-dir")
    (d / WEIGHTS_FILE).unlink()
    (d / WEIGHTS_FILE).mkdir()
    outside = root / "outside"
    outside.mkdir()
    (outside / WEIGHTS_FILE).write_bytes((good / WEIGHTS_FILE).read_bytes())
    (outside / CONFIG_FILE).write_text((good / CONFIG_FILE).read_text())
    d = clone("weights-link-outside")
    (d / WEIGHTS_FILE).unlink()
    (d / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    d = clone("config-link-outside")
    (d / CONFIG_FILE).unlink()
    (d / CONFIG_FILE).symlink_to(outside / CONFIG_FILE)
    d = clone("weights-link-broken")
    (d / WEIGHTS_FILE).unlink()
    (d / WEIGHTS_FILE).symlink_to(root / "nowhere")
    clone("gen-config-list").joinpath(GENERATION_CONFIG_FILE).write_text("[1]")
    clone("gen-config-not-utf8").joinpath(GENERATION_CONFIG_FILE).write_bytes(b'{"temperature": "\xff"}')
    clone("gen-config-hot").joinpath(GENERATION_CONFIG_FILE).write_text('{"temperature": "hot"}')
    clone("gen-config-bad-json").joinpath(GENERATION_CONFIG_FILE).write_text('{"temperature": ')
    d = clone("tokenizer-link-outside")
    (d / TOKENIZER_FILE).unlink()
    (d / TOKENIZER_FILE).symlink_to(outside / WEIGHTS_FILE)
    return dirs


LOAD_REFUSED = [n for n in [*CONFIG_ZOO, "no-format-version", "config-list", "config-not-utf8", "config-missing",
                            "weights-missing", "weights-truncated", "weights-header-huge", "weights-int64",
                            "weights-dir", "weights-link-outside", "config-link-outside", "weights-link-broken"]]
GEN_CONFIG_REFUSED = ["gen-config-list", "gen-config-not-utf8", "gen-config-hot", "gen-config-bad-json"]


@pytest.mark.parametrize("name", LOAD_REFUSED)
def test_load_model_refuses_in_one_line(zoo, name):
    with pytest.raises(FrawdError) as info:
        load_model(zoo[name])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", GEN_CONFIG_REFUSED)
def test_generation_config_refused_in_one_line(zoo, name):
    with pytest.raises(FrawdError, match=GENERATION_CONFIG_FILE) as info:
        load_generation_config(zoo[name])
    assert "\n" not in str(info.value)


def test_a_transformers_generation_config_reads_as_import_reads_it(zoo, tmp_path):
    """Copied in from a transformers checkpoint, it was refused ("unknown sampling parameter(s):
    do_sample, eos_token_id"): its settings mean what they mean in transformers."""
    d = tmp_path / "m"
    d.mkdir()
    for f in zoo["good"].iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    path = d / GENERATION_CONFIG_FILE
    path.write_text(json.dumps({"do_sample": False, "temperature": 0.7, "eos_token_id": [3, 5],
                                "transformers_version": "4.57.0"}))
    assert load_generation_config(d) == {"temperature": 0, "stop_token_ids": [5]}  # greedy without do_sample
    path.write_text(json.dumps({"do_sample": True, "top_p": 0.9, "eos_token_id": 3}))
    assert load_generation_config(d) == {"temperature": 1.0, "top_k": 50, "top_p": 0.9}  # transformers' defaults
    context = load_config(d).context_length
    path.write_text(json.dumps({"max_length": context, "eos_token_id": 3, "transformers_version": "4.57.0"}))
    assert load_generation_config(d) == {"temperature": 0, "max_new_tokens": context}  # as `frawd import` maps it
    path.write_text(json.dumps({"temperature": 0.7, "eos_token_id": 3}))  # no marker: still ours, still refused
    with pytest.raises(FrawdError, match="eos_token_id"):
        load_generation_config(d)


def test_links_inside_the_folder_are_followed(zoo, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for f in zoo["good"].iterdir():
        (d / ("real_" + f.name)).write_bytes(f.read_bytes())
        (d / f.name).symlink_to("real_" + f.name)
    assert load_model(d).config == load_model(zoo["good"]).config
    linked_dir = tmp_path / "linked"
    linked_dir.symlink_to(zoo["good"], target_is_directory=True)  # the folder itself may be a link
    load_model(linked_dir)


def run(capsys, *args) -> tuple[int, str]:
    code, _, err = run_cli(capsys, *args)
    return code, err


COMMANDS = {
    "generate": lambda d, out: ["generate", "--model", d, "--prompt", "hi", "--max-new-tokens", "2"],
    "eval": lambda d, out: ["eval", "--model", d, "--data", d / "tokenizer.json", "--doc-split", "file"],
    "export-hf": lambda d, out: ["export", "--model", d, "--out", out],
    "export-gguf": lambda d, out: ["export", "--model", d, "--format", "gguf", "--out", out / "m.gguf"],
    "sft": lambda d, out: ["sft", "--init", d, "--data", d / "absent.jsonl", "--max-steps", "1", "--out", out],
}
# Every command on a sample of the zoo (each refusal reason once); the loader test covers the rest.
CLI_SAMPLE = ["vocab-2**24", "embd-vocab-2**40", "bias-no", "norm-eps-nan", "pad-token-half", "format-version-str",
              "weights-link-outside", "gen-config-list", "gen-config-not-utf8", "gen-config-hot",
              "tokenizer-link-outside"]


# eval does not read generation_config.json: those entries are not refusals for it
CLI_CASES = [(command, name) for command in COMMANDS for name in CLI_SAMPLE
             if not (command in ("eval", "sft") and name.startswith("gen-config"))]


@pytest.mark.parametrize(("command", "name"), CLI_CASES)
def test_every_command_refuses_in_one_line(zoo, tmp_path, capsys, command, name):
    out = tmp_path / "out"
    code, err = run(capsys, *COMMANDS[command](zoo[name], out))
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("frawd: error: "), err
    assert not out.exists()


# The high-water mark of RSS (VmHWM, reset through clear_refs once imports are done) minus
# the RSS just before loading: an upper bound on what the load allocated.
PEAK_SCRIPT = """
import sys
import torch, frawdllm.modeldir as m
from frawdllm.errors import FrawdError
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
try:
    m.load_model(sys.argv[1])
    print("LOADED")
except FrawdError:
    print("REFUSED")
print(status("VmHWM") - before)
"""


def peak_kib(path) -> tuple[str, int]:
    """("LOADED" or "REFUSED", peak RSS added by loading `path` in a fresh process in KiB)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    outcome, peak = proc.stdout.split()[-2:]
    return outcome, int(peak)


def test_the_peak_measure_sees_a_real_load(tmp_path):
    """Control: loading a valid 64 MiB model shows at least 64 MiB in the measure."""
    FrawdLLM(get_config("tiny", vocab_size=2**16, n_layer=1, n_embd=256, n_head=4,
                        context_length=32)).save_pretrained(tmp_path)
    size_kib = (tmp_path / WEIGHTS_FILE).stat().st_size // 1024
    outcome, peak = peak_kib(tmp_path)
    assert outcome == "LOADED" and size_kib > 60 * 1024
    assert peak >= size_kib


@pytest.mark.parametrize("name", ["vocab-2**24", "layers-500", "embd-vocab-2**40", "embd-vocab-2**30",
                                  "context-2**28-rope", "weights-header-huge"])
def test_refusing_a_config_larger_than_its_weights_allocates_little(zoo, name):
    weights = zoo[name] / WEIGHTS_FILE
    budget_kib = (weights.stat().st_size + 200 * MB) // 1024
    outcome, peak = peak_kib(zoo[name])
    print(f"{name}: loader peak {peak / 1024:.1f} MiB (budget {budget_kib / 1024:.0f} MiB)")
    assert outcome == "REFUSED"
    assert peak < budget_kib
