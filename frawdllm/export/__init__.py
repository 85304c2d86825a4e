"""Interop: FrawdLLM models to and from Hugging Face `transformers` and GGUF (llama.cpp).

`hf` holds the config and weight mapping (both directions), `hf_dir` writes and reads
transformers model directories, `gguf` writes llama.cpp files, `marian` writes a
`Seq2SeqTransformer` as `MarianMTModel`. The heavy optional
dependencies (`transformers`, `gguf`) are imported only when these modules are used.
"""
