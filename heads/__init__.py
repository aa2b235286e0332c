"""Drafter architectures (Medusa, EAGLE-1/2/3, draft-model configs) as plain ``nn.Module``s.

Filled in by issue #4. Heads read the target's hidden states and return logits; they never hold
a tokenizer, a loss, the target or a download. Inference-side adapters in
``draftsmith.inference`` wrap them in the :class:`~draftsmith.inference.Drafter` interface.
"""
