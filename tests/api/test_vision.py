"""Images through a real node, checked against transformers: a tiny random Gemma 4 VLM of
the E2B/E4B layout (devtools/tiny_vlms.py: made with transformers, sharp weights), a text
+ image prompt sent with the official SDKs. The first token's log-probabilities through
/v1/chat/completions equal transformers' forward over its own processing of the same
image (its image processor, its tokenizer) within 1e-3; a different image gives its own
numbers; the same image again is a prefix-cache hit; a prefill chunk boundary falls
inside the image's run of tokens. Claude, Responses and Ollama give the same answer.
Bad images are a 400 in each API's own shape and the node keeps serving."""

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

from exo.devtools.tiny_vlms import gemma4_reference
from tests.support.images import VLM_MODEL_ID, VLM_QUESTION, noise_png, vlm_models_dir
from tests.support.node import ExoNode, running_node

MODEL_ID = VLM_MODEL_ID
QUESTION = VLM_QUESTION
TOLERANCE = 1e-3
TOP = 20
STEPS = 4
# A 96x96 image is 64 soft tokens; chunks of 32 put boundaries inside its run.
PREFILL_STEP = 32


IMAGES = {"first": noise_png(1), "second": noise_png(2)}


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vlm_models_dir(tmp_path_factory.mktemp("vlm-models"))


@pytest.fixture(scope="module")
def references(vlm_dir: Path) -> dict[str, tuple[list[int], list[list[float]]]]:
    path = vlm_dir / MODEL_ID.replace("/", "--")
    return {
        name: gemma4_reference(path, QUESTION, Image.open(io.BytesIO(data)), STEPS) for name, data in IMAGES.items()
    }


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, vlm_dir: Path) -> Iterator[ExoNode]:
    env = {"EXO_MODELS_DIRS": str(vlm_dir), "EXO_PREFILL_STEP": str(PREFILL_STEP), "EXO_MAX_IMAGES": "3"}
    with running_node(tmp_path_factory.mktemp("vlm-home"), env, models=[MODEL_ID]) as exo:
        yield exo


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _openai(node: ExoNode) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0)


def _ask(node: ExoNode, url: str, max_tokens: int = 1):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return _openai(node).chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )


def _first_token_diff(completion, expected: list[float]) -> float:
    entry = completion.choices[0].logprobs.content[0]
    reference = np.sort(np.array(expected))[::-1][:TOP]
    served = np.array([alt.logprob for alt in entry.top_logprobs])
    assert len(served) == TOP
    return float(max(np.abs(served - reference).max(), abs(entry.logprob - reference[0])))


def _greedy_text(node: ExoNode, vlm_dir: Path, name: str, references) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir / MODEL_ID.replace("/", "--"))
    tokens = [int(np.argmax(step)) for step in references[name][1]]
    return tokenizer.decode(tokens)


def test_first_token_logprobs_equal_transformers_for_each_image(node: ExoNode, references) -> None:
    diffs = {}
    for name, data in IMAGES.items():
        completion = _ask(node, _data_url(data))
        ids, logprobs = references[name]
        diffs[name] = _first_token_diff(completion, logprobs[0])
        # The image's soft tokens count as prompt tokens.
        assert completion.usage.prompt_tokens == len(ids)
    print(f"max |logprob diff| per image: {diffs}")
    assert max(diffs.values()) <= TOLERANCE
    # Different images, different numbers: the cache did not serve one for the other.
    assert np.abs(np.array(references["first"][1][0]) - np.array(references["second"][1][0])).max() > 0.01
    again = _ask(node, _data_url(IMAGES["first"]))
    assert again.usage.prompt_tokens_details.cached_tokens > len(references["first"][0]) // 2
    assert _first_token_diff(again, references["first"][1][0]) <= TOLERANCE


def test_every_api_gives_the_same_answer(node: ExoNode, vlm_dir: Path, references) -> None:
    expected = _greedy_text(node, vlm_dir, "second", references)
    data = IMAGES["second"]
    chat = _ask(node, _data_url(data), STEPS).choices[0].message.content
    claude = anthropic.Anthropic(base_url=node.url, api_key="unused", max_retries=0).messages.create(
        model=MODEL_ID,
        max_tokens=STEPS,
        # This SDK release no longer takes temperature as an argument.
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    responses = _openai(node).responses.create(
        model=MODEL_ID,
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
        model=MODEL_ID,
        messages=[{"role": "user", "content": QUESTION, "images": [base64.b64encode(data).decode()]}],
        options={"temperature": 0, "num_predict": STEPS},
    )
    answers = {
        "chat": chat,
        "claude": "".join(block.text for block in claude.content if block.type == "text"),
        "responses": responses.output_text,
        "ollama": olla.message.content,
    }
    print(f"transformers' greedy answer {expected!r}; served {answers}")
    assert all(answer == expected for answer in answers.values()), answers
    assert claude.usage.input_tokens == len(references["second"][0])


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
    assert _first_token_diff(completion, references["first"][1][0]) <= TOLERANCE


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
                    "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
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
