"""ModelConfig: presets, validation, and the exact parameter count."""

import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from frawdllm import FrawdLLM, ModelConfig, get_config
from frawdllm.config import PRESETS, parse_overrides
from frawdllm.errors import ConfigError


def count_built(cfg: ModelConfig) -> int:
    return sum(p.numel() for p in FrawdLLM(cfg).parameters())  # .parameters() dedups tied weights


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_parameters_equals_built_model_for_every_preset(name):
    cfg = get_config(name)
    assert cfg.num_parameters == count_built(cfg)


def test_preset_dimensions_match_the_spec():
    spec = {"tiny": (8192, 256, 6, 8, 256), "small": (8192, 512, 8, 8, 512),
            "base": (8192, 768, 12, 12, 1024), "100m": (32000, 768, 12, 12, 1024)}
    for name, dims in spec.items():
        cfg = get_config(name)
        assert (cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.context_length) == dims
    assert get_config("100m").pos_encoding == "rope"
    for name in ("tiny-llama", "small-llama"):
        cfg = get_config(name)
        assert cfg.use_rope and cfg.use_rmsnorm and cfg.use_swiglu


@settings(max_examples=40, deadline=None)
@given(
    n_head=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([2, 4, 6]),
    kv_div=st.sampled_from([1, 2, 4]),
    n_layer=st.integers(1, 3),
    vocab=st.integers(8, 40),
    ctx=st.integers(1, 12),
    pos=st.sampled_from(["learned", "sinusoidal", "rope", "none"]),
    rms=st.booleans(), swiglu=st.booleans(), bias=st.booleans(), tie=st.booleans(),
    post=st.booleans(), scale=st.booleans(),
    mlp_hidden=st.one_of(st.none(), st.integers(1, 20)),
)
def test_num_parameters_is_exact_for_any_option_combination(
    n_head, head_dim, kv_div, n_layer, vocab, ctx, pos, rms, swiglu, bias, tie, post, scale, mlp_hidden
):
    n_kv = max(1, n_head // kv_div)
    cfg = ModelConfig(
        vocab_size=vocab, n_embd=n_head * head_dim, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv,
        context_length=ctx, pos_encoding=pos, use_rmsnorm=rms, use_swiglu=swiglu, bias=bias,
        tie_embeddings=tie, norm_placement="post" if post else "pre", scale_embeddings=scale,
        mlp_hidden=mlp_hidden, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    assert cfg.num_parameters == count_built(cfg)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(n_embd=250, n_head=8), "n_embd"),
        (dict(n_head=8, n_kv_head=3), "n_kv_head"),
        (dict(n_embd=24, n_head=8, pos_encoding="rope"), "head size"),
        (dict(pos_encoding="alibi"), "pos_encoding"),
        (dict(norm_placement="sandwich"), "norm_placement"),
        (dict(use_rope=True, pos_encoding="learned"), "use_rope"),
        (dict(dropout=1.5), "dropout"),
        (dict(vocab_size=0), "vocab_size"),
        # the edges of the documented ranges
        (dict(dropout=1.0), "dropout"),
        (dict(vocab_size=50, eos_token_id=50), "eos_token_id"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(pos_encoding="rope", rope_theta=0.0), "rope_theta"),
        (dict(vocab_size=2**31), "vocab_size"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **overrides)


def test_the_edges_of_the_ranges_that_are_inside_them_are_accepted():
    from frawdllm.config import MAX_DIM

    assert get_config("tiny", vocab_size=MAX_DIM).vocab_size == 2**31 - 1  # (a config: nothing built)
    assert get_config("tiny", dropout=0.0, vocab_size=51, eos_token_id=50).eos_token_id == 50
    assert get_config("aiayn-tiny", n_encoder_layer=1).n_encoder_layer == 1
    with pytest.raises(ConfigError, match="n_encoder_layer must be an integer in"):
        get_config("aiayn-tiny", n_encoder_layer=0)


def test_enum_errors_list_allowed_values():
    with pytest.raises(ConfigError, match="learned, sinusoidal, rope, none"):
        get_config("tiny", pos_encoding="alibi")


def test_unknown_preset_and_field_are_rejected():
    with pytest.raises(ValueError, match="tiny, small"):
        get_config("huge")
    with pytest.raises(ValueError, match="n_layers"):
        get_config("tiny", n_layers=3)


def test_use_rope_and_pos_encoding_agree():
    assert ModelConfig(use_rope=True).pos_encoding == "rope"
    assert ModelConfig(pos_encoding="rope").use_rope is True
    assert get_config("100m", pos_encoding="learned").use_rope is False


def test_a_later_position_setting_replaces_an_earlier_one(tmp_path):
    """`--set pos_encoding=learned` over a config that says `use_rope: true` (a file, or a
    model's saved config) replaces it, as export's suggested fix asks; and the other way."""
    from frawdllm.train.config import PretrainConfig, build_config

    rope = ModelConfig(use_rope=True)
    assert rope.replace(pos_encoding="learned").pos_encoding == "learned"
    assert ModelConfig().replace(use_rope=True).pos_encoding == "rope"
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  use_rope: true\n  n_layer: 2\n")
    built = build_config(PretrainConfig, config, model_overrides={"pos_encoding": "learned"})
    model = get_config(built.preset, **built.model)
    assert model.pos_encoding == "learned" and model.n_layer == 2
    config.write_text("model:\n  pos_encoding: learned\n")
    built = build_config(PretrainConfig, config, model_overrides={"use_rope": True})
    assert get_config(built.preset, **built.model).pos_encoding == "rope"
    with pytest.raises(ConfigError, match="use_rope"):  # (one layer saying both, differently: still refused)
        build_config(PretrainConfig, config, model_overrides={"use_rope": True, "pos_encoding": "learned"})
    # use_rope=false undoes RoPE only: sinusoidal or no positions agree with it and stay (they became learned)
    assert get_config("aiayn-tiny", use_rope=False).pos_encoding == "sinusoidal"
    assert get_config("tiny", pos_encoding="none").replace(use_rope=False).pos_encoding == "none"
    assert get_config("tiny-llama", use_rope=False).pos_encoding == "learned"
    assert ModelConfig(use_rope=True).replace(use_rope=False).pos_encoding == "learned"
    config.write_text("model:\n  pos_encoding: sinusoidal\n")
    built = build_config(PretrainConfig, config, model_overrides={"use_rope": False})
    assert get_config(built.preset, **built.model).pos_encoding == "sinusoidal"
    config.write_text("model:\n  use_rope: true\n")
    built = build_config(PretrainConfig, config, model_overrides={"use_rope": False})
    assert get_config(built.preset, **built.model).pos_encoding == "learned"


def test_a_config_file_may_be_yaml_or_toml_and_each_error_names_its_language(tmp_path):
    from frawdllm.train.config import PretrainConfig, build_config

    yaml_file, toml_file = tmp_path / "run.yaml", tmp_path / "run.toml"
    yaml_file.write_text("preset: tiny-llama\nlr: 0.001\nmax_time: 30s\nmodel:\n  n_layer: 2\n")
    toml_file.write_text('preset = "tiny-llama"\nlr = 0.001\nmax_time = "30s"\n[model]\nn_layer = 2\n')
    assert build_config(PretrainConfig, toml_file) == build_config(PretrainConfig, yaml_file)
    assert build_config(PretrainConfig, toml_file).model == {"n_layer": 2}
    toml_file.write_text('preset = "tiny\n')
    with pytest.raises(ConfigError, match=r"run\.toml: not valid TOML \("):
        build_config(PretrainConfig, toml_file)
    yaml_file.write_text('preset = "tiny"\n')  # TOML in a .yaml file
    with pytest.raises(ConfigError, match=r"run\.yaml: expected a mapping of config fields .*TOML in a file named"):
        build_config(PretrainConfig, yaml_file)
    yaml_file.write_text("preset: tiny\nbogus_key: 1\n")  # (said "unknown ... field(s): bogus_key", no file)
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: unknown PretrainConfig field\(s\): bogus_key; known: "):
        build_config(PretrainConfig, yaml_file)
    yaml_file.write_text('max_steps: "abc"\nmodel:\n  n_head: 0\n')  # bad values name the file too
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: max_steps: expected an integer or null, got 'abc'$"):
        build_config(PretrainConfig, yaml_file)
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: n_head must be an integer"):
        build_config(PretrainConfig, yaml_file, {"max_steps": 3})
    with pytest.raises(ConfigError, match=r"^--max-steps: expected an integer or null, got 'x'$"):  # (a flag's own)
        build_config(PretrainConfig, yaml_file, {"max_steps": "x"}, {"n_head": 2})


def test_a_bad_value_is_named_as_the_user_gave_it_the_flag_or_the_file(tmp_path):
    # a flag's value is named by the flag typed (it was `batch_size must be ...` after
    # `--batch-size 0`), a file's by the file; a duration's error names its field too
    from frawdllm.train.config import PretrainConfig, build_config

    with pytest.raises(ConfigError, match=r"^--batch-size must be a positive integer, got 0$"):
        build_config(PretrainConfig, None, {"batch_size": 0})
    with pytest.raises(ConfigError, match=r"^--max-time: cannot read 'abc' as a duration"):
        build_config(PretrainConfig, None, {"max_time": "abc"})
    with pytest.raises(ConfigError, match=r"^--dist-timeout: a duration must be positive"):
        build_config(PretrainConfig, None, {"dist_timeout": "0s"})
    config = tmp_path / "run.yaml"
    config.write_text("max_time: abc\nbatch_size: 0\n")
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: batch_size must be a positive integer, got 0$"):
        build_config(PretrainConfig, config)
    config.write_text("max_time: abc\n")  # (was "cannot read 'abc' ...", the file not named)
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: max_time: cannot read 'abc' as a duration"):
        build_config(PretrainConfig, config)
    with pytest.raises(ConfigError, match=r"^max_time: cannot read"):  # (the Python API: the field's name)
        PretrainConfig(max_time="abc")
    # a message that names two fields: the layer that set either, highest first (`--set n_head=3`
    # against a file's n_embd was blamed on the file)
    config.write_text("preset: tiny\nmodel:\n  n_embd: 128\n")
    with pytest.raises(ConfigError, match=r"^n_embd \(128\) must be divisible by n_head \(3\)$"):
        build_config(PretrainConfig, config, {}, {"n_head": 3})
    config.write_text("preset: tiny\nmodel:\n  n_head: 3\n")
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: n_embd \(256\) must be divisible by n_head \(3\)$"):
        build_config(PretrainConfig, config)
    config.write_text("preset: tiny\nmodel:\n  n_embd: 27\n  n_head: 3\n  use_rope: true\n")  # (was unnamed)
    with pytest.raises(ConfigError, match=r"^\S*run\.yaml: n_embd \(27\) / n_head \(3\), the head size 9, must be "
                                          r"even for pos_encoding='rope'$"):
        build_config(PretrainConfig, config)


def test_swiglu_hidden_defaults_to_eight_thirds_rounded():
    cfg = get_config("tiny-llama")
    assert cfg.ffn_dim % 32 == 0 and 0 <= cfg.ffn_dim - 8 * 256 / 3 < 32
    assert get_config("tiny").ffn_dim == 4 * 256


def test_flops_per_token_is_six_n_plus_attention():
    cfg = get_config("tiny")
    n_matmul = cfg.num_parameters - cfg.context_length * cfg.n_embd  # minus learned positions
    assert cfg.flops_per_token(128) == 6 * n_matmul + 12 * cfg.n_layer * cfg.n_embd * 128
    untied = get_config("tiny", tie_embeddings=False)
    assert untied.flops_per_token(128) == cfg.flops_per_token(128)  # same matmuls either way


def test_pos_encoding_none_means_no_positions_and_null_means_from_use_rope():
    from frawdllm import get_config

    assert parse_overrides(ModelConfig, ["pos_encoding=none"]) == {"pos_encoding": "none"}
    assert parse_overrides(ModelConfig, ["pos_encoding=None"]) == {"pos_encoding": "none"}
    assert parse_overrides(ModelConfig, ["pos_encoding=null"]) == {"pos_encoding": None}
    cfg = get_config("tiny", **parse_overrides(ModelConfig, ["pos_encoding=none"]))
    assert cfg.pos_encoding == "none" and not cfg.use_rope


def test_pos_encoding_null_keeps_a_rope_presets_positions(tmp_path):
    """`pos_encoding: null` leaves the positions to `use_rope`: a Llama-style preset (or an
    earlier layer saying `use_rope: true`) keeps RoPE; it gave learned positions, a model
    that the HF export then refused."""
    from frawdllm.train.config import PretrainConfig, build_config

    for preset in ("tiny-llama", "small-llama", "100m"):
        assert get_config(preset, pos_encoding=None).pos_encoding == "rope", preset
    assert get_config("tiny", pos_encoding=None).pos_encoding == "learned"
    assert get_config("tiny-llama").replace(pos_encoding=None).pos_encoding == "rope"
    assert get_config("tiny-llama", pos_encoding="learned").pos_encoding == "learned"
    config = tmp_path / "run.yaml"
    config.write_text("preset: tiny-llama\nmodel:\n  pos_encoding: null\n")
    built = build_config(PretrainConfig, config)
    assert get_config(built.preset, **built.model).pos_encoding == "rope"
    config.write_text("model:\n  use_rope: true\n")
    built = build_config(PretrainConfig, config, model_overrides={"pos_encoding": None})
    assert get_config(built.preset, **built.model).pos_encoding == "rope"


def test_a_resume_compares_the_model_settings_give_not_how_they_are_written():
    """A resume's model check compares the models the settings build: the width a model
    derives, given by hand, or an encoder-decoder preset's own activation repeated, is no
    change (both were refused, the second with the raw mappings); a real change is named."""
    from frawdllm.train.rundir import _model_values

    tiny = get_config("tiny")
    assert _model_values("tiny", {}, "tiny", {"mlp_hidden": tiny.ffn_dim}) == {}
    assert _model_values("aiayn-tiny", {}, "aiayn-tiny", {"activation": "relu", "mlp_hidden": "1024"}) == {}
    assert _model_values("aiayn-tiny", {}, "aiayn-tiny", {"activation": "gelu"}) == {"activation": ("relu", "gelu")}
    assert _model_values("tiny", {}, "tiny", {"mlp_hidden": 100}) == {"mlp_hidden": (tiny.ffn_dim, 100)}


def test_a_config_files_model_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.1 reads `1e-6` (no dot) as text: the `model:` mapping's values are parsed as
    the fields' types, as the top level's are (norm_eps: 1e-6 was refused as not a number)."""
    from frawdllm.train.config import PretrainConfig, build_config
    from frawdllm.train.translation_config import TranslateConfig

    config = tmp_path / "run.yaml"
    config.write_text("model:\n  norm_eps: 1e-6\n  rope_theta: 5e5\n")
    assert build_config(PretrainConfig, config).model == {"norm_eps": 1e-6, "rope_theta": 500000.0}
    config.write_text("model:\n  norm_eps: 1e-6\n")
    assert build_config(TranslateConfig, config).model == {"norm_eps": 1e-6}
    for value in ("2", "'2'"):  # an unknown field, whatever its value, is named with the file that has it
        config.write_text(f"model:\n  n_layr: {value}\n")
        with pytest.raises(ConfigError, match=f"^{re.escape(str(config))}: unknown config field 'n_layr'; known: "):
            build_config(PretrainConfig, config)
    config.write_text("preset: tiny-llama\nmodel:\n  pos_encoding: None\n")  # (YAML's null is null, not None)
    with pytest.raises(ConfigError, match="pos_encoding must be one of .*; got 'None'"):
        build_config(PretrainConfig, config)


def test_a_translation_models_vocabulary_and_special_ids_are_its_tokenizers():
    """translate train sizes the model by its tokenizer and fixes the special ids: a model
    vocab_size or other ids set by hand are refused (they were dropped without a word, and
    config.yaml kept them: a run that has them is told to remove them); the tokenizer's own
    ids may be repeated."""
    from frawdllm.tokenizer import EOS_ID
    from frawdllm.train.translation_config import TranslateConfig

    with pytest.raises(ConfigError, match="model vocab_size: a translation model's vocabulary is its tokenizer's"):
        TranslateConfig(max_steps=1, model={"vocab_size": 1000})
    with pytest.raises(ConfigError, match=re.escape("model pad_token_id 5: the tokenizer's is 0 (it was ignored): "
                                                    "remove pad_token_id")):
        TranslateConfig(max_steps=1, model={"pad_token_id": 5})
    assert TranslateConfig(max_steps=1, model={"eos_token_id": EOS_ID}).model == {"eos_token_id": EOS_ID}


def test_none_clears_a_step_or_token_budget_a_file_or_a_resumed_run_gave(tmp_path, capsys):
    """A resume could not drop its run's --max-steps for a time budget (`none` was not an
    integer; only --max-time took it): `--max-steps none` and `--max-tokens none` clear it."""
    from frawdllm.cli import main
    from frawdllm.train.config import PretrainConfig, build_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("max_steps: 3\nmax_tokens: 1000\n")
    cfg = build_config(PretrainConfig, None, {"out": str(run), "resume": True, "max_steps": "none", "max_time": "60s"})
    assert cfg.max_steps is None and cfg.max_tokens == 1000 and cfg.max_time_s == 60
    main(["pretrain", "--config", str(run / "config.yaml"), "--max-steps", "none", "--max-tokens", "500", "--dry-run",
          "--out", str(tmp_path / "new")])
    assert "budget:        max-tokens 500\n" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["pretrain", "--max-steps", "nonex", "--dry-run", "--out", str(tmp_path / "new")])
    assert "'--max-steps': 'nonex' is not a valid integer" in capsys.readouterr().err


def test_a_head_count_the_presets_kv_heads_do_not_divide_names_the_preset():
    """--set n_head=2 on tiny-llama (4 kv heads, which the user never typed) says where the 4 is from."""
    with pytest.raises(ConfigError, match=re.escape("n_head (2) must be divisible by n_kv_head (4, the tiny-llama "
                                                    "preset's): set n_kv_head as well")):
        get_config("tiny-llama", n_head=2)
    assert get_config("tiny-llama", n_head=2, n_kv_head=None).n_kv_head == 2


@pytest.mark.parametrize("fields, message", [
    (dict(bleu_sentences=-1), "bleu_sentences must be an integer >= 0"),
    (dict(label_smoothing=1.0), "label_smoothing must be in [0, 1)"),
    (dict(valid_src="v.de"), "give both --valid-src and --valid-tgt, or neither"),
    (dict(valid_tgt="v.en"), "give both --valid-src and --valid-tgt, or neither"),
])
def test_translate_configs_ranges_are_checked_at_their_ends(fields, message):
    from frawdllm.train.translation_config import TranslateConfig

    with pytest.raises(ConfigError, match=re.escape(message)):
        TranslateConfig(max_steps=1, **fields)
    TranslateConfig(max_steps=1, bleu_sentences=0, label_smoothing=0.0)


def test_overrides_are_parsed_by_field_type():
    values = parse_overrides(ModelConfig, ["n_layer=2", "use_rope=true", "dropout=0.1", "n_kv_head=none"])
    assert values == {"n_layer": 2, "use_rope": True, "dropout": 0.1, "n_kv_head": None}
    with pytest.raises(ValueError, match="n_layer: cannot parse 'two' as an integer$"):
        parse_overrides(ModelConfig, ["n_layer=two"])


def test_round_trip_through_dict():
    cfg = get_config("tiny-llama", dropout=0.1)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert math.isclose(cfg.dropout, 0.1)


INTEGER_FIELDS = ["batch_size", "grad_accum", "max_steps", "max_tokens", "warmup_steps", "eval_interval",
                  "eval_batches", "keep_last", "log_interval", "sample_tokens", "max_bad_steps", "seed"]


@pytest.mark.parametrize("value", [2.5, 4.0, True, "4"])
@pytest.mark.parametrize("name", INTEGER_FIELDS)
def test_train_config_integer_fields_refuse_floats_bools_and_strings_in_one_line(name, value):
    """The value is set after construction: in the test session beartype already refuses a
    float or a string at __init__ (a bool passes it), so this runs the validation users meet."""
    from frawdllm.train.config import TrainConfig

    cfg = TrainConfig()
    setattr(cfg, name, value)
    with pytest.raises(ConfigError, match=rf"^{name} must be (a positive integer|an integer\b.*), got {value!r}$"):
        cfg.__post_init__()
    if value is True:  # and through the constructor
        with pytest.raises(ConfigError, match=rf"^{name} must be"):
            TrainConfig(**{name: value})


def test_pretrain_vocab_size_must_be_an_integer_and_numpy_integers_become_ints():
    import numpy as np

    from frawdllm.train.config import PretrainConfig, TrainConfig, dump_yaml

    cfg = PretrainConfig()
    cfg.vocab_size = 300.5
    with pytest.raises(ConfigError, match=r"^vocab_size must be a positive integer, got 300\.5$"):
        cfg.__post_init__()
    cfg = TrainConfig()
    cfg.batch_size, cfg.max_steps = np.int64(8), np.int32(3)  # (numpy's, from a sweep)
    cfg.__post_init__()
    assert type(cfg.batch_size) is int and type(cfg.max_steps) is int
    assert "batch_size: 8" in dump_yaml(cfg)  # config.yaml can hold it


def test_a_model_config_takes_numpy_numbers_as_python_ones():
    """`ModelConfig(n_layer=np.int64(2))` said "n_layer must be an integer, got np.int64(2)",
    where the training and sampling configs take numpy's numbers."""
    import json

    import numpy as np

    cfg = ModelConfig()  # (set after construction: the tests' type checker refuses numpy's at the call)
    cfg.n_layer, cfg.context_length, cfg.dropout, cfg.bias = np.int64(2), np.int32(64), np.float32(0.25), np.False_
    cfg.__post_init__()
    assert (cfg.n_layer, cfg.context_length, cfg.dropout, cfg.bias) == (2, 64, 0.25, False)
    assert [type(v) for v in (cfg.n_layer, cfg.context_length, cfg.dropout, cfg.bias)] == [int, int, float, bool]
    assert json.loads(json.dumps(cfg.to_dict()))["n_layer"] == 2  # (config.json can hold it)
    cfg.n_layer = np.float64(2.5)
    with pytest.raises(ConfigError, match="n_layer must be an integer, got 2.5"):
        cfg.__post_init__()


def test_sinusoidal_positions_need_an_even_width_not_an_even_head():
    """The sinusoidal table is added to the embeddings (width n_embd); RoPE rotates pairs
    inside each head. An odd head dimension is fine for the first, not the second."""
    from frawdllm.infer.engine import Engine
    from frawdllm.infer.sampling import SamplingParams
    from frawdllm.model.seq2seq import Seq2SeqTransformer
    from test_engine import IdTokenizer

    cfg = get_config("tiny", n_embd=24, n_head=8, n_layer=1, vocab_size=40, context_length=16,
                     pos_encoding="sinusoidal")
    assert cfg.head_dim == 3
    torch.manual_seed(0)
    model = FrawdLLM(cfg).eval()
    ids = torch.randint(4, 40, (1, 6))
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    out = Engine(model, IdTokenizer()).generate([ids[0].tolist()], params)[0].tokens
    with torch.no_grad():  # greedy through the engine's KV cache = argmax of full forwards
        seq = ids[0].tolist()
        for _ in range(4):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert out == seq[6:]
    s2s = get_config("aiayn-tiny", n_embd=24, n_head=8, n_layer=1, n_encoder_layer=1, vocab_size=40)
    assert s2s.head_dim == 3 and s2s.pos_encoding == "sinusoidal"
    Seq2SeqTransformer(s2s)(ids, ids)
    with pytest.raises(ConfigError, match=r"n_embd \(15\) must be even for sinusoidal positions"):
        get_config("tiny", n_embd=15, n_head=5, pos_encoding="sinusoidal")
