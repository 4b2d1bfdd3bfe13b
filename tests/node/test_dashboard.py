"""The web dashboard every node serves on its API port. The page's view logic
(view.mjs, markdown.mjs) runs in Node over a real node's /state, /models, previews and
chat stream; the pages themselves run in a real browser in test_dashboard_browser.py."""

import json
import re
import subprocess
from importlib.resources import files
from pathlib import Path

import httpx

from tests.support.node import TINY_MODEL_ID, ExoNode

DASHBOARD = Path(str(files("exo") / "resources" / "dashboard"))
VIEW_CHECK = Path(__file__).parent / "js" / "dashboard_view.mjs"


def test_the_dashboard_and_its_assets_are_served(exo_node: ExoNode):
    page = httpx.get(f"{exo_node.url}/", follow_redirects=True, timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert str(page.url).endswith("/dashboard/")
    assets = [a for a in re.findall(r'(?:src|href)="([^"]+)"', page.text) if not a.startswith(("data:", "#"))]
    assert sorted(assets) == ["app.mjs", "style.css"]
    for asset in [*assets, "view.mjs"]:
        response = httpx.get(f"{exo_node.url}/dashboard/{asset}", timeout=10)
        assert response.status_code == 200, asset
        expected = "text/css" if asset.endswith(".css") else "text/javascript"
        assert response.headers["content-type"].startswith(expected), (asset, response.headers["content-type"])
    for script in sorted(p.name for p in DASHBOARD.glob("*.mjs")):
        assert httpx.get(f"{exo_node.url}/dashboard/{script}", timeout=10).status_code == 200, script
        subprocess.run(["node", "--check", str(DASHBOARD / script)], check=True)
    # A missing asset is a 404, not a crash.
    assert httpx.get(f"{exo_node.url}/dashboard/nope.js", timeout=10).status_code == 404


def test_the_dashboard_view_reads_a_real_nodes_state_and_chat_stream(exo_node: ExoNode, tmp_path):
    instance_id = exo_node.place()
    state = exo_node.state()
    previews = exo_node.get("/instance/previews", params={"model_id": TINY_MODEL_ID}).json()
    body = {
        "model": TINY_MODEL_ID,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{exo_node.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        stream = response.read().decode()
    expected_content = "".join(
        choice["delta"].get("content") or ""
        for line in stream.splitlines()
        if line.startswith("data: {")
        for choice in json.loads(line[6:])["choices"]
    )

    given = tmp_path / "dashboard-input.json"
    # The same machine twice under another node id: two nodes on one host share a name.
    node_id = exo_node.node_id()
    twin_id = "0123abcd" + node_id[8:]
    # The twin has an NVIDIA GPU (NodeInfo's gpus, as nvidia-smi reports it).
    h100 = {"name": "NVIDIA H100 80GB HBM3", "totalBytes": 80 * 2**30, "freeBytes": 60 * 2**30}
    twin = {**state["nodes"][node_id], "nodeId": twin_id, "gpus": [h100]}
    twin_state = {**state, "nodes": {**state["nodes"], twin_id: twin}}
    links = [
        {"source": node_id, "sink": twin_id, "sinkIp": "10.0.0.2", "latencyMs": 1.5, "bandwidthMbps": 900.0},
        {"source": twin_id, "sink": node_id, "sinkIp": "10.0.0.1", "latencyMs": 2.25, "bandwidthMbps": 800.0},
    ]
    twin_state["topology"] = {"connections": links}
    cards = exo_node.get("/models").json()
    samples = [
        "Some **bold** and `code <b>` and *it*.\n\n```python\nprint('<hi>')\n```\n- one\n- two",
        "<script>alert(1)</script> [link](javascript:alert(1)) [ok](https://exo.example/)",
        "```\nstill streaming",
    ]
    given.write_text(
        json.dumps(
            {
                "state": state,
                "twinState": twin_state,
                "previews": previews,
                "stream": stream,
                "cards": cards,
                "markdownSamples": samples,
            }
        )
    )
    shown = json.loads(
        subprocess.run(
            ["node", str(VIEW_CHECK), str(given), str(DASHBOARD / "view.mjs"), str(DASHBOARD / "markdown.mjs")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )

    [node] = shown["nodes"]
    assert node["nodeId"] == node_id and node["isMaster"]
    assert node["memoryTotal"] == state["nodes"][node_id]["memory"]["totalBytes"] > 0
    assert 0 <= node["memoryPercent"] <= 100
    info = state["nodes"][node_id]
    engine = "llama.cpp" if info.get("engine") == "llamacpp" else "MLX"
    assert node["engine"] == f"{engine} {info['backend']}"
    assert shown["links"] == []
    name = state["nodes"][node_id]["friendlyName"]
    assert node["name"] == name
    assert sorted(n["name"] for n in shown["twinNodes"]) == sorted([f"{name} ({node_id[:8]})", f"{name} (0123abcd)"])
    [twin_row] = [n for n in shown["twinNodes"] if n["nodeId"] == twin_id]
    assert twin_row["gpus"] == [{"name": h100["name"], "used": 20 * 2**30, "total": 80 * 2**30, "percent": 25}]
    assert len(node["gpus"]) == len(state["nodes"][node_id].get("gpus", []))
    topology = shown["twinTopology"]
    master = next(n for n in topology["nodes"] if n["isMaster"])
    assert master["nodeId"] == node_id and master["y"] < 150  # the master is drawn at the top
    # Two directed links make one line, labelled with the slower direction.
    [edge] = topology["edges"]
    assert edge["bothWays"] and edge["label"] == "2.3 ms"

    [instance] = shown["instances"]
    assert instance["instanceId"] == instance_id and instance["modelId"] == TINY_MODEL_ID
    assert instance["serving"] and instance["sharding"] == "Pipeline"
    assert instance["engine"] == ("llama.cpp" if state["instances"][instance_id].get("engine") == "llamacpp" else "MLX")
    [rank] = instance["ranks"]
    n_layers = state["instances"][instance_id]["shardAssignments"]["runnerToShard"]
    n_layers = next(iter(n_layers.values()))["nLayers"]
    assert rank["layers"] == f"0-{n_layers - 1} of {n_layers}"
    assert rank["status"]["text"] in ("Ready", "Running 1 request(s)")
    assert shown["serving"] == [TINY_MODEL_ID]

    assert any(p["fits"] and p["verdict"] == "fits" for p in shown["previews"])
    assert all(p["fits"] or p["verdict"] != "fits" for p in shown["previews"])
    # A CUDA node's share is measured against its GPU's memory, and the row says so.
    [on_gpu] = shown["gpuPreviews"]
    assert on_gpu["memory"].endswith(" GPU")
    on_this_node = previews[0]["memoryKind"][node_id]
    assert shown["previews"][0]["memory"].endswith(" GPU") == (on_this_node == "gpu")
    # An option another node would prefill for says so, with the wait it saves.
    worth, not_worth = shown["disaggregatedPreviews"]
    name = state["nodes"][node_id]["friendlyName"]
    assert (
        worth["verdict"]
        == f"fits; prefilling on {name} would cut the first token on 8,192 tokens from 4.68 s to 1.34 s"
    )
    assert not_worth["verdict"] == "fits"
    # Only the option worth it offers to place with the prefill there.
    assert shown["disaggregatedOptions"] == [{"prefillNodeId": "p", "decodeNodeId": node_id}, None]

    reply = shown["reply"]
    assert reply["done"] and shown["leftover"] == ""
    assert reply["content"] == expected_content and reply["content"]
    assert reply["finishReason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] > 0
    assert reply["stats"]["generation_tokens"] == reply["usage"]["completion_tokens"]
    assert reply["stats"]["generation_tps"] > 0

    # No link line runs through a node's label, and every label is inside the drawing.
    for count, seen in shown["crossings"].items():
        assert seen["edges"] == int(count) * (int(count) - 1) // 2
        assert seen["crossed"] == [] and seen["outside"] == [], (count, seen)
    assert shown["summary"] == f"1 node · {name} leads · 1 model serving"
    assert "event" not in shown["summary"]

    # The catalog: the tiny model's card, where its files are, that it runs; the fit line.
    [row] = [r for r in shown["catalog"] if r["id"] == TINY_MODEL_ID]
    assert row["serving"] and row["family"] == "llama" and row["dialect"] == "none"
    assert [place["nodeId"] for place in row["downloadedOn"]] == [node_id]
    assert TINY_MODEL_ID in shown["downloadedCatalog"]
    assert shown["fit"]["fits"] and shown["fit"]["text"] == f"fits on {name} (Pipeline)"
    # Placing it sends the preview's own instance: on exactly the nodes the preview names.
    option = shown["fit"]["option"]
    assert list(option["instance"]["shardAssignments"]["nodeToRunner"]) == [node_id]
    assert option["sharding"] == "Pipeline" and option["minNodes"] == 1
    [download] = [d for d in shown["downloads"] if d["modelId"] == TINY_MODEL_ID]
    assert download["inUse"] and not download["canDelete"] and not download["canCancel"]
    [models_dir] = [d for d in shown["dirs"] if TINY_MODEL_ID in d["models"]]
    assert models_dir["nodeId"] == node_id and models_dir["dir"] == str(Path(download["path"]).parent)

    # opencode: `interleaved` exactly for the dialects that send reasoning back.
    models = shown["opencode"]["provider"]["exo"]["models"]
    assert shown["opencode"]["provider"]["exo"]["options"]["baseURL"] == "http://host:52415/v1"
    dialects = {card["model_id"]: card["reasoning_dialect"] for card in cards}
    assert set(dialects.values()) == {"none", "post_last_user", "suffix", "channel", "tool_conditional"}
    for model_id, dialect in dialects.items():
        interleaved = dialect in ("tool_conditional", "post_last_user", "channel")
        assert ("interleaved" in models[model_id]) == interleaved, (model_id, dialect)
        if interleaved:
            assert models[model_id]["interleaved"] == {"field": "reasoning_content"}

    # The chat's request: earlier reasoning back as reasoning_content, tool calls as
    # tool_calls (an id made up where the stream gave none), images as parts.
    assert shown["requestMessages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "The user greets."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            ],
        },
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "reasoning_content": "Paris.",
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_5_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "user", "content": "again"},
        # A stopped reply's half-written call is left out (its arguments do not parse).
        {"role": "assistant", "content": "Hm"},
    ]

    # Tool results the user gave go back as tool messages after the calls; the page offers
    # to answer the calls of the last reply that have none, until a question follows.
    assert shown["pendingAfterStop"] == []
    get_time = {"id": "call_1_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    assert shown["toolRoundMessages"] == [
        {"role": "user", "content": "weather and time?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two tools.",
            "tool_calls": [
                {
                    "id": "call_w",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                get_time,
            ],
        },
        {"role": "tool", "tool_call_id": "call_w", "content": "sunny"},
    ]
    assert shown["toolRoundPending"] == [get_time]
    assert shown["toolRoundAnswered"] == [] and shown["toolRoundAsked"] == []

    # Markdown: escaped, code blocks kept verbatim, only http(s) links, an open fence shown.
    rich, hostile, open_fence = shown["markdown"]
    assert "<strong>bold</strong>" in rich and "<code>code &lt;b&gt;</code>" in rich and "<em>it</em>" in rich
    assert '<code class="language-python">print(&#39;&lt;hi&gt;&#39;)</code>' in rich
    assert "<ul><li>one</li><li>two</li></ul>" in rich
    assert "<script>" not in hostile and "&lt;script&gt;" in hostile
    assert 'href="javascript' not in hostile and '<a href="https://exo.example/"' in hostile
    assert open_fence == '<pre class="code"><code>still streaming</code></pre>'
