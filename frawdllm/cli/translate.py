"""`frawd translate`: train, evaluate and run encoder-decoder translation models."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from ..errors import FrawdError, counted
from ..train.translation_config import TranslateConfig  # (torch-free: the job is imported when run)
from .flags import dataclass_options
from .launch import nproc_option, relaunch_under_torchrun, train_on_this_rank
from .options import FiniteFloat, set_option
from .terminal import for_terminal


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def translate() -> None:
    """Translation with the encoder-decoder Transformer of "Attention Is All You Need".

    \b
    frawd translate train --src train.de --tgt train.en --valid-src val.de --valid-tgt val.en --out RUN
    frawd translate eval --model RUN/model --src test.de --ref test.en
    frawd translate run --model RUN/model "Ein Satz."
    """


@translate.command(context_settings={"max_content_width": 110})
@click.option("--config", "config_file", type=str, metavar="FILE", default=None,
              help="A YAML (or .toml) file of the options below (flags given here override it).")
@nproc_option()
@set_option()
# TrainConfig fields translate train does not use: batches are cut by --tokens-per-batch, and
# its samples translate validation sentences (no prompt)
@dataclass_options(TranslateConfig, skip=("batch_size", "sample_prompt"))
def train(config_file: str | None, overrides: tuple[str, ...], nproc: int | None, **flags) -> None:
    """Train a translation model on parallel text until a budget (--max-steps, --max-tokens,
    --max-time) is spent.

    --src/--tgt are parallel files, one sentence a line (gzip read transparently). A joint
    BPE tokenizer is trained on both sides unless --tokenizer gives one. Pairs with an
    empty side or a side longer than --max-len tokens are skipped (and counted). Batches
    hold about --tokens-per-batch tokens of similar-length sentences; the loss is
    label-smoothed cross-entropy over real target tokens; the learning rate follows the
    paper's inverse square root (noam). Each evaluation logs val_loss and val_bleu (greedy,
    sacreBLEU) to OUT/metrics.jsonl. OUT/model is the best model by validation loss.

    \b
    Example:
      frawd translate train --src train.de.gz --tgt train.en.gz --valid-src val.de.gz \\
          --valid-tgt val.en.gz --preset aiayn-tiny --max-time 30m --out runs/de-en
      frawd translate train --nproc 4 --src train.de.gz --tgt train.en.gz --max-time 1h --out runs/de-en-4
    """
    from ..config import Seq2SeqConfig, parse_overrides
    from ..train.config import build_config
    from . import command_started_at
    from ..train.translation import check_translation, run_translation_training

    started_at = command_started_at()
    cfg = build_config(TranslateConfig, config_file, flags, parse_overrides(Seq2SeqConfig, list(overrides)))
    if nproc is not None:
        _require_files(cfg)
        check_translation(cfg)  # bad flags or data: one line here, not one per rank
        relaunch_under_torchrun(nproc, cfg, token_batches=True)
    train_on_this_rank(lambda: run_translation_training(cfg, started_at=started_at), "translate train", cfg)


def _require_files(cfg: TranslateConfig) -> None:
    """Under --nproc every rank reads the text itself: a pipe (`<(...)`) can be read only once."""
    for flag, path in (("--src", cfg.src), ("--tgt", cfg.tgt), ("--valid-src", cfg.valid_src),
                       ("--valid-tgt", cfg.valid_tgt)):
        if path and Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():
            raise FrawdError(f"{flag} {path} is a pipe or device, which the --nproc ranks cannot each read; "
                             "give a file")


def _decoding_options(batch_help: str):
    """--model, --beam, --alpha and --batch-size (whose help names the command's own input)."""
    def add(command):
        command = click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True,
                               help=batch_help)(command)
        command = click.option("--alpha", type=FiniteFloat(min=0), default=0.6, show_default=True,
                               help="Length penalty exponent of beam search (the paper's 0.6).")(command)
        command = click.option("--beam", type=click.IntRange(min=1), default=4, show_default=True,
                               help="Beam size (1 = greedy; at most the model's vocabulary size).")(command)
        return click.option("--model", "model_dir", required=True, metavar="DIR",
                            help="A model directory (frawd translate train's OUT/model).")(command)
    return add


def _load(model_dir: str):
    from ..model import Seq2SeqTransformer
    from ..modeldir import TOKENIZER_FILE, load_model, model_file
    from ..tokenizer import Tokenizer

    model = load_model(model_dir, kind="seq2seq")
    assert isinstance(model, Seq2SeqTransformer)
    path = model_file(model_dir, TOKENIZER_FILE)
    tokenizer = Tokenizer.load(path).check_fits(model.config.vocab_size, model_dir)
    # (one of another model's, copied in, decoded garbage: ids 0, 2 and 3 meant other tokens)
    tokenizer.require_frawd_specials(str(path), "which translation pads, starts and ends sentences with")
    return model.eval(), tokenizer


class _Translator:
    """Sentences in, translations out; empty and over-long sentences give an empty line (counted)."""

    def __init__(self, model_dir: str, beam: int, alpha: float, batch_size: int) -> None:
        self.model, self.tokenizer = _load(model_dir)
        self.beam, self.alpha, self.batch_size = beam, alpha, batch_size
        self.limit = self.model.config.context_length
        self.empty = self.too_long = 0
        vocab = self.model.config.vocab_size
        if beam > vocab:
            raise FrawdError(f"--beam {beam} exceeds the model's vocabulary size ({vocab} tokens)")

    def _check_memory(self, sentences: int, src_len: int) -> None:
        """Refuse, before any is decoded, batches whose beams would not fit in memory."""
        from ..infer.translate import decoding_memory_problem

        problem = decoding_memory_problem(self.model, min(sentences, self.batch_size), self.beam, src_len)
        if problem:
            raise FrawdError(f"--beam {self.beam} with --batch-size {self.batch_size}: {problem}; lower --beam "
                             "or --batch-size")

    def __call__(self, sentences: list[str], announce: str | None = None) -> list[str]:
        """Their translations; `announce`: a line for stderr once they pass the checks."""
        from ..train.translation import translate_texts

        from ..data.parallel import sentences as stripped

        ids = self.tokenizer.encode_batch(stripped(sentences))
        usable = []
        for i, (text, row) in enumerate(zip(sentences, ids)):
            if not text.strip():
                self.empty += 1
            elif len(row) > self.limit:
                self.too_long += 1
            else:
                usable.append(i)
        if usable:
            self._check_memory(len(usable), max(len(ids[i]) for i in usable))
        if announce:
            click.echo(announce, err=True)
        out = [""] * len(sentences)
        for i, hyp in zip(usable, translate_texts(self.model, self.tokenizer, [ids[i] for i in usable],
                                                  self.beam, self.alpha, self.batch_size)):
            out[i] = hyp
        return out

    def report(self) -> None:
        if self.empty:
            click.echo(f"{counted(self.empty, 'empty source line')}: left empty", err=True)
        if self.too_long:
            click.echo(f"{counted(self.too_long, 'source line')} longer than the model's context_length ({self.limit} "
                       "tokens): not translated (empty lines)", err=True)


def _check_output_file(path: str, flag: str, overwrite: bool, inputs: dict[str, str]) -> None:
    """Refuse, before any work, an output file that must not or cannot be written: one of
    the `inputs` ({flag: path}), an existing file without --overwrite, a place where nothing
    can be written. Its missing folders are made only when it is written (bad input found
    meanwhile leaves nothing behind); that they can be is tried now, in the nearest folder
    that exists (asking `os.access` is not enough: root passes it, and it cannot tell a
    folder that refuses subfolders)."""
    import tempfile

    target = Path(path)
    if target.is_dir():
        raise FrawdError(f"{flag} {path} is a folder; give a file name")
    for input_flag, input_path in inputs.items():
        if target.resolve() == Path(input_path).resolve() or (
                target.exists() and Path(input_path).exists() and os.path.samefile(target, input_path)):
            raise FrawdError(f"{flag} {path} is the {input_flag} file; give another file name")
    if target.is_file() and not overwrite:
        raise FrawdError(f"{flag} {path} exists; give a new file name (or --overwrite to replace it)")
    if target.exists() and not target.is_file():  # a device or pipe (/dev/stdout): written into
        return
    folder = target.absolute().parent
    nearest = next(above for above in (folder, *folder.parents) if above.exists())
    if not nearest.is_dir():
        raise FrawdError(f"{flag} {path}: {nearest} is not a folder")
    try:
        if nearest == folder:
            with tempfile.TemporaryFile(dir=folder):
                pass
        else:
            tempfile.TemporaryDirectory(dir=nearest).cleanup()
    except OSError as error:
        raise FrawdError(f"{flag} {path}: cannot write there ({(error.strerror or str(error)).lower()})") from None


def _write_output(path: Path, text: str, overwrite: bool) -> None:
    """A file written whole or not at all (its missing folders made now); a device or pipe
    that exists (/dev/stdout, a FIFO) is written into, not replaced; without `overwrite` a
    file another process wrote there meanwhile is refused."""
    from ..io import write_text_atomic

    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        write_text_atomic(path, text, replace=overwrite)


def _stdin_lines() -> Iterator[str]:
    """Standard input line by line, read as bytes so that a line that is not UTF-8 is named."""
    from ..data.parallel import decode_utf8
    from ..data.sources import BOM

    for number, raw in enumerate(sys.stdin.buffer, start=1):
        line = decode_utf8(raw, "stdin", number).rstrip("\r\n")
        yield line.removeprefix(BOM) if number == 1 else line


@translate.command(name="eval")
@_decoding_options("Sentences of --src translated together.")
@click.option("--src", "src_path", required=True, metavar="FILE", help="Source sentences.")
@click.option("--ref", "ref_path", required=True, metavar="FILE",
              help="Raw reference translations, line i for line i of --src.")
@click.option("--hyp-out", default=None, metavar="FILE",
              help="Also write the translations here (a new file; never --src or --ref).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --hyp-out file.")
def evaluate(model_dir: str, beam: int, alpha: float, batch_size: int, src_path: str, ref_path: str,
             hyp_out: str | None, overwrite: bool) -> None:
    """Translate --src and score it against --ref with sacreBLEU (cased, 13a tokenization,
    on detokenized output and raw references): prints sacreBLEU's `BLEU = ...` line, its
    signature, and chrF."""
    from sacrebleu.metrics import BLEU, CHRF

    from ..data.parallel import read_parallel

    if hyp_out is not None:
        _check_output_file(hyp_out, "--hyp-out", overwrite, {"--src": src_path, "--ref": ref_path})
    sources, references = read_parallel(src_path, ref_path)
    translator = _Translator(model_dir, beam, alpha, batch_size)
    hyps = translator(sources, announce=f"translating {len(sources):,} sentences (beam {beam})...")
    translator.report()
    if hyp_out is not None:
        _write_output(Path(hyp_out), "".join(h + "\n" for h in hyps), overwrite)
    bleu, chrf = BLEU(), CHRF()
    click.echo(str(bleu.corpus_score(hyps, [references])))
    click.echo(f"signature: {bleu.get_signature()}")
    click.echo(str(chrf.corpus_score(hyps, [references])))
    click.echo(f"signature: {chrf.get_signature()}")


@translate.command()
@_decoding_options("SENTENCES translated together (standard input is translated a line at a time).")
@click.argument("sentences", nargs=-1)
def run(model_dir: str, beam: int, alpha: float, batch_size: int, sentences: tuple[str, ...]) -> None:
    """Translate SENTENCES (one output line each), or, when none is given, standard input
    line by line: each translation is printed as soon as its line is read."""
    from ..errors import check_unicode

    for i, text in enumerate(sentences, start=1):
        check_unicode(text, f"sentence {i}")  # invalid UTF-8 on the command line
    translator = _Translator(model_dir, beam, alpha, batch_size)
    if sentences:
        for line in translator(list(sentences)):
            click.echo(for_terminal(line))
    else:
        if sys.stdin.isatty():
            click.echo("type a sentence and Enter to translate it; Ctrl-D to end", err=True)
        for line in _stdin_lines():
            click.echo(for_terminal(translator([line])[0]))
            sys.stdout.flush()
    translator.report()
