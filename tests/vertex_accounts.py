"""A Google service account for tests: a fresh RSA key, its key file naming the mock's token
endpoint as `token_uri`, and the mock told to trust the key."""

from __future__ import annotations

import json
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from switchyard_mw.testing import MockProvider

EMAIL = "gateway@my-project.iam.gserviceaccount.com"


def service_account_file(
    directory: Path, mock: MockProvider | None, mock_url: str, *, email: str = EMAIL
) -> Path:
    """Write a key file whose `token_uri` is the mock's; `mock` (if given) trusts its key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if mock is not None:
        mock.vertex.trust(email, public)
    path = directory / f"{email.partition('@')[0]}-{len(list(directory.iterdir()))}.json"
    info = {
        "type": "service_account",
        "project_id": "my-project",
        "private_key_id": "k1",
        "private_key": private,
        "client_email": email,
        "client_id": "1",
        "token_uri": f"{mock_url}/token",
    }
    path.write_text(json.dumps(info))
    return path
