"""The fake hub (exo.devtools.fake_hub) as a pytest fixture, with the test process cut
off from every other host."""

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.devtools.fake_hub import FakeHub, running_fake_hub

__all__ = ["FakeHub", "fake_hub", "running_fake_hub"]


def _isolate_from_real_hub(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Anything that falls back to the default hub reaches this fake one instead, and name
    lookups of any other host fail."""
    import huggingface_hub.constants as constants

    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", b"127.0.0.1", b"localhost"):
            raise socket.gaierror(socket.EAI_NONAME, f"tests may only reach 127.0.0.1, not {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", local_only)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # hf_hub_url builds URLs from HUGGINGFACE_CO_URL_TEMPLATE and swaps the ENDPOINT prefix for
    # an explicit endpoint, so both must move together.
    monkeypatch.setattr(constants, "ENDPOINT", endpoint, raising=False)
    monkeypatch.setattr(
        constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}", raising=False
    )
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False, raising=False)


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running FakeHub over `tmp_path / "hub"`; unpacks as `endpoint, root = fake_hub`.

    HF_ENDPOINT points at it for the test. Set `fake_hub.throttle_bytes_per_second` (and the
    other knobs) at any time."""
    with running_fake_hub(tmp_path / "hub") as hub:
        _isolate_from_real_hub(monkeypatch, hub.endpoint)
        yield hub
