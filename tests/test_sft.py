"""SFT: which tokens carry the loss, truncation, packing without cross-example attention,
bad records, LoRA, the stdlib-instruct corpus and `frawd sft` end to end (resume exact)."""

import json

import pexpect
import pytest
import torch
import torch.nn.functional as F

from frawdllm.align import lora
from frawdllm.align.examples import BadExample, Example, chat_messages, tokenize_chat, tokenize_pair, truncate
from frawdllm.align.packing import collate, document_mask, pack_rows
from frawdllm.align.sft import SFTConfig, load_examples, prompt_of, sft_loss
from frawdllm.modeldir import load_model
from frawdllm.tokenizer import ASSISTANT_ID, BOS_ID, EOS_ID, USER_ID
from frawdllm.train.rundir import read_metrics

from align_helpers import byte_tokenizer, model_dir, tiny_model, word_chats, word_prefs, write_jsonl
from cli_helpers import run_cli

MULTI = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "yo"}, {"role": "user", "content": "and?"},
         {"role": "assistant", "content": "ok"}]


def show(tok, example):
    """The example as 'token*' where the token carries loss (printed for the reader of a failure)."""
    return "".join((tok.decode([i]) if i > 6 else f"<{i}>") + ("*" if t else "")
                   for i, t in zip(example.ids, example.trained))


@pytest.mark.parametrize("train_on, asked", [("assistant", 2), ("all", 2), ("last", 4)])
def test_a_held_out_samples_prompt_asks_for_the_first_trained_reply(train_on, asked):
    """Its prompt is the conversation up to that reply's <|assistant|>, as chat renders it
    (with --train-on all it was <|bos|> alone: samples.txt held answers to no question)."""
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"},
                {"role": "assistant", "content": "bye"}]
    example = tokenize_chat(tok, messages, train_on)
    assert prompt_of(example) == tok.render_chat(messages[:asked], add_generation_prompt=True)


def test_loss_is_on_assistant_tokens_and_their_eos_only():
    tok = byte_tokenizer()
    single = tokenize_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    print(show(tok, single))
    assert single.ids == tok.render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                         add_generation_prompt=False)
    assert single.ids[:6] == [BOS_ID, USER_ID, *tok.encode("hi"), EOS_ID, ASSISTANT_ID][:6]
    assert show(tok, single) == "<2><4>hi<3><5>y*o*<3>*"

    multi = tokenize_chat(tok, MULTI)
    print(show(tok, multi))
    assert multi.ids == tok.render_chat(MULTI, add_generation_prompt=False)
    assert show(tok, multi) == "<2><6>be brief<3><4>hi<3><5>y*o*<3>*<4>and?<3><5>o*k*<3>*"
    assert show(tok, tokenize_chat(tok, MULTI, "last")) == "<2><6>be brief<3><4>hi<3><5>yo<3><4>and?<3><5>o*k*<3>*"
    everything = tokenize_chat(tok, MULTI, "all")
    assert everything.trained == [False] + [True] * (len(everything.ids) - 1)  # all but the unpredicted <|bos|>


def test_a_batch_trains_exactly_the_answer_tokens_each_at_the_position_before_it():
    """The packed batch's targets: position i predicts token i + 1, scored only where that
    token is trained (each answer from its first token through its <|eos|>; never the
    <|user|> after it)."""
    tok = byte_tokenizer()
    example = tokenize_chat(tok, MULTI)
    n = len(example.ids) - 1
    batch = collate([example, example], [[0], [1, 0]], 2 * n + 3)
    assert batch["tokens"][0, :n].tolist() == example.ids[:-1]
    assert batch["targets"][0, :n].tolist() == [t if trained else -100
                                               for t, trained in zip(example.ids[1:], example.trained[1:])]
    assert (batch["targets"][0, n:] == -100).all()
    answer = [t for t, trained in zip(example.ids, example.trained) if trained]
    assert [t for t in batch["targets"][0].tolist() if t != -100] == answer == [*tok.encode("yo"), EOS_ID,
                                                                              *tok.encode("ok"), EOS_ID]
    assert batch["targets"][1, :n].tolist() == batch["targets"][1, n:2 * n].tolist() == batch["targets"][0, :n].tolist()


def test_truncation_keeps_the_prompts_tail_and_the_responses_head():
    tok = byte_tokenizer()
    long_prompt = tokenize_chat(tok, [{"role": "user", "content": "abcdefghijklmnopqrstuvwxyz"},
                                      {"role": "assistant", "content": "OK"}])
    cut, was_cut = truncate(long_prompt, 12)
    assert was_cut and len(cut.ids) == 12
    # <|bos|>, the role of the turn the tail is inside (it had been dropped: "<2>uvwxyz<3><5>..."
    # is outside the chat template), the prompt's tail, the whole answer
    assert show(tok, cut) == "<2><4>vwxyz<3><5>O*K*<3>*"
    long_answer = tokenize_chat(tok, [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "abcdefghijklmnopqrstuvwxyz"}])
    cut, _ = truncate(long_answer, 12)
    assert show(tok, cut) == "<2><4>q<3><5>a*b*c*d*e*f*g*"  # the whole short prompt, the answer's head
    both = tokenize_chat(tok, [{"role": "user", "content": "0123456789" * 3},
                               {"role": "assistant", "content": "abcdefghijklmnopqrstuvwxyz"}])
    cut, _ = truncate(both, 12)
    assert show(tok, cut) == "<2><4>89<3><5>a*b*c*d*e*f*"  # the prompt gets half the context
    assert truncate(both, 100) == (both, False)
    assert truncate(both, len(both.ids)) == (both, False)  # exactly full: not counted as truncated
    # --train-on all trains from <|bos|>'s next token: the prompt kept is <|bos|> alone
    everything = tokenize_chat(tok, [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "yo"}],
                               "all")
    cut, was_cut = truncate(everything, 6)
    assert was_cut and show(tok, cut) == "<2><4>*h*e*l*l*"
    pair, was_cut = tokenize_pair(tok, [{"role": "user", "content": "0123456789" * 3}], "abcdefghij", "xyz", 12)
    assert was_cut and pair.prompt == [BOS_ID, USER_ID, *tok.encode("89"), EOS_ID, ASSISTANT_ID]
    # a role that would head an empty turn right before the next is left out (a token fewer)
    turns = tokenize_chat(tok, [{"role": "system", "content": "s" * 9}, {"role": "user", "content": "u"},
                                {"role": "assistant", "content": "a"}])  # <2><6>sssssssss<3><4>u<3><5>a<3>
    assert show(tok, truncate(turns, 8)[0]) == "<2><4>u<3><5>a*<3>*"
    assert show(tok, truncate(turns, 9)[0]) == "<2><6><3><4>u<3><5>a*<3>*"  # (an empty system turn)
    assert show(tok, truncate(turns, 10)[0]) == "<2><6>s<3><4>u<3><5>a*<3>*"
    assert tok.decode(pair.chosen) == "abcdef" and tok.decode(pair.rejected) == "xyz<|eos|>"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_packed_rows_give_each_example_its_unpacked_loss(style):
    tok = byte_tokenizer()
    model = tiny_model(style, context_length=64).eval()
    examples = [tokenize_chat(tok, chat_messages(r, "test")) for r in word_chats(7)]
    rows = pack_rows(examples, 64)
    assert all(len(row) >= 2 for row in rows[:-1]) and len(rows) < len(examples)  # rows are shared
    assert pack_rows(examples, 64, pack=False) == [[i] for i in range(len(examples))]
    four = Example([2, 5, 6, 7, 3], [False, False, True, True, True])  # 4 input tokens
    assert pack_rows([four, four], 8) == [[0, 1]] and pack_rows([four, four], 7) == [[0], [1]]  # exactly full
    assert pack_rows([four], 4) == [[0]]  # (every example truncated to a row has exactly its length)
    longest = max(len(e.ids) for e in examples) - 1
    for pack in (True, False):  # (unpacked, a too-long example failed later, inside collate's numpy)
        with pytest.raises(ValueError, match=rf"has {longest} input tokens, more than the row length {longest - 1}$"):
            pack_rows(examples, longest - 1, pack=pack)
    batch = collate(examples, rows, 64)
    with torch.no_grad():
        from frawdllm.align.sft import packed_hidden
        logits = model.lm_head(packed_hidden(model, batch))  # (B, T, V)
        token_loss = F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), reduction="none",
                                     ignore_index=-100).view(batch["targets"].shape)
        for r, row in enumerate(rows):
            for doc, i in enumerate(row):
                at = batch["documents"][r] == doc
                packed = token_loss[r][at].sum() / (batch["targets"][r][at] != -100).sum()
                alone = collate(examples, [[i]], len(examples[i].ids) - 1)
                unpacked = sft_loss(model, alone)
                assert packed.item() == pytest.approx(unpacked.item(), abs=1e-5), (r, doc)
        # the test can tell: plain causal attention over the packed row (no mask, no position reset)
        leaky = model(batch["tokens"])[0]
        later = batch["documents"] >= 1  # tokens of the second and later examples of a row
        assert (leaky - logits)[later].abs().max() > 1e-3
        assert (leaky - logits)[batch["documents"] == 0].abs().max() < 1e-5


def test_document_mask_is_block_diagonal_causal():
    docs = torch.tensor([[0, 0, 1, 1, 1, -1]])
    mask = document_mask(docs)[0, 0].int().tolist()
    assert mask == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                    [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_a_bad_record_is_named_with_file_and_line_or_skipped_and_counted(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    lines = [{"prompt": "a", "response": "b"}] * 5
    text = "".join(__import__("json").dumps(r) + "\n" for r in lines)
    data.write_text(text + "{not json\n" + '{"messages": [{"role": "bot", "content": "x"}]}\n' + text)
    cfg = SFTConfig(init=None, data=str(data), progress=False, max_steps=1, val_fraction=0.0)
    with pytest.raises(BadExample, match=r"chats.jsonl:6: not valid JSON"):
        load_examples(cfg, byte_tokenizer(), 64)
    cfg.skip_bad_lines = True
    train, val, summary = load_examples(cfg, byte_tokenizer(), 64)
    assert (summary.skipped, summary.examples, len(train)) == (2, 10, 10)
    assert "chats.jsonl:7" in summary.first_skipped[1] and "role 'bot'" in summary.first_skipped[1]
    code, _, err = run_cli(capsys, "sft", "--init", model_dir(tmp_path), "--data", data, "--out", tmp_path / "run",
                           "--max-steps", "1", "--no-progress")
    assert code != 0 and "chats.jsonl:6: not valid JSON" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # a failed start leaves nothing
    missing = tmp_path / "nowhere.jsonl"
    code, _, err = run_cli(capsys, "sft", "--init", model_dir(tmp_path), "--data", missing, "--out", tmp_path / "run",
                           "--max-steps", "1", "--no-progress")
    assert code != 0 and len(err.strip().splitlines()) == 1
    assert f"data source not found: '{missing}'" in err and "expected stdlib-instruct," in err


def test_empty_message_lists_are_bad_records():
    """(An empty "prompt" list was taken as a conversation without a prompt.)"""
    for record, name in [({"messages": []}, "messages"), ({"prompt": [], "response": "x"}, "prompt"),
                         ({"prompt": "q", "response": []}, "response")]:
        with pytest.raises(BadExample, match=rf"^r:1: '{name}' must be a non-empty list of messages$"):
            chat_messages(record, "r:1")


def test_a_byte_order_mark_does_not_cost_the_first_record(tmp_path):
    """A JSONL file saved with a UTF-8 BOM (Windows editors) stopped at line 1 ("not valid
    JSON"), or with --skip-bad-lines silently lost its first example."""
    import gzip

    from frawdllm.data.records import iter_records

    lines = "".join(json.dumps({"prompt": f"q{i}", "response": "a"}) + "\n" for i in range(3))
    plain, packed = tmp_path / "bom.jsonl", tmp_path / "bom.jsonl.gz"
    plain.write_bytes(("\ufeff" + lines).encode())
    with gzip.open(packed, "wb") as f:
        f.write(("\ufeff" + lines).encode())
    for path in (plain, packed):
        records = [record for _, record in iter_records(str(path))]
        assert records == [{"prompt": f"q{i}", "response": "a"} for i in range(3)], path


def test_sft_shapes_trl_and_mixed_tables_use():
    """A table mixing the two shapes gives every row every column: a prompt/response row's
    null `messages` was "must be a non-empty list of messages". TRL's prompt/completion
    shape (strings or messages) was refused."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    for record in [{"messages": turns}, {"messages": turns, "prompt": None, "response": None},
                   {"messages": None, "prompt": "Hi", "response": "Hello."},
                   {"prompt": "Hi", "completion": "Hello."},
                   {"prompt": turns[:1], "completion": turns[1:]}]:
        assert chat_messages(record, "r:1") == turns, record
    with pytest.raises(BadExample, match=r"expected \"messages\" or \"prompt\" and \"response\" \(fields: 'prompt'\)"):
        chat_messages({"messages": None, "prompt": "Hi", "response": None}, "r:1")
    # Both shapes in one record: the prompt/response pair was dropped without a word.
    with pytest.raises(BadExample, match=r"r:1: has both \"messages\" and \"prompt\", \"response\"; give one shape"):
        chat_messages({"messages": turns, "prompt": "Hi", "response": "Other."}, "r:1")
    # Two names for the answer: "response" was learned and "completion" dropped without a word.
    with pytest.raises(BadExample, match=r"r:1: has both \"response\" and \"completion\" .two names for the "
                                         r"answer.; give one"):
        chat_messages({"prompt": "Hi", "response": "Hello.", "completion": "Other."}, "r:1")


def test_characters_a_char_tokenizer_lacks_are_counted_in_the_summary(tmp_path):
    """They became <|unk|> training targets without a word ("Très bien, café" trained as
    "Tr<|unk|>s bien, caf<|unk|>"), where generate warns and data prepare counts them."""
    from frawdllm.tokenizer import train_tokenizer

    tok = train_tokenizer(["abcdefghijklmnopqrstuvwxyz ,.?"], kind="char")
    chats = [{"prompt": "say it", "response": "tres bien"}] * 4 + [{"prompt": "say it", "response": "très bien ☃"}] * 2
    cfg = SFTConfig(init=None, data=str(write_jsonl(tmp_path / "c.jsonl", chats)), progress=False, max_steps=1,
                    val_fraction=0.0)
    *_, summary = load_examples(cfg, tok, 64)
    assert (summary.unknown, summary.unknown_examples) == (4, 2)
    assert "4 character(s) outside the tokenizer's vocabulary became <|unk|> (in 2 examples" in summary.line()
    cfg.data = str(write_jsonl(tmp_path / "d.jsonl", chats[:4]))
    *_, summary = load_examples(cfg, tok, 64)
    assert summary.unknown == 0 and "unk" not in summary.line()
    # (and a cut names what it cut to: --max-length, where it was given, said "the context")
    cfg.max_length = 8
    *_, summary = load_examples(cfg, tok, 8)
    assert "4 truncated to --max-length 8 (prompt tail, response head kept)" in summary.line()
    cfg.data, cfg.max_length = str(write_jsonl(tmp_path / "e.jsonl", chats[:5])), None  # one: not "1 examples"
    *_, summary = load_examples(cfg, tok, 64)
    assert "became <|unk|> (in 1 example;" in summary.line()


def test_lora_starts_at_the_base_trains_adapters_only_and_merges_exactly():
    model = tiny_model("llama")
    x = torch.randint(0, 263, (2, 16))
    before = model(x)[0].detach()
    lora.add_lora(model, rank=4)
    assert torch.equal(model(x)[0], before)  # B = 0: the base model exactly
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-2] for n in trainable} == {"qkv", "proj", "up", "down"}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    adapted = model(x)[0].detach()
    assert not torch.allclose(adapted, before, atol=1e-3)
    merged = lora.merged_copy(model)
    assert not lora.has_lora(merged)
    assert all(p.requires_grad for p in merged.parameters())  # a plain model, trainable (add_lora froze the base)
    torch.testing.assert_close(merged(x)[0], adapted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_lora_flops_per_token_match_a_count_of_the_training_steps_matmuls(style, tmp_path):
    """MFU's FLOPs under LoRA: the frozen base computes no weight gradients (4N, not 6N), so
    6N overstated an SFT or DPO step with adapters by ~1.45x, and its MFU with it. Checked
    against PyTorch's count of one forward and backward (which does not see the attention
    kernel: its 12 L d T, 4 L d T forward, is added), plain and with adapters; DPO adds the
    reference's forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from frawdllm.align.dpo import DPOConfig, DPOTask, load_pairs
    from frawdllm.align.sft import SFTTask

    tok, length = byte_tokenizer(), 32
    chats = write_jsonl(tmp_path / "c.jsonl", word_chats(20))
    prefs = write_jsonl(tmp_path / "p.jsonl", [{"prompt": c["prompt"], "chosen": c["response"].upper(),
                                                "rejected": c["response"]} for c in word_chats(20)])
    options = dict(out=str(tmp_path / "run"), progress=False, device="cpu", dtype="fp32", compile="false",
                   sample_tokens=0, val_fraction=0.0)

    def counted(model, train: bool) -> float:
        cfg, x = model.config, torch.randint(0, 263, (2, length))
        with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(train):
            loss = model(x, targets=x)[1]
            if train:
                loss.backward()
        return counter.get_total_flops() / x.numel() + (12 if train else 4) * cfg.n_layer * cfg.n_embd * length

    torch.manual_seed(0)
    reference = counted(tiny_model(style), train=False)
    for rank in (0, 8):
        model = tiny_model(style)
        if rank:
            lora.add_lora(model, rank)
        step = counted(model, train=True)
        sft = SFTTask(*load_examples(SFTConfig(data=str(chats), **options), tok, length)[:2], model, tok,
                      SFTConfig(data=str(chats), **options), length)
        dpo_cfg = DPOConfig(data=str(prefs), **options)
        dpo = DPOTask(*load_pairs(dpo_cfg, tok, length)[:2], model, tok, dpo_cfg, length)
        # (within 6%: the count also skips the first block's input gradient, nothing before it
        # training: ~4% in this 2-block model; 6N was 40% over)
        assert lora.flops_per_token(model, length) == pytest.approx(step, rel=0.06), rank
        assert sft.flops_per_token == pytest.approx(step, rel=0.06), rank
        assert dpo.flops_per_token == pytest.approx(step + reference, rel=0.06), rank


def _adapted(style="llama"):
    """A LoRA model whose adapters change its function (B != 0), and its merged copy."""
    model = lora.add_lora(tiny_model(style), rank=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    return model, lora.merged_copy(model)

def test_lora_adds_alpha_over_rank_times_b_a_to_the_frozen_layer():
    """y = x W^T + b + (alpha / r) x A^T B^T (LoRA's scaling): the merge test only showed
    that forward and merge agree, whatever the scale."""
    torch.manual_seed(0)
    base = torch.nn.Linear(8, 6)
    layer = lora.LoRALinear(base, rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_b.normal_()  # (zero at the start: no update to see)
    x = torch.randn(3, 8)
    want = x @ base.weight.T + base.bias + 2.0 * (x @ layer.lora_a.T) @ layer.lora_b.T
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer.merged()(x), want)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_a_lora_model_saves_and_exports_merged(tmp_path, style):
    """save_pretrained wrote the adapters' names (blocks.0.attn.qkv.base.weight, lora_a...),
    a folder no loader reads; to_hf_model and gguf_tensors raised KeyError."""
    import transformers

    from frawdllm import FrawdLLM
    from frawdllm.export.gguf import gguf_tensors
    from frawdllm.export.hf import to_hf_model
    from frawdllm.export.hf_dir import write_hf_dir

    model, merged = _adapted(style)
    x = torch.randint(0, 263, (1, 12))
    model.save_pretrained(tmp_path / "m")
    assert lora.has_lora(model)  # the model itself keeps its adapters
    loaded = FrawdLLM.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded(x)[0], merged.eval()(x)[0])
    torch.testing.assert_close(to_hf_model(model)(x).logits, merged(x)[0], atol=1e-5, rtol=1e-5)
    ours = dict(gguf_tensors(model))
    assert all(torch.equal(ours[name], t) for name, t in gguf_tensors(merged))
    (tmp_path / "hf").mkdir()  # (write_hf_dir fills an empty folder)
    write_hf_dir(model, None, tmp_path / "hf")  # (the Python API: KeyError on the adapters' names)
    torch.testing.assert_close(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(x).logits,
                               merged(x)[0], atol=1e-5, rtol=1e-5)


def test_the_engine_runs_a_lora_model_in_pytorch():
    """The native forward read `.weight` of the LoRA layers: AttributeError."""
    from frawdllm.infer import Engine, SamplingParams
    from frawdllm.infer.native import supports

    model, merged = _adapted()
    assert supports(model) == "blocks.0.attn.qkv has LoRA adapters (lora.merged_copy(model) merges them)"
    params = SamplingParams(max_new_tokens=6, temperature=0)
    got = Engine(model, byte_tokenizer()).generate("ab", params)
    assert got[0].tokens == Engine(merged, byte_tokenizer(), native=False).generate("ab", params)[0].tokens


def test_adapters_of_another_rank_are_refused_in_one_line():
    """The names are the same at every rank: the copy failed with a size mismatch."""
    model = lora.add_lora(tiny_model(), rank=2)
    saved = lora.adapter_state(lora.add_lora(tiny_model(), rank=4))
    with pytest.raises(ValueError, match=r"^the saved adapters do not fit this model \(another --lora-rank\?\)$"):
        lora.load_adapter_state(model, saved)


def test_lora_twice_or_a_fractional_rank_is_refused():
    model = lora.add_lora(tiny_model(), rank=2)
    with pytest.raises(ValueError, match="^FrawdLLM already has LoRA adapters$"):
        lora.add_lora(model, 2)
    from cli_helpers import script_lines

    assert script_lines("from frawdllm import FrawdLLM, get_config\nfrom frawdllm.align.lora import add_lora\n"
                        "try:\n    add_lora(FrawdLLM(get_config('tiny', n_layer=1)), 2.5)\n"
                        "except ValueError as exc:\n    print(exc)") == ["LoRA rank must be a positive integer, got 2.5"]
    for alpha in (float("inf"), float("nan"), 0.0, -4.0, True):  # (inf made every output NaN; the CLI refused them)
        with pytest.raises(ValueError, match=r"^LoRA alpha must be a finite positive number, got "):
            lora.add_lora(tiny_model(), 4, alpha)


def test_lora_on_an_encoder_decoder_covers_cross_attention_and_saves_merged(tmp_path):
    """Cross-attention's q and kv were left out while its proj got adapters."""
    from frawdllm import Seq2SeqTransformer, get_config

    torch.manual_seed(0)
    model = Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=50, n_embd=32, n_head=4, n_layer=1,
                                          n_encoder_layer=1, context_length=16, dropout=0.0))
    lora.add_lora(model, rank=2)
    wrapped = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert {"decoder.0.cross.q", "decoder.0.cross.kv", "decoder.0.cross.proj"} <= wrapped
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_b" in n:
                p.normal_(0, 0.05)
    src, tgt = torch.randint(4, 50, (2, 7)), torch.randint(4, 50, (2, 5))
    model.eval().save_pretrained(tmp_path / "m")
    loaded = Seq2SeqTransformer.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(loaded(src, tgt)[0], model(src, tgt)[0], atol=1e-5, rtol=1e-5)


def test_int8_models_and_changed_configs_are_not_saved_or_exported(tmp_path):
    from frawdllm import FrawdError
    from frawdllm.export.hf import to_hf_model
    from frawdllm.infer.quantize import quantize_int8

    int8 = quantize_int8(tiny_model())
    with pytest.raises(FrawdError, match=rf"^cannot save {tmp_path / 'q'}: its linear layers are int8 "
                                         r"\(quantize_int8, for inference only\); use the model from before quantizing$"):
        int8.save_pretrained(tmp_path / "q")
    with pytest.raises(FrawdError, match=r"^cannot export to transformers: its linear layers are int8"):
        to_hf_model(int8)
    changed = tiny_model()
    held = changed.num_parameters()
    changed.config.n_layer = 3  # (2 built)
    with pytest.raises(FrawdError, match=rf"^cannot save {tmp_path / 'c'}: the model holds {held:,} weights but its "
                                         rf"config describes {changed.config.num_parameters:,} "
                                         r"\(was model.config changed after construction\?\)$"):
        changed.save_pretrained(tmp_path / "c")
    assert sorted(tmp_path.iterdir()) == []


def test_the_split_of_a_record_does_not_depend_on_its_file_format(tmp_path):
    """Parquet (and `datasets`) fill every column, with nulls where a record has none: hashed
    with them, the same records fell on other sides of the split than from JSON Lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from frawdllm.align.examples import iter_source

    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               if i % 2 else {"prompt": f"p{i}", "response": f"r{i}"} for i in range(40)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    columns = {name: [r.get(name) for r in records] for name in ("prompt", "response", "messages")}
    pq.write_table(pa.table(columns), tmp_path / "r.parquet")  # (null-filled columns)
    from_parquet = list(iter_source(str(tmp_path / "r.parquet"), "sft"))
    assert any(None in r.values() for _, r, _ in from_parquet)  # (what the case is about)
    assert [key for _, _, key in iter_source(str(tmp_path / "r.jsonl"), "sft")] == [k for _, _, k in from_parquet]


def test_stdlib_instruct_is_built_in_and_split_by_function():
    from frawdllm.align import stdlib_corpus
    from frawdllm.align.examples import is_held_out

    found = stdlib_corpus.functions()
    assert len(found) > 200
    records = list(stdlib_corpus.records("stdlib-instruct"))
    assert len(records) == 2 * len(found)
    by_key = {}
    for where, record, key in records[:200]:
        by_key.setdefault(key, []).append(record)
        assert where.startswith("stdlib-instruct:") and set(record) == {"prompt", "response"}
    assert all(len(rs) == 2 for rs in by_key.values())  # both requests share the split key
    write, summarize = next(iter(by_key.values()))
    assert write["prompt"].startswith("Write a Python function `") and stdlib_corpus.defines_function(write["response"])
    assert summarize["prompt"].startswith("Summarize this Python function") and "\n" not in summarize["response"]
    held = [is_held_out(k, 0.05) for k in {f.key for f in found}]
    assert 0 < sum(held) < len(held) * 0.15
    # the preference rule: even hash -> does not parse; odd -> parses, another body
    prefs = list(stdlib_corpus.records("stdlib-prefs"))
    assert len(prefs) == len(found)
    kinds = {stdlib_corpus._hash(fn.key) % 2: (fn, r) for fn, (_, r, _) in zip(found, prefs)}
    fn, broken = kinds[0]
    assert broken["chosen"] == fn.source and not stdlib_corpus.defines_function(broken["rejected"])
    fn, other = kinds[1]
    assert stdlib_corpus.defines_function(other["rejected"]) and other["rejected"] != fn.source


def test_sft_cli_trains_writes_the_run_and_resumes_exactly(tmp_path, capsys):
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "chats.jsonl", word_chats(60))
    common = ["--init", base, "--data", data, "--batch-size", "4", "--lr", "3e-3", "--dtype", "fp32",
              "--compile", "false", "--device", "cpu", "--log-interval", "1", "--eval-interval", "3",
              "--eval-batches", "2", "--sample-tokens", "8", "--no-progress", "--val-fraction", "0.1"]
    code, out, err = run_cli(capsys, "sft", *common, "--max-steps", "6", "--out", tmp_path / "full")
    assert code == 0, err
    run = tmp_path / "full"
    assert {"config.yaml", "metrics.jsonl", "loss.png", "samples.txt", "checkpoints", "model"} <= \
        {p.name for p in run.iterdir()}
    assert "<|assistant|>" in (run / "samples.txt").read_text()  # answers to held-out prompts
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert load_model(run / "model").config == load_model(base).config
    # 3 steps, then --resume to 6: the same losses, bitwise
    code, _, err = run_cli(capsys, "sft", *common, "--max-steps", "3", "--out", tmp_path / "split")
    assert code == 0, err
    code, _, err = run_cli(capsys, "sft", "--out", tmp_path / "split", "--resume", "--max-steps", "6",
                           "--no-progress")
    assert code == 0, err
    assert [r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r] == losses


@pytest.mark.parametrize("command, flag, changed", [("sft", "--train-on", "train_on"), ("dpo", "--beta", "beta"),
                                                   ("sft", "--val-fraction", "validation examples")])
def test_a_resume_that_changes_what_val_loss_measures_publishes_a_new_best(tmp_path, capsys, command, flag, changed):
    """`--resume --train-on all` (val_loss now counts the prompts: 3.35 -> 3.95) kept the
    best of before, and RUN/model stayed the model of the step before the resume."""
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "data.jsonl", word_chats(60) if command == "sft" else word_prefs(60))
    common = ["--init", base, "--data", data, "--batch-size", "4", "--dtype", "fp32", "--compile", "false",
              "--device", "cpu", "--eval-interval", "2", "--eval-batches", "2", "--sample-tokens", "0",
              "--no-progress", "--val-fraction", "0.2", "--out", tmp_path / "run"]
    assert run_cli(capsys, command, *common, "--max-steps", "2")[0] == 0
    value = {"--train-on": "all", "--beta": "0.5", "--val-fraction": "0.3"}[flag]
    code, out, err = run_cli(capsys, command, "--out", tmp_path / "run", "--resume", "--max-steps", "4",
                             "--no-progress", flag, value)
    assert code == 0, err
    assert f"{tmp_path / 'run'}: val_loss now measures something else ({changed} changed): the best model is " \
           "chosen afresh from step 2" in err
    assert "best val_loss" in out and "at step 4" in out  # the summary
    published = load_model(tmp_path / "run" / "model").state_dict()
    for name, weight in load_model(tmp_path / "run" / "checkpoints" / "step_00000004" / "model").state_dict().items():
        assert torch.equal(published[name], weight), name


def test_a_step_is_one_batch_however_it_is_cut_into_micro_batches(tmp_path, capsys):
    """--batch-size 8 and --batch-size 2 --grad-accum 4 take the same rows a step, and now
    the same loss and update: the mean over the step's trained tokens. Each micro-batch's
    own mean was averaged before, so a token of a short micro-batch weighed more (here
    answers of 1 and 60 characters alternate: ~30x more)."""
    base = model_dir(tmp_path)
    chats = [{"prompt": f"say {i}", "response": "x" if i % 2 else "long answer " * 5} for i in range(64)]
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    common = ["--init", base, "--data", data, "--lr", "3e-3", "--dtype", "fp32", "--compile", "false",
              "--device", "cpu", "--log-interval", "1", "--eval-interval", "100", "--no-pack", "--no-progress",
              "--val-fraction", "0.05", "--max-steps", "4", "--sample-tokens", "4"]
    runs = {}
    for batch, accum in [(8, 1), (4, 2), (2, 4)]:
        out = tmp_path / f"b{batch}x{accum}"
        code, _, err = run_cli(capsys, "sft", *common, "--batch-size", str(batch), "--grad-accum", str(accum),
                               "--out", out)
        assert code == 0, err
        runs[batch] = ([r["loss"] for r in read_metrics(out) if "loss" in r], load_model(out / "model"))
    losses, model = runs[8]
    assert len(losses) == 4
    for batch in (4, 2):
        assert runs[batch][0] == pytest.approx(losses, rel=1e-5), batch
        for (name, p), q in zip(model.state_dict().items(), runs[batch][1].state_dict().values()):
            assert (p - q).abs().max() < 1e-5, (batch, name)


def test_a_steps_loss_and_val_loss_are_the_mean_over_trained_tokens(tmp_path):
    """Against plain cross-entropy over the answer tokens (unpacked rows: the model's own
    forward): the training loss divides by the trained tokens, not all of a row's; val_loss
    weighs every trained token alike, not each batch's mean."""
    from frawdllm.align.sft import SFTTask

    tok = byte_tokenizer()
    model = tiny_model().eval()
    chats = [{"prompt": f"say {i}", "response": "x" if i % 2 else "long answer " * 3} for i in range(80)]
    cfg = SFTConfig(data=str(write_jsonl(tmp_path / "c.jsonl", chats)), out=str(tmp_path / "run"), batch_size=3,
                    pack=False, val_fraction=0.2, eval_batches=4, progress=False, device="cpu", dtype="fp32",
                    compile="false", sample_tokens=0)
    train, val, _ = load_examples(cfg, tok, 64)
    task = SFTTask(train, val, model, tok, cfg, 64)

    def plain(batches):
        with torch.no_grad():
            logits = torch.cat([model(b["tokens"])[0].flatten(0, 1) for b in batches])
        return F.cross_entropy(logits, torch.cat([b["targets"].flatten() for b in batches]), ignore_index=-100)

    batch = task.next_batch()
    with torch.no_grad():
        assert task.loss(model, batch).item() == pytest.approx(plain([batch]).item(), rel=1e-5)
    counts = {int((b["targets"] != -100).sum()) for b in task.val_batches}
    assert len(task.val_batches) >= 2 and len(counts) >= 2  # (the test can tell the two means apart)
    with torch.no_grad():  # (as the loop evaluates)
        val_loss = task.evaluate(model, torch.device("cpu"))["val_loss"]
    assert val_loss == pytest.approx(plain(task.val_batches).item(), rel=1e-5)


def test_sft_and_dpo_keep_the_init_models_sampling_defaults(tmp_path, capsys):
    """`--init`'s generation_config.json (an imported model's temperature and top-p) was
    not in the fine-tuned model: chat and generate fell back to temperature 1."""
    base = model_dir(tmp_path)
    defaults = {"temperature": 0.7, "top_p": 0.9}
    (base / "generation_config.json").write_text(json.dumps(defaults))
    common = ["--init", base, "--batch-size", "4", "--dtype", "fp32", "--compile", "false", "--device", "cpu",
              "--max-steps", "2", "--no-progress", "--val-fraction", "0.1", "--sample-tokens", "4"]
    sft_data = write_jsonl(tmp_path / "chats.jsonl", word_chats(40))
    dpo_data = write_jsonl(tmp_path / "prefs.jsonl", word_prefs(40))
    for command, data in (("sft", sft_data), ("dpo", dpo_data)):
        code, _, err = run_cli(capsys, command, *common, "--data", data, "--out", tmp_path / command)
        assert code == 0, err
        saved = json.loads((tmp_path / command / "model" / "generation_config.json").read_text())
        assert saved == defaults, command


def test_lora_on_a_model_without_its_target_layers_is_refused():
    """It froze every weight and added nothing: 0 trainable parameters, no error."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no linear layer named qkv, q, kv, proj, up, down to put LoRA adapters on in "
                                         "Sequential"):
        lora.add_lora(model, 2)
    assert all(p.requires_grad for p in model.parameters())  # untouched


def test_lora_sft_saves_a_plain_model_and_resumes_exactly(tmp_path, capsys):
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "chats.jsonl", word_chats(40))
    common = ["--init", base, "--data", data, "--batch-size", "4", "--lr", "1e-2", "--dtype", "fp32",
              "--compile", "false", "--device", "cpu", "--log-interval", "1", "--eval-interval", "2",
              "--sample-tokens", "0", "--no-progress", "--lora-rank", "4"]
    assert run_cli(capsys, "sft", *common, "--max-steps", "4", "--out", tmp_path / "full")[0] == 0
    assert run_cli(capsys, "sft", *common, "--max-steps", "2", "--out", tmp_path / "split")[0] == 0
    # (--lora-alpha 8 is the default 2 x rank: the same run, not a change of its adapters)
    code, _, err = run_cli(capsys, "sft", "--out", tmp_path / "split", "--resume", "--max-steps", "4",
                           "--no-progress", "--lora-alpha", "8")
    assert code == 0 and "differ" not in err, err
    full = [r["loss"] for r in read_metrics(tmp_path / "full") if "loss" in r]
    assert [r["loss"] for r in read_metrics(tmp_path / "split") if "loss" in r] == full
    trained, start = load_model(tmp_path / "full" / "model"), load_model(base)
    changed = {n for n, p in trained.state_dict().items() if not torch.equal(p, start.state_dict()[n])}
    assert changed and all(n.endswith(("qkv.weight", "proj.weight", "up.weight", "down.weight")) for n in changed)


def test_sft_output_works_with_chat_and_the_hf_export(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "chats.jsonl", word_chats(20))
    code, _, err = run_cli(capsys, "sft", "--init", base, "--data", data, "--max-steps", "2", "--dtype", "fp32",
                           "--compile", "false", "--device", "cpu", "--sample-tokens", "0", "--no-progress",
                           "--out", tmp_path / "run")
    assert code == 0, err
    model = tmp_path / "run" / "model"
    code, out, err = run_cli(capsys, "generate", "--model", model, "--prompt", "hi", "--max-new-tokens", "4",
                             "--seed", "1")
    assert code == 0, err
    from test_chat_cli import expected_reply, say, spawn

    child = spawn(model, "--temperature", "0", "--max-new-tokens", "6")
    assert say(child, "reverse apple") == expected_reply(model, [{"role": "user", "content": "reverse apple"}], 6)
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    assert run_cli(capsys, "export", "--model", model, "--format", "hf", "--out", tmp_path / "hf")[0] == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = [{"role": "user", "content": "reverse apple"}]
    ids = hf_tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids == byte_tokenizer().render_chat(chat)


def test_examples_come_from_gzip_jsonl_parquet_and_local_hf_datasets(tmp_path):
    import gzip
    import json

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    datasets = pytest.importorskip("datasets")

    records = word_chats(12)
    with gzip.open(tmp_path / "chats.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hfds"))
    tok = byte_tokenizer()
    expected = [tokenize_chat(tok, chat_messages(r, "x")).ids for r in records]
    for spec in (tmp_path / "chats.jsonl.gz", tmp_path / "chats.parquet", f"hf:{tmp_path / 'hfds'}"):
        cfg = SFTConfig(data=str(spec), progress=False, max_steps=1, val_fraction=0.0)
        train, _, summary = load_examples(cfg, tok, 64)
        assert [e.ids for e in train] == expected and summary.examples == 12, spec


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_translation_model_as_init_is_one_line_before_any_work(command, tmp_path, capsys):
    from frawdllm import Seq2SeqTransformer, get_config

    from align_helpers import word_prefs

    mt = tmp_path / "mt"
    Seq2SeqTransformer(get_config("aiayn-tiny", vocab_size=263, n_embd=32, n_head=2, n_layer=1,
                                  n_encoder_layer=1)).save_pretrained(mt, tokenizer=byte_tokenizer())
    records = word_chats(20) if command == "sft" else word_prefs(20)
    data = write_jsonl(tmp_path / "data.jsonl", records)
    code, _, err = run_cli(capsys, command, "--init", mt, "--data", data, "--max-steps", "1", "--out",
                           tmp_path / "run")
    assert code == 1 and "holds an encoder-decoder translation model" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_before_its_first_checkpoint_is_started_over_by_resume(tmp_path, capsys, monkeypatch):
    from frawdllm.align import job

    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "chats.jsonl", word_chats(40))
    run = tmp_path / "run"
    args = ["sft", "--init", base, "--data", data, "--batch-size", "4", "--dtype", "fp32", "--compile", "false",
            "--eval-interval", "0", "--log-interval", "1", "--sample-tokens", "0", "--no-progress", "--max-steps", "2",
            "--out", run]

    def interrupted(self):  # Ctrl-C during the first step: config.yaml and metrics.jsonl, no checkpoint
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(job.Trainer, "fit", interrupted)
        code, _, _ = run_cli(capsys, *args)
    assert code == 130 and (run / "config.yaml").exists() and not (run / "checkpoints").exists()
    code, _, err = run_cli(capsys, *args)
    assert code == 1 and "stopped before its first checkpoint; --resume or --overwrite starts it over" in err
    code, out, err = run_cli(capsys, "sft", "--out", run, "--resume", "--no-progress")
    assert code == 0, err
    assert "starting the run over" in err
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]


@pytest.mark.parametrize("flag", ["--overwrite", "--resume"])
def test_an_overwrite_or_resume_whose_data_is_refused_leaves_the_earlier_run_as_it_was(flag, tmp_path, capsys):
    # (--overwrite deleted the run it was to replace, then refused the data: an empty folder)
    base = model_dir(tmp_path)
    data = write_jsonl(tmp_path / "chats.jsonl", word_chats(40))
    run = tmp_path / "run"
    args = ["--init", base, "--batch-size", "4", "--dtype", "fp32", "--compile", "false", "--eval-interval", "0",
            "--sample-tokens", "0", "--no-progress", "--out", run]
    assert run_cli(capsys, "sft", "--data", data, "--max-steps", "2", *args)[0] == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    (tmp_path / "bad.jsonl").write_text('{"messages": [}\n', encoding="utf-8")
    code, _, err = run_cli(capsys, "sft", "--data", tmp_path / "bad.jsonl", "--max-steps", "4", flag, *args)
    assert code == 1 and "bad.jsonl:1: not valid JSON" in err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_the_pretraining_sample_prompt_is_no_option_of_sft_or_dpo(command, tmp_path, capsys):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "--sample-prompt" not in out and "--sample-count" in out
    config = tmp_path / "c.yaml"
    config.write_text("sample_prompt: Hi\n")  # the same field through a config file
    code, _, err = run_cli(capsys, command, "--config", config, "--init", tmp_path, "--max-steps", "1",
                           "--out", tmp_path / "run")
    assert code == 1 and "sample_prompt: sft and dpo take no prompt" in err and err.count("\n") == 1, err


def test_the_data_summary_prints_without_progress_and_all_bad_records_name_the_file(tmp_path, capsys):
    base = model_dir(tmp_path)
    data = tmp_path / "chats.jsonl"
    write_jsonl(data, word_chats(20))
    data.write_text(data.read_text() + "{not json\n[1]\n")
    common = ["--init", base, "--batch-size", "4", "--dtype", "fp32", "--compile", "false", "--device", "cpu",
              "--sample-tokens", "0", "--max-steps", "1", "--skip-bad-lines", "--no-progress"]
    code, out, err = run_cli(capsys, "sft", *common, "--data", data, "--out", tmp_path / "run")
    assert code == 0, err
    assert "sft data: 20 examples" in err and "2 bad records skipped (first: " in err and "chats.jsonl:21" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n[1]\n" + '{"prompt": "a"}\n')
    code, _, err = run_cli(capsys, "sft", *common, "--data", bad, "--out", tmp_path / "run2")
    assert code == 1 and err.count("\n") == 1, err
    assert f"--data {bad} holds no usable examples: all 3 records were bad and skipped" in err
    assert "bad.jsonl:1: not valid JSON" in err and not (tmp_path / "run2").exists()
    bad.write_text("{not json\n")  # one record: said in the singular (was "all 1 records were")
    code, _, err = run_cli(capsys, "sft", *common, "--data", bad, "--out", tmp_path / "run2")
    assert code == 1 and "holds no usable examples: 1 record was bad and skipped (bad.jsonl:1: not valid JSON" \
        in err.replace(str(tmp_path) + "/", ""), err


@pytest.mark.parametrize("command, takes, refuses", [("sft", "stdlib-instruct", "stdlib-prefs"),
                                                     ("dpo", "stdlib-prefs", "stdlib-instruct")])
def test_each_help_names_only_the_built_in_corpus_its_command_takes(command, takes, refuses, capsys):
    code, out, _ = run_cli(capsys, command, "--help")
    text = "".join(out.split())  # a name may be wrapped at its hyphen
    assert code == 0 and takes in text and refuses not in text


def test_lora_under_fsdp_is_refused_before_anything_runs():
    """The adapters' merge into FSDP-sharded weights saved a wrong model (eval loss 5.96
    against 4.72): the pair is refused where the config is made, before torchrun starts."""
    from frawdllm.align.sft import SFTConfig
    from frawdllm.errors import ConfigError

    with pytest.raises(ConfigError, match="--lora-rank .* --parallel fsdp"):
        SFTConfig(init="m", lora_rank=4, parallel="fsdp", max_steps=1)
    assert SFTConfig(init="m", lora_rank=4, parallel="ddp", max_steps=1).lora_rank == 4


def test_lora_alpha_without_a_rank_and_dpo_beta_inf_are_refused():
    """--lora-alpha alone was ignored; --beta inf ran with NaN losses and exited 0."""
    from frawdllm.align.dpo import DPOConfig
    from frawdllm.align.sft import SFTConfig
    from frawdllm.errors import ConfigError

    with pytest.raises(ConfigError, match="lora_alpha scales LoRA adapters: give --lora-rank"):
        SFTConfig(init="m", lora_alpha=8.0, max_steps=1)
    assert SFTConfig(init="m", lora_alpha=8.0, lora_rank=4, max_steps=1).lora_alpha == 8
    for beta in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ConfigError, match="beta must be a finite positive number"):
            DPOConfig(init="m", beta=beta, max_steps=1)
    for alpha in (float("inf"), float("nan"), 0.0):  # (inf: every step NaN, and exit 0)
        with pytest.raises(ConfigError, match="lora_alpha must be a finite positive number"):
            SFTConfig(init="m", lora_alpha=alpha, lora_rank=4, max_steps=1)


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_lora_rank_above_n_embd_is_one_line_before_any_work(command, tmp_path, capsys):
    """Rank 100000 on a 256-wide model was accepted: adapters larger than the weights, a step 20x slower."""
    from align_helpers import word_prefs

    base = model_dir(tmp_path)
    n_embd = json.loads((base / "config.json").read_text())["n_embd"]
    data = write_jsonl(tmp_path / "data.jsonl", word_chats(20) if command == "sft" else word_prefs(20))
    code, _, err = run_cli(capsys, command, "--init", base, "--data", data, "--max-steps", "1", "--out",
                           tmp_path / "run", "--no-progress", "--lora-rank", str(n_embd + 1))
    assert code == 1 and err.count("\n") == 1, err
    assert f"--lora-rank {n_embd + 1} exceeds the model's n_embd {n_embd}" in err
    assert not (tmp_path / "run").exists()
    if command == "sft":  # at the bounds: a rank of n_embd and a --max-length of the whole context are taken
        context = json.loads((base / "config.json").read_text())["context_length"]
        code, _, err = run_cli(capsys, command, "--init", base, "--data", data, "--max-steps", "1", "--out",
                               tmp_path / "run", "--no-progress", "--lora-rank", str(n_embd),
                               "--max-length", str(context), "--sample-tokens", "0")
        assert code == 0, err


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_batch_no_memory_holds_is_one_line_before_any_work(command, tmp_path, capsys):
    """sft --batch-size 100000 was killed by the kernel's OOM killer, leaving a half-made run."""
    from align_helpers import word_prefs

    data = write_jsonl(tmp_path / "data.jsonl", word_chats(20) if command == "sft" else word_prefs(20))
    code, _, err = run_cli(capsys, command, "--init", model_dir(tmp_path), "--data", data, "--max-steps", "1",
                           "--out", tmp_path / "run", "--no-progress", "--batch-size", "100000000")
    assert code == 1 and err.count("\n") == 1, err
    rows = "200,000,000 rows" if command == "dpo" else "rows"
    assert f"--batch-size 100000000 ({rows} of 64 tokens) needs at least" in err and "GiB available" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_a_tokenizer_with_more_ids_than_the_model_is_one_line_before_any_work(command, tmp_path, capsys):
    """It used to start the run, crash with an IndexError at step 0 and leave a half-made OUT."""
    from frawdllm import FrawdLLM, get_config

    from align_helpers import word_prefs

    small = tmp_path / "small"
    FrawdLLM(get_config("tiny-llama", vocab_size=200, n_layer=1, n_embd=32, n_head=4, context_length=64)
             ).save_pretrained(small)
    byte_tokenizer().save(small / "tokenizer.json")  # 263 ids (save_pretrained refuses to pair them)
    data = write_jsonl(tmp_path / "data.jsonl", word_chats(20) if command == "sft" else word_prefs(20))
    code, _, err = run_cli(capsys, command, "--init", small, "--data", data, "--max-steps", "1", "--out",
                           tmp_path / "run", "--no-progress")
    assert code == 1 and err.count("\n") == 1, err
    assert f"{small}: the tokenizer has 263 ids but the model only 200" in err
    assert not (tmp_path / "run").exists()


def test_invalid_utf8_and_lone_surrogates_are_bad_records_named_by_line(tmp_path, capsys):
    """Bad bytes used to become U+FFFD silently (and be trained on), a bad first byte read as
    "not valid JSON", and a JSON "\\ud800" stopped the run without file:line even with
    --skip-bad-lines."""
    good = "".join(__import__("json").dumps(r) + "\n" for r in word_chats(6)).encode()
    data = tmp_path / "chats.jsonl"
    data.write_bytes(good + b'\xff{"prompt": "a", "response": "b"}\n'  # line 7: a bad byte first
                     + b'{"prompt": "a\xfe", "response": "b"}\n'  # 8: inside a string
                     + b'{"prompt": "a\\ud800", "response": "b"}\r\n'  # 9: a lone (high) surrogate
                     + b'{"prompt": "a\\udc00", "response": "b"}\n' + good)  # 10: a lone low one
    cfg = SFTConfig(init=None, data=str(data), progress=False, max_steps=1, val_fraction=0.0)
    with pytest.raises(BadExample, match=r"chats.jsonl:7: not valid UTF-8 \(byte 0xff at byte 1 of the line\)"):
        load_examples(cfg, byte_tokenizer(), 64)
    cfg.skip_bad_lines = True
    train, _, summary = load_examples(cfg, byte_tokenizer(), 64)
    assert (summary.skipped, len(train)) == (4, 12)
    assert "chats.jsonl:8: not valid UTF-8 (byte 0xfe at byte 14 of the line)" in summary.first_skipped[1]
    assert "chats.jsonl:9: holds a lone surrogate \\ud800" in summary.first_skipped[2]
    from frawdllm.data.records import BadRecord, _parse

    assert _parse(b'{"prompt": "a\\udc00"}') == BadRecord("holds a lone surrogate \\udc00 (a JSON escape that is not text)")
    assert not any("\ufffd" in byte_tokenizer().decode(e.ids) for e in train)  # nothing replaced was learned
    # a pair whose answers differ only in bad bytes is named for them, not as "the same text"
    from frawdllm.align.dpo import DPOConfig, load_pairs

    prefs = tmp_path / "prefs.jsonl"
    prefs.write_bytes(b'{"prompt": "a", "chosen": "x\xff", "rejected": "x\xfe"}\n')
    with pytest.raises(BadExample, match=r"prefs.jsonl:1: not valid UTF-8 \(byte 0xff"):
        load_pairs(DPOConfig(data=str(prefs), val_fraction=0.0), byte_tokenizer(), 64)


def test_a_data_folder_ignores_other_files_but_a_named_one_is_refused(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", word_chats(10))
    (folder / "README.md").write_text("# chats\n")
    (folder / "old").mkdir()
    (folder / "old" / "README.md").write_text("# older chats\n")  # (both were shown as README.md)
    cfg = SFTConfig(init=None, data=str(folder), progress=False, max_steps=1, val_fraction=0.0)
    train, _, summary = load_examples(cfg, byte_tokenizer(), 64)
    assert len(train) == 10 and "; 2 other files in --data ignored (README.md, old/README.md)" in summary.line()
    from frawdllm.errors import FrawdError

    cfg.data = str(folder / "README.md")
    with pytest.raises(FrawdError, match="README.md: expected a .jsonl, .jsonl.gz or .parquet file"):
        load_examples(cfg, byte_tokenizer(), 64)
    (folder / "a.jsonl").unlink()
    cfg.data = str(folder)
    with pytest.raises(FrawdError, match=r"holds no .jsonl, .jsonl.gz or .parquet file of examples \(found: README"):
        load_examples(cfg, byte_tokenizer(), 64)


def test_config_yaml_keeps_the_built_in_data_names_so_resume_finds_them(tmp_path, monkeypatch):
    """config.yaml's paths are saved absolute; `stdlib-instruct` and `stdlib-prefs` (the
    default data of sft and dpo) became `<cwd>/stdlib-instruct`, and `--resume` then failed
    with "data source not found"."""
    from frawdllm.align import stdlib_corpus
    from frawdllm.data.sources import BUILTIN_SOURCES
    from frawdllm.train.rundir import absolute_paths

    monkeypatch.chdir(tmp_path)
    assert set(stdlib_corpus.CORPORA) | {"stdlib"} == set(BUILTIN_SOURCES)
    for name in BUILTIN_SOURCES:
        assert absolute_paths({"data": name}) == {"data": name}
    assert absolute_paths({"data": "prefs.jsonl"}) == {"data": str(tmp_path / "prefs.jsonl")}


@pytest.mark.parametrize("command,data,said", [
    ("sft", "nope.jsonl", "data source not found: 'nope.jsonl'"),
    ("dpo", "stdlib-instruct", "--data stdlib-instruct holds instructions; use --data stdlib-prefs here")])
def test_nproc_refuses_bad_data_once_before_torchrun(command, data, said, tmp_path, capsys, monkeypatch):
    """Each rank found it: the error once per rank, then torchrun's failure table."""
    from frawdllm.cli import sft as sft_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sft_cli, "relaunch_under_torchrun", lambda *a, **k: pytest.fail("torchrun started"))
    code, _, err = run_cli(capsys, command, "--init", model_dir(tmp_path), "--data", data, "--nproc", "2",
                           "--out", tmp_path / "run", "--max-steps", "1")
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"frawd: error: {said}"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("train_on, learned", [("assistant", "A2<|eos|>A3<|eos|>"), ("last", "A3<|eos|>"),
                                               ("all", None)])
def test_a_prompt_completion_record_learns_only_its_completion(train_on, learned, tmp_path):
    """As TRL's SFTTrainer does (completion_only_loss): the prompt's assistant turns were
    trained too, and a completion with no assistant turn trained on the prompt's alone."""
    tok = byte_tokenizer()
    prompt = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "WRONG"},
              {"role": "user", "content": "Q2"}]
    completion = [{"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"},
                  {"role": "assistant", "content": "A3"}]
    write_jsonl(tmp_path / "chats.jsonl", [{"prompt": prompt, "completion": completion}])
    cfg = SFTConfig(init=None, data=str(tmp_path / "chats.jsonl"), progress=False, max_steps=1, val_fraction=0.0,
                    train_on=train_on)
    (example,), _, _ = load_examples(cfg, tok, 256)
    assert example.ids == tok.render_chat(prompt + completion, add_generation_prompt=False)
    if learned is None:  # every token but the unpredicted <|bos|>, the prompt's too
        assert example.trained == [False] + [True] * (len(example.ids) - 1)
    else:
        assert tok.decode([i for i, t in zip(example.ids, example.trained) if t]) == learned
    # the same conversation as messages still learns every assistant turn
    as_messages = tokenize_chat(tok, chat_messages({"messages": prompt + completion}, "r:1"), train_on)
    assert as_messages.ids == example.ids
    if train_on == "assistant":
        assert tok.decode([i for i, t in zip(as_messages.ids, as_messages.trained) if t]) == \
            "WRONG<|eos|>A2<|eos|>A3<|eos|>"
    # a prompt/response record's string response is its one trained turn, as before
    strings = tokenize_chat(tok, chat_messages({"prompt": "Q", "response": "A"}, "r:1"), train_on)
    assert show(tok, strings) == ("<2><4>Q<3><5>A*<3>*" if learned else "<2><4>*Q*<3>*<5>*A*<3>*")


def test_a_completion_without_an_assistant_turn_is_a_bad_record(tmp_path):
    prompt = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}]
    data = tmp_path / "chats.jsonl"
    write_jsonl(data, word_chats(3) + [{"prompt": prompt, "completion": [{"role": "user", "content": "Q2"}]}])
    cfg = SFTConfig(init=None, data=str(data), progress=False, max_steps=1, val_fraction=0.0)
    with pytest.raises(BadExample, match=r"/chats.jsonl:4: 'completion' has no assistant turn to learn "
                                         r"\(--skip-bad-lines"):
        load_examples(cfg, byte_tokenizer(), 64)
    cfg.skip_bad_lines = True
    train, _, summary = load_examples(cfg, byte_tokenizer(), 64)
    assert (len(train), summary.skipped) == (3, 1)
    with pytest.raises(BadExample, match=r"r:1: the conversation has no assistant turn to learn"):
        chat_messages({"messages": prompt[:1]}, "r:1")
    # DPO's prompt may hold assistant turns (context): unchanged
    from frawdllm.align.dpo import DPOConfig, load_pairs

    write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": prompt + [{"role": "user", "content": "Q2"}],
                                            "chosen": "yes", "rejected": "no"}])
    (pair,), _, _ = load_pairs(DPOConfig(data=str(tmp_path / "prefs.jsonl"), val_fraction=0.0), byte_tokenizer(), 64)
    assert pair.prompt == byte_tokenizer().render_chat(prompt + [{"role": "user", "content": "Q2"}],
                                                       add_generation_prompt=True)
