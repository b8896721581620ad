"""The training window's length against the model's context: as asked, with a warning that names the context and
its rotary scaling where it passes a rotary model's context; refused past a learnt position table."""

import pytest
from transformers import GPT2Config, LlamaConfig

from zerofit.models.directory import ModelDirError, window_length

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip


def test_a_window_within_the_context_is_taken_without_a_word():
    assert window_length(4096, LlamaConfig(max_position_embeddings=4096)) == (4096, None)
    assert window_length(None, LlamaConfig(max_position_embeddings=131072)) == (2048, None)


def test_a_window_past_a_rotary_context_trains_as_asked_and_names_its_scaling():
    n, note = window_length(131072, LlamaConfig(max_position_embeddings=4096))
    assert n == 131072
    assert "context of 4096 tokens" in note and "no rope_scaling" in note and "trains as asked" in note
    n, note = window_length(262144, LlamaConfig(max_position_embeddings=131072, rope_scaling=LLAMA31_ROPE))
    assert n == 262144 and "context of 131072 tokens" in note and "rope_scaling llama3 x8" in note


def test_a_window_past_learnt_positions_is_refused():
    with pytest.raises(ModelDirError, match="longer than the model's 1024 positions"):
        window_length(2048, GPT2Config(n_positions=1024))
