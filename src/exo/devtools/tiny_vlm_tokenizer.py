"""The tiny VLMs' tokenizer: tiny_models' BPE with a family's image tokens added, and a
chat template that writes the family's image placeholder where a message has an image."""

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from exo.devtools.tiny_models import write_tokenizer

# Renders image parts as the family's placeholder, which the processor expands into the
# image's run of soft tokens (begin marker, N image tokens, end marker).
VLM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ image_placeholder }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_vlm_tokenizer(path: Path, tokens: dict[str, str], placeholder: str) -> dict[str, int]:
    """The tiny BPE tokenizer with the family's image tokens added; returns their ids."""
    write_tokenizer(path, 512, 64)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens(list(tokens.values()))
    tokenizer.save(str(path / "tokenizer.json"))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokens)
    config["chat_template"] = VLM_CHAT_TEMPLATE.replace("{{ image_placeholder }}", placeholder)
    config_path.write_text(json.dumps(config, indent=2))
    ids = {name: tokenizer.token_to_id(token) or 0 for name, token in tokens.items()}
    ids["vocab_size"] = tokenizer.get_vocab_size()
    return ids


def user_turn(tokenizer: Any, question: str) -> str:
    content = [{"type": "image"}, {"type": "text", "text": question}]
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
