"""Streaming text: never half a character, never a partial stop string, same text as a
one-shot decode."""

import json

import pytest

from frawdllm.infer.textstream import TextStream, text_after
from frawdllm.tokenizer import EOS_ID, byte_tokenizer, train_tokenizer

TEXT = "héllo wörld € 😀 ok – ñ"


@pytest.fixture(scope="module")
def byte_tok():
    return byte_tokenizer()


def push_all(stream, ids):
    return [stream.push(i) for i in ids] + [stream.finish()]


def test_stream_never_splits_a_multibyte_character(byte_tok):
    ids = byte_tok.encode(TEXT)
    assert len(ids) > len(TEXT)  # several characters take several byte tokens
    chunks = push_all(TextStream(byte_tok), ids)
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == TEXT
    # Each chunk is whole characters: it encodes back to exactly its bytes.
    assert sum(len(c.encode("utf-8")) for c in chunks) == len(ids)


def test_a_stream_after_a_prompt_that_ends_inside_a_character_completes_it(byte_tok):
    """A prompt of ids can end inside a character ("hello " and 2 of the 4 bytes of 😀): the
    reply's first bytes completed it, yet were decoded alone, a U+FFFD the full text lacks."""
    ids = byte_tok.encode("hello 😀 あ")
    prompt, reply = ids[:8], ids[8:]
    assert byte_tok.decode(prompt).endswith("\ufffd")
    assert "".join(push_all(TextStream(byte_tok, context=prompt), reply)) == " あ"
    assert "".join(push_all(TextStream(byte_tok), reply)) == "\ufffd\ufffd あ"  # (without the prompt's ids)
    # a reply that does not continue the character: its own text, the broken one stays the prompt's
    assert "".join(push_all(TextStream(byte_tok, context=prompt), byte_tok.encode("ok"))) == "ok"
    assert "".join(push_all(TextStream(byte_tok, context=ids[:6]), reply)) == "\ufffd\ufffd あ"  # (a whole prompt)


def test_stream_over_bpe_equals_one_shot_decode():
    tok = train_tokenizer([TEXT * 20, "the quick brown fox jumps over the lazy dog"] * 5, kind="bpe", vocab_size=300)
    ids = tok.encode(TEXT + " the lazy fox")
    assert "".join(push_all(TextStream(tok), ids)) == tok.decode(ids)


def test_special_tokens_are_not_text(byte_tok):
    ids = byte_tok.encode("ab") + [EOS_ID] + byte_tok.encode("c")
    assert "".join(push_all(TextStream(byte_tok), ids)) == "abc"


def test_partial_stop_string_is_held_back_until_it_cannot_match(byte_tok):
    stream = TextStream(byte_tok, stop=["STOP"])
    out = [stream.push(i) for i in byte_tok.encode("go STO")]
    assert "".join(out) == "go "  # "STO" could still become "STOP"
    assert stream.push(byte_tok.encode("x")[0]) == "STOx"  # now it cannot: released
    assert not stream.stopped


def test_stop_string_across_tokens_ends_the_stream_and_is_never_emitted(byte_tok):
    stream = TextStream(byte_tok, stop=["\n\nUser:", "END"])
    chunks = push_all(stream, byte_tok.encode("Hello there.\n\nUser: more text"))
    assert "".join(chunks) == "Hello there."
    assert stream.stopped and stream.text == "Hello there."
    assert stream.push(byte_tok.encode("z")[0]) == ""  # nothing after a stop


def test_the_first_stop_string_to_complete_ends_the_text(byte_tok):
    # "cd" completes at "abcd", before "bcde" could: the text ends before "cd".
    stream = TextStream(byte_tok, stop=["bcde", "cd"])
    assert "".join(push_all(stream, byte_tok.encode("abcdef"))) == "ab"


def test_of_two_stop_strings_in_one_token_the_earlier_ends_the_text():
    """One token can bring several stop strings at once (BPE merges text with punctuation):
    the text ends at the earliest, whichever stop string is listed first."""

    class Pieces:
        pieces = ["x", "A.b\nc"]

        def decode(self, ids, skip_special_tokens=False):
            return "".join(self.pieces[i] for i in ids)

    for stop in (["\n", "."], [".", "\n"]):
        stream = TextStream(Pieces(), stop=stop)
        assert "".join(push_all(stream, [0, 1])) == "xA" and stream.stopped


def test_held_back_text_is_flushed_at_the_end(byte_tok):
    stream = TextStream(byte_tok, stop=["STOP"])
    assert "".join(push_all(stream, byte_tok.encode("ends with ST"))) == "ends with ST"
    truncated = byte_tok.encode("é")[:1]  # a lone lead byte at the very end
    assert push_all(TextStream(byte_tok), truncated) == ["", "\ufffd"]


class _CountingTokenizer:
    """A tokenizer that records how many ids each decode call reads."""

    def __init__(self, tokenizer):
        self.tokenizer, self.widths = tokenizer, []

    def decode(self, ids, skip_special_tokens=False):
        self.widths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_run_of_invalid_bytes_streams_at_a_constant_cost_per_token(byte_tok):
    # 2000 UTF-8 continuation bytes never form a character: the text is 2000 U+FFFD. They
    # must come out while the run goes on (not all at the end), and no push may re-decode
    # the whole run (it did: 16000 tokens of this took 4x as long streamed as not).
    continuation = byte_tok.encode("é")[1]
    counting = _CountingTokenizer(byte_tok)
    stream = TextStream(counting)
    ids = byte_tok.encode("ok ") + [continuation] * 2000 + byte_tok.encode(" é!")
    chunks = push_all(stream, ids)
    assert "".join(chunks) == byte_tok.decode(ids) == "ok " + "\ufffd" * 2000 + " é!"
    assert sum(len(c) for c in chunks[:1000]) > 900  # streamed as it came
    assert max(counting.widths) <= 32


def test_a_real_character_after_a_run_of_invalid_bytes_is_still_whole(byte_tok):
    continuation = byte_tok.encode("é")[1]
    ids = [continuation] * 40 + byte_tok.encode("😀 ok")
    assert "".join(push_all(TextStream(byte_tok), ids)) == "\ufffd" * 40 + "😀 ok"


@pytest.fixture(scope="module")
def sentencepiece_tok():
    """A Llama-2/Mistral-style tokenizer: '\u2581' for spaces, byte fallback ("<0x0A>")."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, trainers

    from frawdllm.tokenizer import Tokenizer

    spm = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm.train_from_iterator(["all alpha along the lines of al and la"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    setup = json.loads(spm.to_str())  # + the 256 byte tokens, as SentencePiece's vocabularies have them
    vocab = setup["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer(Backend.from_str(json.dumps(setup)))


def test_a_byte_fallback_group_is_held_until_it_closes(sentencepiece_tok):
    """Its decoder turns every byte of a group that is not valid UTF-8 into U+FFFD, the
    newline before a broken character too: the stream had shown "\\n" that the whole decode
    (generate --json, transformers) did not have."""
    tok = sentencepiece_tok
    ids = {name: tok.backend.token_to_id(name) for name in ("<0x0A>", "<0xE6>", "<0x97>", "<0xA5>", "<0x16>",
                                                            "<0x80>")}
    assert None not in ids.values() and set(ids.values()) <= tok.fallback_byte_ids
    al = tok.encode("al")
    for tail in (["<0x0A>", "<0xE6>", "<0x97>"],  # "\n" and half of "日": three U+FFFD when decoded whole
                 ["<0x16>", "<0x80>"],  # a control byte and a stray continuation byte
                 ["<0x0A>", "<0xE6>", "<0x97>", "<0xA5>"]):  # "\n日": valid, shown as it is
        seq = al + [ids[name] for name in tail]
        for more in ([], tok.encode(" la")):  # the group closed by the end, or by a piece after it
            assert "".join(push_all(TextStream(tok), seq + more)) == tok.decode(seq + more), (tail, more)
    seq = al + [ids["<0x0A>"]] * 3 + tok.encode("al")
    assert "".join(push_all(TextStream(tok), seq)) == tok.decode(seq) == "al\n\n\n al"
    chunks = push_all(TextStream(tok), tok.encode("all alpha along the lines"))
    assert sum(1 for c in chunks if c) > 2  # (plain pieces still stream as they come)


def test_a_byte_fallback_group_longer_than_the_hold_limit_is_whole(sentencepiece_tok):
    """Six CJK characters (18 byte tokens) or five emoji (20): at the hold limit (16 ids) the
    group went out decoded as it was, ending inside a character, so every byte was U+FFFD;
    then the whole group decoded shorter than what was shown, and the text after it ("cd")
    never came. Against the whole decode, at every split of the stream's ids."""
    tok = sentencepiece_tok
    for text in ("ab 日本語日本語 cd", "ab 😀😀😀😀😀 al", "日本語日本語日本語日本語", "al 日本語日本語\n日本語日本語 la"):
        ids = tok.encode(text)
        assert sum(i in tok.fallback_byte_ids for i in ids) > 16, text
        assert "".join(push_all(TextStream(tok), ids)) == tok.decode(ids) == text
        for stop in ("cd", "\u672c\u8a9e\u65e5"):  # a stop string in text after the group, or in it
            if stop in text:
                assert "".join(push_all(TextStream(tok, stop=[stop]), ids)) == text[:text.index(stop)], stop
    # bytes that never form a character still stream, as U+FFFD
    bad = [tok.backend.token_to_id("<0x80>")] * 20 + tok.encode(" al")
    assert "".join(push_all(TextStream(tok), bad)) == tok.decode(bad)


@pytest.fixture(scope="module", params=["llama", "metaspace"])
def word_pieces_tok(request):
    """SentencePiece-style tokenizers whose pieces never span a space, as Llama-2's (its
    decoder strips the text's first space) and `tokenizers`' own Metaspace decoder."""
    from tokenizers import Tokenizer as Backend, decoders, models, normalizers, pre_tokenizers, trainers

    from frawdllm.tokenizer import Tokenizer

    spm = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if request.param == "llama":
        spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        spm.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        spm.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        spm.pre_tokenizer, spm.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    spm.train_from_iterator(["all alpha along the lines of al and la"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"]))
    setup = json.loads(spm.to_str())
    vocab = setup["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return Tokenizer(Backend.from_str(json.dumps(setup)))


def test_a_sentencepiece_reply_keeps_the_space_before_its_first_word(word_pieces_tok):
    """Its decoder drops the space a text's first token starts with ("\u2581alpha" alone is
    "alpha"), and the stream decoded the reply alone: prompt "all" + reply "alpha" read
    "allalpha" where transformers (prompt and reply decoded together) reads "all alpha".
    A reply after the prompt's start of text (only <s>) still starts with its word."""
    tok = word_pieces_tok
    ids = tok.encode("all alpha along the lines")
    assert len(ids) == 5  # (a piece a word)
    for cut in range(1, len(ids)):
        prompt, reply = ids[:cut], ids[cut:]
        want = tok.decode(ids)[len(tok.decode(prompt)):]  # (independent: the whole decode)
        assert "".join(push_all(TextStream(tok, (), prompt), reply)) == want, cut
        assert text_after(tok, prompt, reply) == want
    bos = tok.backend.token_to_id("<s>")
    assert "".join(push_all(TextStream(tok, (), [bos]), ids)) == text_after(tok, [bos], ids) == "all alpha along the lines"


def test_a_sentencepiece_tokens_bytes_are_its_text_after_another(word_pieces_tok):
    """Logprobs name a token by `token_bytes`: a "\u2581" token's space was lost (decoded
    alone), so a reply's tokens did not join to its text; a byte token was U+FFFD."""
    tok = word_pieces_tok
    ids = tok.encode("all alpha along the lines")
    assert b"".join(tok.token_bytes(i) for i in ids[1:]).decode() == tok.decode(ids)[len(tok.decode(ids[:1])):]
    assert tok.token_bytes(ids[1]).startswith(b" ")
    if tok.fallback_byte_ids:  # (llama's decoder has ByteFallback)
        assert tok.token_bytes(tok.backend.token_to_id("<0xE6>")) == b"\xe6"
        assert tok.token_bytes(tok.backend.token_to_id("<0x0A>")) == b"\n"


def test_only_a_byte_fallback_tokenizer_has_fallback_bytes(byte_tok):
    assert byte_tok.fallback_byte_ids == frozenset()
    assert train_tokenizer(["abc"], kind="char").fallback_byte_ids == frozenset()


def test_a_long_sentencepiece_stream_keeps_every_words_space_after_the_window_moves(word_pieces_tok):
    """The decode window restarts every few tokens; restarting it at the newest id (instead
    of at the ids already read) decodes the next "\u2581word" alone, which drops its space."""
    tok = word_pieces_tok
    text = "all alpha along the lines of al and la all alpha along the lines of al and la"
    ids = tok.encode(text)
    assert len(ids) > 12
    assert "".join(push_all(TextStream(tok), ids)) == tok.decode(ids) == text
    prompt, reply = ids[:2], ids[2:]
    assert "".join(push_all(TextStream(tok, (), prompt), reply)) == text_after(tok, prompt, reply) \
        == tok.decode(ids)[len(tok.decode(prompt)):]


def test_a_reply_after_a_prompt_ending_in_a_byte_fallback_character_is_whole(sentencepiece_tok):
    """A prompt ending in "日" as byte tokens: its last byte must not be read before the reply
    (alone it is not UTF-8, and with the reply's bytes the whole group turned to U+FFFD)."""
    tok = sentencepiece_tok
    prompt = tok.encode("al 日")
    reply = tok.encode("al 日本 al")[len(prompt):]
    assert prompt[-1] in tok.fallback_byte_ids and reply[0] in tok.fallback_byte_ids
    want = tok.decode(prompt + reply)[len(tok.decode(prompt)):]
    assert want == "本 al"
    assert "".join(push_all(TextStream(tok, (), prompt), reply)) == want
    assert text_after(tok, prompt, reply) == want
