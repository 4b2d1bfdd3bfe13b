"""Images through a real node, checked against transformers: tiny random VLMs of Gemma 4
(the E2B/E4B layout, and the 26B-A4B one whose image tokens attend both ways on sliding
layers), Qwen2.5-VL and Qwen3-VL (interleaved M-RoPE, DeepStack) (devtools/tiny_vlms.py:
made with transformers, sharp weights), a text + image prompt sent with the official SDKs.
The top-20 log-probabilities of 4 greedy tokens through /v1/chat/completions equal
transformers' forward over its own processing of the same image (its image processor,
its tokenizer) within 1e-3.

Kimi-VL too (devtools/tiny_kimi_vl.py), but transformers has no native Kimi-VL (Kimi
ships it as remote code), so its reference is mlx-vlm's own whole kimi_vl model on
mlx-vlm's processing: its language model is mlx-vlm's DeepSeek V3 (the full kv_b_proj
attention), not the mlx-lm one exo serves with (kv_b_proj split per head), but the vision
tower and projector are the same mlx-vlm code on both sides, so they are taken on trust.

For every family a
different image gives its own numbers; the same image again is a prefix-cache hit; a
prefill chunk boundary falls inside the image's run of tokens. Claude, Responses and
Ollama give the same answer. Bad images are a 400 in each API's own shape and the node
keeps serving."""

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import anthropic
import numpy as np
import ollama
import openai
import pytest
from PIL import Image

from exo.devtools.tiny_vlms import make_tiny_vlm, mlx_vlm_reference, vlm_reference
from tests.support.images import VLM_MODELS, VLM_QUESTION, noise_png, vlm_models_dir
from tests.support.node import ExoNode, running_node

MODEL_ID = VLM_MODELS["gemma4_vlm"]
FAMILIES = list(VLM_MODELS)
QUESTION = VLM_QUESTION
TOLERANCE = 1e-3
TOP = 20
STEPS = 4
# A 96x96 image is 64 soft tokens for Gemma 4, 144 for Qwen2.5-VL, Qwen3-VL and Kimi-VL; chunks of 32 put
# boundaries inside its run.
PREFILL_STEP = 32


IMAGES = {"first": noise_png(1), "second": noise_png(2)}


QUANTIZED_ID = "acme/gemma4-vlm-tiny-4bit"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = vlm_models_dir(tmp_path_factory.mktemp("vlm-models"))
    make_tiny_vlm(root / QUANTIZED_ID.replace("/", "--"), "gemma4_vlm_4bit")
    return root


Reference = tuple[list[int], list[list[float]]]


@pytest.fixture(scope="module")
def references(vlm_dir: Path) -> dict[tuple[str, str], Reference]:
    """transformers' prompt ids and greedy logprobs, per (family, image)."""
    return {
        (family, name): vlm_reference(
            vlm_dir / VLM_MODELS[family].replace("/", "--"), QUESTION, Image.open(io.BytesIO(data)), STEPS
        )
        for family in FAMILIES
        for name, data in IMAGES.items()
    }


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, vlm_dir: Path) -> Iterator[ExoNode]:
    env = {"EXO_MODELS_DIRS": str(vlm_dir), "EXO_PREFILL_STEP": str(PREFILL_STEP), "EXO_MAX_IMAGES": "3"}
    with running_node(tmp_path_factory.mktemp("vlm-home"), env, models=list(VLM_MODELS.values())) as exo:
        yield exo


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _openai(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0)


def _ask(node: ExoNode, url: str, max_tokens: int = 1, model: str = MODEL_ID):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return _openai(node).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )


def _first_token_diff(completion, expected: list[float], step: int = 0) -> float:
    entry = completion.choices[0].logprobs.content[step]
    reference = np.sort(np.array(expected))[::-1][:TOP]
    served = np.array([alt.logprob for alt in entry.top_logprobs])
    assert len(served) == TOP
    return float(max(np.abs(served - reference).max(), abs(entry.logprob - reference[0])))


def _steps_diff(completion, reference: Reference) -> float:
    """Over every greedy step: decoding after the image goes through the cache (and
    Qwen2.5-VL's positions there are the index plus the image's delta)."""
    assert len(completion.choices[0].logprobs.content) == STEPS
    return max(_first_token_diff(completion, expected, step) for step, expected in enumerate(reference[1]))


def _greedy_text(vlm_dir: Path, family: str, reference: Reference) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir / VLM_MODELS[family].replace("/", "--"))
    return tokenizer.decode([int(np.argmax(step)) for step in reference[1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers_for_each_image(node: ExoNode, references, family: str) -> None:
    model = VLM_MODELS[family]
    diffs = {}
    for name, data in IMAGES.items():
        completion = _ask(node, _data_url(data), STEPS, model=model)
        ids, _ = references[family, name]
        diffs[name] = _steps_diff(completion, references[family, name])
        # The image's soft tokens count as prompt tokens.
        assert completion.usage.prompt_tokens == len(ids)
    print(f"{family}: max |logprob diff| per image: {diffs}")
    assert max(diffs.values()) <= TOLERANCE
    # Different images, different numbers: the cache did not serve one for the other.
    first, second = (np.array(references[family, name][1][0]) for name in IMAGES)
    assert np.abs(first - second).max() > 0.01
    again = _ask(node, _data_url(IMAGES["first"]), model=model)
    assert again.usage.prompt_tokens_details.cached_tokens > len(references[family, "first"][0]) // 2
    assert _first_token_diff(again, references[family, "first"][1][0]) <= TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_every_api_gives_the_same_answer(node: ExoNode, vlm_dir: Path, references, family: str) -> None:
    """Greedy for STEPS tokens, through each API."""
    model = VLM_MODELS[family]
    expected = _greedy_text(vlm_dir, family, references[family, "second"])
    data = IMAGES["second"]
    chat = _ask(node, _data_url(data), STEPS, model=model).choices[0].message.content
    claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0).messages.create(
        model=model,
        max_tokens=STEPS,
        # This SDK release no longer takes temperature as an argument.
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(data).decode(),
                        },
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    responses = _openai(node).responses.create(
        model=model,
        max_output_tokens=STEPS,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": _data_url(data)},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    olla = ollama.Client(host=f"{node.url}/ollama").chat(
        model=model,
        messages=[{"role": "user", "content": QUESTION, "images": [base64.b64encode(data).decode()]}],
        options={"temperature": 0, "num_predict": STEPS},
    )
    answers = {
        "chat": chat,
        "claude": "".join(block.text for block in claude.content if block.type == "text"),
        "responses": responses.output_text,
        "ollama": olla.message.content,
    }
    print(f"{family}: the reference's greedy answer {expected!r}; served {answers}")
    assert all(answer == expected for answer in answers.values()), answers
    claude_prompt = claude.usage.input_tokens + (claude.usage.cache_read_input_tokens or 0)
    assert claude_prompt == len(references[family, "second"][0])


# What each family's chat template writes for an image; Ollama's raw prompts mark the
# image's place as [img-N] instead.
PLACEHOLDERS = {
    "gemma4": "<|image|>",
    "qwen": "<|vision_start|><|image_pad|><|vision_end|>",
    "kimi": "<|media_start|>image<|media_content|><|media_pad|><|media_end|>",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_ollama_raw_generate_takes_images(node: ExoNode, vlm_dir: Path, references, family: str) -> None:
    """generate with raw: true and images: the raw prompt is the chat template's text with
    the image's placeholder written as [img-0], so the greedy answer is the chat one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir / VLM_MODELS[family].replace("/", "--"))
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    placeholder = PLACEHOLDERS[next(name for name in PLACEHOLDERS if family.startswith(name))]
    assert text.count(placeholder) == 1
    raw = text.replace(placeholder, "[img-0]")
    data = IMAGES["second"]
    answer = ollama.Client(host=f"{node.url}/ollama").generate(
        model=VLM_MODELS[family],
        prompt=raw,
        raw=True,
        images=[base64.b64encode(data).decode()],
        options={"temperature": 0, "num_predict": STEPS},
    )
    expected = _greedy_text(vlm_dir, family, references[family, "second"])
    print(f"{family}: raw generate {answer.response!r}, the reference {expected!r}")
    assert answer.response == expected
    assert answer.prompt_eval_count == len(references[family, "second"][0])


def test_a_quantized_gemma4_vlm_serves_images(node: ExoNode, vlm_dir: Path) -> None:
    """The tiny Gemma 4 VLM quantized by mlx-vlm's own convert, its vision tower and
    projector too (4-bit, groups of 32), in mlx-vlm's weight layout (language_model.model.,
    vision_tower., embed_vision.). transformers cannot read MLX quantization, so the
    reference is mlx-vlm's whole model on the same checkpoint (unquantized, for this
    layout, it equals transformers within 1e-4)."""
    data = IMAGES["first"]
    path = vlm_dir / QUANTIZED_ID.replace("/", "--")
    ids, logprobs = mlx_vlm_reference(path, QUESTION, Image.open(io.BytesIO(data)))
    completion = _ask(node, _data_url(data), model=QUANTIZED_ID)
    diff = _first_token_diff(completion, logprobs)
    print(f"quantized gemma4: max |logprob diff| vs mlx-vlm {diff}")
    assert diff <= TOLERANCE
    assert completion.usage.prompt_tokens == len(ids)


class _ImageServer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/cat.png":
            body = IMAGES["first"]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_http_image_is_fetched_by_the_node(node: ExoNode, image_server: str, references) -> None:
    completion = _ask(node, f"{image_server}/cat.png")
    assert _first_token_diff(completion, references["gemma4_vlm", "first"][1][0]) <= TOLERANCE


def _chat_body(*parts: dict) -> dict:
    return {"model": MODEL_ID, "max_tokens": 1, "messages": [{"role": "user", "content": [*parts]}]}


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_bad_images_are_a_400_naming_the_problem(node: ExoNode, image_server: str) -> None:
    not_an_image = "data:image/png;base64," + base64.b64encode(b"these bytes are text").decode()
    cases = {
        "could not be decoded": _chat_body(_image_part(not_an_image)),
        "not valid base64": _chat_body(_image_part("data:image/png;base64,@@@")),
        "more than 3 images": _chat_body(*[_image_part(_data_url(IMAGES["first"]))] * 4),
        "answered HTTP 404": _chat_body(_image_part(f"{image_server}/missing.png")),
        "failed": _chat_body(_image_part("http://127.0.0.1:9/none.png")),
        "neither a data URL": _chat_body(_image_part("file:///etc/passwd")),
        "cannot read input_audio": _chat_body({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
        # Decodes, but the model's processor refuses it (Qwen's aspect ratio limit is 200).
        "aspect ratio": {
            **_chat_body(_image_part(_data_url(noise_png(6, size=(1, 600))))),
            "model": VLM_MODELS["qwen2_5_vl"],
        },
    }
    for expected, body in cases.items():
        response = node.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, (expected, response.text)
        assert expected in response.json()["error"]["message"], response.json()
    claude = node.post(
        "/v1/messages",
        json={
            "model": MODEL_ID,
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        },
    )
    assert claude.status_code == 400 and claude.json()["type"] == "error"
    assert "could not be decoded" in claude.json()["error"]["message"]
    olla = node.post(
        "/ollama/api/chat",
        json={"model": MODEL_ID, "stream": False, "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]},
    )
    assert olla.status_code == 400 and "could not be decoded" in olla.json()["error"]
    # Still serving.
    assert _ask(node, _data_url(IMAGES["first"])).usage.completion_tokens == 1


def test_the_models_say_vision_where_it_works(node: ExoNode) -> None:
    """/v1/models and Ollama's /api/show (which Open WebUI reads before it lets a user
    attach an image) say vision for the local VLM dirs, from their configs."""
    listed = {entry["id"]: entry for entry in node.get("/v1/models").json()["data"]}
    for model in VLM_MODELS.values():
        assert "vision" in listed[model]["capabilities"], listed[model]
        shown = node.post("/ollama/api/show", json={"model": model}).json()
        assert "vision" in shown["capabilities"], shown
