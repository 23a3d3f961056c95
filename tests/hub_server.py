"""A Hub-compatible HTTP server for tests: standard library only, repositories kept in memory, on 127.0.0.1.

It implements just the endpoints that the real `huggingface_hub` client (and `transformers` on top of it)
calls to create a repository, commit files and download them again, so tests run the real client end to
end without a network. Every file is answered `"uploadMode": "regular"`: its content arrives base64-inline
in the commit (no LFS, no Xet), which is fine for tiny test checkpoints.

```python
with FakeHub(tokens={"hf_writer": "alice"}) as hub:
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_writer"}   # HF_ENDPOINT is read when huggingface_hub is imported
    hub.fail("POST", "/commit/", status=500)                    # the next commit answers 500
    hub.fail("POST", "/api/repos/create", 200, body=b"<html>")  # ... or 200 with a captive portal's page
    hub.repos["alice/tiny"].files()                             # {path: bytes} at the head of main
```

`SilentHub` is the other kind of server: it accepts connections and never answers, or (`trickle=SECONDS`) starts an
answer and sends one more byte of it every SECONDS, never finishing (for time-out tests).

Access rules (like the Hub's): reading a public repository needs no token; reading a private one needs
its owner's token; writing needs a known token (else 401) whose user is the namespace (else 403).
"""

import base64
import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

_ZERO_COMMIT = "0" * 40


def git_blob_sha1(content: bytes) -> str:
    """The git object id of a file: what the Hub calls the `oid` (and `ETag`) of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    sha: str
    parent: str | None
    message: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    refs: dict[str, str] = field(default_factory=dict)  # branch or "refs/pr/N" -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        sha = self.refs.get(revision, revision)
        return self.commits.get(sha)

    def files(self, revision: str = "main") -> dict[str, bytes]:
        """The files at `revision` (a branch, `refs/pr/N` or a commit sha): {path: content}."""
        commit = self.resolve(revision)
        return dict(commit.files) if commit else {}

    def commit(self, parent: Commit | None, message: str, files: dict[str, bytes]) -> Commit:
        digest = hashlib.sha1()
        digest.update((parent.sha if parent else _ZERO_COMMIT).encode() + message.encode())
        for path in sorted(files):
            digest.update(path.encode() + git_blob_sha1(files[path]).encode())
        digest.update(str(len(self.commits)).encode())  # identical trees still get distinct commits
        new = Commit(digest.hexdigest(), parent.sha if parent else None, message, files)
        self.commits[new.sha] = new
        return new


class HubError(Exception):
    """An HTTP error answered the way the Hub does: status, `X-Error-Code` and `X-Error-Message` headers."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class _Failure:
    method: str
    path_contains: str
    status: int
    times: int
    body: bytes | None  # answered as it is (e.g. an HTML page), instead of the Hub's JSON error


class FakeHub:
    """The server: start with `with FakeHub(...) as hub:` (or `start()`/`stop()`); `hub.url` is the endpoint."""

    def __init__(self, tokens: dict[str, str] | None = None):
        self.tokens = dict(tokens or {})  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, int]] = []  # (method, path, status) of every request
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "FakeHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- test controls -----------------------------------------------------------------------------
    def fail(self, method: str, path_contains: str, status: int = 500, times: int = 1,
             body: bytes | None = None) -> None:
        """Answer the next `times` requests `method` whose path contains `path_contains` with `status` (and `body`,
        if given, instead of the Hub's JSON error); `status=0` closes the connection without an answer."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), path_contains, status, times, body))

    def clear_failures(self) -> None:
        """Forget injected failures that no request has met yet."""
        with self._lock:
            self._failures.clear()

    def requests(self, method: str, path_contains: str = "") -> list[tuple[str, str, int]]:
        return [entry for entry in self.log if entry[0] == method.upper() and path_contains in entry[1]]

    def _injected_failure(self, method: str, path: str) -> _Failure | None:
        with self._lock:
            for failure in self._failures:
                if failure.method == method and failure.path_contains in path and failure.times > 0:
                    failure.times -= 1
                    return failure
        return None

    # -- access rules ------------------------------------------------------------------------------
    def user_of(self, headers) -> str | None:
        auth = headers.get("Authorization", "")
        return self.tokens.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None

    def readable_repo(self, repo_id: str, headers) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or repo.private and self.user_of(headers) != repo_id.split("/")[0]:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def check_write(self, namespace: str, headers) -> str:
        user = self.user_of(headers)
        if user is None:
            raise HubError(401, "Invalid username or password.")
        if user != namespace:
            raise HubError(403, f"You don't have the rights to create or write to {namespace}/*")
        return user


_REPO_API = re.compile(
    r"^/api/models/([^/]+/[^/]+)(?:/(revision|preupload|commit|branch|tree|paths-info)/([^/]+)(/.*)?)?$"
)
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep test output quiet
        pass

    # -- plumbing ----------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        path, query = split.path, parse_qs(split.query)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
        failure = self.hub._injected_failure(method, path)
        status = None
        try:
            if failure is not None and failure.status == 0:
                self.close_connection = True  # the client sees the connection end where the answer should be
            elif failure is not None and failure.body is not None:
                status = self._send(failure.status, failure.body, head=method == "HEAD")
            elif failure is not None:
                raise HubError(failure.status, f"Injected failure {failure.status} for {method} {path}")
            else:
                status = self._route(method, path, query, body)
        except HubError as error:
            status = error.status
            headers = {"X-Error-Message": error.message}
            if error.code:
                headers["X-Error-Code"] = error.code
            self._send(error.status, {"error": error.message}, headers, head=method == "HEAD")
        except Exception as error:  # a FakeHub bug: answer it rather than drop the connection
            status = 500
            self._send(500, {"error": f"FakeHub crashed: {error!r}"}, {"X-Error-Message": repr(error)})
        finally:
            self.hub.log.append((method, path, status))

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def _send(self, status: int, payload, headers: dict | None = None, head: bool = False) -> int:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type",
                         "application/octet-stream" if isinstance(payload, bytes) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(data)
        return status

    # -- routes ------------------------------------------------------------------------------------
    def _route(self, method: str, path: str, query: dict, body: bytes) -> int:
        hub = self.hub
        if path == "/api/whoami-v2" and method == "GET":
            user = hub.user_of(self.headers)
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            return self._send(200, {"type": "user", "name": user, "orgs": [],
                                    "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
        if path == "/api/validate-yaml" and method == "POST":
            return self._send(200, {"errors": [], "warnings": []})
        if path == "/api/repos/create" and method == "POST":
            return self._create_repo(json.loads(body or b"{}"))
        if match := _RESOLVE.match(path):
            if method in ("GET", "HEAD"):
                return self._resolve(method, unquote(match[1]), unquote(match[2]), unquote(match[3]))
        if match := _REPO_API.match(path):
            repo_id, action, revision, rest = unquote(match[1]), match[2], unquote(match[3] or "main"), match[4]
            if action in (None, "revision") and method == "GET":
                return self._repo_info(repo_id, revision)
            if action == "tree" and method == "GET":
                recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
                return self._tree(repo_id, revision, unquote(rest or "/").strip("/"), recursive)
            if action == "paths-info" and method == "POST":
                return self._paths_info(repo_id, revision, body)
            if action == "preupload" and method == "POST":
                return self._preupload(repo_id, revision, json.loads(body))
            if action == "commit" and method == "POST":
                return self._commit(repo_id, revision, body, create_pr=query.get("create_pr") == ["1"])
            if action == "branch" and method == "POST":
                return self._create_branch(repo_id, revision, json.loads(body or b"{}"))
        raise HubError(404, f"FakeHub does not implement {method} {path}")

    def _create_repo(self, payload: dict) -> int:
        hub = self.hub
        if payload.get("type", "model") != "model":
            raise HubError(400, "FakeHub only hosts model repositories")
        namespace = payload.get("organization") or hub.user_of(self.headers)
        hub.check_write(namespace or "", self.headers)
        repo_id = f"{namespace}/{payload['name']}"
        with hub._lock:
            if repo_id in hub.repos:  # the Hub's 409 still carries the url (the client reads it with exist_ok)
                return self._send(409, {"error": "You already created this model repo", "url": f"{hub.url}/{repo_id}"},
                                  {"X-Error-Message": "You already created this model repo"})
            repo = Repo(repo_id, private=payload.get("visibility") == "private")
            initial = repo.commit(None, "initial commit",
                                  {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"})
            repo.refs["main"] = initial.sha
            hub.repos[repo_id] = repo
        return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})

    def _commit_or_404(self, repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _repo_info(self, repo_id: str, revision: str) -> int:
        repo = self.hub.readable_repo(repo_id, self.headers)
        commit = self._commit_or_404(repo, revision)
        return self._send(200, {
            "_id": repo_id, "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
            "sha": commit.sha, "private": repo.private, "disabled": False, "gated": False,
            "tags": [], "downloads": 0, "likes": 0,
            "siblings": [{"rfilename": path} for path in sorted(commit.files)],
        })

    def _file_entry(self, path: str, content: bytes) -> dict:
        return {"type": "file", "oid": git_blob_sha1(content), "size": len(content), "path": path}

    def _tree(self, repo_id: str, revision: str, folder: str, recursive: bool) -> int:
        repo = self.hub.readable_repo(repo_id, self.headers)
        files = self._commit_or_404(repo, revision).files
        prefix = f"{folder}/" if folder else ""
        entries, folders = [], set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest:
                parts = rest.split("/")[:-1] if recursive else rest.split("/")[:1]
                folders.update(prefix + "/".join(parts[: depth + 1]) for depth in range(len(parts)))
                if not recursive:
                    continue
            entries.append(self._file_entry(path, files[path]))
        if folder and not entries and not folders:
            raise HubError(404, f"{folder} does not exist at {revision}", "EntryNotFound")
        entries += [{"type": "directory", "oid": _ZERO_COMMIT, "size": 0, "path": name} for name in sorted(folders)]
        return self._send(200, entries)

    def _paths_info(self, repo_id: str, revision: str, body: bytes) -> int:
        repo = self.hub.readable_repo(repo_id, self.headers)
        files = self._commit_or_404(repo, revision).files
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body).get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        return self._send(200, [self._file_entry(path, files[path]) for path in paths if path in files])

    def _preupload(self, repo_id: str, revision: str, payload: dict) -> int:
        repo = self.hub.readable_repo(repo_id, self.headers)
        self.hub.check_write(repo_id.split("/")[0], self.headers)
        files = repo.files(revision)
        return self._send(200, {"files": [
            {"path": entry["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": git_blob_sha1(files[entry["path"]]) if entry["path"] in files else None}
            for entry in payload["files"]
        ]})

    def _commit(self, repo_id: str, revision: str, body: bytes, create_pr: bool) -> int:
        hub = self.hub
        repo = hub.readable_repo(repo_id, self.headers)
        hub.check_write(repo_id.split("/")[0], self.headers)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        with hub._lock:
            parent = self._commit_or_404(repo, revision)
            if header.get("parentCommit") and header["parentCommit"] != parent.sha:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(parent.files)
            for line in lines:
                key, value = line["key"], line["value"]
                if key == "file":
                    files[value["path"]] = base64.b64decode(value["content"]) if value.get("encoding") == "base64" \
                        else value["content"].encode()
                elif key == "deletedFile":
                    files.pop(value["path"], None)
                elif key == "deletedFolder":
                    files = {p: c for p, c in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
                elif key != "header":
                    raise HubError(400, f"FakeHub does not support {key!r} commit operations")
            commit = repo.commit(parent, header["summary"], files)
            pr_url = None
            if create_pr:
                number = sum(ref.startswith("refs/pr/") for ref in repo.refs) + 1
                repo.refs[f"refs/pr/{number}"] = commit.sha
                pr_url = f"{hub.url}/{repo_id}/discussions/{number}"
            else:
                repo.refs[revision] = commit.sha
        return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{commit.sha}", "commitOid": commit.sha,
                                "success": True, "pullRequestUrl": pr_url})

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> int:
        hub = self.hub
        repo = hub.readable_repo(repo_id, self.headers)
        hub.check_write(repo_id.split("/")[0], self.headers)
        with hub._lock:
            if branch in repo.refs:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = self._commit_or_404(repo, payload.get("startingPoint") or "main")
            repo.refs[branch] = start.sha
        return self._send(200, {})

    def _resolve(self, method: str, repo_id: str, revision: str, path: str) -> int:
        repo = self.hub.readable_repo(repo_id, self.headers)
        commit = self._commit_or_404(repo, revision)
        if path not in commit.files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        content = commit.files[path]
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{git_blob_sha1(content)}"'}
        return self._send(200, content, headers, head=method == "HEAD")


class SilentHub:
    """A server that accepts connections on 127.0.0.1 and never answers: a Hub that hangs. With `trickle=SECONDS`
    it reads each request, then sends a status line and one more byte of a header every SECONDS, never finishing:
    a Hub (or proxy) that keeps a connection alive without ever answering. It hangs up after `TRICKLE_FOR`
    seconds, so that a client without a deadline fails a test instead of hanging it.

    `hub.url` is the endpoint; `hub.accepted` counts the connections taken (a client got that far).
    """

    TRICKLE_FOR = 10.0

    def __init__(self, trickle: float | None = None):
        self.accepted = 0
        self.trickle = trickle
        self._socket: socket.socket | None = None
        self._connections: list[socket.socket] = []

    def start(self) -> "SilentHub":
        self._socket = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed by stop()
                return
            self._connections.append(connection)  # kept open, never answered
            self.accepted += 1
            if self.trickle is not None:
                threading.Thread(target=self._trickle, args=(connection,), daemon=True).start()

    def _trickle(self, connection: socket.socket) -> None:
        try:
            connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nX-Trickle: ")
            end = time.monotonic() + self.TRICKLE_FOR
            while time.monotonic() < end:
                time.sleep(self.trickle)
                connection.sendall(b"x")
            connection.close()
        except OSError:  # closed by the client or by stop()
            return

    def stop(self) -> None:
        for connection in [self._socket, *self._connections]:
            connection.close()

    def __enter__(self) -> "SilentHub":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}"
