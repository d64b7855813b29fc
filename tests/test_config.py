"""Config parsing (both rope forms, three source kinds), invariants, presets and parameter counts."""

from __future__ import annotations

import json
import os

import pytest
import transformers

from qwen3vl_jax import PRESETS, Qwen3VL, Qwen3VLConfig, count_params, preset
from qwen3vl_jax.config import ConfigError

# Published sizes of the released checkpoints (billions, as on their model cards: 2B, 4B, 8B, 32B).
PUBLISHED_BILLIONS = {"2b": (2.0, 2.3), "4b": (4.3, 4.6), "8b": (8.6, 8.9), "32b": (33.0, 33.6),
                      "30b-a3b": (30.5, 31.7), "235b-a22b": (234.0, 237.0)}


def _hf_class(cfg: Qwen3VLConfig, kind: str):
    """HF's config or model class for `cfg` (the MoE members have their own)."""
    moe = "Moe" if cfg.text.is_moe else ""
    return getattr(transformers, f"Qwen3VL{moe}{kind}")


def _legacy_dict(cfg: Qwen3VLConfig) -> dict:
    d = cfg.to_hf_dict()
    rope = d["text_config"].pop("rope_parameters")
    d["text_config"]["rope_theta"] = rope.pop("rope_theta")
    d["text_config"]["rope_scaling"] = rope
    d["vision_config"].pop("rope_parameters")
    return d


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_sources_and_rope_forms_agree(name, tmp_path):
    cfg = PRESETS[name]
    v5 = cfg.to_hf_dict()
    legacy = _legacy_dict(cfg)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(legacy))
    assert Qwen3VLConfig.from_hf_config(v5) == cfg
    assert Qwen3VLConfig.from_hf_config(legacy) == cfg
    assert Qwen3VLConfig.from_hf_config(str(path)) == cfg
    assert Qwen3VLConfig.from_hf_config(tmp_path) == cfg
    assert Qwen3VLConfig.from_hf_config(cfg.to_hf_config()) == cfg  # a transformers object
    assert Qwen3VLConfig.from_hf_config(_hf_class(cfg, "Config")(**legacy)) == cfg  # HF's own legacy handling


def test_hf_reads_our_config_as_written():
    hf = PRESETS["8b"].to_hf_config()
    assert hf.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
    assert hf.text_config.rope_parameters["rope_theta"] == 5_000_000.0
    assert hf.vision_config.deepstack_visual_indexes == [8, 16, 24]
    assert hf.tie_word_embeddings is False and PRESETS["2b"].to_hf_config().tie_word_embeddings is True


def test_unknown_attributes_raise_all_together():
    d = PRESETS["2b"].to_hf_dict()
    d["text_config"]["sliding_window"] = 4096
    d["text_config"]["rope_parameters"]["rope_type"] = "yarn"
    d["vision_config"]["hidden_act"] = "relu"
    d["my_new_feature"] = True
    with pytest.raises(ConfigError) as e:
        Qwen3VLConfig.from_hf_config(d)
    message = str(e.value)
    for needle in ("sliding_window", "yarn", "hidden_act", "my_new_feature"):
        assert needle in message


def test_bookkeeping_attributes_are_accepted():
    d = PRESETS["2b"].to_hf_dict()
    d.update(transformers_version="4.57.0", dtype="bfloat16", architectures=["X"])
    d["text_config"].update(use_cache=True, bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    assert Qwen3VLConfig.from_hf_config(d) == PRESETS["2b"]


@pytest.mark.parametrize(
    "section, change, message",
    [
        ("text", {"mrope_section": (24, 20, 24)}, r"sum\(mrope_section\) = 68 must equal head_dim // 2 = 64"),
        ("text", {"num_key_value_heads": 5}, r"not a multiple of num_key_value_heads 5"),
        ("vision", {"deepstack_visual_indexes": (5, 30)}, r"must lie in \[0, depth=24\)"),
        ("vision", {"num_position_embeddings": 2300}, r"not a perfect square"),
        ("vision", {"num_heads": 7}, r"not divisible by num_heads 7"),
    ],
)
def test_invariants(section, change, message):
    with pytest.raises(ConfigError, match=message):
        PRESETS["2b"].replace(**{section: change})


def test_cross_tower_invariant():
    with pytest.raises(ConfigError, match="out_hidden_size 1024 must equal text hidden_size 2048"):
        PRESETS["2b"].replace(vision={"out_hidden_size": 1024})


def test_preset_lookup():
    assert preset("Qwen3-VL-8B-Instruct") is PRESETS["8b"]
    with pytest.raises(KeyError, match="unknown preset"):
        preset("3b")


@pytest.mark.needs_torch
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_full_size_parameter_count(name):
    """Abstract build (no allocation) counts exactly what HF's model has for the same config."""
    import torch  # the test extra installs it; a missing reference is a failure, not a skip

    cfg = PRESETS[name]
    ours = count_params(Qwen3VL.abstract(cfg))
    with torch.device("meta"):
        hf = _hf_class(cfg, "ForConditionalGeneration")(cfg.to_hf_config())
    assert ours == sum(p.numel() for p in hf.parameters())
    low, high = PUBLISHED_BILLIONS[name]
    assert low * 1e9 < ours < high * 1e9


@pytest.mark.parametrize("path, value", [
    (("tie_word_embeddings",), "false"),   # Python reads "false" as true: lm_head would be dropped
    (("text_config", "hidden_size"), "64"),
    (("text_config", "hidden_size"), 64.0),
    (("text_config", "rms_norm_eps"), "1e-6"),
    (("vision_config", "depth"), True),
    (("image_token_id",), "5"),
    (("vision_config", "deepstack_visual_indexes"), ["0"]),
])
def test_wrongly_typed_values_are_refused_at_load_as_hf_refuses_them(tiny_dir, tmp_path, path, value):
    from transformers import AutoConfig

    with open(os.path.join(tiny_dir, "config.json")) as f:
        config = json.load(f)
    node = config
    for key in path[:-1]:
        node = node[key]
    assert path[-1] in node
    node[path[-1]] = value
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=path[-1]):  # HF's StrictDataclassFieldValidationError
        AutoConfig.from_pretrained(bad)
    with pytest.raises(ConfigError) as e:
        Qwen3VLConfig.from_hf_config(bad)
    message = str(e.value)
    assert ".".join(path) in message and repr(value) in message and str(bad / "config.json") in message


def test_corrupt_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_vl", ')
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.json'} is not valid JSON"):
        Qwen3VLConfig.from_hf_config(tmp_path)
