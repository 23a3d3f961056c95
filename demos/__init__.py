"""Demonstrations on real weights and real text: `conversion_demo` (run by `make demo`) and `finetune_demo`.

They use the project's packages (`conversion`, `lazy_llama_tools`) the way a user would; nothing in those packages
imports from here.
"""
