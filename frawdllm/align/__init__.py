"""Post-training: from a base model to a chat model.

    examples.py        chat and preference records -> token ids with a loss mask
    stdlib_corpus.py   `stdlib-instruct` / `stdlib-prefs`: built-in, offline examples
    packing.py         several examples per row, attention kept inside each example
    lora.py            low-rank adapters, merged into a plain model on save
    sft.py             `frawd sft`: supervised fine-tuning on the assistant's tokens
    dpo.py             `frawd dpo`: direct preference optimisation against a frozen reference
    job.py             what both share: the start from a model, LoRA, saving
    config.py          FinetuneConfig, SFTConfig, DPOConfig: torch-free, so `--help` stays instant

Both jobs are `TrainTask`s on the shared loop (frawdllm/train/loop.py). This package imports
nothing itself: `frawdllm.align.config` loads without torch, the jobs with it.
"""
