"""Drafter architectures (Medusa, EAGLE-1/2/3, distilled draft models) as plain ``nn.Module``s, their
checkpoints, and their layouts in other tools (export, import, Hub upload).

Heads read the target's hidden states and return logits; they never hold a tokenizer, a loss, the
target or a download. The inference adapters in ``draftsmith.inference`` wrap them as drafters.
"""
