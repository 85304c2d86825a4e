"""Bad command-line input: every case is refused with exactly one line on stderr, a
non-zero exit, no traceback and nothing left in --out.

The matrix runs through `frawdllm.cli.main` in this process (a traceback would surface as
an uncaught exception here); `test_matrix_cases_in_subprocess` runs a sample of it as a
real `frawd` process to check what the user's terminal sees.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frawdllm import FrawdLLM, get_config
from frawdllm.tokenizer import byte_tokenizer, train_tokenizer
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
FRAWD = [sys.executable, "-c", "from frawdllm.cli import main; main()"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny model directory (byte tokenizer), a small text corpus and a bigger tokenizer."""
    root = tmp_path_factory.mktemp("bad_input")
    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=4,
                                context_length=32))
    model.save_pretrained(root / "model", tokenizer=tok)
    corpus = root / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus, to the end.\n\n" for i in range(400)))
    (root / "big_tok").mkdir()
    big = train_tokenizer(iter([corpus.read_text()]), kind="bpe", vocab_size=400)
    big.save(root / "big_tok" / "tokenizer.json")
    (root / "small_model").mkdir()
    for name in ("config.json", "model.safetensors"):
        (root / "small_model" / name).write_bytes((root / "model" / name).read_bytes())
    big.save(root / "small_model" / "tokenizer.json")  # more ids than the model has rows
    rope = root / "long_rope_model"  # config.json edited: a context no memory holds the KV cache of
    FrawdLLM(get_config("tiny-llama", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=4, n_kv_head=4,
                        context_length=32)).save_pretrained(rope, tokenizer=tok)
    config = json.loads((rope / "config.json").read_text())
    (rope / "config.json").write_text(json.dumps({**config, "context_length": 10**8}))
    (root / "bad_utf8.yaml").write_bytes(b"lr: 0.001\n# \xff\xfe not UTF-8\n")
    (root / "rope_list.yaml").write_text("model:\n  rope_theta: [1]\n")
    (root / "dropout_null.yaml").write_text("model:\n  dropout: null\n")
    (root / "a_file").write_text("not a folder\n")
    with torch.no_grad():  # a diverged run's weights: sampling raised in torch.multinomial, greedy wrote token 0
        model.blocks[0].mlp.up.weight[0, :4] = float("nan")
    model.save_pretrained(root / "nan_model", tokenizer=tok)
    deep = root / "deep_model"  # config.json nested 5,000 levels (a RecursionError traceback)
    deep.mkdir()
    (deep / "config.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    shutil.copytree(root / "model", root / "deep_gen_model")  # (its generation_config.json, the same)
    (root / "deep_gen_model" / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    # a YAML alias bomb: 9 levels of 9 references, 9^9 items to print (the error's repr hung)
    bomb = [f"  - &l0 [{', '.join(['1'] * 9)}]"] + [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]"
                                                       for i in range(1, 9)]
    (root / "bomb.yaml").write_text("lr:\n" + "\n".join(bomb) + "\n")
    readonly = root / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    mounted = False
    if os.geteuid() == 0:  # root writes through any mode: make the folder a read-only mount instead
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(readonly)],
                                 capture_output=True).returncode == 0
    yield root
    if mounted:
        subprocess.run(["umount", str(readonly)], check=True)
    readonly.chmod(0o755)


run = run_cli


def gen(*extra):
    return ["generate", "--model", "{root}/model", "--prompt", "hi", "--max-new-tokens", "4", *extra]


def ev(*extra):
    return ["eval", "--model", "{root}/model", "--data", "{root}/corpus.txt", "--doc-split", "file",
            "--val-fraction", "0.5", *extra]


def pre(*extra):
    return ["pretrain", "--data", "{root}/corpus.txt", "--tokenizer", "byte", "--max-steps", "1",
            "--out", "{out}", *extra]


# (case id, argv with {root}/{out} placeholders, a word the one line must contain)
CASES = [
    # item 8: unwritable --out for every command that writes
    ("pretrain-out-readonly", pre()[:-2] + ["--out", "{root}/readonly/run"], "readonly"),
    ("pretrain-out-file", pre()[:-2] + ["--out", "{root}/a_file"], "a_file"),
    ("data-out-readonly", ["data", "prepare", "--data", "{root}/corpus.txt", "--tokenizer", "{root}/model",
                           "--out", "{root}/readonly/data"], "readonly"),
    ("data-out-file", ["data", "prepare", "--data", "{root}/corpus.txt", "--tokenizer", "{root}/model",
                       "--out", "{root}/a_file/data"], "a_file"),
    ("tokenizer-out-readonly", ["tokenizer", "train", "--data", "{root}/corpus.txt", "--kind", "byte",
                                "--out", "{root}/readonly/tok"], "readonly"),
    ("tokenizer-out-file", ["tokenizer", "train", "--data", "{root}/corpus.txt", "--kind", "byte",
                            "--out", "{root}/a_file/tok"], "a_file"),
    ("export-out-readonly", ["export", "--model", "{root}/model", "--out", "{root}/readonly/hf"],
     "readonly"),
    ("export-out-file", ["export", "--model", "{root}/model", "--out", "{root}/a_file"], "a_file"),
    ("export-gguf-out-readonly", ["export", "--model", "{root}/model", "--format", "gguf",
                                  "--out", "{root}/readonly/m.gguf"], "readonly"),
    ("import-out-readonly", ["import", "--from-hf", "{root}/model", "--out", "{root}/readonly/imp"], ""),
    ("import-hub-name", ["import", "--from-hf", "openai-community/gpt2", "--out", "{out}"],
     "reads a local directory, it downloads nothing: fetch a Hub model first (hf download "
     "openai-community/gpt2 --local-dir DIR)"),
    # item 9
    ("pretrain-preset-huge", pre("--preset", "huge"), "preset"),
    ("pretrain-yaml-rope-list", pre("--config", "{root}/rope_list.yaml"), "rope_theta"),
    ("pretrain-yaml-dropout-null", pre("--config", "{root}/dropout_null.yaml"), "dropout"),
    ("pretrain-yaml-not-utf8", pre("--config", "{root}/bad_utf8.yaml"), "UTF-8"),
    ("pretrain-set-nan", pre("--set", "norm_eps=nan"), "norm_eps"),
    # inf passed `lr > 0` (lr null in metrics.jsonl, then a late failure with --out half written)
    ("pretrain-lr-inf", pre("--lr", "inf"), "--lr must be a finite positive number, got inf"),
    ("pretrain-weight-decay-inf", pre("--weight-decay", "inf"), "--weight-decay must be a finite number"),
    ("pretrain-grad-clip-inf", pre("--grad-clip", "inf"), "--grad-clip must be a finite number"),
    ("pretrain-peak-tflops-inf", pre("--peak-tflops", "inf"), "--peak-tflops must be a finite positive number"),
    ("sft-lr-inf", ["sft", "--init", "{root}/model", "--max-steps", "1", "--out", "{out}", "--lr", "inf"],
     "lr must be a finite positive number"),
    # item 10
    ("eval-max-batches-0", ev("--max-batches", "0"), "max-batches"),
    ("eval-max-batches-neg", ev("--max-batches", "-1"), "max-batches"),
    ("eval-context-0", ev("--context-length", "0"), "context-length"),
    ("eval-batch-size-0", ev("--batch-size", "0"), "batch-size"),
    ("eval-tokenizer-too-big", ["eval", "--model", "{root}/small_model", "--data", "{root}/corpus.txt"],
     "tokenizer"),
    # item 11
    ("generate-temperature-tiny", gen("--temperature", "1e-40"), "temperature"),
    ("generate-penalty-tiny", gen("--repetition-penalty", "1e-40"), "repetition_penalty"),
    ("generate-penalty-huge", gen("--repetition-penalty", "1e40"), "repetition_penalty"),
    ("generate-temperature-inf", gen("--temperature", "inf"), "temperature"),
    ("generate-seed-huge", gen("--seed", str(2**70)), "seed"),
    ("generate-seed-negative", gen("--seed", "-1"), "seed"),
    ("generate-num-samples-huge", gen("--num-samples", str(10**8)), "num-samples"),
    # the loader's refusal, naming the file (it was a KV-cache memory refusal that named none)
    ("generate-context-huge", ["generate", "--model", "{root}/long_rope_model", "--prompt", "x"],
     "long_rope_model/config.json: context_length 100,000,000"),
    ("generate-max-new-tokens-0", gen("--max-new-tokens", "0"), "max_new_tokens"),
    ("generate-nan-weights", ["generate", "--model", "{root}/nan_model", "--prompt", "x"],
     "weights hold nan or inf values (the first: blocks.0.mlp.up.weight)"),
    ("chat-nan-weights", ["chat", "--model", "{root}/nan_model"], "weights hold nan or inf"),
    ("generate-config-nested-too-deep", ["generate", "--model", "{root}/deep_model", "--prompt", "x"],
     "deep_model/config.json: nests too deeply"),  # (the file named: "an input file" before)
    ("generate-generation-config-nested-too-deep", ["generate", "--model", "{root}/deep_gen_model", "--prompt", "x"],
     "deep_gen_model/generation_config.json: nests too deeply"),
    ("pretrain-config-alias-bomb", pre("--config", "{root}/bomb.yaml"), "lr: expected a number"),
    ("generate-top-p-0", gen("--top-p", "0"), "top_p"),
    ("generate-prompt-file-missing", gen("--prompt-file", "{root}/nope.txt"), "nope.txt"),
    ("generate-model-missing", ["generate", "--model", "{root}/nope", "--prompt", "x"], "nope"),
    ("generate-model-is-file", ["generate", "--model", "{root}/a_file", "--prompt", "x"], "a_file"),
    ("generate-tokenizer-too-big", ["generate", "--model", "{root}/small_model", "--prompt", "x"], "tokenizer"),
    ("generate-threads-0", gen("--threads", "0"), "threads"),
    ("generate-threads-huge", gen("--threads", "100000"), "threads"),  # was a segfault in OpenMP
    ("generate-compile-and-native", gen("--compile", "--native", "fp32"), "--native fp32"),
    # item 12
    ("info-seq-len-negative", ["info", "--seq-len", "-5"], "seq-len"),
    ("info-seq-len-0", ["info", "--seq-len", "0"], "seq-len"),
    ("info-preset-huge", ["info", "--preset", "huge"], "preset"),
    ("info-set-bad-bool", ["info", "--set", "bias=maybe"], "bias"),
    ("info-set-overflow", ["info", "--set", f"vocab_size={2**40}"], "vocab_size"),
]


@pytest.mark.parametrize("name,argv,word", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(env, tmp_path, capsys, name, argv, word):
    out = tmp_path / "out"
    argv = [a.format(root=env, out=out) for a in argv]
    before = sorted(p.name for p in env.iterdir())
    readonly_before = sorted((env / "readonly").iterdir())
    code, _, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code != 0, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert word.lower() in lines[0].lower(), lines[0]
    assert not out.exists(), sorted(out.rglob("*"))
    assert sorted(p.name for p in env.iterdir()) == before
    assert sorted((env / "readonly").iterdir()) == readonly_before
    assert (env / "a_file").read_text() == "not a folder\n"


def test_chat_refuses_invalid_utf8_on_stdin_in_one_line(env):
    proc = subprocess.run([*FRAWD, "chat", "--model", str(env / "model"),
                           "--max-new-tokens", "2"], input=b"hello \xff\xfe\n", capture_output=True,
                          timeout=120, cwd=ROOT)
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert len(err.strip().splitlines()) == 1, err
    assert "UTF-8" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["pretrain-out-readonly", "export-out-file", "generate-seed-huge",
                                  "pretrain-yaml-not-utf8"])
def test_matrix_cases_in_subprocess(env, tmp_path, name):
    argv = next(c[1] for c in CASES if c[0] == name)
    argv = [a.format(root=env, out=tmp_path / "out") for a in argv]
    proc = subprocess.run([*FRAWD, *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("frawd: error: ")


def test_the_readonly_folder_really_is_readonly(env):
    """The read-only cases above test something only if writing there really fails."""
    with pytest.raises(OSError):
        (env / "readonly" / "probe").write_text("x")


def test_every_float_setting_of_every_training_command_refuses_nan_and_inf():
    """`--lr inf` and `--weight-decay inf` passed their range checks; so could any float field
    whose check forgot that inf (or nan) is no usable value."""
    import typing

    from frawdllm.align.config import DPOConfig, SFTConfig
    from frawdllm.errors import ConfigError
    from frawdllm.train.config import PretrainConfig, TrainConfig
    from frawdllm.train.translation_config import TranslateConfig

    for cls in (TrainConfig, PretrainConfig, SFTConfig, DPOConfig, TranslateConfig):
        floats = [name for name, hint in typing.get_type_hints(cls).items()
                  if float in (typing.get_args(hint) or (hint,))]
        assert {"lr", "weight_decay", "grad_clip", "beta1", "peak_tflops"} <= set(floats)
        for name in floats:
            for value in (math.inf, -math.inf, math.nan):
                with pytest.raises(ConfigError, match=f"^{name} must be .*, got {value}$"):
                    cls(max_steps=1, **{name: value})
    for duration in ("max_time", "dist_timeout"):  # strings read as seconds: 400 digits are inf
        with pytest.raises(ConfigError, match="a duration must be positive and finite"):
            TrainConfig(max_steps=1, **{duration: "9" * 400})


@pytest.mark.parametrize("argv, said", [
    (["data", "prepare", "--data", "{root}/corpus.txt", "--tokenizer", "{root}/model", "--out", "{root}/a_file"],
     "--out {root}/a_file is a file, not a folder"),
    (["data", "prepare", "--data", "{root}/corpus.txt", "--tokenizer", "{root}/model", "--out", "{root}/a_file/sub"],
     "--out {root}/a_file/sub: {root}/a_file is a file, not a folder"),
    (["tokenizer", "train", "--data", "{root}/corpus.txt", "--kind", "byte", "--out", "{root}/a_file"],
     "{root}/a_file exists and is not a directory; give a directory or a path ending in .json"),
    (["tokenizer", "train", "--data", "{root}/corpus.txt", "--kind", "byte", "--out", "{root}/a_file/t.json"],
     "--out {root}/a_file/t.json: {root}/a_file is a file, not a folder"),
    (["tokenizer", "train", "--data", "{root}/corpus.txt", "--kind", "byte", "--out", "{root}/a_file/d/e"],
     "--out {root}/a_file/d/e: {root}/a_file is a file, not a folder"),
], ids=["data-prepare", "data-prepare-below", "tokenizer-train", "tokenizer-train-json-below",
        "tokenizer-train-below"])
def test_an_out_that_is_a_file_is_bad_input_exit_1_not_a_usage_error(env, capsys, argv, said):
    # (data prepare --out FILE exited 2 with click's "Invalid value for '--out'")
    code, stdout, err = run(capsys, *[a.format(root=env) for a in argv])
    assert (code, stdout, err) == (1, "", f"frawd: error: {said.format(root=env)}\n")
    assert (env / "a_file").read_text() == "not a folder\n"


@pytest.mark.parametrize("argv", [
    ["data", "prepare", "--data", "", "--tokenizer", "tok", "--out", "x"],
    ["data", "prepare", "--data=", "--tokenizer", "tok", "--out", "x"],
    ["tokenizer", "train", "--data", "corpus.txt", "--kind", "char", "--out", " "],
    ["eval", "--model", "", "--data", "corpus.txt"],
    ["pretrain", "--data", "corpus.txt", "--out", ""],
    ["translate", "train", "--src", "", "--tgt", "b", "--out", "x"],
])
def test_an_empty_path_is_a_usage_error_not_the_current_folder(env, capsys, argv, monkeypatch, tmp_path):
    """`--data "$UNSET"` tokenized whatever the working folder held, `--out ''` wrote into it
    (and said it wrote /train.bin), `--model ''` was "config.json: missing"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "private.txt").write_text("not a corpus\n")
    code, stdout, err = run(capsys, *argv)
    flag = next(a.partition("=")[0] for i, a in enumerate(argv) if a.startswith("--") and
                (a.endswith("=") or not argv[i + 1].strip()))
    assert (code, stdout, err) == (2, "", f"frawd: error: {flag} is empty: give a path (an unset shell variable?)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["private.txt"]


@pytest.mark.parametrize("argv, said", [
    (["pretrain", "--config", "{root}", "--max-steps", "1", "--out", "{root}/x"],
     "--config {root} is a folder; give a YAML or .toml file (a run's is RUN/config.yaml)"),
    (["translate", "run", "--model", "{root}/corpus.txt", "hallo"], "{root}/corpus.txt is a file, not a model directory"),
    (["translate", "eval", "--model", "{root}/model", "--src", "{root}", "--ref", "{root}/corpus.txt"],
     "{root} is a folder; give a text file of one sentence a line"),
])
def test_a_file_for_a_folder_or_the_reverse_is_bad_input_exit_1(env, capsys, argv, said):
    """click's own path checks made these usage errors (exit 2, "Invalid value for '--config':
    File ... is a directory"); bad input exits 1 (README)."""
    code, stdout, err = run(capsys, *[a.format(root=env) for a in argv])
    assert (code, stdout, err) == (1, "", f"frawd: error: {said.format(root=env)}\n")


def test_a_tilde_after_an_equals_sign_is_the_home_folder(env, capsys, monkeypatch, tmp_path):
    """`--out=~/tk` (which the shell leaves alone) made a folder named `~` in the working folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, _, err = run(capsys, "tokenizer", "train", f"--data={env / 'corpus.txt'}", "--kind", "char", "--out=~/tk")
    assert code == 0, err
    assert (home / "tk" / "tokenizer.json").is_file() and list(work.iterdir()) == []


def test_an_out_in_a_config_file_that_is_no_path_is_one_line(env, capsys, tmp_path):
    """`out: [a]` (or any list or mapping) in a config file was a TypeError traceback: `out`
    is read before the fields are checked (to find a resumed run's config)."""
    (tmp_path / "run.yaml").write_text("out: [a]\nmax_steps: 1\n")
    code, stdout, err = run(capsys, "pretrain", "--config", tmp_path / "run.yaml", "--dry-run")
    assert (code, stdout, err) == (1, "", f"frawd: error: {tmp_path / 'run.yaml'}: out: expected a string, got ['a']\n")


def test_an_empty_data_source_is_refused_by_the_library_too():
    from frawdllm.data.sources import iter_documents
    from frawdllm.errors import FrawdError

    with pytest.raises(FrawdError, match="^the data source is empty: give stdlib, hf:NAME, a file, a folder "
                                         "or a glob$"):
        next(iter_documents("  "))


@pytest.mark.parametrize("argv, flag", [
    (["pretrain", "--schedule", "foo"], "--schedule"),
    (["pretrain", "--dtype", "fp64"], "--dtype"),
    (["pretrain", "--doc-split", "foo"], "--doc-split"),
    (["sft", "--init", "{root}/model", "--train-on", "foo"], "--train-on"),
    (["dpo", "--init", "{root}/model", "--loss-type", "foo"], "--loss-type"),
    (["translate", "train", "--schedule", "foo"], "--schedule"),
    (["translate", "train", "--preset", "tiny"], "--preset"),
])
def test_a_flag_value_outside_its_choices_is_a_usage_error_exit_2(env, capsys, argv, flag):
    """The README promises exit 2 for an option value outside its choices; these were
    checked after parsing and exited 1."""
    code, stdout, err = run(capsys, *[a.format(root=env) for a in argv], "--max-steps", "1",
                            "--out", env / "choices_run")
    assert (code, stdout) == (2, ""), err
    assert f"Invalid value for '{flag}'" in err and "is not one of" in err, err
    assert not (env / "choices_run").exists()


def test_the_same_values_in_a_config_file_are_bad_input_exit_1(env, capsys, tmp_path):
    config = tmp_path / "bad.yaml"
    for setting, said in (("schedule: foo", "schedule must be one of cosine, linear, wsd, constant, noam; got 'foo'"),
                          ("doc_split: foo", "doc_split must be one of blank, line, file; got 'foo'")):
        config.write_text(setting + "\n")
        code, stdout, err = run(capsys, "pretrain", "--config", config, "--max-steps", "1", "--out", tmp_path / "r")
        assert (code, stdout, err) == (1, "", f"frawd: error: {config}: {said}\n")  # (the file named)


def test_a_bad_doc_split_is_refused_with_prepared_shards_too(env, capsys, tmp_path):
    """--doc-split was checked only for raw text, so a typo passed silently with --data SHARDS."""
    shards = tmp_path / "shards"
    assert run(capsys, "data", "prepare", "--data", env / "corpus.txt", "--tokenizer", env / "model",
               "--out", shards)[0] == 0
    config = tmp_path / "c.yaml"
    config.write_text("doc_split: lines\n")
    code, stdout, err = run(capsys, "pretrain", "--data", shards, "--config", config, "--max-steps", "1",
                            "--dry-run", "--out", tmp_path / "r")
    assert (code, err) == (1, f"frawd: error: {config}: doc_split must be one of blank, line, file; got 'lines'\n"), \
        stdout


@pytest.mark.parametrize("argv, said", [
    (["generate", "--model", "{root}/model", "--prompt", "a", "--device", "xpu"],
     "unknown device 'xpu'; use auto, cpu, cuda, cuda:N or mps"),
    (["generate", "--model", "{root}/model", "--prompt", "a", "--device", "mps"],
     "device mps requested but MPS is not available"),
    (["chat", "--model", "{root}/model", "--device", "meta"], "unknown device 'meta'; use auto, cpu, cuda, cuda:N or mps"),
    (["eval", "--model", "{root}/model", "--data", "{root}/corpus.txt", "--device", "xla"],
     "unknown device 'xla'; use auto, cpu, cuda, cuda:N or mps"),
    (["pretrain", "--data", "{root}/corpus.txt", "--tokenizer", "byte", "--max-steps", "1", "--device", "xpu",
      "--out", "{root}/xpu_run"], "unknown device 'xpu'; use auto, cpu, cuda, cuda:N or mps"),
], ids=["generate-xpu", "generate-mps", "chat-meta", "eval-xla", "pretrain-xpu"])
def test_a_device_type_torch_knows_but_nothing_here_runs_on_is_one_line(env, capsys, argv, said):
    """--device xpu/xla/meta (and mps for generate and chat, which checked only cuda) ended in
    a traceback from torch."""
    if "mps" in argv and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    code, stdout, err = run(capsys, *[a.format(root=env) for a in argv])
    assert (code, err) == (1, f"frawd: error: {said}\n"), stdout
    assert not (env / "xpu_run").exists()


def test_device_cpu_0_loads_a_model(env, capsys):
    """torch's name for the CPU, cpu:0, was passed to safetensors, which refuses it: the
    error blamed the weights file ("not a readable safetensors file")."""
    code, stdout, err = run(capsys, "generate", "--model", env / "model", "--prompt", "a", "--max-new-tokens", "2",
                            "--temperature", "0", "--device", "cpu:0", "--json")
    assert code == 0 and json.loads(stdout)["finish_reason"] in ("stop", "length"), err
