"""One model served three ways, offline: the Anthropic API, Amazon Bedrock and Google Vertex AI,
each played by the bundled mock provider, behind the example gateway.

    pip install -e '.[example,bedrock,vertex]'
    python examples/providers/run.py           # gateway on 127.0.0.1:8000, mock on :9100
    python examples/providers/run.py --demo    # asks as each provider fails in turn, then exits

It starts the mock provider, gives the gateway the credentials each cloud's own tools would
find (the mock's AWS test key in the environment; a fresh service-account key file in
`GOOGLE_APPLICATION_CREDENTIALS`, its token endpoint the mock's, the mock told to trust it),
and serves `examples/starlette_app.py` with `switchyard.toml` beside this file. Nothing of the
machine's own AWS or Google set-up is read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
ANTHROPIC_KEY = "mock-anthropic-key"
SERVICE_ACCOUNT = "gateway@my-project.iam.gserviceaccount.com"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port")
    parser.add_argument("--mock-port", type=int, default=9100, help="the mock provider's port")
    parser.add_argument("--demo", action="store_true", help="ask as providers fail, then exit")
    args = parser.parse_args()
    try:
        import botocore  # noqa: F401 -- the extras this example needs, named in one line
        import google.auth  # noqa: F401
        import uvicorn
    except ImportError as exc:
        sys.exit(f"{exc.name} missing: pip install -e '.[example,bedrock,vertex]'")

    from switchyard_mw.testing import MockProvider

    with tempfile.TemporaryDirectory(prefix="switchyard-providers-") as tmp:
        mock = MockProvider()
        mock_url = f"http://127.0.0.1:{args.mock_port}"
        _serve(uvicorn, mock, args.mock_port)
        _environment(Path(tmp), mock, mock_url)
        config = Path(tmp) / "switchyard.toml"
        text = (HERE / "switchyard.toml").read_text()
        config.write_text(text.replace("127.0.0.1:9100", f"127.0.0.1:{args.mock_port}"))
        os.environ["SWITCHYARD_CONFIG"] = str(config)
        os.environ["SWITCHYARD_START_MOCK"] = "0"
        sys.path.insert(0, str(ROOT))
        if not args.demo:
            uvicorn.run("examples.starlette_app:app", host="127.0.0.1", port=args.port)
            return
        server = _serve(uvicorn, "examples.starlette_app:app", args.port)
        try:
            _demo(f"http://127.0.0.1:{args.port}", mock)
        finally:
            server.should_exit = True


def _environment(tmp: Path, mock: Any, mock_url: str) -> None:
    """What each provider's own tools would find, and nothing of this machine's."""
    from switchyard_mw.testing import MOCK_AWS_ACCESS_KEY_ID, MOCK_AWS_SECRET_ACCESS_KEY

    os.environ["ANTHROPIC_API_KEY"] = ANTHROPIC_KEY
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": MOCK_AWS_ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": MOCK_AWS_SECRET_ACCESS_KEY,
            "AWS_CONFIG_FILE": str(tmp / "aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "aws-credentials"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": str(_service_account(tmp, mock, mock_url)),
        }
    )


def _service_account(tmp: Path, mock: Any, mock_url: str) -> Path:
    """A service-account key file as `gcloud iam service-accounts keys create` writes one,
    with a key made now and the mock's token endpoint; the mock trusts that key."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    mock.vertex.trust(SERVICE_ACCOUNT, public)
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    path = tmp / "vertex-service-account.json"
    info = {
        "type": "service_account",
        "project_id": "my-project",
        "private_key_id": "example",
        "private_key": private,
        "client_email": SERVICE_ACCOUNT,
        "client_id": "1",
        "token_uri": f"{mock_url}/token",
    }
    path.write_text(json.dumps(info))
    path.chmod(0o600)
    return path


def _serve(uvicorn: Any, app: Any, port: int) -> Any:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.05)
    sys.exit(f"nothing listening on 127.0.0.1:{port} after 30 s")


def _demo(gateway: str, mock: Any) -> None:
    """Ask `claude-opus-5` as the API, then Bedrock, fail: the answer comes from the next."""
    import httpx

    from switchyard_mw.testing import MOCK_AWS_ACCESS_KEY_ID, Behaviour

    steps = [
        ("all three up", None, None),
        ("the API answers 503", ANTHROPIC_KEY, Behaviour(status=503)),
        ("Bedrock throttles too", MOCK_AWS_ACCESS_KEY_ID, Behaviour(status=429)),
    ]
    with httpx.Client(base_url=gateway, timeout=30) as client:
        for label, key, behaviour in steps:
            if key is not None and behaviour is not None:
                mock.set_behaviour(key, behaviour)
            for stream in (False, True):
                text, account = _ask(client, stream)
                kind = "stream" if stream else "json"
                print(f"{label:24} {kind:6} -> {account:9} {text}", flush=True)


def _ask(client: Any, stream: bool) -> tuple[str, str]:
    """One Messages request as any Anthropic client sends it; the answer's text and the
    account that gave it."""
    request = {
        "model": "claude-opus-5",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hello"}],
        "stream": stream,
    }
    headers = {"x-api-key": "any", "anthropic-version": "2023-06-01"}
    response = client.post("/v1/messages", json=request, headers=headers)
    response.raise_for_status()
    account = response.headers["x-switchyard-account"]
    if not stream:
        return response.json()["content"][0]["text"], account
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: ") and '"text_delta"' in line:
            text += json.loads(line[6:])["delta"]["text"]
    return text, account


if __name__ == "__main__":
    main()
