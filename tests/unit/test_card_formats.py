"""A model card says which weights each engine runs the model from: MLX the checkpoint
as published, llama.cpp a GGUF converted on the node (or why there is none), as
/v1/models lists them."""

from exo.engine.llamacpp.support import card_formats
from exo.shared.models.model_cards import ModelCard, ModelTask, StorageSize


def card(family: str, quantization: str, capabilities: list[str] | None = None) -> ModelCard:
    return ModelCard(
        model_id=f"org/{family}-{quantization or 'bf16'}",
        n_layers=4,
        hidden_size=64,
        tasks=[ModelTask.TextGeneration],
        family=family,
        quantization=quantization,
        capabilities=capabilities or ["text"],
        storage_size=StorageSize(in_bytes=1),
    )


def test_each_quantization_names_its_gguf_type():
    assert card_formats(card("llama", "4bit"))[1].startswith("GGUF, Q4_K where its rows are whole 256-blocks")
    assert card_formats(card("qwen3", "8bit"))[1].startswith("GGUF, Q8_0")
    assert card_formats(card("qwen2", ""))[1].startswith("GGUF, the checkpoint's own float type")
    assert card_formats(card("llama", "4bit"))[0] == "safetensors, 4bit (MLX runs it as published)"


def test_a_model_llama_cpp_cannot_run_says_why_it_has_no_gguf():
    refusal = card_formats(card("nemotron_h", "4bit"))[1]
    assert refusal.startswith("no GGUF: GGUF conversion covers llama, qwen2, qwen3, qwen3_moe, glm4_moe, minimax_m2")
    assert refusal.endswith(", not nemotron_h")
    # A family exo knows llama.cpp would serve wrong, or cannot be written here, says so.
    assert card_formats(card("gpt_oss", ""))[1] == (
        "no GGUF: gpt_oss is not converted: llama.cpp rounds YaRN's correction range to whole dims,"
        " gpt-oss' reference does not"
    )
    assert "gguf 0.19" in card_formats(card("deepseek_v4", ""))[1]
    # A 4-bit MLA card: mlx-lm's quantized split of kv_b_proj is not converted.
    assert card_formats(card("deepseek_v3", "4bit"))[1].startswith("no GGUF: an MLX-quantized MLA checkpoint")
    assert card_formats(card("glm4_moe", "4bit"))[1].startswith("GGUF, Q4_K")
    assert card_formats(card("llama", "3bit"))[1].startswith("no GGUF: ")
    assert card_formats(card("qwen3", "", ["text", "vision"]))[1] == "no GGUF: the llama.cpp engine takes no images"
