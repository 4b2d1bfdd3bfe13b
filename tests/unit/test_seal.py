"""The cluster secret's envelope (routing/seal.py): what a node with the secret sealed
opens, and nothing else does: another secret, no secret, a flipped bit, another topic, a
replay, a message from outside the time window."""

import json

import pytest

from exo.routing.router import Topic
from exo.routing.seal import MAGIC, MAX_AGE_SECONDS, Rejected, Seal, SealedTransport, peer_token

PAYLOAD = b'{"origin":"n1","body":{"prompt":"the secret plans"}}'


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_sealed_message_opens_with_the_same_secret_and_hides_its_payload():
    sealed = Seal("s3cret").seal(Topic.CHUNKS, PAYLOAD)
    assert sealed.startswith(MAGIC)
    assert b"secret plans" not in sealed and b"origin" not in sealed
    assert Seal("s3cret").open(Topic.CHUNKS, sealed) == PAYLOAD
    # Random nonces: the same payload never seals the same way twice.
    assert Seal("s3cret").seal(Topic.CHUNKS, PAYLOAD) != sealed


def test_another_secret_no_secret_a_flipped_bit_or_another_topic_is_rejected():
    seal = Seal("s3cret")
    sealed = seal.seal(Topic.COMMANDS, PAYLOAD)
    with pytest.raises(Rejected, match="another cluster secret"):
        Seal("other").open(Topic.COMMANDS, sealed)
    with pytest.raises(Rejected, match="not sealed"):
        seal.open(Topic.COMMANDS, PAYLOAD)
    for position in (len(MAGIC), len(MAGIC) + 12, len(sealed) - 1):  # nonce, ciphertext, tag
        tampered = bytearray(sealed)
        tampered[position] ^= 1
        with pytest.raises(Rejected, match="does not authenticate"):
            seal.open(Topic.COMMANDS, bytes(tampered))
    with pytest.raises(Rejected, match="does not authenticate"):
        seal.open(Topic.GLOBAL_EVENTS, sealed)
    with pytest.raises(Rejected):
        seal.open(Topic.COMMANDS, sealed[:20])
    assert seal.open(Topic.COMMANDS, sealed) == PAYLOAD  # the untouched one still opens


def test_a_replayed_message_is_rejected_within_the_window_and_after_it():
    clock = Clock()
    sender, receiver = Seal("s3cret", clock), Seal("s3cret", clock)
    sealed = sender.seal(Topic.GLOBAL_EVENTS, PAYLOAD)
    assert receiver.open(Topic.GLOBAL_EVENTS, sealed) == PAYLOAD
    with pytest.raises(Rejected, match="already received"):
        receiver.open(Topic.GLOBAL_EVENTS, sealed)
    # Long after, the nonce is forgotten, but the send time no longer passes.
    clock.now += 10 * MAX_AGE_SECONDS
    receiver.open(Topic.GLOBAL_EVENTS, sender.seal(Topic.GLOBAL_EVENTS, PAYLOAD))  # prunes the record
    with pytest.raises(Rejected, match="replay, or clock skew"):
        receiver.open(Topic.GLOBAL_EVENTS, sealed)


def test_clock_skew_within_the_window_is_accepted_beyond_it_rejected():
    sender_clock, receiver_clock = Clock(), Clock()
    sender, receiver = Seal("s3cret", sender_clock), Seal("s3cret", receiver_clock)
    sender_clock.now = receiver_clock.now + MAX_AGE_SECONDS - 5
    assert receiver.open(Topic.ELECTION, sender.seal(Topic.ELECTION, PAYLOAD)) == PAYLOAD
    sender_clock.now = receiver_clock.now - MAX_AGE_SECONDS - 5
    with pytest.raises(Rejected, match="clock skew"):
        receiver.open(Topic.ELECTION, sender.seal(Topic.ELECTION, PAYLOAD))


class Loop:
    """A transport whose sent messages come straight back, as zenoh's do."""

    def __init__(self) -> None:
        self.sent: list[tuple[Topic, bytes]] = []
        self.on_message = None

    def start(self, on_message) -> None:
        self.on_message = on_message

    def send(self, topic: Topic, payload: bytes) -> None:
        self.sent.append((topic, payload))

    def close(self) -> None:
        pass


def test_the_sealed_transport_seals_what_it_sends_and_drops_what_does_not_open():
    inner = Loop()
    transport = SealedTransport(inner, "s3cret")
    received: list[tuple[Topic, bytes]] = []
    transport.start(lambda topic, payload: received.append((topic, payload)))
    transport.send(Topic.CHUNKS, PAYLOAD)
    [(topic, wire)] = inner.sent
    assert topic == Topic.CHUNKS and b"secret plans" not in wire
    assert inner.on_message is not None
    inner.on_message(Topic.CHUNKS, wire)
    inner.on_message(Topic.CHUNKS, wire)  # replayed
    inner.on_message(Topic.CHUNKS, PAYLOAD)  # from a node without the secret
    inner.on_message(Topic.CHUNKS, Seal("other").seal(Topic.CHUNKS, PAYLOAD))
    assert received == [(Topic.CHUNKS, PAYLOAD)]
    assert json.loads(received[0][1])["body"]["prompt"] == "the secret plans"


def test_the_peer_token_is_derived_not_the_secret():
    token = peer_token("s3cret")
    assert token == peer_token("s3cret") != peer_token("other")
    assert "s3cret" not in token and len(token) == 64
