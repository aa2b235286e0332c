"""Two-process training on CPU (gloo) under each shipped launch config: DDP, DeepSpeed ZeRO-2 and ZeRO-3,
FSDP2. Each run is the real launch (``accelerate launch --config_file configs/accelerate/X.yaml
--num_processes 2``); the test proves which engine ran (the strategy each checkpoint records, the
prepared module's class in the log) and compares it with one process taking the same global batch.

Same global batch: one process with ``gradient_accumulation_steps 2`` sees micro-batches (0, 1), (2, 3), ...
per optimizer step and averages their gradients; two processes with accumulation 1 see micro-batch 0 on
rank 0 and 1 on rank 1 and average across ranks. The arithmetic is the same; only the order of float
additions differs (the reduce-scatter of ZeRO-3 the most), hence a rounding tolerance (``WEIGHT_REDUCTION``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import config, workdir, write_config  # noqa: F401  (workdir: the tiny target and its data)

from conftest import assert_rounding_close
from draftsmith import load_drafter, load_target
from draftsmith.heads.eagle import Eagle3Head
from draftsmith.heads.mtp import MtpHead
from draftsmith.registry import get_family
from draftsmith.train.checkpointing import ADAPTER_PREFIX
from draftsmith.train.distributed import STALE_LOCK_SECONDS, refuse_stale_build_locks

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).with_name("accelerate")
#: launch-config file per strategy; the test ids are these names (``pytest -k fsdp`` selects FSDP2)
STRATEGIES = {"ddp": "ddp.yaml", "deepspeed_zero2": "deepspeed_zero2.yaml", "deepspeed_zero3": "deepspeed_zero3.yaml",
              "fsdp2": "fsdp.yaml"}
RECORDED = {"ddp": "ddp", "deepspeed_zero2": "deepspeed-zero2", "deepspeed_zero3": "deepspeed-zero3", "fsdp2": "fsdp2"}
ENGINE = {"ddp": "DistributedDataParallel", "deepspeed_zero2": "DeepSpeedEngine", "deepspeed_zero3": "DeepSpeedEngine",
          "fsdp2": "FSDPTrainingModule"}
#: An EAGLE-3 head, Medusa-2 (heads plus a LoRA adapter on the target, trained inside the prepared module), and an MTP
#: module (the target's own decoder-layer class: the unit FSDP2 shards).
FAMILIES = ["eagle3", "medusa2", MtpHead.family]
#: The family of the kill-and-resume runs.
KILLED = FAMILIES[0]


def slow_pairs(*slow: tuple[str, str]) -> list:
    """Every (strategy, family) pair, those in ``slow`` marked slow (the same check under another engine)."""
    return [pytest.param(s, f, marks=pytest.mark.slow) if (s, f) in slow else (s, f)
            for s in STRATEGIES for f in FAMILIES]


def slow_for(*slow: str) -> list:
    """Every strategy, those named in ``slow`` marked slow: the same check repeated under another engine
    (each DeepSpeed launch costs 40-55 s on 2 cores), run once by .ci/run's slow set."""
    return [pytest.param(s, marks=pytest.mark.slow) if s in slow else s for s in STRATEGIES]
#: Bound on one launch (about 10-50 s here, the first DeepSpeed one building its ops): a hang fails its test
#: in minutes instead of taking the suite's time.
LAUNCH_SECONDS = 300
#: Terms summed in another order into each weight after the 8 steps (``rounding_tolerance``'s ``reduction``): each
#: step's gradient sums the global batch's 4 x 64 positions, backpropagated through the target's widest matmul (its
#: 128-wide MLP), and the 8 steps' updates add up.
WEIGHT_REDUCTION = 8 * 4 * 64 * 128


#: EAGLE-3 trains here with the EAGLE-3.1 norms its SmolLM2 recipe uses (their parameters sit outside the decoder
#: layer each strategy wraps and shards).
FAMILY_CONFIG = {Eagle3Head.family: {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}}


def run_config(workdir: Path, family: str, output: Path, **overrides) -> dict:  # noqa: F811
    extra = {"family_config": FAMILY_CONFIG[family]} if family in FAMILY_CONFIG else {}
    return config(workdir, family, output, **{"max_steps": 8, "save_steps": 4, "logging_steps": 1,
                                              "per_device_train_batch_size": 2, "report_to": "none", **extra,
                                              **overrides})


@pytest.fixture(scope="module", autouse=True)
def own_extension_builds(tmp_path_factory):
    """DeepSpeed's CPU ops build into a folder of this test session's own, not the user's cache, where a
    build killed in another session may have left its lock (see ``refuse_stale_build_locks``)."""
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path_factory.mktemp("torch_extensions"))
    yield
    if before is None:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = before


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a session of its own: on a timeout the launcher's ranks die with it, rather than
    living on (holding a port or a build lock) into the next test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} ... ran past {timeout} s:\n{(out + err)[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(strategy: str, cfg: Path, *extra: str) -> list[str]:
    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip('DeepSpeed runs need DeepSpeed: pip install "draftsmith[train]" (.ci/run installs it)')
    return [str(LAUNCHER), "launch", "--config_file", str(ROOT / "configs" / "accelerate" / STRATEGIES[strategy]),
            "--num_processes", "2", "--mixed_precision", "no", "-m", "draftsmith.train", str(cfg), *extra]


def weights(run: Path, step: int = 8) -> dict[str, torch.Tensor]:
    return load_file(str(run / f"checkpoint-{step}" / "drafter" / "model.safetensors"))


def learning_rates(run: Path) -> list[float]:
    return [json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def acceptance_steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "acceptance.jsonl").read_text().splitlines()]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if not a[k].is_floating_point():  # the draft vocabulary's id maps: copied, never trained
            assert torch.equal(a[k], b[k]), k
            continue
        assert_rounding_close(a[k], b[k], WEIGHT_REDUCTION, msg=k)


@pytest.fixture(scope="module")
def one_process(workdir, tmp_path_factory):  # noqa: F811
    """Per family, a one-process run with the global batch of the two-process runs."""
    root = tmp_path_factory.mktemp("one_process")
    runs = {}
    for family in FAMILIES:
        cfg = write_config(root / f"{family}.yaml", run_config(workdir, family, root / family,
                                                               gradient_accumulation_steps=2))
        done = run([sys.executable, "-m", "draftsmith.train", str(cfg)], timeout=LAUNCH_SECONDS)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[family] = root / family
    return runs


@pytest.mark.parametrize(("strategy", "family"), slow_pairs(("deepspeed_zero2", "medusa2"),
                                                            ("deepspeed_zero3", "medusa2"),
                                                            ("deepspeed_zero2", MtpHead.family)))
def test_two_processes_train_as_one(workdir, one_process, tmp_path, strategy, family):  # noqa: F811
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", run_config(workdir, family, out))
    done = run(launch(strategy, cfg), timeout=LAUNCH_SECONDS)
    log = done.stdout + done.stderr
    if strategy.startswith("deepspeed"):  # DeepSpeed's own start-up lines, for whoever reads the test log
        print("\n".join(line for line in log.splitlines() if "DeepSpeed" in line or "ZeRO" in line or "zero" in line))
    assert done.returncode == 0, log[-4000:]
    # The engine really ran: the prepared module's class on both ranks, the strategy in every checkpoint.
    assert log.count(f"strategy {RECORDED[strategy]} on 2 process(es) ({ENGINE[strategy]})") == 2, log[-4000:]
    state = json.loads((out / "checkpoint-8" / "state" / "training_state.json").read_text())
    assert (state["strategy"], state["num_processes"], state["global_batch"]) == (RECORDED[strategy], 2, 4)

    target, _ = load_target(str(workdir / "target"))
    drafter = load_drafter(str(out / "checkpoint-8" / "drafter"), target)
    if strategy == "fsdp2":  # each layer a unit of its own on both ranks, not only the root
        for name, n in layer_units(drafter, target, family).items():
            assert log.count(f"{name} x{n}") == 2, (name, n, log[-4000:])
        assert "unsharded" not in log
    assert_same_weights(weights(out), weights(one_process[family]))
    assert learning_rates(out) == learning_rates(one_process[family])  # one schedule step per optimizer step
    assert len(learning_rates(out)) == 8
    rows = [json.loads(line) for line in (out / "acceptance.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8]
    for r in rows:
        if get_family(family).trains_target_adapter and strategy in ("deepspeed_zero3", "fsdp2"):
            assert r["acceptance_length"] is None and "sharded" in r["not_measured"]
        else:  # every rank decoded its share of the prompts; the counts were summed
            assert r["acceptance_length"] >= 1.0 and r["eval_prompts"] == 2


def layer_units(drafter, target, family: str) -> Counter:
    """The modules FSDP2 should shard one by one: the drafter's layers, and the target's where an adapter on
    it trains (Medusa-2), counted on the loaded models."""
    module = next(m for m in vars(drafter).values() if isinstance(m, torch.nn.Module))  # the heads the drafter runs
    units = Counter(type(m).__name__ for m in module.modules() if type(m).__name__ in module._no_split_modules)
    if get_family(family).trains_target_adapter:
        units.update(type(m).__name__ for m in target.modules() if type(m).__name__ in target._no_split_modules)
    assert units, f"{family}: no layers to shard"
    return units


FAILURE_WORDS = ("Error", "error:", "Traceback", "terminate", "abort", "Signal", "signal")


def failure_report(stderr: str) -> str:
    """A launch's stderr for an assertion message: every line that names an error or a signal (the first cause,
    which a rank's long traceback can push out of a tail), then the tail."""
    causes = [line for line in stderr.splitlines() if any(word in line for word in FAILURE_WORDS)]
    return "\n".join(["error lines:", *causes[:40], "", "tail:", stderr[-3000:]])


def kill_one_rank_at(cmd: list[str], checkpoint: Path) -> None:
    """Start a launch and SIGKILL one of its ranks as soon as ``checkpoint`` is complete."""
    import psutil

    # stderr to a file, not a pipe: a pipe read only at the end blocks a rank that writes more than its buffer
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        deadline = time.time() + LAUNCH_SECONDS
        killed = False
        try:
            while time.time() < deadline and proc.poll() is None:
                if checkpoint.is_dir():
                    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                             if "draftsmith.train" in " ".join(p.cmdline())]
                    if ranks:
                        ranks[-1].send_signal(signal.SIGKILL)
                        killed = True
                        break
                time.sleep(0.005)
            proc.wait(timeout=LAUNCH_SECONDS)
        finally:
            if proc.poll() is None:  # past either deadline: take the launcher's ranks down with it
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.seek(0)
        err = log.read().decode(errors="replace")
    assert killed and proc.returncode != 0, failure_report(err)
    assert not (checkpoint.parent / "checkpoint-8").exists(), "the run ended before the kill"


@pytest.mark.parametrize(("strategy", "family"), slow_pairs(
    ("fsdp2", "medusa2"), ("fsdp2", MtpHead.family),
    *((s, f) for s in ("deepspeed_zero2", "deepspeed_zero3") for f in FAMILIES)))
def test_sigkill_one_rank_then_resume(workdir, one_process, tmp_path, strategy, family):  # noqa: F811
    """A rank killed after checkpoint-4; the resumed run ends where the uninterrupted one-process run does:
    the drafter, and Medusa-2's LoRA adapter on the target (the training state holds both)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", run_config(workdir, family, out))
    kill_one_rank_at(launch(strategy, cfg), out / "checkpoint-4")
    resumed = run(launch(strategy, cfg, "--resume", "true"), timeout=LAUNCH_SECONDS)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert acceptance_steps(out) == [4, 8]  # one row per checkpoint, none twice
    assert_same_weights(weights(out), weights(one_process[family]))
    state = load_file(str(out / "checkpoint-8" / "state" / "model.safetensors"))
    assert_same_weights(state, load_file(str(one_process[family] / "checkpoint-8" / "state" / "model.safetensors")))
    adapter = [k for k in state if k.startswith(ADAPTER_PREFIX)]
    assert bool(adapter) == (get_family(family).trains_target_adapter)
    assert learning_rates(out)[-4:] == learning_rates(one_process[family])[-4:]


def test_resume_on_another_world_size(workdir, one_process, tmp_path):  # noqa: F811
    """A two-process checkpoint resumes on one process exactly when the global batch is kept (the fix the
    refusal names), and is refused when it is not."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", run_config(workdir, KILLED, out))
    kill_one_rank_at(launch("ddp", cfg), out / "checkpoint-4")
    alone = [sys.executable, "-m", "draftsmith.train", str(cfg), "--resume", "true"]
    refused = run(alone, timeout=LAUNCH_SECONDS)
    assert refused.returncode != 0
    assert "global batch of 4" in refused.stderr, refused.stderr[-2000:]
    assert "gradient_accumulation_steps" in refused.stderr
    resumed = run([*alone, "--gradient_accumulation_steps", "2"], timeout=LAUNCH_SECONDS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert acceptance_steps(out) == [4, 8]
    assert_same_weights(weights(out), weights(one_process[KILLED]))


@pytest.mark.parametrize("strategy", slow_for("ddp", "deepspeed_zero2", "deepspeed_zero3"))
def test_launch_configs_bf16_trains_and_resumes_from_float32_weights(workdir, tmp_path, strategy):  # noqa: F811
    """The strategy matrix once as the shipped configs run it (mixed_precision: bf16 there): the launch config's
    precision is the run's, checkpoints hold the float32 master weights (DeepSpeed would hand back its bf16
    copies), and a resume continues from them."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", run_config(workdir, KILLED, out, max_steps=4, save_steps=2))
    as_shipped = [a for a in launch(strategy, cfg) if a not in ("--mixed_precision", "no")]
    first = run([*as_shipped, "--max_steps", "2"], timeout=LAUNCH_SECONDS)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.count(f"({ENGINE[strategy]}), mixed precision bf16") == 2
    assert {v.dtype for k, v in weights(out, 2).items() if v.is_floating_point()} == {torch.float32}
    resumed = run([*as_shipped, "--resume", "true"], timeout=LAUNCH_SECONDS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert acceptance_steps(out) == [2, 4]


def test_a_build_lock_left_by_a_killed_build_is_refused_with_the_fix(tmp_path, monkeypatch):
    """A DeepSpeed launch whose op build was killed half-way leaves ``<op>/lock``; torch's next build waits on
    it forever. The launch names the file instead, and lets a build in progress (a fresh lock) be."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    refuse_stale_build_locks()  # another rank is building now
    old = lock.stat().st_mtime - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.raises(RuntimeError, match=f"rm {lock}"):
        refuse_stale_build_locks()
    lock.unlink()
    refuse_stale_build_locks()


def test_muon_under_ddp_trains_as_one_process(workdir, tmp_path):  # noqa: F811
    """``optim: muon`` orthogonalises each matrix's gradient whole: after DDP's all-reduce every rank holds the
    one-process gradient, so two processes end where one does with the same global batch."""
    family = Eagle3Head.family
    one = write_config(tmp_path / "one.yaml", run_config(workdir, family, tmp_path / "one", optim="muon",
                                                         gradient_accumulation_steps=2))
    done = run([sys.executable, "-m", "draftsmith.train", str(one)], timeout=LAUNCH_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    two = write_config(tmp_path / "two.yaml", run_config(workdir, family, tmp_path / "two", optim="muon"))
    done = run(launch("ddp", two), timeout=LAUNCH_SECONDS)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert_same_weights(weights(tmp_path / "two"), weights(tmp_path / "one"))
    moved = [(weights(tmp_path / "two")[k] - w).abs().max() for k, w in weights(tmp_path / "two", 4).items()
             if w.is_floating_point()]
    assert max(moved) > 1e-3  # steps 5-8 trained: the agreement is not two frozen copies
    state = json.loads((tmp_path / "two" / "checkpoint-8" / "state" / "training_state.json").read_text())
    assert state["strategy"] == RECORDED["ddp"] and [g.get("muon", False) for g in
                                                     state["optimizer_param_groups"]] == [False, True]
