"""Hugging Face Hub stand-ins for tests (no network here): a local cache in the standard
layout, and a small Hub server on loopback that ``HF_ENDPOINT`` points the real
``huggingface_hub`` client at.

- ``write_hub_cache`` lays files out as ``snapshot_download`` leaves them:
  ``models--OWNER--NAME/{blobs/SHA256, snapshots/COMMIT/NAME -> blob, refs/REVISION}``.
- ``FakeHub`` serves one repository the way the Hub's HTTP API does for a public (or gated,
  or forbidden, or missing) model repo: ``/api/models/REPO/revision/REV``,
  ``/api/models/REPO/tree/REV`` and ``/REPO/resolve/REV/FILE`` (HEAD and GET), and records
  every file it sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def write_hub_cache(cache: Path, repo_id: str, files: dict[str, Path], *, commit: str = COMMIT,
                    revision: str | None = "main") -> Path:
    """Put ``files`` (name -> source file) into ``cache`` as the snapshot ``commit`` of
    ``repo_id`` (and the ref ``revision`` pointing at it); returns the snapshot folder."""
    folder = repo_folder(cache, repo_id)
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        data = Path(source).read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if revision is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / revision).write_text(commit)
    return snapshot


class FakeHub:
    """One model repository over HTTP on 127.0.0.1.  ``mode``: ``"ok"``, ``"gated"`` (401
    with ``X-Error-Code: GatedRepo``, as the Hub answers before the licence is accepted),
    ``"forbidden"`` (403) or ``"missing"`` (404 ``RepoNotFound``)."""

    def __init__(self, repo_id: str, files: dict[str, Path], *, mode: str = "ok") -> None:
        self.repo_id = repo_id
        self.files = {name: Path(path).read_bytes() for name, path in files.items()}
        self.mode = mode
        self.sent: list[str] = []  # files whose content was sent (GET)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _refuse(self, handler: BaseHTTPRequestHandler) -> bool:
        status, code = {"gated": (401, "GatedRepo"), "forbidden": (403, None), "missing": (404, "RepoNotFound")}.get(
            self.mode, (None, None))
        if status is None:
            return False
        handler.send_response(status)
        if code:
            handler.send_header("X-Error-Code", code)
        handler.send_header("X-Error-Message", "refused by the test hub")
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return True

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = handler.path.split("?")[0]
        if self._refuse(handler):
            return
        api = f"/api/models/{self.repo_id}/revision/"
        tree = f"/api/models/{self.repo_id}/tree/"
        resolve = f"/{self.repo_id}/resolve/"
        if path.startswith(api):
            payload = json.dumps({"id": self.repo_id, "sha": COMMIT,
                                  "siblings": [{"rfilename": name} for name in sorted(self.files)]}).encode()
            self._send(handler, 200, payload, body, {"Content-Type": "application/json"})
        elif path.startswith(tree):  # the file listing newer clients ask for
            payload = json.dumps([{"type": "file", "path": name, "size": len(data),
                                   "oid": hashlib.sha1(data).hexdigest()}
                                  for name, data in sorted(self.files.items())]).encode()
            self._send(handler, 200, payload, body, {"Content-Type": "application/json"})
        elif path.startswith(resolve):
            name = path[len(resolve):].split("/", 1)[1]
            data = self.files.get(name)
            if data is None:
                self._send(handler, 404, b"", body, {"X-Error-Code": "EntryNotFound"})
                return
            if body:
                self.sent.append(name)
            self._send(handler, 200, data, body, {"X-Repo-Commit": COMMIT,
                                                  "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
        else:
            self._send(handler, 404, b"", body, {"X-Error-Code": "RepoNotFound"})

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes, body: bool, headers: dict[str, str]) -> None:
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
