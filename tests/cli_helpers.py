"""Running `frawd` in the test process and reading what it printed."""

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
