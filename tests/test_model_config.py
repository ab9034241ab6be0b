"""ModelConfig from published config.json shapes, and rope variants."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from servefleet.engine.model.config import ModelConfig, ModelConfigError
from servefleet.engine.model.rope import inverse_frequencies, rope_table

LLAMA_31_8B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
}
LLAMA_2_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
QWEN2_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
MISTRAL_7B = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "max_position_embeddings": 32768,
    "vocab_size": 32000,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_llama31() -> None:
    c = ModelConfig.from_hf_config(LLAMA_31_8B, {"eos_token_id": [128001, 128009, 128010]})
    assert (c.architecture, c.head_dim, c.num_kv_heads) == ("llama", 128, 8)
    assert c.eos_token_ids == [128001, 128008, 128009, 128010]
    assert c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.factor == 8.0 and not c.attention_bias and not c.tie_word_embeddings


def test_llama2_qwen2_mistral_smollm2() -> None:
    llama2 = ModelConfig.from_hf_config(LLAMA_2_7B)
    assert llama2.rope_theta == 10000.0 and llama2.rope_scaling is None
    assert llama2.eos_token_ids == [2] and llama2.head_dim == 128
    qwen2 = ModelConfig.from_hf_config(QWEN2_05B)
    assert qwen2.attention_bias and not qwen2.output_bias and qwen2.tie_word_embeddings
    assert qwen2.head_dim == 64 and qwen2.sliding_window is None
    mistral = ModelConfig.from_hf_config(MISTRAL_7B)
    assert mistral.architecture == "mistral" and mistral.sliding_window == 4096
    smol = ModelConfig.from_hf_config(SMOLLM2_135M)
    assert (smol.head_dim, smol.rope_theta, smol.tie_word_embeddings) == (64, 100000.0, True)


def test_bad_configs_are_rejected_with_the_reason() -> None:
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_config({**LLAMA_2_7B, "model_type": "gpt2"})
    bad = dict(LLAMA_2_7B)
    del bad["hidden_size"]
    with pytest.raises(ModelConfigError, match="hidden_size"):
        ModelConfig.from_hf_config(bad)
    with pytest.raises(ModelConfigError, match="longrope"):
        ModelConfig.from_hf_config({**LLAMA_2_7B, "rope_scaling": {"type": "longrope"}})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_config({**LLAMA_2_7B, "num_key_value_heads": 5})


def test_dynamic_rope_is_accepted_and_exact_within_trained_context() -> None:
    plain = ModelConfig.from_hf_config(LLAMA_2_7B)
    dynamic = ModelConfig.from_hf_config(
        {**LLAMA_2_7B, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    )
    assert dynamic.rope_scaling is not None and dynamic.rope_scaling.rope_type == "dynamic"
    torch.testing.assert_close(inverse_frequencies(dynamic)[0], inverse_frequencies(plain)[0])


def test_rope_table_matches_transformers_llama3() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA_31_8B.items() if k != "model_type"}
    )
    theirs, factor = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours, our_factor = inverse_frequencies(ModelConfig.from_hf_config(LLAMA_31_8B))
    torch.testing.assert_close(ours, theirs)
    assert our_factor == factor
    cos, sin = rope_table(ModelConfig.from_hf_config(LLAMA_31_8B), 16, torch.float32, "cpu")
    assert cos.shape == sin.shape == (16, 128)
    torch.testing.assert_close(cos[0], torch.ones(128))
