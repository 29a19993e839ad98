"""A local stand-in for the Hugging Face Hub: the endpoints huggingface_hub 2.x calls, over fixture repos.

    hub = FakeHub().start()                 # http://127.0.0.1:<port>; point HF_ENDPOINT at hub.url
    hub.add_repo("org/tiny", directory)     # every file of the directory, at one commit
    hub.cut_once("org/tiny", "big.safetensors", after=11 << 20)   # drop the connection mid-file, once
    hub.failing[("org/tiny", "big.safetensors")] = 500   # every GET of that file answers HTTP 500
    hub.log                                 # every request: method, path, Range, status, bytes sent

Endpoints (what the real client requests, found by pointing it here):
- ``GET /api/models/{repo}/revision/{rev}[?blobs=true]``: the commit and every file with its size;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=...``: the file listing (cached by the client);
- ``HEAD|GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag`` (sha256 of the content, as for
  LFS files), ``Content-Length``; GET honours ``Range: bytes=N-`` (206).
Errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound) as the hub's do.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from exo.api.server import BackgroundServer

CHUNK = 64 << 10


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    token: str | None = None  # private: this bearer token is required

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    status: int
    sent: int = 0


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[Logged] = field(default_factory=list)
    # (repo, file) -> bytes after which the next GET is cut (the connection dropped)
    cuts: dict[tuple[str, str], int] = field(default_factory=dict)
    # (repo, file) -> seconds to sleep between chunks (a slow transfer)
    slow: dict[tuple[str, str], float] = field(default_factory=dict)
    # (repo, file) -> event a GET of that file waits for before sending its body
    gates: dict[tuple[str, str], threading.Event] = field(default_factory=dict)
    # (repo, file) -> the HTTP status every GET of that file gets (a hub that fails)
    failing: dict[tuple[str, str], int] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # paths of file GETs whose body began
    _server: BackgroundServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- setup ---------------------------------------------------------------------------------------
    def add_repo(self, repo: str, source: Path | dict[str, bytes], *, token: str | None = None,
                 skip: tuple[str, ...] = ()) -> str:
        """Serve ``source`` (a directory, or name -> content) as ``repo``; returns its commit."""
        if isinstance(source, Path):
            files = {str(p.relative_to(source)): p.read_bytes() for p in sorted(source.rglob("*"))
                     if p.is_file() and p.name not in skip}
        else:
            files = dict(source)
        digest = hashlib.sha1(repo.encode())
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha256(files[name]).digest())
        self.repos[repo] = Repo(files, digest.hexdigest(), token)
        return self.repos[repo].commit

    def cut_once(self, repo: str, name: str, after: int) -> None:
        self.cuts[(repo, name)] = after

    def gets(self, repo: str, name: str | None = None) -> list[Logged]:
        """GET requests of file downloads (of one file, or of every file) of ``repo``."""
        prefix = f"/{repo}/resolve/"
        return [e for e in self.log if e.method == "GET" and e.path.startswith(prefix)
                and (name is None or e.path.endswith("/" + name))]

    def fetched_files(self, repo: str) -> set[str]:
        return {e.path.split("/resolve/", 1)[1].split("/", 1)[1] for e in self.gets(repo)}

    # -- serving -------------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}/revision/{rev}", self._info)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}", self._tree)
        app.router.add_get("/api/models/{owner}/{name}/tree/{rev}/{path:.*}", self._tree)
        app.router.add_route("*", "/{owner}/{name}/resolve/{rev}/{path:.+}", self._resolve)
        self._server = BackgroundServer(app).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url

    def _record(self, request: web.Request, status: int, sent: int = 0) -> None:
        with self._lock:
            self.log.append(Logged(request.method, request.path, request.headers.get("Range"), status, sent))

    def _repo(self, request: web.Request) -> tuple[str, Repo]:
        repo_id = f"{request.match_info['owner']}/{request.match_info['name']}"
        repo = self.repos.get(repo_id)
        if repo is None:
            raise self._error(request, 404, "RepoNotFound", f"Repository {repo_id} not found")
        if repo.token is not None and request.headers.get("Authorization") != f"Bearer {repo.token}":
            raise self._error(request, 401, "RepoNotFound", "Invalid username or password.")
        rev = request.match_info["rev"]
        if rev not in ("main", repo.commit):
            raise self._error(request, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return repo_id, repo

    def _error(self, request: web.Request, status: int, code: str, message: str) -> web.HTTPException:
        self._record(request, status)
        return _http_error(status, code, message)

    async def _info(self, request: web.Request) -> web.Response:
        repo_id, repo = self._repo(request)
        self._record(request, 200)
        siblings = [{"rfilename": name, "size": len(data), "blobId": repo.etag(name)[:40]}
                    for name, data in sorted(repo.files.items())]
        return web.json_response({"id": repo_id, "modelId": repo_id, "sha": repo.commit,
                                  "private": repo.token is not None, "siblings": siblings})

    async def _tree(self, request: web.Request) -> web.Response:
        _, repo = self._repo(request)
        self._record(request, 200)
        prefix = request.match_info.get("path", "").strip("/")
        entries = [{"type": "file", "oid": repo.etag(name)[:40], "size": len(data), "path": name}
                   for name, data in sorted(repo.files.items()) if not prefix or name.startswith(prefix + "/")]
        return web.json_response(entries)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo_id, repo = self._repo(request)
        name = request.match_info["path"]
        data = repo.files.get(name)
        if data is None:
            raise _http_error(404, "EntryNotFound", f"{name} does not exist", commit=repo.commit,
                              record=lambda s: self._record(request, s))
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(name)}"', "Accept-Ranges": "bytes"}
        failing = self.failing.get((repo_id, name))
        if failing is not None and request.method == "GET":
            raise _http_error(failing, "", "the hub failed", record=lambda s: self._record(request, s))
        if request.method == "HEAD":
            self._record(request, 200)
            return web.Response(status=200, headers={**headers, "Content-Length": str(len(data))})
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", request.headers.get("Range", ""))
        status = 200
        if match:
            start, status = int(match.group(1)), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        response = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(body))})
        await response.prepare(request)
        with self._lock:
            self.started.append(request.path)
        gate = self.gates.get((repo_id, name))
        if gate is not None:
            while not gate.is_set():
                await asyncio.sleep(0.02)
        cut = self.cuts.pop((repo_id, name), None)
        delay = self.slow.get((repo_id, name), 0.0)
        sent = 0
        for offset in range(0, len(body), CHUNK):
            piece = body[offset : offset + CHUNK]
            if cut is not None and sent + len(piece) > cut - start:
                piece = piece[: max(0, cut - start - sent)]
                await response.write(piece)
                sent += len(piece)
                self._record(request, status, sent)
                assert request.transport is not None
                request.transport.close()  # the connection drops mid-body
                return response
            await response.write(piece)
            sent += len(piece)
            if delay:
                await asyncio.sleep(delay)
        self._record(request, status, sent)
        await response.write_eof()
        return response


def _http_error(status: int, code: str, message: str, commit: str | None = None, record=None) -> web.HTTPException:
    if record is not None:
        record(status)
    headers = {"X-Error-Code": code, "X-Error-Message": message} if code else {}
    if commit:
        headers["X-Repo-Commit"] = commit
    kind = {401: web.HTTPUnauthorized, 404: web.HTTPNotFound, 500: web.HTTPInternalServerError,
            503: web.HTTPServiceUnavailable}[status]
    return kind(text=f'{{"error": "{message}"}}', content_type="application/json", headers=headers)
