"""What a command costs before and after its work: only a run that compiles imports
`torch._dynamo` and inductor (~2 s to import and ~0.5 s more to tear down at exit, on a
2-core CPU), and Python's collections at exit are skipped."""

import subprocess
import sys

from align_helpers import byte_tokenizer
from conftest import ROOT

from frawdllm import FrawdLLM, get_config

COMPILER = "sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor')))"


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_the_package_does_not_import_the_compiler():
    code = ("import sys; import frawdllm.cli, frawdllm.train.loop, frawdllm.infer.engine, frawdllm.model; "
            f"print({COMPILER})")
    assert _run(code) == "[]"


def test_a_generate_command_does_not_import_the_compiler(tmp_path):
    # (building a model on the meta device to check the weights' shapes did: meta kernels
    # are Python functions that import dynamo on their first call)
    tok = byte_tokenizer()
    FrawdLLM(get_config("tiny-llama", vocab_size=tok.vocab_size, n_layer=1, n_embd=32, n_head=2, n_kv_head=1,
                        context_length=32)).save_pretrained(tmp_path, tokenizer=tok)
    code = ("import atexit, sys; "
            f"sys.argv = ['frawd', 'generate', '--model', {str(tmp_path)!r}, '--prompt', 'ab', '--max-new-tokens', '4']; "
            f"atexit.register(lambda: print({COMPILER})); "
            "from frawdllm.cli import main; main()")
    assert _run(code).splitlines()[-1] == "[]"


def test_a_command_freezes_the_collector_as_it_ends():
    code = ("import gc, sys, atexit; sys.argv = ['frawd', '--version']; "
            "atexit.register(lambda: print(gc.get_freeze_count() > 0)); "
            "from frawdllm.cli import main; main()")
    assert _run(code).splitlines()[-1] == "True"
