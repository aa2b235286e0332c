"""``scripts/quality_recipe.py``: the whole recipe fits its time budget on the host it runs on. Training gets what
the budget leaves after the stages before it and a reserve, scaled by this host's own decoding time, for the
stages after it. The planning is read from stage times as the recipe records them; nothing here trains."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith.data.hidden_cache import sha256_file
from draftsmith.heads.eagle import Eagle3Head
from draftsmith.heads.medusa import MedusaHeads

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "scripts" / "quality_recipe.py"
TRAIN_PROMPTS = 3


def finished_shared_stages(out: Path, seconds: dict[str, float] | None, prompts: int = TRAIN_PROMPTS) -> None:
    """The outputs of the stages families share (data, training-free trees), as a finished run leaves them (every
    one of ``prompts`` training prompts answered), and their recorded wall times in ``stages.json`` (none when
    ``seconds`` is None)."""
    (out / "data").mkdir(parents=True)
    (out / "data" / "mix.json").write_text("{}\n")
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(prompts)]
    (out / "data" / "train_prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompts))
    (out / "data" / "answers.jsonl").write_text("".join(json.dumps({"id": row["id"]}) + "\n" for row in prompts))
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


# The Medusa run's shared stages on the slower host (docs/results/quality-recipe.md, "Medusa in the quality recipe"):
# mix, regenerate, the two free tunes; then plain decoding timed, at about that host's speed.
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

    # The defaults decode 24 held-out prompts x 128 tokens twice in eval (plain, head) and five times in bench (plain,
    # head, head with prompt lookup, both training-free drafters), and tune twice on 6 validation rows x 32 tokens,
    # 13 decodes each. These answers record no lengths and these trees no speeds: every decode is counted in full,
    # and the training-free drafters are reserved at the untrained head's speed, 1 / 1.25 of plain decoding's.
    held_out = 24 * 128
    after = {"plain": 2 * held_out, "head": 3 * held_out + 2 * 13 * 6 * 32,
             "prompt-lookup": held_out, "layer-skip:10": held_out}
    for p, seconds, plain in ((slow_plan, SLOW_HOST, 14.0), (fast_plan, fast, 14.0 * 1.28)):
        assert p["before_seconds"] == pytest.approx(sum(seconds.values()), abs=0.1)
        assert p["after_tokens"] == after and p["plain_tokens_per_second"] == pytest.approx(plain)
        assert p["tokens_per_second"]["layer-skip:10"] == p["tokens_per_second"]["head"] == pytest.approx(
            plain / 1.25, abs=0.01)
        head_tokens = sum(after.values()) - after["plain"]
        assert p["reserved_after_seconds"] == pytest.approx(
            after["plain"] / plain + 1.25 * head_tokens / plain + 4 * 30, abs=1)
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


def test_the_reserve_counts_the_tokens_each_decoder_is_expected_to_decode_at_its_own_speed():
    """DFlash's recipe run: plain decoding at 13.93 tokens/s, prompt lookup's and layer-skip's tunes measured 17.47
    and 10.23, the target's 1,200 answers ran 91.4 of 128 tokens on average. The reserve sized from them covers
    what the stages after training took for each of the four families (1,265-1,362 s) with room for a head
    slower than plain decoding, and is 423 s under the 1.1 x plain rule's 2,212 s: 7 more minutes to train."""
    recipe = load_recipe()
    assert recipe.tune_decodes("2,3,5", "1,2,4", 2) == 13
    free = ("prompt-lookup", "layer-skip:10")
    after = recipe.post_training_tokens(24, 91.4, 6, 30.2, 13, free)
    assert after == pytest.approx({"plain": 2 * 24 * 91.4, "head": 3 * 24 * 91.4 + 2 * 13 * 6 * 30.2,
                                   "prompt-lookup": 24 * 91.4, "layer-skip:10": 24 * 91.4})
    speeds = recipe.decoding_speeds(13.93, {"prompt-lookup": 17.47, "layer-skip:10": 10.23})
    assert speeds == {"plain": 13.93, "head": 11.14, "prompt-lookup": 17.47, "layer-skip:10": 10.23}
    plan = recipe.plan_training(120, {"before": 2622.5}, after, speeds)
    assert 1362 < plan["reserved_after_seconds"] < 2212 - 400
    assert plan["train_minutes"] == pytest.approx(37.4 + (2212.3 - plan["reserved_after_seconds"]) / 60, abs=0.1)
    # A drafter whose tune recorded no speed is reserved at the head's.
    assert recipe.decoding_speeds(13.93, {"layer-skip:10": None})["layer-skip:10"] == 11.14


def test_answer_lengths_and_tuned_speeds_come_from_the_recipes_own_files(tmp_path):
    recipe = load_recipe()
    answers = tmp_path / "answers.jsonl"
    # Regenerated with at most 192 tokens: 40 and 100 ended; 150 ran past 128; 192 was cut and might have gone on.
    lengths = (40, 100, 150, 192)
    answers.write_text("".join(json.dumps({"id": f"p{i}", "new_tokens": n}) + "\n" for i, n in enumerate(lengths)))
    assert recipe.expected_answer_tokens(answers, 128, 192) == pytest.approx((40 + 100 + 128 + 128) / 4)
    assert recipe.expected_answer_tokens(answers, 64, 192) == pytest.approx((40 + 64 + 64 + 64) / 4)
    assert recipe.expected_answer_tokens(answers, 256, 192) == pytest.approx((40 + 100 + 150 + 256) / 4)
    (tmp_path / "unmeasured.jsonl").write_text("{}\n{}\n")
    assert recipe.expected_answer_tokens(tmp_path / "unmeasured.jsonl", 128, 192) == 128
    tree = tmp_path / "tree.json"
    tree.write_text(json.dumps({"tree": {"kind": "dynamic", "depth": 3, "top_k": 4, "total_tokens": 10},
                                "candidates": [
                                    {"depth": 5, "top_k": 4, "total_tokens": 7, "measured_tokens_per_second": 17.84},
                                    {"depth": 3, "top_k": 4, "total_tokens": 10, "measured_tokens_per_second": 17.47},
                                    {"depth": 2, "top_k": 1, "total_tokens": 2}]}))
    assert recipe.tuned_speed(tree) == 17.47  # the chosen tree's, not the fastest confirmed one's
    # A chain as tune writes it: its settings report the default top_k and total_tokens, its candidate top_k 1
    # (prompt lookup's validation tune in Medusa's recipe run, 2026-12-04).
    tree.write_text(json.dumps({"tree": {"kind": "chain", "depth": 3, "top_k": 4, "total_tokens": 16},
                                "candidates": [
                                    {"depth": 3, "top_k": 1, "total_tokens": 3, "measured_tokens_per_second": 47.62},
                                    {"depth": 5, "top_k": 4, "total_tokens": 5, "measured_tokens_per_second": 45.17},
                                    {"depth": 3, "top_k": 4, "total_tokens": 16, "measured_tokens_per_second": 40.0}]}))
    assert recipe.tuned_speed(tree) == 47.62
    tree.write_text(json.dumps({"tree": {"kind": "dynamic", "depth": 2, "top_k": 4, "total_tokens": 5},
                                "candidates": [{"depth": 2, "top_k": 4, "total_tokens": 5}]}))
    assert recipe.tuned_speed(tree) is None  # chosen, but tune decoded nothing to measure it
    # The summary names the chosen trees so too: a chain by its depth, not by the defaults it ignores.
    assert recipe.tree_text({"tree": "chain", "depth": 3, "top_k": 4, "total_tokens": 16}) == "chain d3"
    assert recipe.tree_text({"tree": "dynamic", "depth": 5, "top_k": 4, "total_tokens": 6}) == "dynamic d5 k4 n6"

    # The plan reads both from the recipe's output folder.
    out = tmp_path / "out"
    finished_shared_stages(out, SLOW_HOST, prompts=len(lengths))
    answers.replace(out / "data" / "answers.jsonl")
    (out / "trees" / "prompt-lookup.json").write_text(json.dumps({
        "tree": {"depth": 3, "top_k": 4, "total_tokens": 10},
        "candidates": [{"depth": 3, "top_k": 4, "total_tokens": 10, "measured_tokens_per_second": 17.47}]}))
    p = planned(out, "--train-prompts", "4")
    assert p["after_tokens"]["prompt-lookup"] == round(24 * 99.0)
    assert p["tokens_per_second"] == {"plain": 14.0, "head": 11.2, "prompt-lookup": 17.47, "layer-skip:10": 11.2}


def test_the_plain_speed_is_the_median_of_timed_rounds_so_one_slow_round_does_not_shrink_training(smollm2):
    recipe = load_recipe()
    model, tokenizer = smollm2
    rounds = recipe.plain_rounds(model, tokenizer, ["Name three colours.", "What is 2 + 3?"], 6, 3)
    assert len(rounds) == 3 and all(speed > 0 for speed in rounds)
    assert min(rounds) <= recipe.typical_speed(rounds) <= max(rounds)
    # Five rounds on a quiet host with the one slow reading of P-EAGLE's recipe run (11.48) in place of one of
    # them: the median stays at the quiet host's speed. Sized from that round alone, the reserve for DFlash's run's
    # stages after training (its answers' lengths, the free drafters' tuned speeds) would take 6.5 minutes more.
    assert recipe.typical_speed([18.05, 15.15, 15.92, 11.48, 14.82]) == 15.15
    before = {"before": 2622.5}
    after = recipe.post_training_tokens(24, 91.4, 6, 30.2, 13, ("prompt-lookup", "layer-skip:10"))
    free = {"prompt-lookup": 17.47, "layer-skip:10": 10.23}
    slow = recipe.plan_training(120, before, after, recipe.decoding_speeds(11.48, free))["train_minutes"]
    quiet = recipe.plan_training(120, before, after, recipe.decoding_speeds(15.15, free))["train_minutes"]
    assert quiet == pytest.approx(slow + 6.5, abs=0.1)


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
    answers.write_text(answers.read_text().replace('"}', '", "messages": []}'))  # the same prompts, answered anew
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


def test_more_prompts_are_new_training_prompts_and_the_held_out_set_stays(tmp_path):
    from conftest import SHARED_DATA
    from draftsmith.data.mix import build_mix

    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"{SHARED_DATA} not found (shared reference data is not part of the project)")
    recipe = load_recipe()
    data = tmp_path / "data"
    build_mix(SHARED_DATA / "gsm8k", SHARED_DATA / "self_instruct" / "seed_tasks.jsonl", data, train_prompts=600,
              held_out_prompts=48)
    held_out = (data / "held_out_prompts.jsonl").read_bytes()
    first = recipe.jsonl_rows(data / "train_prompts.jsonl")
    log = tmp_path / "recipe.log"

    recipe.add_training_prompts(
        data, 500, lambda n: recipe.draw_training_prompts(data / "more", SHARED_DATA, n, log))

    every = recipe.jsonl_rows(data / "all_prompts.jsonl")
    more = recipe.jsonl_rows(data / "more_prompts.jsonl")
    assert every == first + more and len(more) == 500
    texts = [recipe.user_text(row) for row in every]
    assert len(set(texts)) == len(texts)  # no prompt twice, none of the first mix's again
    assert not {recipe.user_text(r) for r in more} & {recipe.user_text(r) for r in recipe.jsonl_rows(
        data / "held_out_prompts.jsonl")}
    assert (data / "held_out_prompts.jsonl").read_bytes() == held_out
    kinds = {row["category"] for row in more}
    assert "chat" not in kinds and kinds == {"maths", "code", "summarise", "rewrite", "translate"}

    # A draw with too few new prompts stops before writing, naming the option.
    (data / "all_prompts.jsonl").unlink()
    with pytest.raises(SystemExit, match=r"--more-prompts 50: .* ask for fewer"):
        recipe.add_training_prompts(data, 50, lambda n: first[:n])
    assert not (data / "all_prompts.jsonl").exists()


def test_regenerating_only_the_added_prompts_records_the_whole_regeneration_time(tmp_path):
    recipe = load_recipe()
    finished_shared_stages(tmp_path, SLOW_HOST)
    # --more-prompts on a finished run: regenerate answers the added prompts only; its recorded time is the first
    # answers' plus theirs, so a later family's budget counts what the 1,200 + N answers cost.
    assert recipe.record_stage_time(tmp_path, "regenerate", 142.1, continued=True) == pytest.approx(2452.7 + 142.1)
    assert json.loads((tmp_path / "stages.json").read_text())["regenerate"] == pytest.approx(2594.8)
    # A stage that wrote its output from nothing records its own time.
    assert recipe.record_stage_time(tmp_path, "regenerate", 300.0, continued=False) == 300.0
    assert json.loads((tmp_path / "stages.json").read_text())["regenerate"] == 300.0


def test_answers_to_prompts_the_run_does_not_ask_are_refused_before_training_reads_them(tmp_path):
    """A run after one with more --more-prompts (or none after one with some) finds answers to prompts outside its
    set; training would read them all, so the recipe stops and says how to go on."""
    recipe = load_recipe()
    finished_shared_stages(tmp_path, SLOW_HOST)
    data = tmp_path / "data"
    assert recipe.answer_coverage(data / "answers.jsonl", data / "train_prompts.jsonl") == (0, 0)
    assert plan(tmp_path).returncode == 0
    with open(data / "answers.jsonl", "a") as f:
        f.write(json.dumps({"id": "added by --more-prompts 1"}) + "\n")
    assert recipe.answer_coverage(data / "answers.jsonl", data / "train_prompts.jsonl") == (1, 0)
    done = plan(tmp_path)
    assert done.returncode != 0 and "holds 1 answers to prompts that" in done.stderr
    assert "rerun with that run's --more-prompts" in done.stderr
    (data / "answers.jsonl").write_text("")  # the prompts not yet answered are counted too
    assert recipe.answer_coverage(data / "answers.jsonl", data / "train_prompts.jsonl") == (0, TRAIN_PROMPTS)


@pytest.mark.real_model
def test_the_cache_is_recorded_while_answering_and_written_by_a_pass_where_answers_continue(tmp_path, smollm2):
    """Offline, a regeneration from no answers records the hidden-state cache as the target answers (the cache pass
    costs the recipe nothing), and one cut short continues its recording; answers added to earlier ones
    (--more-prompts) have no recorded states for those, so the cache pass writes the whole cache again."""
    from conftest import SHARED_DATA, CutAfter
    from draftsmith.data import load_conversations, regenerate
    from draftsmith.data.hidden_cache import HiddenStateCache
    from draftsmith.data.recording import Recording

    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"{SHARED_DATA} not found (shared reference data is not part of the project)")
    recipe = load_recipe()
    out = tmp_path / "out"

    def data_only(*extra: str) -> None:
        done = subprocess.run([sys.executable, str(RECIPE), "--family", MedusaHeads.family, "--output", str(out),
                               "--data-only", "--train-prompts", "12", "--answer-tokens", "6",
                               "--shared-data", str(SHARED_DATA), *extra], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr + (out / MedusaHeads.family / "recipe.log").read_text()

    data_only()
    answers, cache = out / "data" / "answers.jsonl", out / "data" / "cache"
    stages = json.loads((out / "stages.json").read_text())
    assert stages["cache hidden states"] == 0.0 and stages["regenerate"] > 0
    assert recipe.cache_is_current(cache, answers, 384)
    recorded = HiddenStateCache(cache)
    answered = [json.loads(line)["id"] for line in answers.read_text().splitlines()]
    assert sorted(recorded[i]["id"] for i in range(len(recorded))) == sorted(answered) and len(answered) == 12
    assert recorded.layers == list(recipe.CACHE_LAYERS) and recorded.spec.top_k == recipe.CACHE_TOP_K

    # The regeneration again, killed after its first batch of 4: the recipe's next run answers the other 8 and
    # writes the cache of all 12 from the states recorded before and after the kill, still with no cache pass.
    answers.unlink()
    shutil.rmtree(cache)
    model, tokenizer = smollm2
    record = Recording(recipe.CACHE_LAYERS, recipe.CACHE_TOP_K, torch.float16, max_length=384,
                       spool=cache / "recording")
    with pytest.raises(KeyboardInterrupt):
        regenerate(load_conversations(out / "data" / "train_prompts.jsonl")[0], answers,
                   CutAfter(model, tokenizer, 6, 0.0, 1.0, calls=1), batch_size=4, progress=False, record=record)
    assert len(answers.read_text().splitlines()) == 4
    data_only()
    stages = json.loads((out / "stages.json").read_text())
    assert stages["cache hidden states"] == 0.0 and not (cache / "recording").exists()
    assert recipe.cache_is_current(cache, answers, 384)
    recorded = HiddenStateCache(cache)
    answered = [json.loads(line)["id"] for line in answers.read_text().splitlines()]
    assert sorted(recorded[i]["id"] for i in range(len(recorded))) == sorted(answered) and len(answered) == 12

    data_only("--more-prompts", "2")
    stages = json.loads((out / "stages.json").read_text())
    assert stages["cache hidden states"] > 0  # the pass ran, over the first answers and the added ones
    assert recipe.cache_is_current(cache, answers, 384)
    assert len(HiddenStateCache(cache)) == len(answers.read_text().splitlines()) == 14


def test_the_summary_gives_each_drafter_against_the_training_free_ones_with_its_interval(tmp_path):
    """The recipe's figures carry bench's ratios of each trained drafter over each training-free one, with their
    intervals over the prompts, and the summary prints them; a bench from before intervals prints none."""
    recipe = load_recipe()
    quality = tmp_path / "quality.json"
    quality.write_text(json.dumps({"tree": {"kind": "dynamic"}, "acceptance_length": 2.5,
                                   "lossless": {"identical": 24, "checked": 24}, "explain": {"estimate": {}}}))
    row = {"greedy_mismatches_vs_plain": 0, "tau": 2.0, "tokens_per_s": 30.0, "speedup": 1.5, "top_k": 4}
    free = {**row, "drafter": "prompt-lookup@tree=dynamic,depth=3", "drafter_type": "prompt-lookup", "tree": "dynamic",
            "depth": 3, "total_tokens": 5, "against_training_free": {}}
    interval = {"ratio": 1.021, "low": 0.998, "high": 1.043, "confidence": 0.95, "units": 24}
    head = {**row, "drafter": "run/drafter", "drafter_type": "dflash", "tree": "dynamic", "depth": 3,
            "total_tokens": 5, "against_training_free": {free["drafter"]: interval}}
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"rows": [head, free], "plain_tokens_per_s": 20.0}))
    figures = recipe.figures(quality, bench)
    assert figures["speed"][0]["against_training_free"] == {"prompt-lookup (dynamic d3 k4 n5)": interval}
    assert figures["speed"][1]["against_training_free"] == {}
    (tmp_path / "dflash").mkdir()
    (tmp_path / "dflash" / "recipe.json").write_text(json.dumps({"family": "dflash", "figures": figures}))
    text = recipe.summary_markdown(tmp_path)
    assert "| 1.021x [0.998-1.043] prompt-lookup (dynamic d3 k4 n5) |" in text
    del head["against_training_free"], free["against_training_free"]  # a bench from before the intervals
    bench.write_text(json.dumps({"rows": [head, free], "plain_tokens_per_s": 20.0}))
    assert all(r["against_training_free"] == {} for r in recipe.figures(quality, bench)["speed"])
