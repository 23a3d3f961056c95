"""Tools around LazyLlama: real data and weights, inspection, evaluation, fine-tuning."""
