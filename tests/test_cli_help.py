"""`frawd ... --help` loads no torch, for every command and subcommand (frawdllm/cli/__init__.py
promises it: help is instant, ~0.1 s, where importing torch takes 1-2 s).

One subprocess walks the whole command tree from the `frawd` group (each command is imported
as `--help` would import it) and asks for each one's help in turn; torch showing up in
sys.modules after a command's help means that command (or the first such one) imported it.
The configs behind the training commands' flags live in torch-free modules for this
(frawdllm/train/config.py, frawdllm/align/config.py, frawdllm/train/translation_config.py).
"""

import json
import subprocess
import sys

# command path -> why its --help genuinely needs torch (none does today)
NEEDS_TORCH: dict[tuple[str, ...], str] = {}

SCRIPT = r"""
import json, sys
import click
from click.testing import CliRunner
from frawdllm.cli import cli

needs_torch = {tuple(p) for p in json.loads(sys.argv[1])}
torch_before = "torch" in sys.modules

def walk(command, path):
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command, info_name=" ".join(["frawd", *path]))
        for name in command.list_commands(ctx):
            if tuple(path + [name]) not in needs_torch:
                yield from walk(command.get_command(ctx, name), path + [name])

runner, results = CliRunner(), []
for path, command in walk(cli, []):
    result = runner.invoke(cli, [*path, "--help"])
    results.append({"path": path, "exit_code": result.exit_code, "has_usage": "Usage:" in result.output,
                    "output": result.output[-500:], "torch": "torch" in sys.modules})
print(json.dumps({"torch_before": torch_before, "results": results}))
"""


def _help_of_every_command() -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([list(p) for p in NEEDS_TORCH])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_of_every_command_loads_no_torch():
    report = _help_of_every_command()
    assert not report["torch_before"], "importing frawdllm.cli loaded torch"
    results = report["results"]
    paths = {" ".join(r["path"]) for r in results}
    # the walk reached the nested groups' commands, not only the top level
    for expected in ("", "info", "pretrain", "sft", "dpo", "eval", "generate", "chat", "export", "import",
                     "serve", "tokenizer", "tokenizer train", "data", "data prepare", "translate",
                     "translate train", "translate eval", "translate run"):
        assert expected in paths, f"frawd {expected} --help was not tried (found: {sorted(paths)})"
    for r in results:
        name = " ".join(["frawd", *r["path"]])
        assert r["exit_code"] == 0 and r["has_usage"], f"{name} --help failed:\n{r['output']}"
    loaded = [" ".join(["frawd", *r["path"], "--help"]) for r in results if r["torch"]]
    assert not loaded, (f"{loaded[0]} imported torch (commands after it in {loaded[1:]} were not told apart); "
                        "import the heavy modules inside the command's function, and keep what its "
                        "options need (its config dataclass) torch-free")


def test_tokenizer_training_runs_without_torch(tmp_path):
    """`frawd tokenizer train` never needs torch (frawdllm/__init__.py says such commands start
    fast): run with torch made unimportable, it trains and writes its tokenizer."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("to be or not to be, that is the question\n" * 50)
    script = ("import sys; sys.modules['torch'] = None\n"
              "from frawdllm.cli import main\n"
              "main(sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", script, "tokenizer", "train", "--data", str(corpus), "--kind", "char",
                          "--out", str(tmp_path / "tok")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_every_flag_a_help_names_is_a_flag_of_that_command():
    """`frawd chat --help` said "--stats shows what ran", a flag only `frawd generate` has. A
    flag of another command is named with it ("frawd generate --stats", "torchrun --standalone")."""
    import re

    import click
    from click.testing import CliRunner

    from frawdllm.cli import cli

    def commands(command, path):
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name="frawd")
            for name in command.list_commands(ctx):
                yield from commands(command.get_command(ctx, name), [*path, name])
        else:
            yield tuple(path), command

    every = dict(commands(cli, []))
    flags = {" ".join(path): {o for p in c.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
             for path, c in every.items()}
    wrong = []
    for path, command in every.items():
        text = re.sub(r"\s+", " ", CliRunner().invoke(cli, [*path, "--help"], terminal_width=1000).output)
        for found in re.finditer(r"(?<![\w-])--[a-z][a-z0-9-]*", text):
            before = text[max(0, found.start() - 40):found.start()]
            named = re.findall(r"frawd ((?:translate |tokenizer |data )?[a-z]+)|(torchrun)", before)
            other, torchrun = named[-1] if named else ("", "")
            if not torchrun and found.group() not in flags[other or " ".join(path)]:
                wrong.append(f"frawd {' '.join(path)} --help: {found.group()} ({before[-30:]}...)")
    assert not wrong, wrong
