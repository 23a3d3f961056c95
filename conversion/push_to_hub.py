"""Publish a LazyLlama folder (converted or trained) to the Hugging Face Hub in one commit.

```bash
lazy-push DIR REPO_ID [--private] [--revision BRANCH] [--commit-message MSG] [--create-pr] [--token TOKEN] [--stats FILE]
python -m conversion.push_to_hub DIR REPO_ID ...
```

Order of work, so that a failure loses nothing: check the folder (config, weights, code files, the full
`auto_map`) and find a token before any request; then create the repository if needed and upload every
file plus a model card (see `conversion.model_card.card_for_push`) in a single commit. The local folder is
only read. A commit is atomic on the Hub, so after any failure the same command can simply be run again;
files that are already there unchanged are not uploaded twice.
"""

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from conversion.model_card import card_for_push, load_statistics

try:  # the HTTP client huggingface_hub uses (httpx2 in huggingface_hub >= 2, httpx before)
    from httpx2 import TransportError
except ImportError:
    from httpx import TransportError

NETWORK_ERRORS = (OSError, TransportError)  # connection refused, DNS, reset, timeout

AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
DEFAULT_COMMIT_MESSAGE = "Upload LazyLlama checkpoint (lazy-push)"
_SKIPPED_PARTS = ("__pycache__", ".git", ".cache", ".ipynb_checkpoints")  # never uploaded
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


def _relative_imports(path: Path) -> set[str]:
    return set(_RELATIVE_IMPORT.findall(path.read_text(encoding="utf-8")))


def _defines_class(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return any(isinstance(node, ast.ClassDef) and node.name == name for node in tree.body)


def _check_code(folder: Path, config: dict, problems: list[str]) -> None:
    auto_map = config.get("auto_map") or {}
    missing = [name for name in AUTO_CLASSES if name not in auto_map]
    if missing:
        problems.append(
            f"config.json `auto_map` lacks {', '.join(missing)}: users without the package could not load the model "
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
        elif not _defines_class(path, class_name):
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
            problems.append(f"{module}.py is imported by the model code (`from .{module} import ...`) but is not in {folder}.")
            continue
        todo += sorted(_relative_imports(path) - seen)


def _check_weights(folder: Path, config: dict, problems: list[str]) -> None:
    from safetensors import safe_open

    if (folder / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((folder / WEIGHTS_INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            problems.append(f"{WEIGHTS_INDEX} is not a valid index ({error!r}).")
            return
        shards = sorted(set(weight_map.values()))
        names = set(weight_map)
    elif (folder / WEIGHTS_FILE).is_file():
        shards, names = [WEIGHTS_FILE], None
    else:
        problems.append(f"no weights: neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX} is in {folder}.")
        return
    absent = [shard for shard in shards if not (folder / shard).is_file()]
    if absent:
        problems.append(f"weight shard(s) listed in {WEIGHTS_INDEX} are missing: {', '.join(absent)}.")
        return
    if names is None:
        try:
            with safe_open(folder / WEIGHTS_FILE, framework="pt") as weights:
                names = set(weights.keys())
        except Exception as error:  # noqa: BLE001 - any unreadable file is the same problem for the user
            problems.append(f"{WEIGHTS_FILE} is not a readable safetensors file ({error}).")
            return
    layers = config.get("num_hidden_layers") or 0
    lazy = [f"model.layers.{layer}.self_attn.{name}" for layer in range(layers) for name in ("tau", "distance_bias")]
    lacking = [name for name in lazy if name not in names]
    if lacking:
        problems.append(
            f"the weights lack {len(lacking)} Lazy Attention parameter(s) (e.g. {lacking[0]}): this looks like a "
            "plain Llama checkpoint; convert it first (python -m conversion.convert_llama_to_lazy)."
        )


def validate_folder(folder: str | Path) -> list[str]:
    """Check that `folder` is a complete LazyLlama checkpoint that loads from the Hub with and without the
    package; return the paths to upload (relative, sorted). Raises `PushError` listing every problem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise PushError(f"{folder} is not a folder: give the folder written by the converter or save_pretrained.")
    problems = []
    config = None
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        problems.append(f"no config.json in {folder}.")
    except json.JSONDecodeError as error:
        problems.append(f"config.json is not valid JSON ({error}).")
    if config is not None:
        if config.get("model_type") != "lazy_llama":
            problems.append(
                f"config.json has model_type {config.get('model_type')!r}, expected 'lazy_llama': "
                "convert a Llama checkpoint first (python -m conversion.convert_llama_to_lazy)."
            )
        _check_code(folder, config, problems)
        _check_weights(folder, config, problems)
    if problems:
        raise PushError(f"{folder} is not ready to publish; nothing was uploaded:\n" + "\n".join(f"  - {p}" for p in problems))
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file()
        and not any(part in _SKIPPED_PARTS for part in path.relative_to(folder).parts)
        and path.suffix != ".pyc"
    )


def _is_weight_file(path: str) -> bool:
    return path.endswith(".safetensors") or path == WEIGHTS_INDEX


def _explain(error: HfHubHTTPError, repo_id: str, action: str) -> PushError:
    status = error.response.status_code if error.response is not None else None
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
    if status is not None and status >= 500:
        return PushError(
            f"{action} failed: the Hub answered {status}{detail}. Nothing was committed (a commit is all or nothing) "
            "and the local folder is untouched: run the same command again."
        )
    return PushError(f"{action} failed: {error}")


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
) -> PushResult:
    """Validate `folder`, create `repo_id` if needed and upload the folder plus a model card in one commit.

    `token` defaults to the usual places (`HF_TOKEN`, the `hf auth login` cache); `revision` is a branch
    (created from `main` if missing); `create_pr` opens a pull request instead of committing to the branch;
    `stats` are attention statistics for the card (default: `folder/attention_stats.json` if present).
    Raises `PushError` with what went wrong and what to do; the folder is never modified.
    """
    folder = Path(folder)
    files = validate_folder(folder)
    token = token or get_token()
    if not token:
        raise PushError(
            "no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass --token. Nothing was uploaded."
        )
    api = HfApi(token=token)
    card = card_for_push(folder, repo_id, stats=stats)
    branch = revision or "main"
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
        repo_id = repo_url.repo_id
        if branch != "main" and not branch.startswith("refs/pr/"):
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        remote = set(api.list_repo_files(repo_id, revision=branch))
    except HfHubHTTPError as error:
        raise _explain(error, repo_id, "Creating the repository") from error
    except NETWORK_ERRORS as error:
        raise PushError(f"cannot reach the Hub at {api.endpoint} ({error}). Nothing was uploaded.") from error

    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(folder / path)) for path in files if path != "README.md"]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=str(card).encode("utf-8")))
    # Weights from an earlier push with another sharding would otherwise stay and confuse the loader.
    operations += [CommitOperationDelete(path_in_repo=path) for path in sorted(remote) if _is_weight_file(path) and path not in files]
    try:
        info = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
            revision=branch,
            create_pr=create_pr,
        )
    except HfHubHTTPError as error:
        raise _explain(error, repo_id, "Uploading") from error
    except NETWORK_ERRORS as error:
        raise PushError(f"lost the connection to the Hub at {api.endpoint} ({error}). Nothing was committed; "
                        "the local folder is untouched: run the same command again.") from error
    uploaded = [op.path_in_repo for op in operations if isinstance(op, CommitOperationAdd) and op._remote_oid != op._local_oid]
    url = info.pr_url or (str(repo_url) if branch == "main" else f"{repo_url}/tree/{branch}")
    return PushResult(url=url, repo_url=str(repo_url), commit_url=info.commit_url, pr_url=info.pr_url, uploaded=uploaded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lazy-push",
        description="Publish a LazyLlama folder to the Hugging Face Hub in one commit, with its code files and a model card.",
    )
    parser.add_argument("folder", help="folder written by the converter or by save_pretrained")
    parser.add_argument("repo_id", help="target repository, 'namespace/name' (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repository private (an existing one keeps its visibility)")
    parser.add_argument("--revision", help="branch to commit to (created from main if missing); default main")
    parser.add_argument("--commit-message", help=f"default: {DEFAULT_COMMIT_MESSAGE!r}")
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing to the branch")
    parser.add_argument("--token", help="Hub token; default: HF_TOKEN, then the `hf auth login` cache")
    parser.add_argument("--stats", help="JSON file of measured attention statistics for the model card "
                                        "(default: DIR/attention_stats.json if present)")
    args = parser.parse_args(argv)
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
        )
    except (PushError, ValueError) as error:
        print(f"lazy-push: error: {error}", file=sys.stderr)
        return 1
    changed = f"{len(result.uploaded)} file(s) uploaded" if result.uploaded else "nothing changed"
    print(f"{changed}; commit {result.commit_url}", file=sys.stderr)
    print(result.url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
