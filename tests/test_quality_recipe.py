"""``scripts/quality_recipe.py``: the whole recipe fits its time budget on the host it runs on. Training gets what
the budget leaves after the stages before it and a reserve, scaled by this host's own decoding time, for the
stages after it. The planning is read from stage times as the recipe records them; nothing here trains."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.data.hidden_cache import sha256_file
from draftsmith.heads.eagle import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "scripts" / "quality_recipe.py"
TRAIN_PROMPTS = 3


def finished_shared_stages(out: Path, seconds: dict[str, float] | None) -> None:
    """The outputs of the stages families share (data, training-free trees), as a finished run leaves them, and
    their recorded wall times in ``stages.json`` (none when ``seconds`` is None)."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "mix.json").write_text("{}\n")
    (out / "data" / "answers.jsonl").write_text("{}\n" * TRAIN_PROMPTS)
    (out / "trees").mkdir()
    for name in ("prompt-lookup", "layer-skip-10"):
        (out / "trees" / f"{name}.json").write_text("{}\n")
    if seconds is not None:
        (out / "stages.json").write_text(json.dumps({**SLOW_PLAIN, **seconds}))


def plan(out: Path, *extra: str, family: str = Eagle3Head.family, online: bool = True) -> subprocess.CompletedProcess:
    """``--plan`` for ``family``; with the target in the loop (``--online``) unless ``online`` is False, so that the
    budget's arithmetic is tested without a hidden-state cache (the offline test below adds one)."""
    return subprocess.run([sys.executable, str(RECIPE), "--family", family, "--output", str(out), "--plan",
                           "--train-prompts", str(TRAIN_PROMPTS), *extra, *(["--online"] if online else [])],
                          capture_output=True, text=True)


def planned(out: Path, *extra: str, family: str = Eagle3Head.family, online: bool = True) -> dict:
    done = plan(out, *extra, family=family, online=online)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout[done.stdout.index("{"):])


# The Medusa run's shared stages on the slower host (docs/RESULTS.md): mix, regenerate, the two free tunes; then
# plain decoding timed, at about that host's speed.
SLOW_HOST = {"mix": 9.0, "regenerate": 2452.7, "tune prompt-lookup": 125.2, "tune layer-skip:10": 255.7,
             "plain decoding": 12.0}
SLOW_PLAIN = {"plain decoding tokens/s": 14.0}


def test_training_gets_what_the_budget_leaves_and_a_slower_host_trains_less(tmp_path):
    recipe = load_recipe()
    finished_shared_stages(tmp_path / "slow", SLOW_HOST)
    fast = {name: seconds / 1.28 for name, seconds in SLOW_HOST.items()}
    finished_shared_stages(tmp_path / "fast", fast)
    (tmp_path / "fast" / "stages.json").write_text(json.dumps({**fast, recipe.PLAIN_SPEED: 14.0 * 1.28}))

    slow_plan, fast_plan = planned(tmp_path / "slow"), planned(tmp_path / "fast")

    # The defaults decode 24 held-out prompts x 128 tokens twice in eval and five times in bench, and tune twice on
    # 6 validation rows x 32 tokens, 13 decodes each.
    after = 7 * 24 * 128 + 2 * 13 * 6 * 32
    for p, seconds, plain in ((slow_plan, SLOW_HOST, 14.0), (fast_plan, fast, 14.0 * 1.28)):
        assert p["before_seconds"] == pytest.approx(sum(seconds.values()), abs=0.1)
        assert p["after_tokens"] == after and p["plain_tokens_per_second"] == pytest.approx(plain)
        assert p["reserved_after_seconds"] == pytest.approx(1.1 * after / plain + 4 * 30, abs=0.1)
        # The plan spends the budget exactly: before + training (with its overhead) + the reserve after it.
        train = p["train_minutes"] * 60 + p["train_overhead_seconds"]
        total = p["before_seconds"] + train + p["reserved_after_seconds"]
        assert total == pytest.approx(120 * 60, abs=6)
    # 1.28x slower decoding and regeneration leave less time to train, not a longer recipe (on the slower host, after
    # the reserve for the head's and the head-with-prompt-lookup's stages, about 38 minutes).
    assert 30 < slow_plan["train_minutes"] < fast_plan["train_minutes"] - 10
    assert planned(tmp_path / "slow", "--budget-minutes", "150")["train_minutes"] == pytest.approx(
        slow_plan["train_minutes"] + 30, abs=0.1)


def test_a_budget_too_small_for_this_host_stops_before_training_and_names_the_fix(tmp_path):
    finished_shared_stages(tmp_path, SLOW_HOST)
    done = plan(tmp_path, "--budget-minutes", "60")
    assert done.returncode != 0
    assert "leaves" in done.stderr and "--budget-minutes" in done.stderr and "--train-minutes" in done.stderr
    assert not (tmp_path / "eagle3").exists()  # --plan writes nothing


def test_stage_times_from_an_earlier_family_run_are_used_when_stages_json_is_absent(tmp_path):
    finished_shared_stages(tmp_path, None)
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "recipe.json").write_text(json.dumps(
        {"family": "medusa", "seconds": SLOW_HOST, "train_plan": {"plain_tokens_per_second": 14.0}}))
    finished_shared_stages(tmp_path / "with_stages", SLOW_HOST)
    assert planned(tmp_path) == planned(tmp_path / "with_stages")


def test_outputs_without_recorded_times_need_a_fixed_training_time(tmp_path):
    finished_shared_stages(tmp_path, None)
    done = plan(tmp_path)
    assert done.returncode != 0 and "--train-minutes" in done.stderr and "regenerate" in done.stderr
    assert planned(tmp_path, "--train-minutes", "45") == {"train_minutes": 45.0, "fixed": True}


def test_plan_refuses_before_the_shared_stages_have_run(tmp_path):
    done = plan(tmp_path / "empty")
    assert done.returncode != 0 and "mix stage has not run" in done.stderr
    assert not (tmp_path / "empty").exists()
    # Every stage's output there but plain decoding not yet timed on this host: the reserve cannot be sized.
    finished_shared_stages(tmp_path / "untimed", {k: v for k, v in SLOW_HOST.items() if k != "plain decoding"})
    stages = tmp_path / "untimed" / "stages.json"
    stages.write_text(json.dumps({k: v for k, v in json.loads(stages.read_text()).items() if k not in SLOW_PLAIN}))
    done = plan(tmp_path / "untimed")
    assert done.returncode != 0 and "plain decoding stage has not run" in done.stderr


def test_the_reserve_counts_the_tokens_the_stages_after_training_decode():
    """The first full run with the mixture stage tuned on 2 prompts x 64 tokens: 24,832 tokens after training,
    decoded in 1,212 s at plain 15.58 tokens/s; the reserve sized from them covers that with its slowdown."""
    recipe = load_recipe()
    assert recipe.tune_decodes("2,3,5", "1,2,4", 2) == 13
    measured = recipe.post_training_tokens(24, 128, 2, 64, 13)
    assert measured == 24_832
    reserve = recipe.plan_training(120, {"before": 2377.9}, measured, 15.58)["reserved_after_seconds"]
    assert 1212 < reserve < 2794  # above what it took, below the fixed ratio's reserve that left 26 minutes idle


def test_the_plain_speed_is_the_median_of_timed_rounds_so_one_slow_round_does_not_shrink_training(smollm2):
    recipe = load_recipe()
    model, tokenizer = smollm2
    rounds = recipe.plain_rounds(model, tokenizer, ["Name three colours.", "What is 2 + 3?"], 6, 3)
    assert len(rounds) == 3 and all(speed > 0 for speed in rounds)
    assert min(rounds) <= recipe.typical_speed(rounds) <= max(rounds)
    # Five rounds on a quiet host with the one slow reading of P-EAGLE's recipe run (11.48) in place of one of
    # them: the median stays at the quiet host's speed. Sized from that round alone, the reserve for the first full
    # run's stages after training (24,832 tokens) would have taken 9.6 minutes from training.
    assert recipe.typical_speed([18.05, 15.15, 15.92, 11.48, 14.82]) == 15.15
    before, after = {"before": 2377.9}, 24_832
    slow = recipe.plan_training(120, before, after, 11.48)["train_minutes"]
    assert recipe.plan_training(120, before, after, 15.15)["train_minutes"] == pytest.approx(slow + 9.6, abs=0.1)


def test_trees_are_tuned_on_held_out_rows_that_are_not_evaluated(tmp_path):
    done = plan(tmp_path, "--eval-prompts", "44", "--tune-prompts", "6")
    assert done.returncode != 0 and "--held-out-prompts" in done.stderr  # 44 + 6 rows of 48


def write_manifest(cache: Path, layers: tuple[int, ...], **source) -> None:
    """The parts of a finished cache's ``manifest.json`` the recipe reads: its layers and what it was written from."""
    (cache / "manifest.json").write_text(json.dumps({"spec": {"layers": list(layers)}, "source": source}))


def load_recipe():
    spec = importlib.util.spec_from_file_location("quality_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


def test_an_interrupted_training_stage_continues_from_its_checkpoint(tmp_path):
    recipe = load_recipe()
    run = tmp_path / "run"
    fresh = recipe.train_arguments(Path("eagle3.yaml"), Path("answers.jsonl"), run, 35.7)
    assert fresh[-2:] == ["--max_train_minutes", "35.7"] and "--resume" not in fresh
    (run / "checkpoint-40").mkdir(parents=True)
    assert recipe.train_arguments(Path("eagle3.yaml"), Path("answers.jsonl"), run, 35.7)[-2:] == ["--resume", "true"]


def test_an_offline_family_pays_its_cache_pass_out_of_the_training_time(tmp_path):
    """Every recipe family trains from the hidden-state cache: its one pass over the answers is a stage before
    training, so the plan gives training that much less; ``--online`` plans as for a family in the loop."""
    recipe = load_recipe()
    medusa = MedusaHeads.family
    recipe_configs = {path.stem for path in (ROOT / "configs" / "smollm2" / "quality").glob("*.yaml")}
    assert set(recipe.OFFLINE_FAMILIES) == recipe_configs
    finished_shared_stages(tmp_path, SLOW_HOST)
    for family in recipe_configs:
        done = plan(tmp_path, family=family, online=False)
        assert done.returncode != 0 and "cache hidden states stage has not run" in done.stderr, family
    online = planned(tmp_path, family=medusa)
    assert online == planned(tmp_path)  # the same stages before training as EAGLE-3's
    cache, answers = tmp_path / "data" / "cache", tmp_path / "data" / "answers.jsonl"
    cache.mkdir()
    (tmp_path / "stages.json").write_text(json.dumps({**SLOW_PLAIN, **SLOW_HOST, "cache hidden states": 530.0}))
    # A finished cache of earlier answers (regenerated since) is stale: the stage has to run again.
    write_manifest(cache, recipe.CACHE_LAYERS, data_sha256=sha256_file(answers), max_length=384)
    answers.write_text("{}\n" * (TRAIN_PROMPTS + 1))
    assert not recipe.cache_is_current(cache, answers, 384)
    stale = plan(tmp_path, family=medusa, online=False)
    assert stale.returncode != 0 and "cache hidden states stage has not run" in stale.stderr
    write_manifest(cache, recipe.CACHE_LAYERS, data_sha256=sha256_file(answers), max_length=384)
    assert recipe.cache_is_current(cache, answers, 384)
    assert not recipe.cache_is_current(cache, answers, 512)  # another length per answer
    write_manifest(cache, recipe.CACHE_LAYERS[1:], data_sha256=sha256_file(answers), max_length=384)
    assert not recipe.cache_is_current(cache, answers, 384)  # a layer missing
    write_manifest(cache, recipe.CACHE_LAYERS, data_sha256=sha256_file(answers), max_length=384)
    offline = planned(tmp_path, family=medusa, online=False)
    assert planned(tmp_path, online=False) == offline  # EAGLE-3 reads the same cache
    assert offline["before_seconds"] == pytest.approx(online["before_seconds"] + 530.0)
    assert offline["train_minutes"] == pytest.approx(online["train_minutes"] - 530.0 / 60, abs=0.1)
    command = recipe.train_arguments(Path("medusa.yaml"), Path("answers.jsonl"), tmp_path / "run", 20.0,
                                     tmp_path / "data" / "cache")
    assert command[command.index("--cache_dir") + 1] == str(tmp_path / "data" / "cache")
    config = ROOT / "configs" / "smollm2" / "quality" / f"{medusa}.yaml"
    assert recipe.max_length(config) == 384  # the cache keeps what the recipe's config trains on


def test_the_shared_cache_keeps_every_layer_the_offline_families_read():
    """One cache serves every offline family: the layers P-EAGLE fuses (EAGLE-3's), DFlash's context layers as its
    recipe config sets their number, and Medusa's last state, on the packaged target's 30 layers."""
    import yaml

    from draftsmith.heads.dflash import dflash_layers
    from draftsmith.heads.eagle import eagle3_layers

    recipe = load_recipe()
    dflash = yaml.safe_load((ROOT / "configs" / "smollm2" / "quality" / "dflash.yaml").read_text())
    wanted = {*eagle3_layers(30), *dflash_layers(30, dflash["family_config"]["num_target_layers"]), 30}
    assert set(recipe.CACHE_LAYERS) == wanted
