"""Images by content hash, in one dir of a node's home. The API puts each image a request
carries here (api/images.py) and the task names it by hash and by the node that holds it;
the worker of the node holding the instance's rank 0 reads it from here, or first takes
it once from the holder's `/peer-images` (api/peer_images.py, worker/images.py). So the
bytes never enter an event (nor the durable event log every node keeps), cross the
cluster at most once per node, and a follow-up turn repeating an image moves none.

Files are named by their sha256 and written whole (a temporary name, then a rename), so a
name present is always its content. Past `MAX_STORE_BYTES` the least recently used go."""

import hashlib
import os
import re
from pathlib import Path

PEER_IMAGES_PREFIX = "/peer-images"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def max_store_bytes() -> int:
    return int(os.environ.get("EXO_IMAGE_STORE_BYTES", str(1 << 30)))


def images_dir(exo_home: Path) -> Path:
    return exo_home / "data" / "images"


def is_sha256(name: str) -> bool:
    return _SHA256.fullmatch(name) is not None


def put_image(directory: Path, data: bytes) -> str:
    """Stores `data` (once: the same bytes again only mark it used); its sha256."""
    sha256 = hashlib.sha256(data).hexdigest()
    path = directory / sha256
    if path.exists():
        path.touch()
        return sha256
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{sha256}.{os.getpid()}.tmp"
    temporary.write_bytes(data)
    temporary.replace(path)
    _prune(directory, max_store_bytes())
    return sha256


def get_image(directory: Path, sha256: str) -> bytes | None:
    if not is_sha256(sha256):
        return None
    path = directory / sha256
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    path.touch()
    return data


def _prune(directory: Path, limit: int) -> None:
    files = [(path.stat().st_mtime, path) for path in directory.iterdir() if is_sha256(path.name)]
    total = sum(path.stat().st_size for _, path in files)
    for _, path in sorted(files)[:-1]:  # the newest stays, whatever its size
        if total <= limit:
            return
        total -= path.stat().st_size
        path.unlink(missing_ok=True)
