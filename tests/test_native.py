"""The native C forward (frawdllm/infer/native.c) against PyTorch's full forward.

Prefill (several tokens per row, left padding) and decode steps, every architecture,
shapes that are not multiples of the C code's vector and tile widths, fp32 and fp16
weights, threads, the rebuild after a weight change, and the ways it says no.
"""

import os
import signal
import threading
import time

import pytest
import torch

from frawdllm import FrawdLLM, cbuild, get_config
from frawdllm.errors import FrawdError
from frawdllm.infer import Engine, KVCache, SamplingParams, native, paths, quantize_int8
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from test_engine import CONFIGS, IdTokenizer, make_model

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no native forward: {native.unavailable_reason()}")
WEIGHTS = ["fp32", pytest.param("fp16", marks=pytest.mark.skipif(not native.has_fp16(), reason="no F16C"))]

SHAPES = {  # widths around the C code's 8- or 16-float vectors and 64-output tiles
    "small": dict(n_embd=32, n_head=4),  # every product narrower than a tile
    "odd": dict(n_embd=48, n_head=4, vocab_size=131),  # head_dim 12: scalar attention; 131: a partial vector
    "wide": dict(n_embd=160, n_head=5, vocab_size=300),  # full tiles plus partial ones
}


def padded_prompts(lengths, vocab, seed=0):
    """Left-padded ids, positions and the valid mask, as the engine builds them."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(7, vocab, (n,), generator=gen)
    pad = torch.tensor([width - n for n in lengths])[:, None]
    slots = torch.arange(width)[None, :]
    return ids, (slots - pad).clamp(min=0), slots >= pad


@torch.no_grad()
def full_logits(model, ids_row):
    return model(torch.tensor([ids_row]))[0][0, -1]


@torch.no_grad()
def check_against_full_forward(model, weights, lengths=(5, 9, 1), steps=6, threads=1, atol=1e-5, amx_rows=None,
                               kv_dtype=torch.float32):
    """Prefill ragged rows, decode a few steps; every row's logits equal the full forward.
    `amx_rows`: products of at least that many rows on AMX tiles (else as timed)."""
    decoder = native.NativeDecoder(model, weights, amx_rows=amx_rows)
    assert amx_rows is None or decoder.amx_rows == amx_rows
    ref = native.fp16_rounded_copy(model) if weights == "fp16" else model
    cfg = model.config
    ids, positions, valid = padded_prompts(lengths, cfg.vocab_size)
    cache = KVCache(cfg, len(lengths), ids.shape[1] + steps, dtype=kv_dtype)
    cache.begin(ids.shape[1], valid=valid)
    logits = decoder.forward(ids, positions, cache, threads=threads).clone()
    seqs = [ids[r, ids.shape[1] - n:].tolist() for r, n in enumerate(lengths)]
    for step in range(steps + 1):
        for r, seq in enumerate(seqs):
            torch.testing.assert_close(logits[r], full_logits(ref, seq), atol=atol, rtol=0)
        if step == steps:
            break
        tokens = logits.argmax(-1)
        for r, seq in enumerate(seqs):
            seq.append(int(tokens[r]))
        cache.begin(1)
        positions = torch.tensor([[len(s) - 1] for s in seqs])
        logits = decoder.forward(tokens[:, None], positions, cache, threads=threads).clone()
    return decoder


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_logits_equal_the_full_forward(name, weights):
    check_against_full_forward(make_model(std=0.2, **CONFIGS[name]), weights)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["learned", "llama", "post-ln"])
def test_widths_that_are_not_multiples_of_vectors_or_tiles(name, shape):
    overrides = {**CONFIGS[name], **SHAPES[shape]}
    if overrides.get("n_kv_head", 1) > 1:
        overrides["n_kv_head"] = 1 if shape == "wide" else 2  # n_head 5 is only divisible by 1 and 5
    torch.manual_seed(0)
    cfg = get_config("tiny", n_layer=2, context_length=48, **{"vocab_size": 97, **overrides})
    model = FrawdLLM(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)  # biases and norm gains too
    check_against_full_forward(model, "fp32")


@pytest.mark.parametrize("lengths", [(4, 7), (4, 7, 1, 3, 9, 2, 5, 6, 8)])
def test_threads_split_the_work_without_changing_a_bit(lengths):
    """One thread, or several taking the tiles and attention tasks of a phase from a queue
    (in whatever order they come): the same bits."""
    model = make_model(std=0.2, **CONFIGS["rope-gqa"])
    decoder = native.NativeDecoder(model)
    ids, positions, valid = padded_prompts(lengths, model.config.vocab_size)
    out = []
    for threads in (1, 3, 2):
        cache = KVCache(model.config, len(lengths), 16)
        cache.begin(ids.shape[1], valid=valid)
        first = decoder.forward(ids, positions, cache, threads=threads).clone()
        cache.begin(1)
        second = decoder.forward(first.argmax(-1)[:, None], positions[:, -1:] + 1, cache, threads=threads).clone()
        out.append((first, second, cache.k[1].clone()))
    for results in out[1:]:
        for a, b in zip(out[0], results):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["rope-gqa", "post-ln"])
def test_a_thread_that_falls_behind_finds_the_work_done(name):
    """A thread the OS preempts costs the others only the item it holds: they take the rest of
    each phase and go on. Here every thread but the first sleeps 2 ms as it begins phase k of
    each forward (k = 0, 4, 9: before the first product, at attention, in a later layer),
    called from the main thread (OpenMP's team) and from another (native.c's own), in a
    prefill of 3 rows (AMX where there is one) and a decode step: the late thread finds the
    phases that ended meanwhile done, joins the one under way, and the results are the
    one-thread bits."""
    model = make_model(std=0.2, **CONFIGS[name])
    decoder = native.NativeDecoder(model, "fp16", amx_rows=2 if native.has_amx() else None)
    lengths = (5, 40, 17)
    ids, positions, valid = padded_prompts(lengths, model.config.vocab_size)

    def run(threads):
        cache = KVCache(model.config, len(lengths), 48, dtype=torch.float16)
        cache.begin(ids.shape[1], valid=valid)
        first = decoder.forward(ids, positions, cache, threads=threads).clone()
        cache.begin(1)
        return first, decoder.forward(first.argmax(-1)[:, None], positions[:, -1:] + 1, cache, threads=threads).clone()

    expected = run(1)
    lib = native.library()
    for phase in (0, 4, 9):
        lib.frawd_test_late_threads(2000, phase)
        try:
            on_main = run(2)
            elsewhere: list = []
            caller = threading.Thread(target=lambda: elsewhere.append(run(2)))
            caller.start()
            caller.join(60)
        finally:
            lib.frawd_test_late_threads(0, 0)
        for got in (on_main, elsewhere[0]):
            for a, b in zip(expected, got):
                assert torch.equal(a, b)


def test_callers_on_other_threads_and_in_a_forked_child_get_the_same_bits():
    """Beside the main thread (OpenMP's team, torch's), native.c's own team of threads serves
    every other calling thread, one forward at a time (here four Python threads and two
    decoders at once), and a forked child starts a team of its own (the parent's threads do
    not exist there)."""
    model = make_model(std=0.2, **CONFIGS["rope-gqa"])
    decoders = [native.NativeDecoder(model), native.NativeDecoder(model)]
    ids, positions, valid = padded_prompts((4, 7, 2), model.config.vocab_size)

    def run(decoder, threads):
        cache = KVCache(model.config, 3, 16)
        cache.begin(ids.shape[1], valid=valid)
        return decoder.forward(ids, positions, cache, threads=threads).clone()

    expected = run(decoders[0], 1)
    assert torch.equal(run(decoders[0], 2), expected)  # (this thread's OpenMP team, before the fork)
    results: dict[int, list] = {}
    callers = [threading.Thread(target=lambda i=i: results.__setitem__(i, [run(decoders[i % 2], 2) for _ in range(25)]))
               for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(torch.equal(out, expected) for outs in results.values() for out in outs)

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: forwards from its main thread and from a new one; answers through the pipe
        try:
            out = [run(decoders[0], 2)]  # (the parent's main thread ran OpenMP forwards: that team is gone)
            caller = threading.Thread(target=lambda: out.append(run(decoders[0], 2)))
            caller.start()
            caller.join()
            os.write(write, b"same" if len(out) == 2 and all(torch.equal(o, expected) for o in out) else b"different")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's forward did not finish within 60 s")
        time.sleep(0.02)
    with os.fdopen(read, "rb") as answer:
        assert answer.read() == b"same"


def test_the_tiny_preset_with_two_threads_equals_pytorch():
    torch.manual_seed(0)
    check_against_full_forward(FrawdLLM(get_config("tiny")).eval(), "fp32", lengths=(40, 3), steps=3, threads=2)


@pytest.mark.skipif(not native.has_fp16(), reason="no F16C")
def test_fp16_weights_stay_close_to_fp32():
    model = make_model(std=0.2, **CONFIGS["learned"])
    outs = {}
    for weights in ("fp32", "fp16"):
        cache = KVCache(model.config, 1, 16)
        cache.begin(6)
        ids = torch.arange(7, 13)[None]
        outs[weights] = native.NativeDecoder(model, weights).forward(ids, torch.arange(6)[None], cache).clone()
    diff = (outs["fp32"] - outs["fp16"]).abs().max()
    assert 0 < diff < 1e-2  # fp16 rounding (relative 2^-11 per weight) shows, but only just


def test_engine_rebuilds_the_decoder_after_the_weights_change():
    model = make_model(**CONFIGS["rope"])
    engine = Engine(model, IdTokenizer())
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate([[9, 10, 11]], params)[0].tokens
    assert engine.native_decoder() is engine.native_decoder()  # reused while nothing changes
    with torch.no_grad():
        model.blocks[0].mlp.up.weight.mul_(-1.0)  # in place: same pointer, new version
    after = engine.generate([[9, 10, 11]], params)[0].tokens
    assert after != before
    assert after == Engine(model, IdTokenizer()).generate([[9, 10, 11]], params)[0].tokens


@pytest.mark.parametrize("update", ["fused AdamW step", "through .data", "the bias alone"])
def test_engine_sees_weight_updates_that_leave_the_version_counter_alone(update):
    """torch's fused AdamW and writes through `.data` do not bump a tensor's version: the
    decoder went on with its old copies of the linear weights (beside the new embeddings it
    points to), giving tokens of neither model."""
    torch.manual_seed(0)
    model = make_model(**CONFIGS["learned"])
    engine = Engine(model, IdTokenizer())
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate([[9, 10, 11]], params)[0].tokens
    if update == "fused AdamW step":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
        x = torch.randint(0, model.config.vocab_size, (2, 8))
        versions = [p._version for p in model.parameters()]
        model(x, x)[1].backward()
        optimizer.step()
        assert [p._version for p in model.parameters()] == versions  # what the version check missed
    elif update == "through .data":
        for p in model.parameters():
            p.data.mul_(-1.0)
    else:
        model.blocks[0].mlp.up.bias.data += 5.0
    after = engine.generate([[9, 10, 11]], params)[0].tokens
    assert after == Engine(model, IdTokenizer()).generate([[9, 10, 11]], params)[0].tokens
    assert after != before


def test_refresh_copies_again_after_a_data_write_the_probes_miss():
    """One row of the tied embedding written through `.data`: the version counter stays, the
    probes (16 values a tensor) miss it, and the LM head's packed copy kept the old row."""
    torch.manual_seed(0)
    model = make_model(**CONFIGS["learned"])
    engine = Engine(model, IdTokenizer(), native=True)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    before = engine.generate([[9, 10, 11]], params)[0].tokens
    model.lm_head.weight.data[before[0]] *= -3.0  # the first pick's row (tied: the embedding's too)
    engine.refresh()
    after = engine.generate([[9, 10, 11]], params)[0].tokens
    assert after == Engine(model, IdTokenizer(), native=True).generate([[9, 10, 11]], params)[0].tokens
    assert after != before


def test_models_it_cannot_run_use_pytorch_or_fail_clearly_when_native_is_required():
    bf16 = make_model(**CONFIGS["learned"]).to(torch.bfloat16)
    assert "bfloat16" in native.supports(bf16)
    assert not Engine(bf16, IdTokenizer()).native  # the default falls back
    with pytest.raises(FrawdError, match="native decoding is not possible: .*bfloat16"):
        Engine(bf16, IdTokenizer(), native=True)
    with pytest.raises(FrawdError, match="compile or native"):
        Engine(make_model(), IdTokenizer(), native=True, compile=True)
    with pytest.raises(FrawdError, match="weights must be one of"):
        Engine(make_model(), IdTokenizer(), weights="int4")


def test_out_of_range_tokens_and_positions_are_refused_before_any_work():
    model = make_model(**CONFIGS["learned"])
    decoder = native.NativeDecoder(model)
    cache = KVCache(model.config, 1, 8)
    cache.begin(2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.forward(torch.tensor([[5, 97]]), torch.tensor([[0, 1]]), cache)
    with pytest.raises(ValueError, match="past the model's context"):
        decoder.forward(torch.tensor([[5, 6]]), torch.tensor([[0, 48]]), cache)


def test_without_a_compiler_the_engine_falls_back_to_pytorch(tmp_path, monkeypatch):
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    assert not native.available()
    assert "no C compiler" in native.unavailable_reason()
    assert not Engine(make_model(), IdTokenizer()).native
    with pytest.raises(FrawdError, match="native decoding is not possible: no C compiler"):
        Engine(make_model(), IdTokenizer(), native=True)


def test_the_compiled_library_is_cached_and_built_atomically(tmp_path, monkeypatch):
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    assert native.available()
    built = sorted((tmp_path / "native").iterdir(), key=lambda p: p.suffix != ".so")
    # the library and its build lock (cbuild: concurrent builds compile once); no temporary file left behind
    assert [p.suffix for p in built] == [".so", ".lock"] and built[1].stem == built[0].stem
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    assert native.available() and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_an_unwritable_cache_builds_into_a_folder_of_the_process(tmp_path, monkeypatch, capsys):
    """A read-only home or a cache path that is a file: the C forward is built for this
    process rather than not at all (PyTorch instead is several times slower)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(blocker))
    (tmp_path / "process").mkdir()
    monkeypatch.setattr(cbuild, "_process_folder", tmp_path / "process", raising=False)
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    assert native.available()
    assert [p.suffix for p in (tmp_path / "process").iterdir()] == [".so"]
    assert capsys.readouterr().err == (f"compiling the native forward for this CPU (for this process only: cannot "
                                       f"write {blocker / 'native'}: Not a directory)...\n")


def test_a_build_with_nowhere_to_go_is_not_announced(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(blocker))
    monkeypatch.setattr(cbuild, "process_folder", lambda: blocker, raising=False)  # (nor can a temporary folder be)
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    assert not native.available()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("the native forward is unavailable (") and "Not a directory" in err[0]


@pytest.mark.parametrize("name", ["learned", "llama", "post-ln"])
def test_int8_models_run_natively_and_equal_their_dequantized_weights(name):
    model = quantize_int8(make_model(std=0.2, **CONFIGS[name]))
    assert native.supports(model) is None
    decoder = native.NativeDecoder(model)
    ref = native.dequantized_copy(model)
    ids, positions, valid = padded_prompts((6, 2), model.config.vocab_size)
    cache = KVCache(model.config, 2, 12)
    cache.begin(ids.shape[1], valid=valid)
    logits = decoder.forward(ids, positions, cache)
    for r, n in enumerate((6, 2)):
        torch.testing.assert_close(logits[r], full_logits(ref, ids[r, ids.shape[1] - n:].tolist()), atol=1e-5, rtol=0)


@pytest.mark.skipif(not native.has_fp16(), reason="no F16C")
@pytest.mark.parametrize("name, shape", [("learned", dict(n_embd=45, n_head=5)), ("llama", {})])
def test_every_stream_form_gives_the_same_bits(name, shape):
    """Batch-1 fp16 products convert 16 or 8 weights at a time and prefetch the weight
    stream with one of three hints (each decoder times them on its own weights): every
    form gives exactly the logits of the form chosen, which equal PyTorch on the
    fp16-rounded model. (45 inputs: an odd one left after the pairs; vocabulary 200: a
    partial last tile.)"""
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", n_layer=2, context_length=48, vocab_size=200,
                                **{"n_embd": 32, "n_head": 4, **CONFIGS[name], **shape})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    check_against_full_forward(model, "fp16", lengths=(1, 3), steps=5)  # (the chosen form)
    decoder = native.NativeDecoder(model, "fp16")
    results = []
    tokens = torch.tensor([[3, 9, 27, 81], [5, 7, 11, 13]])
    for hint, narrow, rows, kv in [(None,) * 4, (0, 0, 0, 1), (1, 0, 1, 0), (2, 0, 2, 1), (2, 1, 0, 0)]:
        if hint is not None:
            decoder.set_forms(hint, narrow, rows, decoder.amx_rows, kv)
        logits = []
        for batch in (tokens[:1], tokens):  # one row, then two (the many-row hint)
            cache = KVCache(model.config, len(batch), 8)
            for step in range(batch.shape[1]):
                cache.begin(1)
                logits.append(decoder.forward(batch[:, step:step + 1], torch.full((len(batch), 1), step),
                                              cache).clone())
        results.append(torch.cat(logits))
    for other in results[1:]:
        assert torch.equal(results[0], other)


def test_amx_planes_hold_each_fp16_weight_exactly_in_the_tile_layout():
    """wh + wl == the fp16-rounded weight, bit for bit (wh its bf16 rounding, wl the rest),
    placed where native.c's AMX products read it: per 16 outputs (padded to whole tiles),
    per 32 inputs, wh then wl, each 16 input pairs x 16 outputs x 2. (Runs everywhere: the
    layout is Python's.)"""
    torch.manual_seed(0)
    out, inputs, tile = 70, 64, 64
    weight = torch.randn(out, inputs) * torch.logspace(-6, 2, inputs)  # (magnitudes from fp16 subnormals up)
    planes = native.amx_planes(weight, tile)
    blocks = -(-out // tile) * tile // 16
    assert planes.dtype == torch.bfloat16 and planes.shape == (blocks, inputs // 32, 2, 16, 16, 2)
    flat = planes.view(-1)
    w16 = weight.to(torch.float16).float()
    for o, i in [(0, 0), (1, 0), (0, 1), (17, 33), (63, 63), (69, 40), (5, 62)]:
        at = ((o // 16 * (inputs // 32) + i // 32) * 2 * 16 * 16 + (i % 32) // 2 * 16 + o % 16) * 2 + i % 2
        hi, lo = flat[at], flat[at + 512]  # (wl: one plane, 16 x 16 x 2 values, further)
        assert hi == w16[o, i].to(torch.bfloat16)
        assert hi.float() + lo.float() == w16[o, i]
    assert planes[out // 16, :, :, :, out % 16:].abs().sum() == 0  # padding outputs are zero: in the
    assert planes[out // 16 + 1:].abs().sum() == 0  # partial 16-output block and in the blocks past it
    whole = planes.float().sum(dim=2)  # wh + wl, back to (outputs, inputs)
    whole = whole.permute(0, 3, 1, 2, 4).reshape(blocks * 16, inputs)
    assert torch.equal(whole[:out], w16)


def test_an_amx_row_count_below_zero_is_refused():
    model = make_model(std=0.2)
    with pytest.raises(ValueError, match="amx_rows must be a row count >= 0"):
        native.NativeDecoder(model, "fp32", amx_rows=-1)


@pytest.mark.skipif(not native.available() or not native.has_amx(), reason="no AMX (Intel Xeon since Sapphire Rapids)")
@pytest.mark.parametrize("name", CONFIGS)
def test_amx_products_equal_the_full_forward(name):
    """Products of 2 rows and more on AMX tiles (inputs split into three bf16 parts, weights
    into two: fp32-accurate sums in another order): ragged prefills of 3 to 240 rows (past
    the 128 rows split at a time) and decode batches of 3 to 40 rows (blocks of 32 rows and
    the 16 left) give the fp16 model's logits."""
    model = make_model(std=0.2, **CONFIGS[name])
    for lengths in [(5, 9, 1), (7,) * 8 + (30,) * 8, tuple(range(1, 41))]:
        check_against_full_forward(model, "fp16", lengths=lengths, steps=2, amx_rows=2, threads=2)


def test_positions_of_another_shape_and_a_cache_with_too_few_rows_are_refused():
    model = make_model(**CONFIGS["learned"])
    decoder = native.NativeDecoder(model)
    cache = KVCache(model.config, 1, 8)
    cache.begin(3)
    with pytest.raises(TypeError, match="same shape"):  # (it read past the positions; `forward`'s
        decoder._forward(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1]]), cache, None)  # annotations are checked in tests only)
    cache = KVCache(model.config, 1, 8)
    cache.begin(1)
    decoder.forward(torch.tensor([[5]]), torch.tensor([[0]]), cache)  # the decoder now points at this cache
    with pytest.raises(ValueError, match="at least batch 2"):  # (it wrote past the cache's one row)
        decoder.forward(torch.tensor([[5], [6]]), torch.tensor([[1], [1]]), cache)


def test_a_data_write_at_a_probed_entry_is_seen(monkeypatch):
    """The probes read 16 entries spread over each tensor (not its first 16): a `.data`
    write in the middle of a weight, at a probed entry, makes the copies stale."""
    model = make_model(**CONFIGS["learned"])
    decoder = native.NativeDecoder(model)
    flat = model.blocks[0].mlp.up.weight.data.view(-1)
    assert decoder.is_current(model)
    flat[flat.numel() // 16 * 8] += 1.0
    assert not decoder.is_current(model)


def test_a_model_with_a_short_context_times_its_forms_within_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))  # (no forms remembered: timed now)
    monkeypatch.setattr(paths, "machine_busy", lambda window=None: False)
    model = make_model(context_length=8, **CONFIGS["learned"])
    decoder = native.NativeDecoder(model)
    check_against_full_forward(model, decoder.weights, lengths=(3, 1), steps=4)


def test_stream_forms_are_timed_once_per_model_shape_and_say_what_they_are(tmp_path, monkeypatch):
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paths, "machine_busy", lambda window=None: False)
    timed = []
    fastest = native.NativeDecoder._fastest
    monkeypatch.setattr(native.NativeDecoder, "_fastest", lambda self, *a, **k: timed.append(a[2]) or fastest(self, *a, **k))
    model = FrawdLLM(get_config("tiny", n_layer=2, n_embd=64, n_head=4)).eval()
    amx_timed = []
    for weights in ("fp32", "fp16", "fp32", "fp16"):
        decoder = native.NativeDecoder(model, weights)
        one_row, batches, *more = decoder.stream_forms.split("; ")
        hint, *width = one_row.split(", ")
        assert hint.split()[0] == "prefetch" and hint.split()[1] in native.PREFETCH_HINTS
        assert width in ([], ["fp16 8 at a time"]) and (weights == "fp16" or not width)
        assert batches.split()[0] in native.PREFETCH_HINTS and batches.endswith(" in batches")
        assert more == ([f"AMX from {decoder.amx_rows} rows"] if decoder.amx_rows else []) + (
            [] if decoder.forms[4] else ["no cache prefetch"])
        assert not decoder.amx_rows or (weights == "fp16" and decoder.amx_rows in native.AMX_ROWS)
        assert bool(decoder._planes) == bool(decoder.amx_rows)  # (planes freed where AMX does not pay)
        if weights == "fp16" and not amx_timed:
            amx_timed = timed[5:-1]  # fp32, then fp16: one row, 8 rows, AMX's row counts, the cache prefetch
    # once per weight type: one row, 8 rows, (AMX,) 32 rows for the cache prefetch
    assert timed == [1, 8, 32, 1, 8, *amx_timed, 32]
    if native.has_amx():  # from 32 rows down while AMX keeps winning
        assert amx_timed and amx_timed == list(native.AMX_ROWS[:len(amx_timed)])
    else:
        assert amx_timed == []


@pytest.mark.parametrize("weights", WEIGHTS)
def test_one_row_steps_equal_the_general_forward(weights):
    """`RowStep` (batch-1 decoding with nothing built per step) gives the logits and cache
    contents of `NativeDecoder.forward`, bit for bit, at one and two threads."""
    model = make_model(std=0.2, **CONFIGS["llama"], vocab_size=150)
    decoder = native.NativeDecoder(model, weights)
    prompt = torch.tensor([[5, 17, 2, 40, 11]])
    caches = [KVCache(model.config, 1, 16) for _ in range(2)]
    for cache in caches:
        cache.begin(prompt.shape[1])
        decoder.forward(prompt, torch.arange(5)[None], cache)
    step = native.RowStep(decoder, caches[1])
    for i, (token, threads) in enumerate([(7, 1), (99, 2), (3, 2), (60, 1)]):
        for cache in caches:
            cache.begin(1)
        expected = decoder.forward(torch.tensor([[token]]), torch.tensor([[5 + i]]), caches[0], threads)
        got = step(token, 5 + i, 5 + i, threads)
        assert torch.equal(got, expected)
    for a, b in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v)):
        assert torch.equal(a, b)
    assert torch.equal(caches[0].valid, caches[1].valid)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        step(150, 9, 9, 1)


FP16 = pytest.mark.skipif(not native.has_fp16(), reason="no F16C")


@FP16
@pytest.mark.parametrize("shape", ["vectors", "scalars"])
@pytest.mark.parametrize("name", ["rope-gqa", "post-ln", "llama"])
def test_an_fp16_kv_cache_equals_pytorch_through_the_same_cache(name, shape):
    """Keys and values stored as fp16 (rounded once, read back exactly): prefill of ragged,
    left-padded rows and decode steps give PyTorch's logits through a KVCache of the same
    dtype, and layer 0's stored keys are exactly the fp16 rounding of the fp32 cache's.
    (fp16: 5e-4 of logits ~3: a key within float rounding of an fp16 boundary can round
    either way on the two sides, which moves a logit by up to ~3e-4 here; a wrong slot or
    conversion moves them by O(1).)"""
    torch.manual_seed(0)
    # head_dim 32: whole 8- or 16-float vectors of keys and values; 12: one element at a time
    width = {"n_embd": 64, "n_head": 2} if shape == "vectors" else {"n_embd": 48, "n_head": 4}
    model = FrawdLLM(get_config("tiny", n_layer=2, context_length=24, vocab_size=97,
                                **{**CONFIGS[name], **width})).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.1)
    decoder = native.NativeDecoder(model, "fp32")
    ids, positions, valid = padded_prompts((6, 2, 4), model.config.vocab_size)
    caches = {}
    for dtype, atol in ((torch.float32, 2e-5), (torch.float16, 5e-4)):
        ours, theirs = caches[dtype] = [KVCache(model.config, 3, 10, dtype=dtype) for _ in range(2)]
        for cache in (ours, theirs):
            cache.begin(ids.shape[1], valid=valid)
        with torch.inference_mode():
            got = decoder.forward(ids, positions, ours)
            torch.testing.assert_close(got, paths.torch_logits(model, ids, positions, theirs), atol=atol, rtol=0)
            for step in range(3):
                tokens, step_positions = got.argmax(-1)[:, None], positions[:, -1:] + 1 + step
                for cache in (ours, theirs):
                    cache.begin(1)
                got = decoder.forward(tokens, step_positions, ours)
                torch.testing.assert_close(got, paths.torch_logits(model, tokens, step_positions, theirs),
                                           atol=atol, rtol=0)
    half, full = caches[torch.float16][0], caches[torch.float32][0]
    assert half.k[0].dtype == torch.float16
    filled = ids.shape[1]  # the prefill's slots: computed alike before any rounding reaches them
    assert torch.equal(half.k[0][:, :, :filled], full.k[0][:, :, :filled].half())
    assert torch.equal(half.v[0][:, :, :filled], full.v[0][:, :, :filled].half())


@FP16
def test_one_row_steps_on_an_fp16_cache_equal_the_general_forward():
    torch.manual_seed(0)  # head_dim 32: whole vectors of keys and values
    model = FrawdLLM(get_config("tiny", n_layer=2, n_embd=64, n_head=2, context_length=24, vocab_size=150,
                                **{**CONFIGS["llama"], "n_kv_head": 1})).eval()
    decoder = native.NativeDecoder(model, "fp16")
    caches = [KVCache(model.config, 1, 12, dtype=torch.float16) for _ in range(2)]
    for cache in caches:
        cache.begin(4)
        decoder.forward(torch.tensor([[5, 17, 2, 40]]), torch.arange(4)[None], cache)
    step = native.RowStep(decoder, caches[1])
    for i, (token, threads) in enumerate([(7, 1), (99, 2), (3, 2)]):
        for cache in caches:
            cache.begin(1)
        expected = decoder.forward(torch.tensor([[token]]), torch.tensor([[4 + i]]), caches[0], threads)
        assert torch.equal(step(token, 4 + i, 4 + i, threads), expected)
    for a, b in zip((*caches[0].k, *caches[0].v), (*caches[1].k, *caches[1].v)):
        assert torch.equal(a, b)


@pytest.mark.skipif(not native.has_fp16(), reason="no F16C")
@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_step_whose_keys_pass_fp16s_range_fails_clearly(rows):
    """One token's embedding is huge: prompts without it fit the fp16 cache; a decode step
    (the general forward and the one-row step) that feeds it fails with one clear error
    instead of caching inf. An fp32 cache takes the same step."""
    torch.manual_seed(0)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=64, n_head=2, context_length=24, vocab_size=150,
                                **CONFIGS["learned"])).eval()
    with torch.no_grad():  # token 99 = e, a +-1 pattern of mean 0 (its own norm); every key row = 1500 e:
        e = torch.tensor([1.0, -1.0] * 32)  # 99's keys are 1500 * 64 = 96000, past fp16's 65504;
        model.embed.tok.weight[99] = e  # another token's are 1500 * 8 * N(0, 1)
        model.blocks[0].attn.qkv.weight[64:128] = 1500 * e
    decoder = native.NativeDecoder(model, "fp16")
    exact = native.NativeDecoder(model, "fp32")
    for weights, dtype in ((decoder, torch.float16), (exact, torch.float32)):
        cache = KVCache(model.config, rows, 12, dtype=dtype)
        cache.begin(3)
        weights.forward(torch.tensor([[5, 17, 2]] * rows), torch.arange(3).expand(rows, 3), cache)
        cache.begin(1)
        step = lambda: weights.forward(torch.tensor([[99]] * rows), torch.full((rows, 1), 3), cache)  # noqa: E731
        if dtype == torch.float32:
            assert torch.isfinite(step()).all()
            continue
        with pytest.raises(FrawdError, match="exceed fp16's range.*--native fp32"):
            step()
        if rows == 1:
            with pytest.raises(FrawdError, match="exceed fp16's range"):
                native.RowStep(decoder, cache)(99, 3, 3, 1)


def test_the_kv_cache_dtype_follows_the_weights_and_the_plan(monkeypatch):
    """fp16 keys and values where the C forward reads fp16 (or int8) weights in every phase;
    exact fp32 with fp32 weights, with PyTorch anywhere in the plan, or without F16C."""
    model = make_model(**CONFIGS["learned"])
    assert Engine(model, IdTokenizer(), native=False).kv_dtype == torch.float32
    assert Engine(model, IdTokenizer(), native=True, weights="fp32").kv_dtype == torch.float32
    if native.has_fp16():
        assert Engine(model, IdTokenizer(), native=True, weights="fp16").kv_dtype == torch.float16
        assert Engine(quantize_int8(make_model(**CONFIGS["learned"])), IdTokenizer(), native=True).kv_dtype == \
            torch.float16
        mixed = Engine(model, IdTokenizer(), weights="fp16")
        mixed._plan = {**{name: paths.Path("native", 1) for name in paths.PHASES}, "long": paths.Path("torch")}
        assert mixed.kv_dtype == torch.float32
    monkeypatch.setattr(native, "has_fp16", lambda: False)
    assert Engine(model, IdTokenizer(), native=True, weights="fp32").kv_dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or"):
        native.kv_is_half(KVCache(model.config, 1, 4, dtype=torch.bfloat16))


def test_a_large_model_says_its_forms_are_being_timed_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paths, "machine_busy", lambda window=None: False)
    monkeypatch.setattr(paths, "LOUD_PARAMS", 1000)  # (the tiny model below counts as large)
    model = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    native.NativeDecoder(model, "fp32")
    assert capsys.readouterr().err == "timing how this CPU reads this model's weights (once)...\n"
    native.NativeDecoder(model, "fp32")
    assert capsys.readouterr().err == ""
