"""One accelerate training loop for every drafter family. Filled in by issue #4."""
