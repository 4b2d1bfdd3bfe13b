"""Keys derived from the cluster secret (--cluster-secret / EXO_CLUSTER_SECRET), one per
purpose, so no two uses share a key and the secret itself is never used or sent. The
routing seal (routing/seal.py) and the MLX ring's broadcasts (engine/mlx/parallel.py)
read it here."""

import os

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SECRET_ENV = "EXO_CLUSTER_SECRET"


def derive_key(secret: str, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"exo cluster secret", info=purpose).derive(secret.encode())


def secret_from_env() -> str | None:
    """The secret as a runner process sees it: the node exports it to its children."""
    return os.environ.get(SECRET_ENV) or None
