"""`python -m frawdllm.cli ...` is `frawd ...` (torchrun starts each rank this way)."""

from . import main

main()
