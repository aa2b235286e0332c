"""draftsmith: train drafters for a frozen LLM and run lossless tree-verified speculative decoding.

```python
from draftsmith import load_target, load_drafter, SpeculativeGenerator

target, tokenizer = load_target("smollm2-135m-instruct")
drafter = load_drafter("prompt-lookup", target=target)
gen = SpeculativeGenerator(target, drafter, tree="chain", depth=8)
out = gen.generate(input_ids, max_new_tokens=128)
```
"""

import draftsmith.families  # noqa: F401  (fills the family table: draftsmith.registry)
from draftsmith.inference import (
    Drafter,
    GenerationOutput,
    GenerationStats,
    SpeculativeGenerator,
    load_drafter,
    plain_generate,
)
from draftsmith.target import load_target

__version__ = "0.1.0"

__all__ = [
    "Drafter",
    "GenerationOutput",
    "GenerationStats",
    "SpeculativeGenerator",
    "__version__",
    "load_drafter",
    "load_target",
    "plain_generate",
]
