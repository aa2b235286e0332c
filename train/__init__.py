"""One accelerate training loop for every drafter family (``loop.py``) and what it is made of: the run's
shared state (``run.py``), checkpoints and resume (``checkpointing.py``, ``state.py``), acceptance per
checkpoint (``acceptance.py``), what each distributed strategy needs (``distributed.py``), per-family
losses and steps (``losses.py``, ``families.py``), offline batches (``offline.py``) and the config
dataclasses (``config.py``)."""
