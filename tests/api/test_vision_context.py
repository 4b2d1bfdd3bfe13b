"""The context check counts an image's tokens before the request is sent: the API app in
process (a fake cluster port whose node holds the tiny Gemma 4 VLM's files), a card with
a small context. The text alone fits; with the image's 64 soft tokens and markers it does
not, and the 400 names the count the engine would build (its processing, done here with
the tokenizer and transformers' image processor).

Also for a Gemma 4 laid out as the hub's checkpoints are (devtools/tiny_vlms.py's
make_tiny_gemma4_hub_vlm): the image processor's fields only nested in
processor_config.json, a processor template of its own, a template without BOS and a
tokenizer that adds one, the image markers named by the tokenizer alone; the count is
the length of transformers' Gemma4Processor input_ids, which the engine's prompt equals
(tests/unit/test_vlm_processor_prompts.py)."""

import asyncio
import base64
import io
from pathlib import Path

import httpx
from PIL import Image
from transformers import AutoTokenizer

from exo.api.app import create_app
from exo.catalog.cards import card_from_model_dir
from exo.devtools.tiny_vlms import GEMMA4_TOKENS, make_tiny_gemma4_hub_vlm, make_tiny_vlm, processor_inputs
from tests.support.fake_cluster import FakeCluster
from tests.support.images import VLM_MODELS, VLM_QUESTION, noise_png

MODEL = VLM_MODELS["gemma4_vlm"]
CONTEXT = 48
SOFT_TOKENS = 64  # a 96x96 image in the tiny processor


class LocalFiles(FakeCluster):
    def __init__(self, model_dir: Path) -> None:
        card = card_from_model_dir(model_dir, MODEL).model_copy(update={"context_length": CONTEXT})
        super().__init__({MODEL: card})
        self.model_dir = model_dir

    def local_model_dir(self, model_id: str) -> Path | None:
        return self.model_dir if model_id == MODEL else None


def test_image_tokens_count_against_the_context(tmp_path: Path) -> None:
    model_dir = make_tiny_vlm(tmp_path / "vlm", "gemma4_vlm")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": VLM_QUESTION}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    text_only = len(tokenizer(text, add_special_tokens=False).input_ids)
    run = GEMMA4_TOKENS["boi_token"] + GEMMA4_TOKENS["image_token"] * SOFT_TOKENS + GEMMA4_TOKENS["eoi_token"]
    expanded = len(tokenizer(text.replace(GEMMA4_TOKENS["image_token"], run), add_special_tokens=False).input_ids)
    assert text_only < CONTEXT < expanded
    _assert_refused_with_count(model_dir, expanded)


def test_a_hub_layout_vlm_counts_as_its_processor(tmp_path: Path) -> None:
    model_dir = make_tiny_gemma4_hub_vlm(
        tmp_path / "vlm",
        max_soft_tokens=70,
        bos=False,
        template_file="processor_config.json",
        tokenizer_adds_bos=True,
        config_markers=False,
    )
    expected = processor_inputs(model_dir, VLM_QUESTION, Image.open(io.BytesIO(noise_png(1))))["input_ids"].shape[1]
    assert expected > CONTEXT

    _assert_refused_with_count(model_dir, expected)


def _assert_refused_with_count(model_dir: Path, count: int) -> None:
    url = "data:image/png;base64," + base64.b64encode(noise_png(1)).decode()
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": VLM_QUESTION}],
            }
        ],
    }

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(LocalFiles(model_dir)))
        async with httpx.AsyncClient(transport=transport, base_url="http://exo") as client:
            # A request the check lets through waits on the fake cluster, which never answers.
            return await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 30)

    response = asyncio.run(main())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"prompt is too long: {count} tokens > {CONTEXT}" in error["message"], error
