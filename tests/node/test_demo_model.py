"""The built-in demo model: shipped in the package, listed with no network, and its
answers read as English."""

import openai

from tests.support.node import start_node, stop_node

DEMO_MODEL_ID = "exo/demo-chat"


def test_demo_model_is_placed_at_start_and_answers_in_english(tmp_path):
    # What the README's run command does: a fresh EXO_HOME, no models dirs configured.
    node = start_node(tmp_path / "home", args=("--place-model", DEMO_MODEL_ID))
    try:
        sdk = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", max_retries=0, timeout=120)
        models = {m.id: m for m in sdk.models.list().data}
        assert DEMO_MODEL_ID in models
        assert models[DEMO_MODEL_ID].model_extra["context_length"] == 1024

        node.wait_for_state(
            lambda s: [r["kind"] for r in s["runners"].values()] == ["RunnerReady"], timeout=120, what="demo ready"
        )

        def ask(question: str) -> str:
            completion = sdk.chat.completions.create(
                model=DEMO_MODEL_ID, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=60
            )
            assert completion.choices[0].finish_reason == "stop"
            return completion.choices[0].message.content

        assert "yellow" in ask("What colour is a banana?").lower()
        assert "cluster" in ask("Hello! What is exo?").lower()
        story = ask("Tell me a short story about a dog.")
        words = story.split()
        assert len(words) >= 8 and all(w.strip(".,!?'").isalpha() for w in words if not w[0].isdigit())
    finally:
        stop_node(node)
