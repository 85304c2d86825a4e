"""Benchmark: `frawd data prepare` throughput against bare `tokenizers` encode_batch.

On the stdlib corpus (default) with an 8192-token byte-level BPE trained here:

- bare: `tokenizers.Tokenizer.encode_batch` over all documents already in memory, on all
  cores (the practical limit of tokenization alone);
- prepare: `prepare_shards` (the code `frawd data prepare` runs) end to end: listing and
  reading the files, hashing the inputs, tokenizing, writing train.bin/val.bin/meta.json;
- bare_fast: `encode_batch_fast` (no character offsets; what prepare calls), for reference;
- cli: the `frawd data prepare` command in a fresh process (adds interpreter start-up
  and imports; reported, not part of the ratio).

Bare and prepare runs alternate; figures are medians. MB are UTF-8 bytes of document text.

    .venv/bin/python benchmarks/data_prepare.py [--data stdlib] [--repeats 3]

Prints key=value lines; the last is prepare_vs_bare_ratio=<prepare MB/s / bare MB/s>.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import ArgumentParser, cpu_features_line, positive_int, run_main
from frawdllm.data import iter_documents, prepare_shards
from frawdllm.tokenizer import train_tokenizer


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="stdlib",
                        help="the corpus, as `frawd data prepare --data` takes it: stdlib, hf:NAME, a file, "
                             "a folder or a glob [default: stdlib]")
    parser.add_argument("--vocab-size", type=positive_int, default=8192,
                        help="size of the BPE vocabulary trained here [default: 8192]")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs of bare and prepare, alternating; figures are medians [default: 3]")
    args = parser.parse_args()

    docs = list(iter_documents(args.data))
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    print(f"corpus={args.data}")
    print(f"corpus_mb={text_mb:.3f}")
    print(f"documents={len(docs)}")
    print(f"cpu_threads={os.cpu_count()}")
    print(cpu_features_line())

    start = time.perf_counter()
    tok = train_tokenizer(docs, "bpe", vocab_size=args.vocab_size)
    print(f"bpe_vocab_size={tok.vocab_size}")
    print(f"bpe_train_seconds={time.perf_counter() - start:.3f}")

    with tempfile.TemporaryDirectory() as work:
        tok_path = Path(work) / "tokenizer.json"
        tok.save(tok_path)
        bare_backend = tok.backend  # the plain tokenizers.Tokenizer
        bare_backend.encode_batch(docs[:50], add_special_tokens=False)  # start the thread pool
        bare, bare_fast, prep = [], [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            bare_backend.encode_batch(docs, add_special_tokens=False)
            bare.append(time.perf_counter() - start)
            start = time.perf_counter()
            bare_backend.encode_batch_fast(docs, add_special_tokens=False)
            bare_fast.append(time.perf_counter() - start)
            start = time.perf_counter()
            meta = prepare_shards(args.data, str(tok_path), Path(work) / "shards", force=True)
            prep.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "from frawdllm.cli import main; main()", "data", "prepare",
                        "--data", args.data, "--tokenizer", str(tok_path), "--out", str(Path(work) / "cli"),
                        "--force"], check=True, capture_output=True)
        cli_seconds = time.perf_counter() - start

    bare_s, fast_s, prep_s = statistics.median(bare), statistics.median(bare_fast), statistics.median(prep)
    print(f"train_tokens={meta['train_tokens']}")
    print(f"val_tokens={meta['val_tokens']}")
    print(f"bare_encode_batch_seconds={bare_s:.3f}")
    print(f"bare_encode_batch_mb_per_s={text_mb / bare_s:.3f}")
    print(f"bare_encode_batch_fast_seconds={fast_s:.3f}")
    print(f"bare_encode_batch_fast_mb_per_s={text_mb / fast_s:.3f}")
    print(f"prepare_seconds={prep_s:.3f}")
    print(f"prepare_mb_per_s={text_mb / prep_s:.3f}")
    print(f"cli_prepare_wall_seconds={cli_seconds:.3f}")
    print(f"cli_prepare_mb_per_s={text_mb / cli_seconds:.3f}")
    print(f"prepare_vs_bare_fast_ratio={fast_s / prep_s:.3f}")
    print(f"prepare_vs_bare_ratio={bare_s / prep_s:.3f}")


if __name__ == "__main__":
    run_main(main)
