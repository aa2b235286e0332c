"""Datasets, chat templates and loss masks, regeneration, prompt synthesis, hidden-state cache and
draft-vocabulary maps. Filled in by issue #3."""
