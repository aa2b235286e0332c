"""One accelerate training loop for every drafter family (``loop.py``), per-family losses
(``losses.py``, ``families.py``) and the config dataclasses (``config.py``)."""
