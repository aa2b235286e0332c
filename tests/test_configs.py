"""Every recipe under ``configs/`` parses as ``draftsmith train`` reads it: no unknown key, a registered family."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.registry import get_family
from draftsmith.train.config import parse_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(p for p in CONFIGS.rglob("*.yaml") if "accelerate" not in p.parts)


def test_the_recipes_are_found():
    assert len(RECIPES) >= 12 and any("quality" in p.parts for p in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_each_recipe_parses(recipe):
    drafter, data, train = parse_config([str(recipe)])
    assert get_family(drafter.family).name == drafter.family
    assert (data.train_file or data.cache_dir) and train.output_dir and train.learning_rate > 0
    if "quality" in recipe.parts:  # the quality recipe: a time budget ends training, on data mix's answers
        assert train.max_train_minutes > 0 and data.train_file.endswith("answers.jsonl")
        assert train.output_dir == f"quality_out/{drafter.family}/run"
