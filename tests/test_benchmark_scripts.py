"""The benchmark scripts' option checks, which need no measuring: what a user's mistake gets
before any work (the measurements themselves are the scripts' business, not the suite's)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def bench(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_align_demo_refuses_more_different_words_than_the_lengths_allow(tmp_path):
    """It drew distinct random words until it had enough: with 1-letter words (26) it looped
    forever, after pretraining the base model."""
    done = bench("align_demo.py", "--skip-stdlib", "--min-letters", "1", "--max-letters", "1", "--work",
                 str(tmp_path / "w"), cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(
        "align_demo.py: error: 200 test + --sft-examples 6000 + --dpo-examples 1000 different words need 7,200, "
        "but words of 1..1 letters are only 26"), done.stderr
    assert not (tmp_path / "w").exists()


def test_shakespeare_char_reads_relative_paths_from_where_it_is_run(tmp_path):
    """It moved to the repository before reading them: `--config my.yaml` in the current folder
    was "not found", and a relative `--out` went into the repository."""
    (tmp_path / "my.yaml").write_text("no_such_field: 1\n", encoding="utf-8")
    done = bench("shakespeare_char.py", "--config", "my.yaml", "--out", "run", cwd=tmp_path)
    assert done.returncode == 1 and str(tmp_path / "my.yaml") in done.stderr and "no_such_field" in done.stderr, \
        done.stderr
    assert "not found" not in done.stderr and not (ROOT / "run").exists()
