"""The files of a LazyLlama checkpoint folder: what the converter writes and what `lazy-push` uploads by default."""

from pathlib import PurePath

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CARD_FILE = "README.md"
SETTINGS_FILE = "lazy_conversion.json"  # conversion settings, written by conversion.convert_llama_to_lazy
STATS_FILE = "attention_stats.json"  # measured attention statistics, if someone saved them next to the weights
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def names_outside_folder(names) -> list[str]:
    """The file names of a weight index that leave its folder (absolute, or through `..`): an index, which may come
    from anywhere, only names files beside it."""
    return [name for name in names if PurePath(name).is_absolute() or ".." in PurePath(name).parts]
