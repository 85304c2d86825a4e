"""Sampling: the filters keep exactly the right tokens, the draw follows the distribution,
seeds reproduce, the penalty follows its definition, bad parameters are refused clearly."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from frawdllm.errors import ConfigError, FrawdError
from frawdllm.infer.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    apply_repetition_penalty,
    make_generator,
    min_p_filter,
    processed_logits,
    greedy_choice,
    sample_next,
    top_k_filter,
    top_p_filter,
)
from infer_helpers import one_thread  # noqa: F401  (autouse fixture)


def logits_of(probs):
    return torch.tensor([[math.log(p) for p in probs]])


def kept(logits):
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


PROBS = [0.05, 0.5, 0.15, 0.3]  # ranks: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize("k, expected", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3}), (0, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely_tokens(k, expected):
    assert kept(top_k_filter(logits_of(PROBS), k)) == expected


def test_top_k_keeps_ties_with_the_kth_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    assert kept(top_k_filter(logits, 2)) == {1, 2, 3}


@pytest.mark.parametrize("p, expected", [
    (1e-50, {1}),  # 0 in float32: the top token still stays (every token dropped made NaN probabilities)
    (0.3, {1}),  # the top token alone already reaches 0.3
    (0.5, {1}),
    (0.55, {1, 3}),  # 0.5 < 0.55 <= 0.8
    (0.79, {1, 3}),
    (0.81, {1, 2, 3}),  # needs 0.5 + 0.3 + 0.15 = 0.95
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert kept(top_p_filter(logits_of(PROBS), p)) == expected


@pytest.mark.parametrize("min_p, expected", [
    (0.0, {0, 1, 2, 3}),
    (0.09, {0, 1, 2, 3}),  # threshold 0.045 < 0.05
    (0.11, {1, 2, 3}),  # threshold 0.055
    (0.29, {1, 2, 3}),  # threshold 0.145 < 0.15
    (0.31, {1, 3}),
    (0.61, {1}),  # threshold 0.305 > 0.3
    (1.0, {1}),  # the top token's own probability: it alone stays (none, with <=: sampling then failed)
])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top_probability(min_p, expected):
    assert kept(min_p_filter(logits_of(PROBS), min_p)) == expected


def test_filters_compose_in_order_top_k_then_top_p_renormalised():
    # After top-k=2 the survivors {1: 0.5, 3: 0.3} renormalise to 0.625 / 0.375, so
    # top-p=0.6 keeps only token 1 (on the full distribution it would keep 1 and 3).
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)
    assert kept(processed_logits(logits_of(PROBS), params)) == {1}
    assert kept(top_p_filter(logits_of(PROBS), 0.6)) == {1, 3}


def test_filters_match_hugging_face_warpers_on_random_logits():
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    history = torch.randint(0, 50, (6, 12), generator=gen)
    seen = torch.zeros(6, 50, dtype=torch.bool).scatter_(1, history, True)
    for temperature, top_k, top_p, min_p, penalty in [
        (0.7, 10, 1.0, 0.0, 1.0), (1.3, 0, 0.8, 0.0, 1.0), (1.0, 0, 1.0, 0.1, 1.0),
        (0.9, 20, 0.9, 0.05, 1.3), (1.0, 5, 0.5, 0.0, 0.8),
    ]:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repetition_penalty=penalty)
        ours = processed_logits(logits, params, seen)
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(history, logits.clone())
        theirs = TemperatureLogitsWarper(temperature)(history, theirs)
        if top_k:
            theirs = TopKLogitsWarper(top_k)(history, theirs)
        if top_p < 1:
            theirs = TopPLogitsWarper(top_p)(history, theirs)
        if min_p:
            theirs = MinPLogitsWarper(min_p)(history, theirs)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), params
        finite = torch.isfinite(ours)
        torch.testing.assert_close(ours[finite], theirs[finite])


def test_top_p_keeps_hugging_faces_tokens_with_ties_and_a_large_vocabulary():
    """Summed from the top in float32, the mass drifted (at 200k tokens, p = 0.9999, 149k kept
    against the rule's 152k), and tokens tied at the cut were taken in another order."""
    from transformers.generation.logits_process import TopPLogitsWarper

    gen = torch.Generator().manual_seed(3)
    cases = [(torch.randn(1, 200_000, generator=gen) * 3, 0.9999), (torch.randn(1, 200_000, generator=gen) * 3, 0.99),
             (torch.zeros(1, 8), 0.3), (torch.zeros(1, 40), 0.3), (torch.tensor([[2.0, 1, 1, 1, 1, 0]]), 0.5),
             (torch.randint(0, 4, (16, 30), generator=gen).float(), 0.6)]  # (many ties)
    for logits, p in cases:
        theirs = TopPLogitsWarper(p)(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())
        assert torch.equal(torch.isfinite(top_p_filter(logits, p)), torch.isfinite(theirs)), (logits.shape, p)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 3.0, -1.0]]


def test_repetition_penalty_can_change_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.1)
    seen = torch.tensor([[True, False, False]])
    assert sample_next(logits, params, seen=seen).item() == 1  # 5 / 1.1 = 4.55 < 4.9
    assert sample_next(logits, params.replace(repetition_penalty=1.0), seen=seen).item() == 0


def test_greedy_is_argmax_and_ignores_the_filters():
    logits = torch.tensor([[0.1, 2.0, 1.9], [3.0, -1.0, 2.0]])
    params = SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    assert sample_next(logits, params).tolist() == [1, 0]


def test_greedy_choice_is_torch_argmax_with_ties_nan_and_inf():
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    logits[1] = 1.0  # all tied: the first
    logits[2, [7, 50]] = 100.0  # a tie at the top: the first
    logits[3, [9, 20]] = float("inf")
    logits[4, [11, 40]] = float("nan")  # NaN counts as the largest, the first one wins
    logits[5, 3], logits[5, 250] = float("inf"), float("nan")
    logits[6] = float("-inf")
    for rows in (logits, logits[2:3], logits[:, :1], logits[:, ::2], logits.double()):
        got = greedy_choice(rows)
        assert got.dtype == torch.int64 and got.tolist() == rows.argmax(dim=-1).tolist()


def test_samples_follow_the_temperature_scaled_distribution():
    logits = logits_of([0.1, 0.2, 0.3, 0.4]).repeat(20000, 1)
    params = SamplingParams(temperature=2.0)
    draws = sample_next(logits, params, make_generator(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    expected = (logits[0] / 2.0).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.012), (freq, expected)


def test_samples_never_leave_the_kept_set():
    logits = logits_of(PROBS).repeat(5000, 1)
    draws = sample_next(logits, SamplingParams(temperature=1.0, top_p=0.79), make_generator(1))
    assert set(draws.tolist()) == {1, 3}


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_k=50)
    a = sample_next(logits, params, make_generator(42))
    b = sample_next(logits, params, make_generator(42))
    c = sample_next(logits, params, make_generator(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -0.1, "temperature must be 0 \\(greedy\\) or"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("top_k", -1, "top_k must be an integer >= 0"),
    ("min_p", 1.2, r"min_p must be in \[0, 1\]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be in"),
    ("max_new_tokens", 0, "max_new_tokens must be a positive integer"),
    ("num_samples", 0, "num_samples must be a positive integer"),
    ("stop", [""], "stop strings must not be empty"),
    ("temperature", float("nan"), "temperature must be 0 \\(greedy\\) or"),
    ("logprobs", -1, r"logprobs must be None \(off\) or an integer in \[0, 20\]"),
    ("logprobs", 21, r"logprobs must be None \(off\) or an integer in \[0, 20\]"),
    ("stop_token_ids", [5, -1], r"^stop_token_ids must be >= 0, got \[-1\]$"),  # (the value, as every field's)
])
def test_invalid_parameters_raise_one_clear_error(field, value, message):
    with pytest.raises(ConfigError, match=message) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, FrawdError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("ignore_eos", "no"), ("ignore_eos", 1), ("ignore_eos", None),
    ("max_new_tokens", True), ("max_new_tokens", 2.0), ("top_k", True), ("top_k", 2.0),
    ("num_samples", True), ("seed", True), ("seed", 1.0),
    ("temperature", "1"), ("temperature", True), ("top_p", "0.5"), ("min_p", False), ("repetition_penalty", None),
    ("stop", b"x"), ("stop", 5), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]), ("stop_token_ids", "3"),
])
def test_every_field_refuses_a_value_of_the_wrong_type(field, value):
    # The fields set as the dataclass's __init__ sets them, then its own checks: in this test
    # session the import hook's beartype would refuse the call to __init__ before they ran.
    params = object.__new__(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        object.__setattr__(params, f.name, value if f.name == field else f.default)
    with pytest.raises(ConfigError, match=f"^{field} must") as info:
        params.__post_init__()
    assert "\n" not in str(info.value)


def test_numpy_scalars_become_python_numbers():
    """A user's numpy values (an index from np.argmax, a seed from a numpy generator) were
    refused as "must be a positive integer"; they are the numbers they hold. (Set as in the
    test above: the tests' own type checks would refuse them before __post_init__.)"""
    values = {"max_new_tokens": np.int64(5), "temperature": np.float32(0.5), "top_k": np.int32(3),
              "seed": np.uint64(2**63), "num_samples": np.int16(2), "ignore_eos": np.bool_(True),
              "stop_token_ids": np.array([3, 4])}
    params = object.__new__(SamplingParams)
    for f in dataclasses.fields(SamplingParams):
        object.__setattr__(params, f.name, values.get(f.name, f.default))
    params.__post_init__()
    assert params == SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, seed=2**63, num_samples=2,
                                    ignore_eos=True, stop_token_ids=(3, 4))
    assert [type(getattr(params, k)) for k in ("max_new_tokens", "temperature", "seed", "ignore_eos")] == \
        [int, float, int, bool]
    assert [type(i) for i in params.stop_token_ids] == [int, int]
    object.__setattr__(params, "max_new_tokens", np.float64(5.0))  # a float is still not a count
    with pytest.raises(ConfigError, match="^max_new_tokens must be a positive integer"):
        params.__post_init__()


def test_params_from_dict_rejects_unknown_keys_and_accepts_lists():
    params = SamplingParams.from_dict({"stop": ["a", "bc"], "stop_token_ids": [5], "temperature": 0})
    assert params.stop == ("a", "bc") and params.stop_token_ids == (5,) and params.greedy
    with pytest.raises(ConfigError, match="unknown sampling parameter.*top_q"):
        SamplingParams.from_dict({"top_q": 0.5})


@pytest.mark.parametrize("field, value", [
    ("temperature", 1e-40), ("temperature", float("inf")), ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e40), ("seed", 2**64), ("seed", -1),
])
def test_values_that_would_overflow_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**{field: value})


def test_the_extreme_accepted_values_keep_probabilities_finite():
    from frawdllm.infer.sampling import MAX_PENALTY, MIN_TEMPERATURE

    logits = torch.tensor([[300.0, -300.0, 12.0, 0.0]])
    seen = torch.tensor([[True, True, False, False]])
    for penalty in (MAX_PENALTY, 1 / MAX_PENALTY):
        params = SamplingParams(temperature=MIN_TEMPERATURE, repetition_penalty=penalty)
        probs = processed_logits(logits, params, seen).softmax(dim=-1)
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-6
        assert int(sample_next(logits, params, make_generator(0), seen)) == int(probs.argmax())
    SamplingParams(seed=2**64 - 1)  # the largest seed torch takes
    SamplingParams(temperature=1e-4)  # the documented bound, as a number: 1e-4 in, below it out
    with pytest.raises(ConfigError, match=r"temperature must be 0 \(greedy\) or a finite number >= 0.0001"):
        SamplingParams(temperature=9e-5)



SAMPLE_MISUSE = r"""
import torch
from frawdllm.infer.sampling import SamplingParams, sample_next
for logits, params in [(torch.randn(10), SamplingParams(temperature=0)), (torch.randn(10), SamplingParams(top_k=3)),
                       (torch.randn(1, 2, 10), SamplingParams(top_p=0.5)),
                       (torch.randint(0, 5, (2, 10)), SamplingParams()), ([[0.5, 0.5]], SamplingParams())]:
    try:
        print("accepted", sample_next(logits, params))
    except ValueError as exc:
        print(exc)
print(sample_next(torch.tensor([[0.0, 3.0]]), SamplingParams(temperature=0)).tolist())
"""


def test_sample_next_refuses_logits_that_are_not_a_float_batch_in_one_line():
    """A 1-D row was "TypeError: expected np.ndarray (got numpy.int64)" (greedy) or an
    IndexError (top-k); a 3-D tensor multinomial's "prob_dist must be 1 or 2 dim"; integer
    logits were sampled. (Run as a user's script runs: without the tests' type checks.)"""
    from cli_helpers import script_lines

    must = "logits must be a (batch, vocabulary) floating-point tensor, got "
    assert script_lines(SAMPLE_MISUSE) == [must + "a 1-D torch.float32 tensor", must + "a 1-D torch.float32 tensor",
                                           must + "a 3-D torch.float32 tensor", must + "a 2-D torch.int64 tensor",
                                           must + "list", "[1]"]


def test_seeds_2_to_the_32_apart_draw_differently():
    """torch's CPU generator keeps a seed's low 32 bits: seeds k x 2^32 apart (and the
    server's -1 beside 2^32 - 1) drew the same numbers, samples and initial weights alike."""
    from frawdllm.seeds import torch_seed
    from frawdllm.train.device import seed_everything

    seeds = [5, 2**32 + 5, 2**33 + 5, 2**63 + 5, 2**32 - 1, 2**64 - 1]
    draws = [tuple(torch.rand(4, generator=make_generator(s)).tolist()) for s in seeds]
    assert len(set(draws)) == len(seeds)
    assert draws[0] == tuple(torch.rand(4, generator=torch.Generator().manual_seed(5)).tolist())  # (below 2^32: as is)
    weights = []
    for s in (7, 2**32 + 7):
        seed_everything(s)
        weights.append(torch.randn(4).tolist())
    assert weights[0] != weights[1]
    assert all(0 <= torch_seed(s) < 2**32 for s in [*seeds, -1, -(2**63)]) and torch_seed(-1) != torch_seed(2**32 - 1)
    assert torch_seed(2**32) not in (0, 2**32) and torch_seed(2**32 - 1) == 2**32 - 1  # the range's edges


def test_the_documented_edges_of_logprobs_are_accepted():
    """logprobs is documented as an integer in [0, 20] (OpenAI's top_logprobs limit): 20 itself is in."""
    assert SamplingParams(logprobs=MAX_LOGPROBS).logprobs == 20
    assert SamplingParams(logprobs=0).logprobs == 0
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)


def test_token_id_zero_is_a_valid_stop_token():
    assert SamplingParams(stop_token_ids=[0]).stop_token_ids == (0,)


def test_one_stop_string_or_one_stop_token_id_may_be_given_alone():
    """`stop: Sequence[str] | str`, `stop_token_ids: Sequence[int] | int`: a lone value is a one-item tuple."""
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop_token_ids=5) == SamplingParams(stop_token_ids=[5])
