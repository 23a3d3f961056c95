"""Publish a LazyLlama folder (converted or trained) to the Hugging Face Hub in one commit.

```bash
lazy-push DIR REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--create-pr] [--token TOKEN]
          [--stats FILE] [--include PATTERN ...] [--timeout SECONDS] [--retries N]
python -m conversion.push_to_hub DIR REPO_ID ...
```

Order of work, so that a failure loses nothing: check the folder (config, every weight shard's header and
size, code files, the full `auto_map`, the files the card is made from) and find a token before any request;
then create the repository if needed and upload the model's files (weights, config, code, tokenizer,
generation config, conversion settings, plus `--include` patterns) and a model card (see
`conversion.model_card.card_for_push`) in a single commit. Anything else in the folder (an `.env`, training
checkpoints, optimizer state) stays local. The local folder is only read. Every request gives up after
`--timeout` seconds without an answer, or when its answer has not arrived whole `--timeout` seconds after it was
sent (a server that trickles its answer); time-outs, lost connections, 429 and 502/503/504 answers are retried
`--retries` times with a growing pause. A commit is atomic on the Hub, so after any failure (or Ctrl-C) the
same command can simply be run again; files that are already there unchanged are not uploaded twice.
"""

import ast
import fnmatch
import json
import math
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token, set_client_factory
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.utils import _http as hub_http  # the client factory in use, to wrap and restore it

from conversion.checkpoint_files import (
    CARD_FILE,
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    SETTINGS_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    names_outside_folder,
)
from conversion.model_card import card_for_push, load_statistics
from lazy_llama_tools.cli import PUSH_COMMIT_MESSAGE, PUSH_RETRIES, PUSH_TIMEOUT, push_parser
from lazy_llama_tools.loading import listed
from modeling_lazy.modeling_lazy import LAZY_PARAMETER_NAMES

try:  # the HTTP client huggingface_hub uses (httpx2 in huggingface_hub >= 2, httpx before) and its connections
    import httpcore2 as httpcore
    from httpx2 import (
        BaseTransport,
        NetworkError,
        RemoteProtocolError,
        SyncByteStream,
        TimeoutException,
        TransportError,
    )
    from httpx2 import Timeout as HTTPTimeout
except ImportError:
    import httpcore
    from httpx import BaseTransport, NetworkError, RemoteProtocolError, SyncByteStream, TimeoutException, TransportError
    from httpx import Timeout as HTTPTimeout

NETWORK_ERRORS = (OSError, TransportError)  # connection refused, DNS, reset, timeout
RETRIED_STATUSES = (429, 502, 503, 504)  # rate limit and gateway trouble pass; a 500 is reported at once
DEFAULT_TIMEOUT = PUSH_TIMEOUT  # seconds without an answer before a request gives up
DEFAULT_RETRIES = PUSH_RETRIES
MAX_WAIT = 60.0  # longest pause between attempts, even if the server asks for more

AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")
DEFAULT_COMMIT_MESSAGE = PUSH_COMMIT_MESSAGE
_NEVER_UPLOADED = (".git", "__pycache__")  # not even with --include
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", flags=re.MULTILINE)  # what transformers follows


class PushError(RuntimeError):
    """A push that cannot go on; the message says what is wrong and what to do."""


@dataclass
class PushResult:
    url: str  # what to open: the pull request, the branch, or the repository
    repo_url: str
    commit_url: str
    pr_url: str | None
    uploaded: list[str]  # paths in the repository that this commit added or changed (README.md included)
    left_out: list[str] = field(default_factory=list)  # files of the folder that were not uploaded


def _relative_imports(path: Path) -> set[str]:
    return set(_RELATIVE_IMPORT.findall(path.read_text(encoding="utf-8")))


def _defines_class(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return any(isinstance(node, ast.ClassDef) and node.name == name for node in tree.body)


def _unreadable_code(path: Path, error: Exception, problems: list[str]) -> None:
    """Report a code file that is not UTF-8 Python (once, though several `auto_map` entries may name it)."""
    if isinstance(error, SyntaxError):
        what = f"has a syntax error (line {error.lineno}: {error.msg}), so the model code cannot be loaded"
    else:
        what = "is not UTF-8 text"
    problem = f"{path.name} {what}: copy the code files again (save_pretrained or the converter writes them)."
    if problem not in problems:
        problems.append(problem)


def _check_code(folder: Path, config: dict, problems: list[str]) -> list[str]:
    """Check the `auto_map` and the code files it needs; return those files."""
    auto_map = config.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        problems.append(f"{CONFIG_FILE} `auto_map` must be a JSON object (Auto class -> 'module.ClassName'), got a "
                        f"{type(auto_map).__name__}: save the folder again with `save_pretrained` or the converter.")
        return []
    missing = [name for name in AUTO_CLASSES if name not in auto_map]
    if missing:
        problems.append(
            f"{CONFIG_FILE} `auto_map` lacks {', '.join(missing)}: users without the package could not load the model "
            "with trust_remote_code=True. Save the folder with `LazyLlamaForCausalLM.save_pretrained` (it writes "
            "the full auto_map) or the converter."
        )
    modules = set()
    for auto_class in AUTO_CLASSES:
        reference = auto_map.get(auto_class)
        if not reference:
            continue
        if not isinstance(reference, str) or "--" in reference or reference.count(".") != 1:
            problems.append(f"auto_map[{auto_class!r}] = {reference!r}: expected 'module.ClassName' for a file in DIR.")
            continue
        module, class_name = reference.split(".")
        path = folder / f"{module}.py"
        if not path.is_file():
            problems.append(f"auto_map[{auto_class!r}] names {module}.py, which is not in {folder}.")
            continue
        try:
            defined = _defines_class(path, class_name)
        except (SyntaxError, UnicodeDecodeError) as error:
            _unreadable_code(path, error, problems)
            continue
        if not defined:
            problems.append(f"auto_map[{auto_class!r}] names class {class_name}, which {module}.py does not define.")
        else:
            modules.add(module)
    # Every module reached by `from .x import` must travel too: transformers downloads each one (even the ones
    # imported inside try/except), so one missing file breaks loading with trust_remote_code=True.
    seen, todo = set(), sorted(modules)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = folder / f"{module}.py"
        if not path.is_file():
            problems.append(f"{module}.py is imported by the model code (`from .{module} import ...`) "
                            f"but is not in {folder}.")
            continue
        try:
            todo += sorted(_relative_imports(path) - seen)
        except UnicodeDecodeError as error:
            _unreadable_code(path, error, problems)
    return sorted(f"{module}.py" for module in seen if (folder / f"{module}.py").is_file())


def _check_weights(folder: Path, config: dict, problems: list[str]) -> list[str]:
    """Check that every weight shard is a complete safetensors file (header, and data covering exactly the
    file) holding what the index says, and that the weights include the Lazy Attention parameters; return the
    weight files (the index first)."""
    from safetensors import safe_open

    weight_map = None
    if (folder / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            problems.append(f"{WEIGHTS_INDEX} is not a valid index ({error!r}).")
            return []
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            problems.append(f"{WEIGHTS_INDEX} is not a valid index: `weight_map` must map tensor names to file names.")
            return []
        shards, files = sorted(set(weight_map.values())), [WEIGHTS_INDEX]
        outside = names_outside_folder(shards)
        if outside:
            problems.append(f"{WEIGHTS_INDEX} names weight files outside the folder ({', '.join(outside[:3])}): an "
                            "index may only name files beside it.")
            return []
    elif (folder / WEIGHTS_FILE).is_file():
        shards, files = [WEIGHTS_FILE], []
    else:
        problems.append(f"no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} is in {folder}.")
        return []
    absent = [shard for shard in shards if not (folder / shard).is_file()]
    if absent:
        problems.append(f"weight shard(s) listed in {WEIGHTS_INDEX} are missing: {', '.join(absent)}.")
        return []
    names, readable = set(), True
    for shard in shards:
        try:
            with safe_open(folder / shard, framework="pt") as weights:
                held = set(weights.keys())
        except Exception as error:  # noqa: BLE001 - any unreadable file is the same problem for the user
            problems.append(f"{shard} is not a complete safetensors file ({error}): truncated or corrupt; "
                            "write the folder again.")
            readable = False
            continue
        if weight_map is not None:
            lacking = sorted(name for name, file in weight_map.items() if file == shard and name not in held)
            if lacking:
                problems.append(f"{WEIGHTS_INDEX} lists {len(lacking)} tensor(s) that {shard} does not hold "
                                f"(e.g. {lacking[0]}).")
        names |= held
    layers = config.get("num_hidden_layers")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        problems.append(f"{CONFIG_FILE} `num_hidden_layers` must be a whole number >= 1, got {layers!r}: save the "
                        "folder again with `save_pretrained` or the converter.")
        return files + shards
    lazy = [f"model.layers.{layer}.self_attn.{name}" for layer in range(layers) for name in LAZY_PARAMETER_NAMES]
    lacking = [name for name in lazy if name not in names]
    if readable and lacking:
        problems.append(
            f"the weights lack {len(lacking)} Lazy Attention parameter(s) (e.g. {lacking[0]}): this looks like a "
            "plain Llama checkpoint; convert it first (python -m conversion.convert_llama_to_lazy)."
        )
    return files + shards


def _folder_files(folder: Path) -> list[str]:
    """Every file under `folder` (relative posix paths), `.git` and `__pycache__` left out."""
    return sorted(
        rel for rel in (path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())
        if not any(part in _NEVER_UPLOADED for part in rel.split("/")) and not rel.endswith(".pyc")
    )


def validate_folder(folder: str | Path, include: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Check that `folder` is a complete LazyLlama checkpoint that loads from the Hub with and without the
    package; return the paths to upload (relative, sorted): the model's files (config, weights, code,
    tokenizer, generation config, card, conversion settings) and the files matching the glob patterns
    `include` (relative to `folder`, e.g. `attention_stats.json` or `logs/*`). Raises `PushError` listing every
    problem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder: give the folder written by the converter or save_pretrained.")
    problems, selected = [], set()
    config = None
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        problems.append(f"no {CONFIG_FILE} in {folder}.")
    except UnicodeDecodeError:
        problems.append(f"{CONFIG_FILE} is not UTF-8 text.")
    except json.JSONDecodeError as error:
        problems.append(f"{CONFIG_FILE} is not valid JSON ({error}).")
    if config is not None and not isinstance(config, dict):
        problems.append(f"{CONFIG_FILE} must hold a JSON object of model settings, got {json.dumps(config)[:40]}.")
        config = None
    if config is not None:
        if config.get("model_type") != "lazy_llama":
            problems.append(
                f"{CONFIG_FILE} has model_type {config.get('model_type')!r}, expected 'lazy_llama': "
                "convert a Llama checkpoint first (python -m conversion.convert_llama_to_lazy)."
            )
        selected |= {CONFIG_FILE, *_check_code(folder, config, problems), *_check_weights(folder, config, problems)}
    selected |= {name for name in (GENERATION_CONFIG_FILE, SETTINGS_FILE, CARD_FILE, *TOKENIZER_FILES)
                 if (folder / name).is_file()}
    present = _folder_files(folder)
    for pattern in include:
        matched = [path for path in present if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            problems.append(f"--include {pattern!r} matches no file in {folder} (patterns are relative to it).")
        selected.update(matched)
    if problems:
        raise PushError(f"{folder} is not ready to publish; nothing was uploaded:\n"
                        + "\n".join(f"  - {p}" for p in problems))
    return sorted(selected)


def _is_weight_file(path: str) -> bool:
    return path.endswith(".safetensors") or path == WEIGHTS_INDEX


def _status(error: HfHubHTTPError) -> int | None:
    return error.response.status_code if error.response is not None else None


def _explain(error: HfHubHTTPError, repo_id: str, action: str) -> PushError:
    status = _status(error)
    server = getattr(error, "server_message", None) or ""
    detail = f" (server said: {server.strip()})" if server.strip() else ""
    if isinstance(error, RevisionNotFoundError):
        return PushError(f"{action} failed: the revision does not exist on {repo_id}{detail}.")
    if status == 401:
        return PushError(
            f"{action} failed: the Hub rejected the token (401){detail}. Check HF_TOKEN / `hf auth login` / --token, "
            "and that the token has write access."
        )
    if status == 403:
        return PushError(
            f"{action} failed: the token has no write rights on {repo_id} (403){detail}. Push to your own namespace "
            "or ask for access."
        )
    if isinstance(error, RepositoryNotFoundError) or status == 404:
        return PushError(
            f"{action} failed: repository {repo_id} was not found or this token cannot see it (404){detail}. "
            "Check the repository id and the token."
        )
    if status == 429:
        return PushError(
            f"{action} failed: the Hub is rate-limiting these requests (429){detail}. Wait a few minutes and run "
            "the same command again; nothing was committed and the local folder is untouched."
        )
    if status is not None and status >= 500:
        return PushError(
            f"{action} failed: the Hub answered {status}{detail}. Nothing was committed (a commit is all or nothing) "
            "and the local folder is untouched: run the same command again."
        )
    return PushError(f"{action} failed: {error}")


def _outcome(action: str) -> str:
    """What a failed step leaves behind, and what to do."""
    if action == "Uploading":
        return ("the commit may or may not have been applied (a commit is all or nothing); the local folder is "
                "untouched: run the same command again, it uploads only what is missing")
    return "nothing was committed and the local folder is untouched: run the same command again later"


def _unreachable(error: Exception, action: str, endpoint: str, timeout: float, attempts: int) -> PushError:
    outcome = _outcome(action)
    error = error.error if isinstance(error, _Unanswered) else error
    if isinstance(error, TimeoutException):
        return PushError(f"{action} failed: the Hub at {endpoint} did not answer within {timeout:g} s "
                         f"({attempts} attempt(s)); {outcome}, or allow more time with --timeout.")
    return PushError(f"{action} failed: cannot reach the Hub at {endpoint} ({error}; {attempts} attempt(s)); "
                     f"{outcome}.")


def _pause(attempt: int, error: Exception | None = None) -> float:
    """Seconds to wait before attempt `attempt + 2`: what a 429/503 asked for (Retry-After), else 1, 2, 4, ..."""
    response = getattr(error, "response", None)
    asked = response.headers.get("Retry-After") if response is not None else None
    try:
        seconds = float(asked) if asked is not None else 2.0**attempt
    except ValueError:
        seconds = 2.0**attempt
    return min(MAX_WAIT, max(0.0, seconds)) if math.isfinite(seconds) else MAX_WAIT


def _call_hub(action: str, call, *, repo_id: str, endpoint: str, timeout: float, retries: int):
    """`call()`, retried on time-outs, lost connections, 429 and 502/503/504; a `PushError` naming `action`
    when it keeps failing (or fails otherwise)."""
    for attempt in range(retries + 1):
        try:
            return call()
        except HfHubHTTPError as error:
            if _status(error) not in RETRIED_STATUSES or attempt == retries:
                raise _explain(error, repo_id, action) from error
            time.sleep(_pause(attempt, error))
        except NETWORK_ERRORS as error:
            if attempt == retries:
                raise _unreachable(error, action, endpoint, timeout, attempt + 1) from error
            time.sleep(_pause(attempt))
        except json.JSONDecodeError as error:  # a 200 answer from something that is not the Hub
            raise PushError(
                f"{action} failed: {endpoint} answered with something that is not the Hub's JSON (a captive portal "
                f"or a proxy's page?); check HF_ENDPOINT and the network; {_outcome(action)}."
            ) from error


_RETRIED_BY_THE_LIBRARY = (TimeoutException, NetworkError, RemoteProtocolError)  # by huggingface_hub's http_backoff


class _Unanswered(OSError):
    """A request that timed out or lost its connection. huggingface_hub retries its own errors for some requests
    (pre-upload, LFS: five more times, with pauses); this one it passes on, so that `_call_hub` alone retries, as
    often as `--retries` says."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _OneAttemptStream(SyncByteStream):
    """An answer's body, whose time-outs and lost connections are `_Unanswered` too (the body is read after the
    transport has returned)."""

    def __init__(self, stream: SyncByteStream):
        self.stream = stream

    def __iter__(self):
        try:
            yield from self.stream
        except _RETRIED_BY_THE_LIBRARY as error:
            raise _Unanswered(error) from error

    def close(self) -> None:
        self.stream.close()


class _OneAttemptTransport(BaseTransport):
    """`transport`, with its time-outs and lost connections raised as `_Unanswered`."""

    def __init__(self, transport: BaseTransport):
        self.transport = transport

    def handle_request(self, request):
        try:
            response = self.transport.handle_request(request)
        except _RETRIED_BY_THE_LIBRARY as error:
            raise _Unanswered(error) from error
        response.stream = _OneAttemptStream(response.stream)
        return response

    def close(self) -> None:
        self.transport.close()


class _AnswerDeadlineStream(httpcore.NetworkStream):
    """A connection on which each answer must arrive whole within `seconds` of its request being sent: the
    per-read time-out alone lets a server that sends a byte now and then (each within it) hold a request forever."""

    def __init__(self, stream: httpcore.NetworkStream, seconds: float):
        self.stream, self.seconds, self.deadline = stream, seconds, None

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.deadline = None  # a request is going out: its answer gets the whole allowance once it is sent
        self.stream.write(buffer, timeout)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.seconds
        left = self.deadline - now
        if left <= 0:
            raise httpcore.ReadTimeout(f"the answer did not arrive whole within {self.seconds:g} s")
        return self.stream.read(max_bytes, left if timeout is None else min(timeout, left))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname: str | None = None, timeout: float | None = None):
        return _AnswerDeadlineStream(self.stream.start_tls(ssl_context, server_hostname, timeout), self.seconds)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class _AnswerDeadlineBackend(httpcore.NetworkBackend):
    """Opens `_AnswerDeadlineStream` connections through `backend`."""

    def __init__(self, backend: httpcore.NetworkBackend, seconds: float):
        self.backend, self.seconds = backend, seconds

    def connect_tcp(self, *args, **kwargs) -> _AnswerDeadlineStream:
        return _AnswerDeadlineStream(self.backend.connect_tcp(*args, **kwargs), self.seconds)

    def connect_unix_socket(self, *args, **kwargs) -> _AnswerDeadlineStream:
        return _AnswerDeadlineStream(self.backend.connect_unix_socket(*args, **kwargs), self.seconds)

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


@contextmanager
def request_timeout(seconds: float):
    """Every request huggingface_hub sends in the block gives up after at most `seconds` without progress
    (connect, send, answer), also where the library asked for no time-out, and when its answer has not arrived
    whole `seconds` after it was sent, and is not retried by the library (`_Unanswered`); the previous client setup
    returns after."""
    previous = hub_http._GLOBAL_CLIENT_FACTORY

    def enforce(request):
        asked = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            phase: seconds if asked.get(phase) is None else min(asked[phase], seconds)
            for phase in HTTPTimeout(seconds).as_dict()
        }

    def factory():
        client = previous()
        client.event_hooks = {**client.event_hooks, "request": [*client.event_hooks.get("request", []), enforce]}
        # The client has no public hook on its connections: wrap the network backend of each connection pool (the
        # default transport's and any proxy's) so that every connection it opens keeps the answer deadline.
        for transport in (getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()):
            pool = getattr(transport, "_pool", None)
            if pool is not None:
                pool._network_backend = _AnswerDeadlineBackend(pool._network_backend, seconds)
        client._transport = _OneAttemptTransport(client._transport)
        client._mounts = {pattern: transport if transport is None else _OneAttemptTransport(transport)
                          for pattern, transport in client._mounts.items()}
        return client

    set_client_factory(factory)
    try:
        yield
    finally:
        set_client_factory(previous)


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    stats: dict | None = None,
    include: list[str] | tuple[str, ...] = (),
    timeout: float = DEFAULT_TIMEOUT,
    retries: int = DEFAULT_RETRIES,
) -> PushResult:
    """Validate `folder`, create `repo_id` if needed and upload the model's files plus a model card in one commit.

    `token` defaults to the usual places (`HF_TOKEN`, the `hf auth login` cache); `revision` is a branch
    (created from `main` if missing); `create_pr` opens a pull request instead of committing to the branch;
    `stats` are attention statistics for the card (default: `folder/attention_stats.json` if present);
    `include` adds files by glob pattern (see `validate_folder`); each request gives up after `timeout`
    seconds without an answer, and failures that may pass are retried `retries` times.
    Raises `PushError` with what went wrong and what to do; the folder is never modified.
    """
    folder = Path(folder)
    if not (math.isfinite(timeout) and timeout > 0) or retries < 0:
        raise PushError(f"timeout must be a positive number of seconds and retries >= 0, got {timeout!r} and "
                        f"{retries!r}.")
    files = validate_folder(folder, include)
    try:
        card = card_for_push(folder, repo_id, stats=stats)
    except ValueError as error:  # a README.md, settings or statistics file that cannot be read
        raise PushError(f"{folder} is not ready to publish; nothing was uploaded: {error}") from error
    token = token or get_token()
    if not token:
        raise PushError(
            "no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass --token. Nothing was uploaded."
        )
    api = HfApi(token=token)
    branch = revision or "main"
    with request_timeout(timeout):
        def hub(action, call):
            return _call_hub(action, call, repo_id=repo_id, endpoint=api.endpoint, timeout=timeout, retries=retries)

        repo_url = hub("Creating the repository", lambda: api.create_repo(repo_id, private=private, exist_ok=True))
        repo_id = repo_url.repo_id
        if branch != "main" and not branch.startswith("refs/pr/"):
            hub(f"Creating branch {branch!r}", lambda: api.create_branch(repo_id, branch=branch, exist_ok=True))
        listed = hub(f"Listing the files of {repo_id}", lambda: api.model_info(repo_id, revision=branch))
        remote = {sibling.rfilename for sibling in listed.siblings or []}

        def operations():  # fresh for every attempt: the client keeps upload state on them
            ops = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(folder / path))
                   for path in files if path != CARD_FILE]
            ops.append(CommitOperationAdd(path_in_repo=CARD_FILE, path_or_fileobj=str(card).encode("utf-8")))
            # Weights from an earlier push with another sharding would otherwise stay and confuse the loader.
            return ops + [CommitOperationDelete(path_in_repo=path) for path in sorted(remote)
                          if _is_weight_file(path) and path not in files]

        sent = []

        def commit():
            sent[:] = operations()
            return api.create_commit(repo_id, sent, commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
                                     revision=branch, create_pr=create_pr)

        info = hub("Uploading", commit)
    uploaded = [op.path_in_repo for op in sent
                if isinstance(op, CommitOperationAdd) and op._remote_oid != op._local_oid]
    url = info.pr_url or (str(repo_url) if branch == "main" else f"{repo_url}/tree/{branch}")
    left_out = [path for path in _folder_files(folder) if path not in files]
    return PushResult(url=url, repo_url=str(repo_url), commit_url=info.commit_url, pr_url=info.pr_url,
                      uploaded=uploaded, left_out=left_out)


def _summarise(paths: list[str], shown: int = 6) -> str:
    """`a.txt, logs/ (3 files), ...`: files at the top, folders with their file counts."""
    groups: dict[str, int] = {}
    for path in paths:
        top = path.split("/", 1)[0] + ("/" if "/" in path else "")
        groups[top] = groups.get(top, 0) + 1
    items = [f"{name} ({count} files)" if name.endswith("/") else name for name, count in groups.items()]
    return listed(items, shown)


def main(argv: list[str] | None = None) -> int:
    """`python -m conversion.push_to_hub`: the `lazy-push` command (`lazy_llama_tools.cli.lazy_push` parses the same
    arguments before importing the Hub client)."""
    return run(push_parser().parse_args(argv))


def run(args) -> int:
    """Publish as the parsed `lazy-push` arguments say; returns the exit status."""
    try:
        stats = load_statistics(args.stats) if args.stats else None
        result = push_to_hub(
            args.folder,
            args.repo_id,
            token=args.token,
            private=True if args.private else None,
            revision=args.revision,
            commit_message=args.commit_message,
            create_pr=args.create_pr,
            stats=stats,
            include=args.include,
            timeout=args.timeout,
            retries=args.retries,
        )
    except (PushError, ValueError) as error:
        print(f"lazy-push: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lazy-push: interrupted. The local folder is untouched and a commit is all or nothing, so the "
              "repository holds its previous files or the whole new commit: run the same command again to finish.",
              file=sys.stderr)
        return 130
    if result.left_out:
        print(f"not uploaded (not part of the model; add with --include PATTERN): {_summarise(result.left_out)}",
              file=sys.stderr)
    changed = f"{len(result.uploaded)} file(s) uploaded" if result.uploaded else "nothing changed"
    print(f"{changed}; commit {result.commit_url}", file=sys.stderr)
    print(result.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
