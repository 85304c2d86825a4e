"""The engine's choice of forward per phase, sharing one engine between threads, the model
left untouched, the AVX2 build of the native forward, and how a failed build is told."""

import subprocess
import threading
import time

import pytest
import torch

from frawdllm import cbuild
from frawdllm.infer import Engine, SamplingParams, native, paths, quantize_int8
from frawdllm.io import read_json_object
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)
from test_engine import CONFIGS, IdTokenizer, make_model
from test_native import check_against_full_forward

NATIVE = pytest.mark.skipif(not native.available(), reason=f"no native forward: {native.unavailable_reason()}")
GREEDY = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)


def prompts(n, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(7, vocab, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _snapshot(model):
    return [(name, p.data_ptr(), p.stride(), p.detach().clone()) for name, p in model.named_parameters()]


@NATIVE
@pytest.mark.parametrize("mode", [dict(native=False), dict(native=True, weights="fp32"),
                                  dict(native=True, weights="fp16"), {}])
def test_an_engine_never_changes_its_model_and_training_works_after_generating(mode):
    if mode.get("weights") == "fp16" and not native.has_fp16():
        pytest.skip("no fp16 conversion on this CPU")
    model = make_model(**CONFIGS["llama"])
    before = _snapshot(model)
    engine = Engine(model, IdTokenizer(), **mode)
    engine.generate(prompts(3, model.config.vocab_size), GREEDY)
    for (name, ptr, stride, value), p in zip(before, model.parameters()):
        assert (p.data_ptr(), p.stride()) == (ptr, stride), name
        assert torch.equal(p, value), name
    # a training step after generating equals the same step on an untouched copy
    twin = make_model(**CONFIGS["llama"])
    ids = torch.randint(7, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    for m in (model, twin):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        logits = m(ids[:, :-1])[0]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@NATIVE
@pytest.mark.parametrize("mode", ["torch", "fp32", "fp16", "auto"])
def test_four_threads_sharing_one_engine_get_the_single_thread_outputs(mode):
    if mode == "fp16" and not native.has_fp16():
        pytest.skip("no fp16 conversion on this CPU")
    kwargs = {"torch": dict(native=False), "fp32": dict(native=True, weights="fp32"),
              "fp16": dict(native=True, weights="fp16"), "auto": {}}[mode]
    model = make_model(**CONFIGS["rope-gqa"])
    engine = Engine(model, IdTokenizer(), **kwargs)
    work = prompts(80, model.config.vocab_size)
    alone = [engine.generate([p], GREEDY)[0].tokens for p in work]
    shared: list = [None] * len(work)
    barrier = threading.Barrier(4)

    def worker(k):
        barrier.wait()
        for i in range(k, len(work), 4):
            shared[i] = engine.generate([work[i]], GREEDY)[0].tokens

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    equal = sum(a == b for a, b in zip(alone, shared))
    assert equal == len(work), f"{equal}/{len(work)} equal"


@NATIVE
@pytest.mark.parametrize("prefill,decode", [("native", "torch"), ("torch", "native")])
def test_phases_on_different_forwards_share_the_cache_correctly(prefill, decode):
    model = make_model(**CONFIGS["learned"])
    reference = Engine(model, IdTokenizer(), native=False).generate(prompts(4, 97), GREEDY)
    engine = Engine(model, IdTokenizer(), native=True, weights="fp32")
    threads = torch.get_num_threads()
    engine._plan = {"prefill": paths.Path(prefill, threads), "long": paths.Path(prefill, threads)} | {
        name: paths.Path(decode, threads) for name in ("decode", "batch", "wide")}
    assert engine.generate(prompts(4, 97), GREEDY) == reference  # a batch: ragged prompts, padding
    assert [engine.generate([p], GREEDY)[0].tokens for p in prompts(4, 97)] == [c.tokens for c in reference]


@NATIVE
def test_an_int8_rows_result_does_not_depend_on_its_batch_under_a_mixed_plan():
    """PyTorch ran int8 layers with bf16 activations, the native forward with fp32 ones: a
    prompt alone (prefilled natively) and beside a longer one (the batch prefilled by PyTorch)
    got log-probabilities ~0.01 apart, and its greedy text changed with the batch. Both
    compute in fp32 now, as the dequantized model."""
    from frawdllm.infer.native import dequantized_copy

    model = quantize_int8(make_model(**CONFIGS["learned"]))
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True, logprobs=0)
    engine = Engine(model, IdTokenizer(), native=True)
    engine._plan = {"prefill": paths.Path("native", 1), "long": paths.Path("torch"), "decode": paths.Path("native", 1),
                    "batch": paths.Path("native", 1), "wide": paths.Path("torch")}
    short, long = prompts(1, 97, seed=3)[0], (prompts(1, 97, seed=4)[0] * 9)[:34]  # (2 rows of 34: "long")
    assert paths.phase(2, max(len(short), len(long))) == "long"

    def scored(batch):  # the first row's (token, logprob) pairs
        return [(c.token, c.logprob.logprob) for c in engine.stream(batch, params) if c.index == 0]

    alone, beside = scored([short]), scored([short, long])
    assert [t for t, _ in alone] == [t for t, _ in beside]
    assert max(abs(a - b) for (_, a), (_, b) in zip(alone, beside)) < 1e-4
    # scoring a prompt (a PyTorch forward) gives the dequantized model's log-probabilities
    ids = torch.tensor([long])
    with torch.no_grad():
        want = dequantized_copy(model)(ids)[0][0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    got = torch.tensor([e.logprob for e in engine.prompt_logprobs(long, 0)[1:]])
    assert (got - want).abs().max() < 1e-4


def test_phases_by_shape():
    assert [paths.phase(*shape) for shape in [(1, 5), (3, 2), (1, 64), (2, 33), (1, 256), (1, 1), (2, 1), (7, 1),
                                              (8, 1), (64, 1)]] == [
        "prefill", "prefill", "prefill", "long", "long", "decode", "batch", "batch", "wide", "wide"]


@NATIVE
def test_the_plan_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paths, "LOUD_PARAMS", 0)
    monkeypatch.setattr(paths, "machine_busy", lambda window=None: False)
    model = make_model(**CONFIGS["rope"])
    first = Engine(model, IdTokenizer()).plan()
    assert set(first) == set(paths.PHASES)
    assert all(p.kind in ("native", "torch") for p in first.values())
    assert "measuring which forward is fastest" in capsys.readouterr().err
    calls = []
    monkeypatch.setattr(paths, "measure", lambda *a, **k: calls.append(a))
    assert Engine(model, IdTokenizer()).plan() == first
    assert not calls and capsys.readouterr().err == ""


def test_the_engine_paths_file_keeps_only_its_newest_entries(tmp_path, monkeypatch):
    """engine_paths.json grew without bound (2,091 entries, 305 KB, read by each engine)."""
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paths, "KEPT_ENTRIES", 3)
    monkeypatch.setattr(paths, "machine_busy", lambda window=None: False)
    monkeypatch.setattr(paths, "_key", lambda model, weights, threads: f"{weights}|{threads}")
    for n in range(5):
        assert paths.remembered("plan", torch.nn.Identity(), f"w{n}", lambda: n) == n
    kept = read_json_object(tmp_path / "native" / "engine_paths.json")
    assert [entry["value"] for entry in kept.values()] == [2, 3, 4]
    assert paths.remembered("plan", torch.nn.Identity(), "w4", lambda: "measured again") == 4  # (still read from the file)


@NATIVE
def test_a_plan_measured_on_a_busy_machine_is_measured_again_once_it_is_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path))
    model = make_model(**CONFIGS["learned"])
    measured = []
    real = paths.measure
    monkeypatch.setattr(paths, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))

    def plan_when(busy: bool):
        monkeypatch.setattr(paths, "machine_busy", lambda window=None: busy)
        return Engine(model, IdTokenizer()).plan()

    plan_when(busy=True)
    plan_when(busy=True)  # still busy: the plan made under load is all there is
    assert len(measured) == 1
    plan_when(busy=False)  # quiet now: measured again, and that plan is kept from then on
    assert len(measured) == 2
    plan_when(busy=True)
    plan_when(busy=False)
    assert len(measured) == 2


def test_machine_busy_counts_what_other_processes_used_during_the_window(monkeypatch):
    """Busy: other processes used over a quarter of the cores in the window (this process's
    own CPU time, its spinning threads included, does not count)."""
    monkeypatch.setattr(paths, "usable_cpus", lambda: 2)
    monkeypatch.setattr(paths.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # (lagging: says quiet)

    def window(others_s: float, own_s: float = 0.0) -> paths.CpuWindow:
        """A 1 s window in which the machine used others_s + own_s CPU seconds, own_s of them ours."""
        times = paths.os.times()
        monkeypatch.setattr(paths, "_machine_cpu_seconds", lambda: 100.0 + others_s + own_s)
        return paths.CpuWindow(100.0, times.user + times.system - own_s, paths.time.perf_counter() - 1.0)

    assert paths.machine_busy(window(0.8))  # 0.8 of 2 cores' second: 40%
    assert not paths.machine_busy(window(0.3))  # 15%
    assert not paths.machine_busy(window(0.1, own_s=1.9))  # this process kept both cores busy itself
    assert paths.machine_busy(window(1.2, own_s=0.5))


def test_without_proc_stat_machine_busy_reads_the_load_average(monkeypatch):
    monkeypatch.setattr(paths, "_machine_cpu_seconds", lambda: None)
    monkeypatch.setattr(paths, "usable_cpus", lambda: 2)
    monkeypatch.setattr(paths.os, "getloadavg", lambda: (1.5, 0.0, 0.0))
    assert paths.machine_busy()
    monkeypatch.setattr(paths.os, "getloadavg", lambda: (0.4, 3.0, 3.0))
    assert not paths.machine_busy()


def test_the_measurement_keeps_the_fastest_candidate(monkeypatch):
    model = make_model(**CONFIGS["learned"])
    slow = {"decode": "torch", "prefill": "native", "long": "native"}  # make these lose by sleeping
    real = paths.torch_logits

    class Decoder:
        def forward(self, tokens, positions, cache, threads):
            # PyTorch's own work and 10 ms more, so it loses on a busy machine too (a bare 10 ms
            # lost to a PyTorch prefill slowed by a test running beside it)
            if slow.get(paths.phase(*tokens.shape)) == "native":
                real(model, tokens, positions, cache)
                time.sleep(0.01)

    def torch_logits(model_, tokens, positions, cache):
        if slow.get(paths.phase(*tokens.shape)) == "torch":
            time.sleep(0.01)
        return real(model_, tokens, positions, cache)

    monkeypatch.setattr(paths, "torch_logits", torch_logits)
    plan = paths.measure(model, Decoder(), threads=1, budget_s=0.0)
    assert plan["decode"].kind == "native" and plan["prefill"].kind == "torch" and plan["long"].kind == "torch"


def test_thread_choice_follows_the_cheaper_count_and_probes_less_when_probes_lose():
    choice = paths.ThreadChoice(first=2, threads=2)
    cost = {2: 10.0, 1: 1.0}  # two threads are slow now (a busy core elsewhere)
    picks = []
    for _ in range(600):
        n = choice.pick()
        picks.append(n)
        choice.record(n, cost[n], 1)
    assert picks[:2] == [2, 1]  # each tried once
    assert picks[-320:].count(2) == 320 // paths.ThreadChoice.MAX_INTERVAL  # then probed once in 64 calls
    cost = {2: 0.5, 1: 1.0}  # the machine quiets down: two winning probes win it back
    for calls in range(1, 600):
        n = choice.pick()
        choice.record(n, cost[n], 1)
        if choice.cost(2) < choice.cost(1):
            break
    assert calls <= paths.ThreadChoice.MAX_INTERVAL + 8 + 1
    assert [choice.pick() for _ in range(5)].count(2) >= 4


def test_one_slow_call_does_not_move_a_phase_to_the_slower_thread_count():
    """A call slowed once (another thread of the process took a core) leaves the choice as it
    was; a count that stays slow loses it after two calls."""
    choice = paths.ThreadChoice(first=2, threads=2)
    cost = {2: 1.0, 1: 1.8}
    for _ in range(100):
        n = choice.pick()
        choice.record(n, cost[n], 1)
    assert choice.pick() == 2
    choice.record(2, 6.0, 1)  # one step that waited for a core
    assert [choice.pick() for _ in range(3)] == [2, 2, 2]
    for _ in range(2):  # now two threads stay slow
        choice.record(2, 6.0, 1)
    assert choice.pick() == 1


def test_a_pytorch_phase_moves_to_one_thread_when_its_team_waits(monkeypatch):
    """Under load torch's team of threads waits at every operation for its member without a
    core (here every 2-thread decode step takes 20 ms more): the engine's PyTorch phases run
    at the thread count they are fastest with, as native ones do, and leave torch's count as
    it was."""
    from frawdllm.infer import engine as engine_module

    seen, real = [], engine_module.decode_logits

    def loaded(*args):
        seen.append(torch.get_num_threads())
        if seen[-1] > 1:
            time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr(engine_module, "decode_logits", loaded)
    model = make_model()
    torch.set_num_threads(2)  # (the one_thread fixture restores it)
    engine = Engine(model, IdTokenizer(), native=False)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    out = engine.generate(prompts(3, model.config.vocab_size), params)
    assert torch.get_num_threads() == 2
    assert seen[0] == 2 and 1 in seen and seen[-30:].count(2) <= 2, seen
    torch.set_num_threads(1)
    assert [c.tokens for c in out] == [c.tokens for c in Engine(model, IdTokenizer(), native=False).generate(
        prompts(3, model.config.vocab_size), params)]


@NATIVE
def test_an_int8_engine_names_its_forward_int8():
    engine = Engine(quantize_int8(make_model(**CONFIGS["learned"])), IdTokenizer(), native=True)
    assert engine.weights == "int8"
    assert engine.describe() == "native int8"
    assert Engine(make_model(), IdTokenizer(), native=False).describe() == "PyTorch eager"
    mixed = Engine(make_model(), IdTokenizer(), native=True, weights="fp32")
    mixed._plan = {"prefill": paths.Path("torch"), "long": paths.Path("torch"), "decode": paths.Path("native", 1),
                   "batch": paths.Path("native", 1), "wide": paths.Path("torch")}
    assert mixed.describe() == "PyTorch eager (prefill, long, wide); native fp32 (decode, batch)"


def _cpu_has(flag):
    try:
        return flag in cbuild.cpu_signature().split()
    except OSError:
        return False


BUILDS = {"haswell": ("avx2", "fma", "f16c"), "ivybridge": ("avx", "f16c")}  # -march= : the CPU flags it needs


@pytest.mark.parametrize("march", BUILDS)
@pytest.mark.parametrize("name", ["llama", "post-ln"])
def test_the_avx2_and_avx_builds_equal_pytorch(name, march, tmp_path, monkeypatch):
    """The 8-wide code, whatever this CPU has beyond it: built for AVX2 (-march=haswell) and for
    AVX with F16C but no AVX2 (-march=ivybridge: Ivy Bridge, AMD Piledriver, where fp16 weights
    and an fp16 cache were read as int8 bytes, logits off by ~1500)."""
    if not all(_cpu_has(flag) for flag in BUILDS[march]):
        pytest.skip(f"this CPU cannot run -march={march} code")
    monkeypatch.setenv("FRAWD_MARCH", march)
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    assert native.available() and native.has_fp16()
    model = make_model(std=0.2, **CONFIGS[name])
    for weights in ("fp32", "fp16"):
        check_against_full_forward(model, weights, threads=2)
    check_against_full_forward(model, "fp16", threads=2, kv_dtype=torch.float16, atol=3e-2)


def test_an_empty_frawd_march_is_the_default_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """`FRAWD_MARCH=` (a script's unset variable) built with a bare `-march=`, which failed:
    the C forward was lost; and a bad value's message began inside the compiler's list of
    valid ones, the error line cut off."""
    from frawdllm import cbuild

    monkeypatch.setenv("FRAWD_MARCH", "")
    assert cbuild.march() == "native"
    monkeypatch.setenv("FRAWD_MARCH", "haswellx")
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    assert not native.available()
    why = native.unavailable_reason()
    assert "error: bad value" in why and "haswellx" in why and why.endswith("(FRAWD_MARCH=haswellx)"), why
    assert len(why) < 800, why


def test_a_failed_build_falls_back_to_pytorch_and_says_so_once(tmp_path, monkeypatch, capsys):
    compiler = tmp_path / "cc"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'fatal error: No space left on device' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("FRAWD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native.LIBRARY, "_lib", None)
    monkeypatch.setattr(native.LIBRARY, "_why_not", None)
    model = make_model()
    engines = [Engine(model, IdTokenizer()) for _ in range(3)]
    assert not any(e.native for e in engines)
    assert engines[0].generate([[5, 6]], GREEDY)[0].tokens  # PyTorch serves
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "compiling the native forward for this CPU (once)..."
    assert len(err) == 2 and "No space left on device" in err[1] and err[1].endswith("using PyTorch instead")


@pytest.mark.skipif(subprocess.run(["which", "aarch64-linux-gnu-gcc"], capture_output=True).returncode != 0,
                    reason="no aarch64 cross compiler (apt-get install gcc-aarch64-linux-gnu)")
def test_the_native_forward_compiles_for_aarch64(tmp_path):
    result = subprocess.run(["aarch64-linux-gnu-gcc", *cbuild.CFLAGS, "-march=armv8.2-a", "-Wall", "-Wno-psabi",
                             str(native.LIBRARY.source), "-o", str(tmp_path / "native.so"), "-lm"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_plan_is_kept_for_its_weights_threads_and_build_alone(monkeypatch):
    """engine_paths.json's key: a plan measured for fp32 weights, at 2 threads or for one C
    build (-march) must not serve int8 or fp16 weights, another thread count or build."""
    from frawdllm import FrawdLLM, get_config
    from frawdllm.infer import paths

    model = FrawdLLM(get_config("tiny", vocab_size=64, n_layer=1, n_embd=32, n_head=2, context_length=16))
    monkeypatch.delenv("FRAWD_MARCH", raising=False)
    keys = {paths._key(model, "fp32", 2), paths._key(model, "int8", 2), paths._key(model, "fp16", 2),
            paths._key(model, "fp32", 1)}
    monkeypatch.setenv("FRAWD_MARCH", "x86-64")
    keys.add(paths._key(model, "fp32", 2))
    assert len(keys) == 5
    monkeypatch.delenv("FRAWD_MARCH")
    assert paths._key(model, "fp32", 2) in keys  # (the same inputs: the same key)
