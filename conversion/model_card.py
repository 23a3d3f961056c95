"""Model cards for LazyLlama checkpoints (converted or trained), written with `huggingface_hub.ModelCard`."""

import json
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

TAGS = ["lazy-attention", "elastic-softmax", "llama", "custom_code", "text-generation"]


def render_model_card(
    folder: str | Path,
    *,
    base_model: str | None = None,
    conversion: dict | None = None,
    stats: dict | None = None,
    license: str | None = None,
    repo_id: str | None = None,
) -> ModelCard:
    """Build the card of a LazyLlama folder: metadata, what the model is, conversion settings, measured
    attention statistics (a dict with `sparsity`, `sink`, ... means) and usage with and without the package."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=list(TAGS),
    )
    name = repo_id or folder.name
    lines = [
        f"# {name}",
        "",
        "A LazyLlama checkpoint: a Llama whose attention is **Lazy Attention** (arXiv 2601.00919): a learnable",
        "per-head distance bias added to the RoPE scores, and Elastic-Softmax `ReLU(softmax + tau_h / n_i)`",
        "in place of softmax, so heads can give exactly zero weight to irrelevant tokens.",
        "",
        f"- layers: {config.get('num_hidden_layers')}, hidden size: {config.get('hidden_size')}, "
        f"heads: {config.get('num_attention_heads')} (key/value heads: {config.get('num_key_value_heads')})",
        f"- distance-bias window: {config.get('lazy_bias_window')}",
    ]
    if base_model:
        lines.append(f"- converted from: `{base_model}`")
    if conversion:
        lines += ["", "## Conversion settings", "", "| setting | value |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in conversion.items()]
    if stats:
        lines += ["", "## Measured attention statistics", "", "| measure | value |", "|---|---|"]
        lines += [f"| {key} | {value:.4f} |" if isinstance(value, float) else f"| {key} | {value} |"
                  for key, value in stats.items()]
    lines += [
        "",
        "## Usage",
        "",
        "Without installing anything beyond `transformers` (the code travels with the checkpoint):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        "```",
        "",
        "With the `lazyllama` package installed (`import modeling_lazy` registers the Auto classes):",
        "",
        "```python",
        "import modeling_lazy",
        "from transformers import AutoModelForCausalLM",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        "```",
    ]
    return ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n" + "\n".join(lines) + "\n")


def write_model_card(folder: str | Path, **kwargs) -> Path:
    """Render the card (see `render_model_card`) into `folder/README.md` and return its path."""
    path = Path(folder) / "README.md"
    render_model_card(folder, **kwargs).save(path)
    return path
