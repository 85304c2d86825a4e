"""FrawdLLM behaviour: causality, position encodings, attention variants, training signal."""

import math

import pytest
import torch

from frawdllm import FrawdLLM, ModelConfig
from frawdllm.model.embeddings import apply_rope, rope_tables, sinusoidal_table

POS = ["learned", "sinusoidal", "rope", "none"]


def small_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, context_length=32,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return ModelConfig(**base)


def test_init_is_gpt2s_with_residual_projections_scaled_by_depth():
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(n_embd=256, n_layer=8, n_head=4, bias=True))
    residual = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.mlp.down.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    biases = [p for n, p in model.named_parameters() if n.endswith(".bias") and "norm" not in n]
    assert biases and all(torch.count_nonzero(b) == 0 for b in biases)


def test_dropout_sits_on_each_branch_and_after_the_embeddings():
    # (a branch's dropout on the whole residual stream, or none after the embeddings, trains
    # another model than GPT-2's)
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(dropout=0.5, n_layer=1)).train()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        for linear in (model.blocks[0].attn.proj, model.blocks[0].mlp.down):
            linear.weight.zero_()
            if linear.bias is not None:
                linear.bias.zero_()
        assert torch.equal(model.blocks[0].residual_stream(x), x)  # branches of zero leave the stream alone
        embedded = model.embed(torch.randint(3, 64, (2, 8)), torch.arange(8)[None])
    assert 0.3 < (embedded == 0).float().mean().item() < 0.7


@pytest.mark.parametrize("pos", POS)
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_changing_token_t_never_changes_earlier_logits(pos, placement):
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(pos_encoding=pos, norm_placement=placement)).eval()
    ids = torch.randint(0, 64, (2, 20))
    changed = ids.clone()
    t = 11
    changed[:, t] = (ids[:, t] + 1) % 64
    with torch.no_grad():
        a, _ = model(ids)
        b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_sinusoidal_table_equals_the_papers_formula():
    n_pos, dim = 50, 16
    table = sinusoidal_table(n_pos, dim)
    for p in (0, 1, 7, 49):
        for i in range(dim // 2):
            angle = p / 10000 ** (2 * i / dim)
            assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_rope_scores_depend_only_on_relative_distance():
    torch.manual_seed(0)
    hd = 16
    cos, sin = rope_tables(64, hd, 10000.0)
    q = torch.randn(1, 1, 1, hd)
    k = torch.randn(1, 1, 1, hd)

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, cos[m : m + 1], sin[m : m + 1])
        kn = apply_rope(k, cos[n : n + 1], sin[n : n + 1])
        return (qm * kn).sum().item()

    for distance in (0, 3, 10):
        ref = score(distance, 0)
        for shift in (1, 5, 40):
            assert score(distance + shift, shift) == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert score(3, 0) != pytest.approx(score(10, 0), rel=1e-3)


def naive_attention_forward(model: FrawdLLM, ids: torch.Tensor) -> torch.Tensor:
    """Reference: the same model, attention written out with explicit masking and softmax."""
    cfg = model.config
    x = model.embed(ids, torch.arange(ids.shape[1]).unsqueeze(0))
    T = ids.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for block in model.blocks:
        h = block.norm1(x)
        attn = block.attn
        q, k, v = attn.qkv(h).split([cfg.n_embd, cfg.n_kv_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim], -1)
        q = q.view(1, T, cfg.n_head, cfg.head_dim).transpose(1, 2)
        k = k.view(1, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
        v = v.view(1, T, cfg.n_kv_head, cfg.head_dim).transpose(1, 2)
        heads = []
        for hidx in range(cfg.n_head):
            kv = hidx // (cfg.n_head // cfg.n_kv_head)
            scores = q[0, hidx] @ k[0, kv].T / math.sqrt(cfg.head_dim)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(scores.softmax(-1) @ v[0, kv])
        x = x + attn.proj(torch.cat(heads, dim=-1).unsqueeze(0))
        x = x + block.mlp(block.norm2(x))
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_attention_matches_a_naive_reference_for_mha_gqa_mqa(n_kv_head):
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(n_kv_head=n_kv_head)).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        ours, _ = model(ids)
        ref = naive_attention_forward(model, ids)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_gqa_equals_mha_with_duplicated_kv_heads():
    torch.manual_seed(0)
    gqa = FrawdLLM(small_cfg(n_kv_head=2, pos_encoding="rope")).eval()
    mha = FrawdLLM(small_cfg(n_kv_head=4, pos_encoding="rope")).eval()
    state = gqa.state_dict()
    hd, D = 8, 32
    for i in range(2):
        w = state[f"blocks.{i}.attn.qkv.weight"]
        b = state[f"blocks.{i}.attn.qkv.bias"]
        q_w, k_w, v_w = w.split([D, 2 * hd, 2 * hd])
        q_b, k_b, v_b = b.split([D, 2 * hd, 2 * hd])
        dup_w = lambda t: t.view(2, hd, D).repeat_interleave(2, 0).reshape(4 * hd, D)  # noqa: E731
        dup_b = lambda t: t.view(2, hd).repeat_interleave(2, 0).reshape(4 * hd)  # noqa: E731
        state[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q_w, dup_w(k_w), dup_w(v_w)])
        state[f"blocks.{i}.attn.qkv.bias"] = torch.cat([q_b, dup_b(k_b), dup_b(v_b)])
    mha.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids)[0], mha(ids)[0], atol=1e-5, rtol=1e-5)


def test_targets_of_minus_100_are_ignored():
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg()).eval()
    ids = torch.randint(0, 64, (1, 10))
    targets = torch.randint(0, 64, (1, 10))
    targets[0, :4] = -100
    logits, loss = model(ids, targets)
    expected = torch.nn.functional.cross_entropy(logits[0, 4:], targets[0, 4:])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_sequence_longer_than_context_raises_with_both_numbers():
    model = FrawdLLM(small_cfg(context_length=8))
    with pytest.raises(ValueError, match=r"9.*8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_embedding_scale_multiplies_by_sqrt_d():
    torch.manual_seed(0)
    scaled = FrawdLLM(small_cfg(pos_encoding="none", scale_embeddings=True))
    ids = torch.tensor([[3, 4]])
    out = scaled.embed(ids, torch.arange(2).unsqueeze(0))
    torch.testing.assert_close(out, scaled.embed.tok(ids) * math.sqrt(32))


def test_tied_head_shares_the_embedding_matrix():
    model = FrawdLLM(small_cfg())
    assert model.lm_head.weight.data_ptr() == model.embed.tok.weight.data_ptr()
    untied = FrawdLLM(small_cfg(tie_embeddings=False))
    assert untied.lm_head.weight.data_ptr() != untied.embed.tok.weight.data_ptr()


@pytest.mark.parametrize("pos", POS)
def test_tiny_model_overfits_one_batch(pos):
    torch.manual_seed(0)
    model = FrawdLLM(small_cfg(pos_encoding=pos, context_length=16))
    ids = torch.randint(3, 64, (4, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(200):
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if loss.item() < 0.1:
            break
    assert loss.item() < 0.1, f"{pos}: loss {loss.item():.3f} after {step + 1} steps"


def test_the_model_keeps_a_copy_of_its_config():
    cfg = small_cfg()
    model = FrawdLLM(cfg)
    cfg.n_layer, cfg.dropout = 5, 0.5  # the caller's object changes; the model's does not
    assert model.config is not cfg and model.config == small_cfg() and len(model.blocks) == 2


def test_a_config_of_another_kind_of_model_is_one_clear_error():
    from frawdllm import Seq2SeqTransformer, get_config
    from frawdllm.errors import ConfigError
    from frawdllm.model.gpt import model_config
    from frawdllm.config import Seq2SeqConfig

    seq2seq = get_config("aiayn-tiny", vocab_size=64, n_layer=1, n_encoder_layer=1, n_embd=32, n_head=4)
    with pytest.raises(ConfigError, match="FrawdLLM is decoder-only but got a Seq2SeqConfig.*Seq2SeqTransformer"):
        FrawdLLM(seq2seq)
    # What Seq2SeqTransformer.__init__ runs first (in this test session the import hook's
    # beartype refuses a ModelConfig at the call, before it could).
    with pytest.raises(ConfigError, match="needs a Seq2SeqConfig, got a ModelConfig: build a FrawdLLM"):
        model_config(small_cfg(), Seq2SeqConfig, "Seq2SeqTransformer")
    assert isinstance(Seq2SeqTransformer(seq2seq).config, Seq2SeqConfig)


@pytest.mark.parametrize("pos", ["learned", "rope", "sinusoidal"])
def test_a_model_too_large_for_the_memory_is_refused_before_allocating(pos, monkeypatch):
    """A context_length of 2e9 asked the allocator for gigabytes of position tables and
    embeddings (an allocator error, or the OOM killer where memory is overcommitted)."""
    from frawdllm import Seq2SeqTransformer, get_config
    from frawdllm import memory
    from frawdllm.errors import ConfigError

    monkeypatch.setattr(memory, "free_memory", lambda device: 2**30)  # 1 GiB available
    huge = ModelConfig(vocab_size=300, n_embd=16, n_head=2, n_layer=1, context_length=2_000_000_000, pos_encoding=pos)
    with pytest.raises(ConfigError, match=r"^FrawdLLM: this config needs \d{3}\.\d GiB .*context_length "
                                          r"2,000,000,000\), more than the 1\.0 GiB of memory available$"):
        FrawdLLM(huge)
    seq2seq = get_config("aiayn-tiny", vocab_size=64, n_layer=1, n_encoder_layer=1, n_embd=32, n_head=4,
                         context_length=2_000_000_000)
    with pytest.raises(ConfigError, match="^Seq2SeqTransformer: this config needs"):
        Seq2SeqTransformer(seq2seq)
    with torch.device("meta"):  # (shapes only: nothing is allocated, nothing refused)
        assert FrawdLLM(huge).embed.tok.weight.is_meta
    assert len(FrawdLLM(small_cfg()).blocks) == 2  # a model that fits is built


def test_from_pretrained_returns_the_model_in_eval_mode(tmp_path):
    FrawdLLM(small_cfg(dropout=0.5)).save_pretrained(tmp_path / "m")
    model = FrawdLLM.from_pretrained(tmp_path / "m")
    assert not any(m.training for m in model.modules())


def test_eval_mode_restores_the_modes_when_the_last_of_overlapping_blocks_ends():
    """Two threads generating with one model overlap like this: the first to finish must not
    switch dropout back on under the other."""
    from frawdllm.model.gpt import eval_mode

    model = FrawdLLM(small_cfg(dropout=0.5)).train()
    model.blocks[1].eval()
    modes = [m.training for m in model.modules()]
    first, second = eval_mode(model), eval_mode(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not any(m.training for m in model.modules())
    second.__exit__(None, None, None)
    assert [m.training for m in model.modules()] == modes
    with pytest.raises(RuntimeError), eval_mode(model):  # an error inside restores them too
        raise RuntimeError
    assert [m.training for m in model.modules()] == modes


BAD_CALLS = r"""
import torch
from frawdllm import FrawdLLM, get_config
m = FrawdLLM(get_config("tiny", n_layer=1, n_embd=32, n_head=2, vocab_size=300, context_length=32))
x = torch.randint(0, 300, (2, 8))
for args in [(x[0],), ([[1, 2]],), (x.float(),), (x, x.reshape(8, 2)), (x, x > 3), (x.to(torch.uint8),),
             (x.to(torch.int16), x)]:
    try:
        m(*args)
        print("accepted")
    except ValueError as exc:
        print(exc)
print(float(m(x, x.int())[1]) == float(m(x, x)[1]))
r = FrawdLLM(get_config("tiny-llama", n_layer=1, n_embd=32, n_head=8, n_kv_head=8, vocab_size=300, context_length=32))
for model, kwargs in [(r, dict(positions=torch.arange(8))), (m, dict(positions=torch.tensor([[3]]))),
                      (r, dict(positions=torch.zeros(3, 8, dtype=torch.long))),
                      (m, dict(positions=torch.arange(8.0)[None])), (m, dict(targets=x.index_fill(1, torch.tensor([3]), 300))),
                      (m, dict(targets=x.index_fill(1, torch.tensor([3]), -1)))]:
    try:
        model(x, **kwargs)
        print("accepted")
    except ValueError as exc:
        print(exc)
"""


def test_bad_ids_and_targets_are_one_line_naming_them():
    """Without the tests' shape checks (a user's run): a 1-D tensor failed with `IndexError:
    tuple index out of range`, (T, B) targets against (B, T) ids gave a loss without a word,
    int32 targets a RuntimeError inside cross_entropy. Positions of the wrong shape ran
    silently (a 1-D arange(T) with T heads rotated head h by position h, a (1, 1) tensor gave
    every token one position) or failed deep inside; a target past the vocabulary was
    PyTorch's "IndexError: Target 300 is out of bounds"."""
    from cli_helpers import script_lines

    assert script_lines(BAD_CALLS) == [
        "token_ids must be a (batch, time) integer tensor, got a 1-D torch.int64 tensor",
        "token_ids must be a (batch, time) integer tensor, got list",
        "token_ids must be a (batch, time) integer tensor, got a 2-D torch.float32 tensor",
        "targets of shape (8, 2) do not match token_ids of shape (2, 8)",
        "targets must be a (batch, time) integer tensor, got a 2-D torch.bool tensor",
        # (nn.Embedding takes int64 and int32 only: PyTorch's RuntimeError from inside it)
        "token_ids must hold int64 or int32 ids, got a torch.uint8 tensor: convert it with .long()",
        "token_ids must hold int64 or int32 ids, got a torch.int16 tensor: convert it with .long()",
        "True",
        "positions must be a (1 or batch 2, time 8) integer tensor, got a (8,) torch.int64 tensor",
        "positions must be a (1 or batch 2, time 8) integer tensor, got a (1, 1) torch.int64 tensor",
        "positions must be a (1 or batch 2, time 8) integer tensor, got a (3, 8) torch.int64 tensor",
        "positions must be a (1 or batch 2, time 8) integer tensor, got a (1, 8) torch.float32 tensor",
        "target id 300 is outside the model's vocabulary (vocab_size 300; -100 marks a target to ignore)",
        "target id -1 is outside the model's vocabulary (vocab_size 300; -100 marks a target to ignore)",
    ]


@pytest.mark.parametrize("pos", POS)
def test_ids_past_the_vocabulary_and_negative_positions_are_one_line(pos):
    """An id >= vocab_size was `IndexError: index out of range in self` from inside the
    embedding; a negative position the same with learned positions, and with RoPE read
    the tables from the end, silently."""
    model = FrawdLLM(small_cfg(pos_encoding=pos))
    ids = torch.tensor([[1, 2, 3]])
    for bad, message in [(64, "token id 64 is outside the model's vocabulary \\(vocab_size 64\\)"),
                         (-2, "token id -2 is outside the model's vocabulary \\(vocab_size 64\\)")]:
        with pytest.raises(ValueError, match=f"^{message}$"):
            model(torch.tensor([[1, bad, 3]]))
    with pytest.raises(ValueError, match="^position -1 is negative$"):
        model(ids, positions=torch.tensor([[-1, 0, 1]]))
    model(ids, positions=torch.tensor([[0, 1, 2]]))  # (still fine)


def test_free_memory_is_what_the_cgroup_leaves_when_below_the_machines(monkeypatch):
    """Inside a container the limit less what the cgroup already uses, not the limit."""
    from pathlib import Path

    from frawdllm import memory

    files = {"/proc/meminfo": "MemTotal: 100000000 kB\nMemAvailable: 50000000 kB\n",
             "/sys/fs/cgroup/memory.max": "8000000000\n", "/sys/fs/cgroup/memory.current": "3000000000\n"}
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: files[str(self)])
    assert memory.free_memory(torch.device("cpu")) == 5_000_000_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert memory.free_memory(torch.device("cpu")) == 50_000_000_000 * 1024 // 1000


def test_the_package_lists_its_lazily_imported_model_classes():
    """dir(frawdllm) (help(), tab completion) lacked FrawdLLM and Seq2SeqTransformer, which are
    imported on first use."""
    import frawdllm

    assert {"FrawdLLM", "Seq2SeqTransformer", "get_config", "ModelConfig"} <= set(dir(frawdllm))
