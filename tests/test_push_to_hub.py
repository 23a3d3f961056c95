"""Hub publishing end to end: the real `huggingface_hub` client against `hub_server.FakeHub` on 127.0.0.1.

- `lazy-push` (a subprocess, `HF_ENDPOINT` set) and `LazyLlamaForCausalLM.push_to_hub` (in-process, endpoint
  patched) publish a tiny checkpoint;
- a fresh Python that cannot import this project loads both repositories with `trust_remote_code=True`
  (`AutoModelForCausalLM`, `AutoModel`, `AutoTokenizer`) and must reproduce the pushed model's outputs;
- validation, missing token, 401 on create, 403, 500 on commit, pushing twice, `--private`, `--revision`,
  `--create-pr`, `--commit-message`, and token sources;
- what is uploaded (the model's files, `--include`), truncated shards, 429/503, a 500 on the file listing, and
  a Hub that accepts connections but never answers (`hub_server.SilentHub`: time-outs, Ctrl-C).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import run_without_project, tiny_model
from hub_server import FakeHub, SilentHub
from huggingface_hub import constants as hub_constants
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.utils import hub as transformers_hub

from conversion.model_card import SETTINGS_FILE, STATS_FILE, write_model_card
from conversion.push_to_hub import PushError, main, push_to_hub, validate_folder
from modeling_lazy import LazyLlamaForCausalLM

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WRITER, OTHER = "hf_alice_write", "hf_bob_write"  # tokens of users "alice" and "bob"
CODE_FILES = ["configuration_lazy.py", "modeling_lazy.py", "lazy_attention_ops.py", "lazy_attention_torch.py",
              "lazy_attention_triton.py", "lazy_attention_triton_common.py", "lazy_attention_triton_forward.py",
              "lazy_attention_triton_backward.py", "lazy_attention_triton_decode.py", "lazy_attention_cpu.py"]
AUTO_MAP = {
    "AutoConfig": "configuration_lazy.LazyLlamaConfig",
    "AutoModel": "modeling_lazy.LazyLlamaModel",
    "AutoModelForCausalLM": "modeling_lazy.LazyLlamaForCausalLM",
    "AutoModelForSequenceClassification": "modeling_lazy.LazyLlamaForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_lazy.LazyLlamaForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_lazy.LazyLlamaForQuestionAnswering",
}
TEXTS = ["w1 w2 w3 w4 w5 w6 w7 w8", "w9 w3 w3 w7"]
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M"
CONVERSION = {"source": "/data/smollm2", "tau_init": -0.5, "bias_window": 6, "bias_init_std": 0.5, "seed": 0,
              "dtype": "float32", "exact": False}
STATS = {"mean": {"sparsity": 0.4321, "tile_density": 0.9, "sink": 0.1234, "surviving_mass": 0.8, "tau": -0.5},
         "layers": [{"sparsity": [0.4, 0.5], "sink": [0.1, 0.2]}, {"sparsity": [0.3, 0.5], "sink": [0.05, 0.15]}]}


# -- a tiny checkpoint ---------------------------------------------------------------------------------
def _tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built offline; ids 0/1/2 are pad/bos/eos as in `conftest.tiny_config`."""
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", padding_side="left")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, model, tokenizer): `conftest.tiny_model` (GQA, non-trivial tau and distance bias) saved with a
    tokenizer, conversion settings, attention statistics and a generated card, as the converter leaves it."""
    model = tiny_model(seed=0)
    tokenizer = _tokenizer(model.config.vocab_size)
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-lazy"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # what the converter and `lazy-inspect` leave next to the weights; the card on the Hub must carry them
    (folder / SETTINGS_FILE).write_text(json.dumps(CONVERSION))
    (folder / STATS_FILE).write_text(json.dumps(STATS))
    write_model_card(folder, base_model=BASE_MODEL, license="apache-2.0",
                     conversion={k: v for k, v in CONVERSION.items() if k != "source"})
    return folder, model, tokenizer


def _digest(folder: Path) -> dict[str, tuple[str, int]]:
    """Content hash and mtime of every file: "the local folder is untouched" means this does not change."""
    return {p.relative_to(folder).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- the server and the client's view of it ------------------------------------------------------------
@pytest.fixture(scope="module")
def hub():
    with FakeHub(tokens={WRITER: "alice", OTHER: "bob"}) as server:
        yield server


def _point_client_at(patcher: pytest.MonkeyPatch, hub: FakeHub, home: Path, token: str | None = WRITER) -> None:
    """`HF_ENDPOINT` is read when huggingface_hub is imported, so an in-process test patches what it set."""
    patcher.setattr(hub_constants, "ENDPOINT", hub.url)
    patcher.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    patcher.setattr(transformers_hub, "_hf_api", None)  # transformers' shared HfApi captured the old endpoint
    patcher.setattr(hub_constants, "HF_TOKEN_PATH", str(home / "token"))
    patcher.setattr(hub_constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    patcher.setattr(hub_constants, "HF_HUB_CACHE", str(home / "hub"))
    patcher.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    patcher.delenv("HF_OIDC_RESOURCE", raising=False)
    if token is None:
        patcher.delenv("HF_TOKEN", raising=False)
    else:
        patcher.setenv("HF_TOKEN", token)


@pytest.fixture
def client(hub, tmp_path, monkeypatch):
    _point_client_at(monkeypatch, hub, tmp_path)
    yield hub
    hub.clear_failures()  # a failure a test injected but did not meet must not hit the next test


def _subprocess_env(hub: FakeHub, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE")) and k != "PYTHONPATH"}
    env.update(HF_ENDPOINT=hub.url, HF_TOKEN=WRITER, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1")
    return env


# -- publishing once, for the tests that read the result -----------------------------------------------
@pytest.fixture(scope="module")
def published(hub, checkpoint, tmp_path_factory):
    """Push the checkpoint twice: with the CLI (`alice/tiny-cli`) and with `model.push_to_hub` (`alice/tiny-method`)."""
    folder, model, tokenizer = checkpoint
    before = _digest(folder)
    home = tmp_path_factory.mktemp("cli-home")
    cli = subprocess.run(
        [sys.executable, "-m", "conversion.push_to_hub", str(folder), "alice/tiny-cli",
         "--commit-message", "First upload"],
        cwd=PROJECT_ROOT, env=_subprocess_env(hub, home), capture_output=True, text=True, timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert _digest(folder) == before, "lazy-push modified the local folder"
    with pytest.MonkeyPatch.context() as patcher:
        _point_client_at(patcher, hub, tmp_path_factory.mktemp("method-home"))
        model.push_to_hub("alice/tiny-method")
        tokenizer.push_to_hub("alice/tiny-method")  # the usual pair of calls: the model method uploads no tokenizer
    return {"cli": cli}


def test_cli_prints_url_and_uploads_a_complete_repo(hub, checkpoint, published):
    folder, _, _ = checkpoint
    assert published["cli"].stdout.strip() == f"{hub.url}/alice/tiny-cli"
    repo = hub.repos["alice/tiny-cli"]
    files = repo.files()
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md", *CODE_FILES]:
        assert name in files, f"{name} was not uploaded"
    for name in CODE_FILES:  # the code travels unchanged
        assert files[name] == (folder / name).read_bytes()
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert json.loads(files["config.json"])["auto_map"] == AUTO_MAP
    # one commit on top of the repository's initial one, with the message asked for
    head = repo.resolve("main")
    assert head.message == "First upload" and repo.commits[head.parent].parent is None
    assert [entry[1] for entry in hub.requests("POST", "/api/models/alice/tiny-cli/commit/")] == [
        "/api/models/alice/tiny-cli/commit/main"]
    card = files["README.md"].decode()
    front_matter = card.split("---")[1]
    for expected in ("library_name: transformers", "pipeline_tag: text-generation", "- lazy-attention",
                     "- custom_code"):
        assert expected in front_matter
    assert 'from_pretrained("alice/tiny-cli", trust_remote_code=True)' in card
    assert "import modeling_lazy" in card
    # carried from the folder's card, settings and statistics
    for expected in (f"base_model: {BASE_MODEL}", "license: apache-2.0"):
        assert expected in front_matter
    assert "| bias_window | 6 |" in card and "/data/smollm2" not in card
    assert "| 0.4321 |" in card and "| 0.1234 |" in card  # mean sparsity and sink
    assert "| 1 | 0.4000 | 0.1000 |" in card  # per layer: sparsity, sink
    assert "# tiny-lazy" not in card and "# alice/tiny-cli" in card


def test_model_push_to_hub_uploads_code_and_full_auto_map(hub, published):
    files = hub.repos["alice/tiny-method"].files()
    for name in CODE_FILES:
        assert name in files, f"PreTrainedModel.push_to_hub did not upload {name}"
    assert json.loads(files["config.json"])["auto_map"] == AUTO_MAP
    assert "- lazy-attention" in files["README.md"].decode() and "- custom_code" in files["README.md"].decode()


def test_save_pretrained_with_push_uploads_the_code_too(client, tmp_path):
    """`save_pretrained(dir, push_to_hub=True)` (transformers uploads from inside the save) uploads the complete
    folder: the code files and the full `auto_map` as `push_to_hub` does, and the folder is written locally."""
    model = tiny_model(seed=3)
    model.save_pretrained(tmp_path / "saved", push_to_hub=True, repo_id="alice/tiny-save-push",
                          commit_message="saved and pushed")
    files = client.repos["alice/tiny-save-push"].files()
    for name in ["config.json", "model.safetensors", *CODE_FILES]:
        assert name in files, f"{name} was not uploaded"
        assert files[name] == (tmp_path / "saved" / name).read_bytes(), name
    assert json.loads(files["config.json"])["auto_map"] == AUTO_MAP
    assert client.repos["alice/tiny-save-push"].resolve("main").message == "saved and pushed"


LOADER = textwrap.dedent("""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    results = {{}}
    for repo in {repos!r}:
        tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
        batch = tokenizer({texts!r}, return_tensors="pt", padding=True)
        lm = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True).eval()
        base = AutoModel.from_pretrained(repo, trust_remote_code=True).eval()
        assert type(lm).__module__.startswith("transformers_modules."), type(lm).__module__
        assert type(base).__name__ == "LazyLlamaModel", type(base)
        with torch.no_grad():
            results[repo] = {{
                "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                "logits": lm(**batch).logits, "hidden": base(**batch).last_hidden_state,
                "attn_implementation": lm.config._attn_implementation,
            }}
    torch.save(results, {out!r})
""")


def test_fresh_python_without_the_package_loads_what_was_pushed(hub, checkpoint, published, tmp_path):
    _, model, tokenizer = checkpoint
    repos = ["alice/tiny-cli", "alice/tiny-method"]
    out = tmp_path / "loaded.pt"
    run = run_without_project(LOADER.format(repos=repos, texts=TEXTS, out=str(out)), cwd=tmp_path,
                              env=_subprocess_env(hub, tmp_path / "home"), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = torch.load(out)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
        hidden = model.model(**batch).last_hidden_state
    for repo in repos:
        loaded = results[repo]
        assert torch.equal(loaded["input_ids"], batch["input_ids"]), "the tokenizer on the Hub tokenizes differently"
        assert torch.equal(loaded["attention_mask"], batch["attention_mask"])
        assert loaded["attn_implementation"] == "lazy"
        torch.testing.assert_close(loaded["logits"], logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(loaded["hidden"], hidden, rtol=0, atol=1e-5)


# -- validation happens before any request ---------------------------------------------------------------
def _broken_copy(checkpoint, tmp_path, breaker) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(checkpoint[0], folder)
    breaker(folder)
    return folder


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("breaker, message", [
    (lambda f: _edit_config(f, lambda c: c["auto_map"].pop("AutoModel")), "auto_map` lacks AutoModel"),
    (lambda f: _edit_config(f, lambda c: c.pop("auto_map")), "lacks AutoConfig, AutoModel, AutoModelForCausalLM"),
    (lambda f: (f / "lazy_attention_torch.py").unlink(), "lazy_attention_torch.py is imported by the model code"),
    (lambda f: (f / "configuration_lazy.py").unlink(), "names configuration_lazy.py, which is not in"),
    (lambda f: (f / "model.safetensors").unlink(), "no weights"),
    (lambda f: _edit_config(f, lambda c: c.update(model_type="llama")), "expected 'lazy_llama'"),
    (lambda f: (f / "config.json").unlink(), "no config.json"),
    (lambda f: (f / "config.json").write_text("[1]"), "config.json must hold a JSON object of model settings, got [1]"),
    (lambda f: (f / "config.json").write_bytes(b"\xff\xfe{}"), "config.json is not UTF-8 text"),
    (lambda f: _edit_config(f, lambda c: c.update(auto_map=["x"])), "config.json `auto_map` must be a JSON object"),
    (lambda f: _edit_config(f, lambda c: c.update(num_hidden_layers="2")),
     "config.json `num_hidden_layers` must be a whole number >= 1, got '2'"),
    (lambda f: (f / "modeling_lazy.py").write_text("def (\n"), "modeling_lazy.py has a syntax error (line 1: "),
    (lambda f: (f / STATS_FILE).write_text('{"mean": 5}'), f"{STATS_FILE} holds no attention statistics"),
    (lambda f: (f / "README.md").write_text("---\nlicense: [unclosed\n---\nhello\n"),
     "README.md has broken YAML metadata at line 2"),
    (lambda f: (f / "README.md").write_bytes(b"\xff\xfe"), "README.md is not UTF-8 text"),
    (lambda f: (f / SETTINGS_FILE).write_text("{bad"), f"{SETTINGS_FILE} is not valid JSON"),
    (lambda f: (f / SETTINGS_FILE).write_text("[]"), f"{SETTINGS_FILE} must hold a JSON object"),
    (lambda f: (f / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../elsewhere/model.safetensors"}})),
     "names weight files outside the folder"),
], ids=["auto_map-entry", "no-auto_map", "imported-file", "config-code", "weights", "model_type", "config",
        "config-list", "config-not-utf8", "auto_map-list", "layers-string", "code-syntax", "stats-shape",
        "card-yaml", "card-not-utf8", "settings-not-json", "settings-list", "index-outside"])
def test_incomplete_folder_is_refused_before_any_request(client, checkpoint, tmp_path, breaker, message):
    folder = _broken_copy(checkpoint, tmp_path, breaker)
    requests_before = len(client.log)
    with pytest.raises(PushError, match="nothing was uploaded") as error:
        push_to_hub(folder, "alice/never")
    assert message in str(error.value)
    assert len(client.log) == requests_before and "alice/never" not in client.repos
    problems = str(error.value).split("nothing was uploaded", 1)[1]
    assert problems.count(message) == 1, "each problem is named once"


def test_saved_checkpoint_validates(checkpoint):
    files = validate_folder(checkpoint[0])
    assert set(CODE_FILES) <= set(files) and "model.safetensors" in files


# -- failures are clear and lose nothing -----------------------------------------------------------------
def test_no_token_is_a_clear_error(hub, checkpoint, tmp_path, monkeypatch, capsys):
    _point_client_at(monkeypatch, hub, tmp_path, token=None)
    requests_before = len(hub.log)
    assert main([str(checkpoint[0]), "alice/no-token"]) == 1
    assert "no Hugging Face token: set HF_TOKEN, run `hf auth login`, or pass --token" in capsys.readouterr().err
    assert len(hub.log) == requests_before


def test_token_from_flag_and_login_cache(hub, checkpoint, tmp_path, monkeypatch):
    _point_client_at(monkeypatch, hub, tmp_path, token=None)
    assert main([str(checkpoint[0]), "alice/token-flag", "--token", WRITER]) == 0
    (tmp_path / "token").write_text(WRITER)  # what `hf auth login` writes
    assert main([str(checkpoint[0]), "alice/token-cache"]) == 0
    assert ("config.json" in hub.repos["alice/token-flag"].files()
            and "config.json" in hub.repos["alice/token-cache"].files())


def test_401_on_create_then_rerun(client, checkpoint):
    folder = checkpoint[0]
    before = _digest(folder)
    client.fail("POST", "/api/repos/create", status=401)
    with pytest.raises(PushError, match=r"rejected the token \(401\)"):
        push_to_hub(folder, "alice/unauthorised")
    assert _digest(folder) == before and "alice/unauthorised" not in client.repos
    push_to_hub(folder, "alice/unauthorised")
    assert "model.safetensors" in client.repos["alice/unauthorised"].files()


def test_no_rights_on_namespace(client, checkpoint):
    with pytest.raises(PushError, match=r"no write rights on bob/theirs \(403\)"):
        push_to_hub(checkpoint[0], "bob/theirs")
    assert "bob/theirs" not in client.repos


def test_500_on_commit_loses_nothing_and_rerun_completes_then_twice_is_safe(client, checkpoint):
    folder = checkpoint[0]
    before = _digest(folder)
    client.fail("POST", "/api/models/alice/flaky/commit/", status=500)
    with pytest.raises(PushError, match=r"answered 500.*Nothing was committed.*run the same command again"):
        push_to_hub(folder, "alice/flaky")
    assert _digest(folder) == before
    repo = client.repos["alice/flaky"]  # created, but no partial upload
    assert sorted(repo.files()) == [".gitattributes"]

    first = push_to_hub(folder, "alice/flaky")
    files = repo.files()
    assert set(validate_folder(folder)) <= set(files) and "README.md" in files
    assert sorted(first.uploaded) == sorted(set(validate_folder(folder)) | {"README.md"})  # every file and the card
    assert (folder / "README.md").read_bytes() != files["README.md"]  # the card was rendered for the repo, not copied

    head = repo.refs["main"]
    second = push_to_hub(folder, "alice/flaky")
    assert second.uploaded == [] and repo.refs["main"] == head and repo.files() == files
    assert _digest(folder) == before


def test_stale_weight_shards_are_removed(client, checkpoint, tmp_path):
    """Re-publishing with another sharding must not leave old shards next to the new index."""
    folder = checkpoint[0]
    push_to_hub(folder, "alice/resharded")
    resharded = tmp_path / "resharded"
    shutil.copytree(folder, resharded)
    model = LazyLlamaForCausalLM.from_pretrained(folder)
    (resharded / "model.safetensors").unlink()
    model.save_pretrained(resharded, max_shard_size="20KB")
    push_to_hub(resharded, "alice/resharded")
    files = client.repos["alice/resharded"].files()
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    shards = set(json.loads(files["model.safetensors.index.json"])["weight_map"].values())
    assert len(shards) > 1 and shards <= set(files)


def test_private_revision_stats_and_pull_request(client, checkpoint, capsys, tmp_path):
    folder = str(checkpoint[0])
    (tmp_path / "bad.json").write_text("[]")
    assert main([folder, "alice/options", "--stats", str(tmp_path / "bad.json")]) == 1
    assert "holds no attention statistics" in capsys.readouterr().err and "alice/options" not in client.repos

    (tmp_path / "stats.json").write_text(json.dumps({"sparsity": 0.5959}))
    assert main([folder, "alice/options", "--private", "--revision", "dev", "--commit-message", "to dev",
                 "--stats", str(tmp_path / "stats.json")]) == 0
    assert capsys.readouterr().out.strip() == f"{client.url}/alice/options/tree/dev"
    repo = client.repos["alice/options"]
    assert repo.private
    assert sorted(repo.files("main")) == [".gitattributes"] and "model.safetensors" in repo.files("dev")
    assert repo.resolve("dev").message == "to dev"
    assert "| 0.5959 |" in repo.files("dev")["README.md"].decode()  # --stats wins over DIR/attention_stats.json

    main_head = repo.refs["main"]
    assert main([folder, "alice/options", "--create-pr", "--commit-message", "proposal"]) == 0
    assert capsys.readouterr().out.strip() == f"{client.url}/alice/options/discussions/1"
    assert repo.refs["main"] == main_head, "--create-pr must not touch main"
    assert "model.safetensors" in repo.files("refs/pr/1")


# -- what is uploaded: the model's files, plus what is asked for ------------------------------------------
def test_only_the_models_files_are_uploaded_unless_included(client, checkpoint, tmp_path, capsys):
    folder = tmp_path / "with-extras"
    shutil.copytree(checkpoint[0], folder)
    (folder / ".env").write_text("HF_TOKEN=hf_secret\n")
    (folder / "checkpoint-3").mkdir()
    (folder / "checkpoint-3" / "optimizer.pt").write_bytes(b"optimizer state")
    (folder / "checkpoint-3" / "trainer_state.json").write_text("{}")
    (folder / "training_args.bin").write_bytes(b"a pickle")
    assert main([str(folder), "alice/selected"]) == 0
    err = capsys.readouterr().err
    files = client.repos["alice/selected"].files()
    for secret in (".env", "checkpoint-3/optimizer.pt", "checkpoint-3/trainer_state.json", "training_args.bin",
                   STATS_FILE):
        assert secret not in files, f"{secret} was uploaded"
    for name in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json", SETTINGS_FILE,
                 "README.md", *CODE_FILES]:
        assert name in files, f"{name} was not uploaded"
    assert "not uploaded" in err and ".env" in err and "checkpoint-3/ (2 files)" in err and "--include" in err
    # --include adds files by pattern, relative to DIR; a pattern that matches nothing is refused
    assert main([str(folder), "alice/selected", "--include", STATS_FILE, "--include", "checkpoint-3/*"]) == 0
    files = client.repos["alice/selected"].files()
    assert STATS_FILE in files and "checkpoint-3/optimizer.pt" in files and ".env" not in files
    assert main([str(folder), "alice/selected", "--include", "*.ckpt"]) == 1
    assert "--include '*.ckpt' matches no file" in capsys.readouterr().err


def test_truncated_shard_of_a_sharded_checkpoint_is_refused_before_any_request(client, checkpoint, tmp_path):
    folder = tmp_path / "sharded"
    shutil.copytree(checkpoint[0], folder)
    (folder / "model.safetensors").unlink()
    checkpoint[1].save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    validate_folder(folder)  # complete: fine
    shards[1].write_bytes(shards[1].read_bytes()[:-100])
    requests_before = len(client.log)
    with pytest.raises(PushError, match="nothing was uploaded") as error:
        push_to_hub(folder, "alice/truncated")
    assert f"{shards[1].name} is not a complete safetensors file" in str(error.value)
    assert len(client.log) == requests_before and "alice/truncated" not in client.repos


# -- answers that are not plain failures ------------------------------------------------------------------
def test_rate_limit_and_unavailable_server(client, checkpoint):
    client.fail("POST", "/api/repos/create", status=429)
    with pytest.raises(PushError, match=r"rate-limiting these requests \(429\).*Wait a few minutes and run the same"):
        push_to_hub(checkpoint[0], "alice/limited", retries=0)
    client.fail("POST", "/api/repos/create", status=503)  # passes: retried after a pause
    push_to_hub(checkpoint[0], "alice/limited", retries=1)
    assert "model.safetensors" in client.repos["alice/limited"].files()


def test_500_on_the_file_listing_is_named_as_such(client, checkpoint):
    client.fail("GET", "/api/models/alice/listing/revision/main", status=500)
    with pytest.raises(PushError) as error:
        push_to_hub(checkpoint[0], "alice/listing")
    assert str(error.value).startswith("Listing the files of alice/listing failed: the Hub answered 500")
    assert sorted(client.repos["alice/listing"].files()) == [".gitattributes"]  # created, nothing committed


@pytest.fixture
def silent(tmp_path, monkeypatch):
    """A Hub that accepts connections and never answers, with the client pointed at it."""
    with SilentHub() as server:
        _point_client_at(monkeypatch, server, tmp_path)
        yield server


def test_a_hub_that_never_answers_times_out_in_one_line(silent, checkpoint, capsys):
    started = time.monotonic()
    assert main([str(checkpoint[0]), "alice/hanging", "--timeout", "0.5", "--retries", "1"]) == 1
    elapsed = time.monotonic() - started
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "did not answer within 0.5 s (2 attempt(s))" in lines[0], lines
    assert "--timeout" in lines[0] and silent.accepted >= 2
    assert elapsed < 30, f"took {elapsed:.0f} s"


def test_a_hub_that_trickles_its_answer_times_out_like_a_silent_one(checkpoint, tmp_path, monkeypatch, capsys):
    """A byte every 0.2 s keeps each read within --timeout, but the answer never completes: the request still
    gives up --timeout seconds after it was sent, with the same line as for a silent Hub."""
    with SilentHub(trickle=0.2) as server:
        _point_client_at(monkeypatch, server, tmp_path)
        started = time.monotonic()
        assert main([str(checkpoint[0]), "alice/trickled", "--timeout", "1", "--retries", "0"]) == 1
        elapsed = time.monotonic() - started
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "did not answer within 1 s (1 attempt(s))" in lines[0], lines
    assert server.accepted >= 1 and elapsed < 8, f"took {elapsed:.1f} s"


def test_lost_connections_are_retried_as_often_as_asked_also_where_the_library_retries(client, checkpoint, capsys):
    """huggingface_hub retries some requests by itself (the pre-upload: five more times, with pauses); `--retries`
    alone counts: one request and one retry, then one line."""
    client.fail("POST", "/alice/dropped/preupload/", status=0, times=100)
    started = time.monotonic()
    assert main([str(checkpoint[0]), "alice/dropped", "--timeout", "5", "--retries", "1"]) == 1
    elapsed = time.monotonic() - started
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot reach the Hub" in lines[0] and "; 2 attempt(s))" in lines[0], lines
    assert len(client.requests("POST", "/alice/dropped/preupload/")) == 2
    assert elapsed < 20, f"took {elapsed:.0f} s"


def test_an_answer_that_is_not_json_names_the_step_and_the_endpoint(client, checkpoint, capsys):
    """A captive portal or a proxy answers 200 with a page of its own."""
    client.fail("POST", "/api/repos/create", status=200, body=b"<html>captive portal</html>")
    assert main([str(checkpoint[0]), "alice/portal", "--retries", "0"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        f"lazy-push: error: Creating the repository failed: {client.url} answered with something that is not the "
        "Hub's JSON"), lines
    assert "HF_ENDPOINT" in lines[0] and "alice/portal" not in client.repos


def test_ctrl_c_while_waiting_for_the_hub_ends_in_one_line(silent, checkpoint, tmp_path):
    """`lazy-push` in its own process, started as a shell starts it (SIGINT at its default disposition: inside the
    full suite the pytest process had SIGINT ignored, which a child inherits, so the interrupt was never delivered),
    and a real SIGINT once it waits on the connection."""
    push = subprocess.Popen(
        [sys.executable, "-m", "conversion.push_to_hub", str(checkpoint[0]), "alice/hanging", "--timeout", "120",
         "--retries", "0"], cwd=PROJECT_ROOT, env=_subprocess_env(silent, tmp_path), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while silent.accepted == 0 and push.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert silent.accepted, "lazy-push never connected to the hub"
        time.sleep(0.5)  # the client now waits for an answer
        push.send_signal(signal.SIGINT)
        _, err = push.communicate(timeout=60)
    finally:
        push.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert push.returncode == 130 and len(lines) == 1 and lines[0].startswith("lazy-push: interrupted."), lines
