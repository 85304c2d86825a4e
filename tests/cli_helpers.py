"""Running `frawd` in the test process and reading what it printed; running a user's script."""

import subprocess
import sys

from frawdllm.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `frawd ARGS` run in this process."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def script_lines(script: str) -> list[str]:
    """The lines a Python script prints, run in a fresh interpreter: as a user's script runs,
    without the tests' run-time type checks (which would refuse some misuse first)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()
