"""Bad entries in a models dir: config.json that is not JSON, a truncated safetensors
file, a config of an architecture no engine knows (shipping custom code that must never
run). The node stays up, serves the good model, and says what is wrong with each bad
one, never with a 500."""

import json
import shutil

import httpx

from tests.support.node import running_node

CUSTOM_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('remote code ran')\n"


def chat(node, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(f"{node.url}/v1/chat/completions", json=body, timeout=120)


def test_bad_model_dirs_are_named_and_the_good_one_serves(tmp_path, tiny_models_dir):
    models = tmp_path / "models"
    good = tiny_models_dir / "acme--tiny"
    for name in ("acme--badjson", "acme--truncated", "acme--alien"):
        shutil.copytree(good, models / name)
    (models / "acme--badjson" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    weights = models / "acme--truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    alien = models / "acme--alien"
    marker = tmp_path / "remote-code-ran"
    config = json.loads((alien / "config.json").read_text())
    config.update(model_type="alien_net", architectures=["AlienNetForCausalLM"])
    config["auto_map"] = {"AutoConfig": "configuration_alien.AlienConfig"}
    (alien / "config.json").write_text(json.dumps(config))
    (alien / "configuration_alien.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    tokenizer_config = json.loads((alien / "tokenizer_config.json").read_text())
    tokenizer_config["auto_map"] = {"AutoTokenizer": ["tokenization_alien.AlienTokenizer", None]}
    (alien / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (alien / "tokenization_alien.py").write_text(CUSTOM_CODE.format(marker=str(marker)))

    env = {"EXO_MODELS_DIRS": f"{tiny_models_dir}:{models}"}
    with running_node(tmp_path / "home", env) as node:
        node_id = node.node_id()
        node.wait_for_state(lambda s: node_id in s["nodes"], what="node info")
        listed = {m["id"] for m in node.get("/v1/models").json()["data"]}
        assert {"acme/tiny", "acme/alien"} <= listed and not {"acme/badjson", "acme/truncated"} & listed

        for model, says in (("acme/badjson", "config.json is not valid JSON"), ("acme/truncated", "is truncated")):
            for response in (chat(node, model), node.post("/place_instance", json={"model_id": model})):
                assert response.status_code == 422, response.text
                error = response.json()["error"]
                assert error["code"] == "unusable_model" and says in error["message"], error
                assert str(models / model.replace("/", "--")) in error["message"]
        placement = node.get("/instance/placement", params={"model_id": "acme/truncated"})
        assert placement.status_code == 422 and "holds" in placement.json()["error"]["message"]

        # No engine runs this architecture: the runner's own error, after its retries.
        response = chat(node, "acme/alien")
        assert response.status_code == 503, response.text
        assert "Model type alien_net not supported" in response.json()["error"]["message"]
        assert not marker.exists(), "a model dir's custom code ran (trust_remote_code)"

        answer = chat(node, "acme/tiny")
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0
        assert node.get("/v1/models").status_code == 200
