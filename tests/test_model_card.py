"""Model cards: metadata the Hub understands, settings and statistics carried, hand-written cards respected."""

import json

from huggingface_hub import ModelCard

from conversion.model_card import (
    GENERATED_MARKER,
    SETTINGS_FILE,
    STATS_FILE,
    card_for_push,
    load_statistics,
    render_model_card,
    write_model_card,
)

CONFIG = {"model_type": "lazy_llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
          "num_key_value_heads": 2, "lazy_bias_window": 8}


def _folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def _metadata(card: ModelCard) -> dict:
    return ModelCard(str(card)).data.to_dict()  # parsed back from the text, as the Hub would


def test_metadata_and_usage(tmp_path):
    card = render_model_card(_folder(tmp_path), base_model="HuggingFaceTB/SmolLM2-135M", license="apache-2.0",
                             repo_id="alice/lazy", stats={"sparsity": 0.5, "sink": 0.25})
    meta = _metadata(card)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["license"] == "apache-2.0"
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert {"lazy-attention", "custom_code"} <= set(meta["tags"])
    text = str(card)
    assert 'AutoModelForCausalLM.from_pretrained("alice/lazy", trust_remote_code=True)' in text
    assert 'AutoModelForCausalLM.from_pretrained("alice/lazy")' in text and "import modeling_lazy" in text
    assert "| attention sparsity (fraction of exactly-zero weights among visible pairs) | 0.5000 |" in text
    assert "| attention sink (mean weight on the first key) | 0.2500 |" in text


def test_base_model_that_is_not_a_hub_id_stays_out_of_the_metadata(tmp_path):
    """A GGUF's `general.name` or a local path would make the Hub reject or mislink the card."""
    card = render_model_card(_folder(tmp_path), base_model="SmolLM2 135M Instruct")
    assert "base_model" not in _metadata(card)
    assert "- converted from: `SmolLM2 135M Instruct`" in str(card)


def test_push_rerenders_a_generated_card_for_the_repo(tmp_path):
    folder = _folder(tmp_path)
    write_model_card(folder, base_model="SmolLM2 135M Instruct", license="apache-2.0", repo_id="model",
                     conversion={"tau_init": 0.0, "exact": True})
    (folder / SETTINGS_FILE).write_text(json.dumps({"source": "/secret/path", "tau_init": 0.0, "exact": True}))
    (folder / STATS_FILE).write_text(json.dumps({"mean": {"sparsity": 0.0, "sink": 0.3}, "layers": []}))
    card = card_for_push(folder, "alice/lazy")
    text = str(card)
    assert _metadata(card)["license"] == "apache-2.0"
    assert "- converted from: `SmolLM2 135M Instruct`" in text and "/secret/path" not in text
    assert 'from_pretrained("alice/lazy"' in text and "computes exactly what the source model" in text
    assert "| attention sink (mean weight on the first key) | 0.3000 |" in text


def test_push_keeps_a_hand_written_card_and_adds_what_the_hub_needs(tmp_path):
    folder = _folder(tmp_path)
    (folder / "README.md").write_text("---\nlicense: mit\ntags:\n- mine\n---\n\n# My model\n\nHand-written words.\n")
    card = card_for_push(folder, "alice/lazy")
    meta = _metadata(card)
    assert "Hand-written words." in str(card) and GENERATED_MARKER not in str(card)
    assert meta["license"] == "mit" and meta["library_name"] == "transformers"
    assert {"mine", "lazy-attention", "custom_code"} <= set(meta["tags"])


def test_statistics_from_a_lazy_inspect_report(tmp_path):
    report = {"input": {"text_file": "brown.txt"}, "model": {"text": {"mean": {"sparsity": 0.6}, "layers": []}},
              "baseline": None}
    (tmp_path / "report.json").write_text(json.dumps(report))
    stats = load_statistics(tmp_path / "report.json")
    assert stats["mean"] == {"sparsity": 0.6} and stats["source"] == "brown.txt"
