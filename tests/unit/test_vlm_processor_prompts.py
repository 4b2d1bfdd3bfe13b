"""A Gemma 4 VLM's prompt for an image is the one the model dir's own processor makes
(issue 33): the engine's prompt ids for one image and a question equal transformers'
Gemma4Processor.apply_chat_template(tokenize=True) input_ids, loaded from the same dir,
and the engine's first token and its log-probability are transformers' model's on those
ids (within 1e-3).

The dirs are laid out as the hub's 26B-A4B/31B checkpoints are (processor_config.json
with the image processor nested, the template in chat_template.jinja), then varied in
what makes the prompt: the image's soft-token budget, what the template writes around
the image (blank lines or none), a processor template apart from the tokenizer's (in
processor_config.json, or the legacy chat_template.json), a
template that writes no BOS with a tokenizer that adds one, begin/end-of-image markers
named by the tokenizer alone, the 31B's thinking switch in a vocabulary with the
reasoning channel's tokens (where mlx-lm's tokenizer finds think markers and would turn
thinking on). The image is 120x72: not square, resized to the budget.
Runs the real engine in this process (no node); the processor is transformers' own,
without its video processor (torchvision, which exo does not install)."""

import base64
import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image
from transformers import AutoTokenizer

from exo.api.checks import chat_prompt_token_count, chat_tokenizer_at
from exo.devtools.tiny_vlms import (
    gemma4_processor_reference,
    make_tiny_gemma4_hub_vlm,
    make_tiny_vlm,
    processor_inputs,
)
from exo.engine.mlx.engine import MlxEngine
from exo.engine.parsing.reasoning import prompt_opens_reasoning
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.text_generation import ChatMessage, ImageInput, TextGenerationTaskParams
from tests.support.engine import load_engine
from tests.support.images import VLM_QUESTION, noise_png

TOLERANCE = 1e-3
IMAGE = noise_png(1, (120, 72))
SHA256 = hashlib.sha256(IMAGE).hexdigest()

LAYOUTS = {
    "31b": {},
    "blank_lines_around_image": {"image": "\n\n<|image|>\n\n", "max_soft_tokens": 70},
    "processor_template": {"template_file": "processor_config.json"},
    "legacy_processor_template": {"template_file": "chat_template.json"},
    "tokenizer_adds_bos": {"bos": False, "tokenizer_adds_bos": True},
    "markers_in_tokenizer_only": {"config_markers": False},
}


def _params() -> TextGenerationTaskParams:
    content = [{"type": "image", "sha256": SHA256}, {"type": "text", "text": VLM_QUESTION}]
    image = ImageInput(sha256=SHA256, media_type="image/png", data_base64=base64.b64encode(IMAGE).decode())
    return TextGenerationTaskParams(
        model=ModelId("test/model"),
        messages=[ChatMessage(role="user", content=content)],
        images=[image],
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=1,
    )


def _first_token(engine: MlxEngine) -> tuple[int, float]:
    engine.submit(CommandId("first"), _params())
    while engine.has_work:
        for chunk in engine.step():
            if chunk.logprobs:
                return chunk.logprobs[0].token_id, chunk.logprobs[0].logprob
    raise AssertionError("no token")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_prompt_is_the_processors(layout: str, tmp_path: Path) -> None:
    model_dir = make_tiny_gemma4_hub_vlm(tmp_path / layout, **LAYOUTS[layout])
    reference_ids, reference_logprobs = gemma4_processor_reference(
        model_dir, VLM_QUESTION, Image.open(io.BytesIO(IMAGE))
    )
    engine = load_engine(model_dir)

    ids, _, _ = engine.prompt_of(CommandId("prompt"), _params())
    token, logprob = _first_token(engine)

    best = max(range(len(reference_logprobs)), key=reference_logprobs.__getitem__)
    print(
        f"{layout}: processor {len(reference_ids)} ids, engine {len(ids)}; first token {token} "
        f"logprob {logprob:.5f}, transformers {best} {reference_logprobs[best]:.5f}"
    )
    assert ids == reference_ids
    assert token == best
    assert abs(logprob - reference_logprobs[best]) < TOLERANCE


# What a request says of thinking: nothing, on, off (issue 33 saw 320 ids against the
# processor's 318 on a request that said nothing).
THINKING_SWITCHES: dict[str, dict[str, bool]] = {
    "unset": {},
    "enable_thinking": {"enable_thinking": True},
    "no_thinking": {"enable_thinking": False},
}


@pytest.fixture(scope="module")
def thinking_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma4_hub_vlm(tmp_path_factory.mktemp("thinking") / "31b", thinking=True)


@pytest.fixture(scope="module")
def thinking_engine(thinking_vlm: Path) -> MlxEngine:
    return load_engine(thinking_vlm)


@pytest.mark.parametrize("switch", list(THINKING_SWITCHES))
def test_a_thinking_templates_image_prompt_is_the_processors(
    switch: str, thinking_vlm: Path, thinking_engine: MlxEngine
) -> None:
    """The template's own default where the request does not say (the 31B's: off), as the
    processor renders it without the switch; the request's choice where it does."""
    said = THINKING_SWITCHES[switch]
    reference_ids = processor_inputs(thinking_vlm, VLM_QUESTION, Image.open(io.BytesIO(IMAGE)), **said)
    reference_ids = reference_ids["input_ids"][0].tolist()

    ids, _, _ = thinking_engine.prompt_of(CommandId("prompt"), _params().model_copy(update=said))

    print(f"thinking {switch}: processor {len(reference_ids)} ids, engine {len(ids)}")
    assert ids == reference_ids


def test_a_text_prompt_that_does_not_say_is_transformers(thinking_vlm: Path, thinking_engine: MlxEngine) -> None:
    """Without images the engine's prompt is transformers' apply_chat_template on the
    model's template with no thinking switch passed: thinking off, an empty thought
    channel closed, so the answer does not start inside reasoning. The API counts the
    same tokens."""
    params = TextGenerationTaskParams(
        model=ModelId("test/model"), messages=[ChatMessage(role="user", content=VLM_QUESTION)]
    )
    tokenizer = AutoTokenizer.from_pretrained(thinking_vlm)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": VLM_QUESTION}], add_generation_prompt=True, tokenize=False
    )

    ids, text, _ = thinking_engine.prompt_of(CommandId("text"), params)

    assert text == expected
    assert text.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    assert "<|think|>" not in text
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert thinking_engine.think_markers is not None
    assert not prompt_opens_reasoning(text, *thinking_engine.think_markers)
    chat = chat_tokenizer_at(thinking_vlm)
    assert chat is not None
    assert chat_prompt_token_count(chat, params, "none") == len(ids)


# The hub's Qwen-VL chat template (ChatML, the image as its pad token between the vision
# markers), which the processor's own chat_template.json carries; the tiny tokenizer keeps
# another.
QWEN_VL_HUB_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_prompt_is_its_processors(family: str, tmp_path: Path) -> None:
    """The grid family's processor (its template in chat_template.json): the same ids.
    Their logprobs over equal ids are transformers' (tests/api/test_vision.py)."""
    model_dir = make_tiny_vlm(tmp_path / family, family)
    (model_dir / "chat_template.json").write_text(json.dumps({"chat_template": QWEN_VL_HUB_TEMPLATE}))
    reference_ids = processor_inputs(model_dir, VLM_QUESTION, Image.open(io.BytesIO(IMAGE)))["input_ids"][0].tolist()
    engine = load_engine(model_dir)

    ids, _, _ = engine.prompt_of(CommandId("prompt"), _params())

    print(f"{family}: processor {len(reference_ids)} ids, engine {len(ids)}")
    assert ids == reference_ids
