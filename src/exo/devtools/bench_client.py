"""exo-bench's client side: streamed OpenAI Chat Completions, timed as a client sees them,
against any server that speaks them (an exo node, mlx_lm.server).

A request's time to first token is from sending it to its first streamed token; its
decode rate counts the tokens after the first over the time from the first to the last.
A round of N concurrent requests also has an aggregate: all requests' tokens after their
first over the time from the earliest first token to the latest last one; and an end to
end rate: all their tokens over the time from the first one sent to the latest last
token, which does not depend on the order a server serves them in (the aggregate's
window opens at the earliest first token, so a server that starts one request decoding
before the others have their first token widens its own window). A streamed
answer whose tokens after the first came in one event has no decode rate a client can
measure: that is NaN, printed as nan, rather than a rate of millions."""

import json
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

# Words the tiny models' tokenizers were trained on: each stays a token or two.
FILLER = "the cat runs over the quiet moon and the node sleeps while the cluster hums "


@dataclass
class Measured:
    """One request, as the client saw it."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    tokens: int = 0
    # Speculative decoding: proposals kept and not kept (usage's prediction tokens).
    accepted_tokens: int = 0
    rejected_tokens: int = 0
    text: str = ""
    sent_at: float = 0.0
    first_at: float = 0.0
    last_at: float = 0.0
    # A streamed answer whose tokens after the first all came in one event.
    burst: bool = False
    # Disaggregated serving: the KV's bytes on the wire, seconds from asking for it to
    # having it all, and the prefill node's own seconds (generation_stats.kv_handoff).
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    kv_prefill_seconds: float = 0.0
    # The serving runner's peak memory so far (MLX's, generation_stats), 0 where unknown.
    peak_memory_bytes: int = 0

    @property
    def ttft(self) -> float:
        return self.first_at - self.sent_at

    @property
    def decode_tps(self) -> float:
        if self.burst:
            return math.nan
        return (self.tokens - 1) / max(self.last_at - self.first_at, 1e-9)


@dataclass
class Round:
    """N requests sent at once."""

    requests: list[Measured] = field(default_factory=list)

    @property
    def aggregate_tps(self) -> float:
        decoded = sum(r.tokens - 1 for r in self.requests)
        window = max(r.last_at for r in self.requests) - min(r.first_at for r in self.requests)
        if all(r.burst for r in self.requests):
            return math.nan
        return decoded / max(window, 1e-9)

    @property
    def end_to_end_tps(self) -> float:
        window = max(r.last_at for r in self.requests) - min(r.sent_at for r in self.requests)
        return sum(r.tokens for r in self.requests) / max(window, 1e-9)

    def summary(self) -> dict[str, Any]:
        count = len(self.requests)
        ttfts = [r.ttft for r in self.requests]
        return {
            "prompt_tokens": round(sum(r.prompt_tokens for r in self.requests) / count),
            "cached_tokens": round(sum(r.cached_tokens for r in self.requests) / count),
            "completion_tokens": round(sum(r.tokens for r in self.requests) / count),
            "ttft_s": sum(ttfts) / count,
            "ttft_max_s": max(ttfts),
            "prefill_tps": sum(r.prompt_tokens / max(r.ttft, 1e-9) for r in self.requests) / count,
            "decode_tps": sum(r.decode_tps for r in self.requests) / count,
            "aggregate_tps": self.aggregate_tps,
            "end_to_end_tps": self.end_to_end_tps,
            "proposals_kept": _kept(self.requests),
            "kv_bytes": round(sum(r.kv_bytes for r in self.requests) / count),
            "kv_s": sum(r.kv_seconds for r in self.requests) / count,
            "kv_prefill_s": sum(r.kv_prefill_seconds for r in self.requests) / count,
            "peak_memory_bytes": max(r.peak_memory_bytes for r in self.requests),
        }


def _kept(requests: list[Measured]) -> float | None:
    """The share of proposed tokens kept; None when nothing was proposed."""
    accepted = sum(r.accepted_tokens for r in requests)
    proposed = accepted + sum(r.rejected_tokens for r in requests)
    return accepted / proposed if proposed else None


def messages_for(words: int, tag: str) -> list[dict[str, str]]:
    """A user message of about `words` filler words, starting with `tag` so prompts with
    different tags share no prefix beyond the chat template's header."""
    filler = (FILLER * (words // 14 + 1)).split()[:words]
    return [{"role": "user", "content": f"{tag} " + " ".join(filler)}]


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, banned: list[int]) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # EOS banned: every request decodes exactly max_tokens tokens.
        "logit_bias": {str(token): -100 for token in banned},
    }


def stream_chat(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, client: httpx.Client | None = None
) -> Measured:
    if client is None:
        with httpx.Client(timeout=3600) as own:
            return stream_chat(url, body, headers, own)
    measured = Measured(sent_at=time.perf_counter())
    pieces: list[str] = []
    events = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url}: {response.status_code} {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            stats = event.get("generation_stats") or {}
            measured.peak_memory_bytes = stats.get("peak_memory_bytes") or measured.peak_memory_bytes
            handoff = stats.get("kv_handoff")
            if handoff:
                measured.kv_bytes, measured.kv_seconds = handoff["bytes"], handoff["seconds"]
                measured.kv_prefill_seconds = handoff["prefill_seconds"]
            usage = event.get("usage")
            if usage:
                measured.tokens = usage["completion_tokens"]
                measured.prompt_tokens = usage["prompt_tokens"]
                measured.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                details = usage.get("completion_tokens_details") or {}
                measured.accepted_tokens = details.get("accepted_prediction_tokens") or 0
                measured.rejected_tokens = details.get("rejected_prediction_tokens") or 0
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content") or ""
                pieces.append(delta.get("content") or "")
                if not text:
                    continue  # a role-only or finishing delta is no token
                events += 1
                now = time.perf_counter()
                measured.first_at = measured.first_at or now
                measured.last_at = now
    measured.text = "".join(pieces)
    measured.burst = measured.tokens > 2 and events < 3
    return measured


def concurrent_round(url: str, bodies: list[dict[str, Any]], headers: dict[str, str] | None = None) -> Round:
    """The requests sent together, as one client with a connection each sends them: made
    before the first is sent (an httpx client takes ~25 ms to make here, which a client per
    request spread over the sending, so a server got them over ~100 ms on 2 cores)."""
    results: list[Measured | BaseException] = [Measured() for _ in bodies]
    ready = threading.Barrier(len(bodies))

    def run(index: int) -> None:
        try:
            ready.wait()
            results[index] = stream_chat(url, bodies[index], headers, client)
        except BaseException as error:  # re-raised below, in the caller's thread
            results[index] = error

    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    with httpx.Client(timeout=3600, limits=limits) as client:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return Round([r for r in results if isinstance(r, Measured)])


def words_for_tokens(url: str, model: str, pp: int, headers: dict[str, str] | None = None) -> int:
    """How many filler words make a prompt of about `pp` tokens on this server: two probe
    prompts (tagged like the measured ones) give the template's overhead and the tokens
    per word, and a third checks the guess once."""

    def count(words: int) -> int:
        tag = f"{uuid.uuid4().hex[:6]}r0p{pp}s0"
        return stream_chat(url, chat_body(model, messages_for(words, tag), 1, []), headers).prompt_tokens

    low, high = count(16), count(256)
    per_word = max((high - low) / 240, 1e-3)
    words = max(1, round(16 + (pp - low) / per_word))
    return max(1, round(words + (pp - count(words)) / per_word))
