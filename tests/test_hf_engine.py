"""HFEngine: behaviour log-probs agree with the learner's, weights load in place, sampling is seeded."""

from __future__ import annotations

import pytest
import torch

from lit_gmc.batch import collate_groups
from lit_gmc.data.engines.base import RolloutEngine, SamplingParams
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.data.tasks.base import Prompt
from lit_gmc.logprobs import response_logprobs

PROMPTS = [Prompt(0, "1+2=", "3"), Prompt(1, "40+23=", "63"), Prompt(2, "9+9=", "18")]


def learner_logprobs(model, groups, pad_id, temperature=1.0):
    batch = collate_groups(groups, pad_id=pad_id)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_width,
                                  temperature=temperature)  # fmt: skip
    return batch, lp


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_match_the_learner_at_the_sampling_temperature(tiny_model, char_tokenizer, temperature):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    groups = engine.generate(PROMPTS, 4, SamplingParams(temperature=temperature, max_new_tokens=6, seed=1))
    batch, lp = learner_logprobs(tiny_model, groups, char_tokenizer.pad_token_id, temperature)
    mask = batch.response_mask
    assert mask.sum() > 0
    torch.testing.assert_close(batch.behavior_logprobs[mask], lp[mask], atol=2e-5, rtol=0)
    assert (batch.behavior_logprobs[~mask] == 0).all()


def test_groups_are_well_formed(tiny_model, char_tokenizer):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    assert isinstance(engine, RolloutEngine)
    groups = engine.generate(PROMPTS, 5, SamplingParams(max_new_tokens=4, seed=0))
    assert [g.prompt_id for g in groups] == [0, 1, 2]
    for g in groups:
        assert g.response_ids.shape == g.response_mask.shape == g.behavior_logprobs.shape
        assert g.response_ids.shape[0] == 5 and g.version == 0
        assert char_tokenizer.decode(g.prompt_ids) == g.prompt
        eos = char_tokenizer.eos_token_id
        for ids, mask, reason in zip(g.response_ids, g.response_mask, g.finish_reasons, strict=True):
            real = ids[mask].tolist()
            assert (ids[~mask] == char_tokenizer.pad_token_id).all()
            assert mask.tolist() == sorted(mask.tolist(), reverse=True)  # real tokens first
            if reason == "stop":
                assert real[-1] == eos and eos not in real[:-1]
            else:
                assert reason == "length" and eos not in real and len(real) == 4


def test_same_seed_same_samples_other_seed_other_samples(tiny_model, char_tokenizer):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    a = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=5))
    b = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=5))
    c = engine.generate(PROMPTS, 8, SamplingParams(max_new_tokens=6, seed=6))
    assert all(torch.equal(x.response_ids, y.response_ids) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x.response_ids, z.response_ids) for x, z in zip(a, c, strict=True))


def test_samples_are_those_of_generate_under_torch_manual_seed(tiny_model, char_tokenizer):
    """The draws are the ones ``torch.manual_seed`` gives, and the caller's generator is left as it was."""
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    before = torch.get_rng_state()
    (group,) = engine.generate(PROMPTS[1:2], 6, SamplingParams(max_new_tokens=5, seed=11))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random stream is untouched
    ids = torch.tensor([char_tokenizer(PROMPTS[1].text, add_special_tokens=False)["input_ids"]])
    torch.manual_seed(11)
    with torch.no_grad():
        out = engine.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, num_return_sequences=6,
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=char_tokenizer.pad_token_id,
            eos_token_id=char_tokenizer.eos_token_id,
        )  # fmt: skip
    want = out[:, ids.shape[1] :]  # (6, L'): generate stops when every row has ended
    real = group.response_mask[:, : want.shape[1]]
    assert torch.equal(group.response_ids[:, : want.shape[1]][real], want[real])


def test_prompts_are_the_tokenizers_own_ids_left_padded(tiny_model, char_tokenizer):
    """Prompt ids and mask of a launch: what the tokenizer gives when it pads on the left itself."""
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    prompts = [*PROMPTS, Prompt(3, "", "0")]  # an empty prompt is all padding
    groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3, seed=0))
    want = char_tokenizer([p.text for p in prompts], add_special_tokens=False, padding=True, padding_side="left",
                          return_tensors="pt")  # fmt: skip
    batch = collate_groups(groups, char_tokenizer.pad_token_id)
    width = batch.prompt_width
    assert torch.equal(batch.input_ids[::2, :width], want["input_ids"])
    assert torch.equal(batch.attention_mask[::2, :width], want["attention_mask"].bool())
    for group, text in zip(groups, [p.text for p in prompts], strict=True):
        assert group.prompt_ids.dtype == torch.long
        assert group.prompt_ids.tolist() == char_tokenizer(text, add_special_tokens=False)["input_ids"]


def test_load_weights_updates_in_place_and_sets_the_version(tiny_model, char_tokenizer):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    before = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, seed=2))
    new = {name: p.detach() + 0.5 * torch.randn_like(p) for name, p in tiny_model.named_parameters()}
    engine.load_weights(new.items(), version=7)
    assert engine.version == 7
    for name, p in engine.model.named_parameters():
        torch.testing.assert_close(p, new[name])
    # the engine now samples from the new weights: its log-probs are the new model's, not the old one's
    tiny_model.load_state_dict(new, strict=False)
    after = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=6, seed=2))
    assert all(g.version == 7 for g in after)
    batch, lp = learner_logprobs(tiny_model, after, char_tokenizer.pad_token_id)
    torch.testing.assert_close(batch.behavior_logprobs[batch.response_mask], lp[batch.response_mask], atol=2e-5, rtol=0)
    assert not all(torch.equal(x.behavior_logprobs, y.behavior_logprobs) for x, y in zip(before, after, strict=True))
    with pytest.raises(KeyError, match="nonexistent"):
        engine.load_weights([("nonexistent.weight", torch.zeros(1))], version=8)


def test_greedy_is_deterministic_across_seeds(tiny_model, char_tokenizer):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    a = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=5, seed=1))
    b = engine.generate(PROMPTS, 2, SamplingParams(temperature=0.0, max_new_tokens=5, seed=2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.response_ids, y.response_ids)
        assert torch.equal(x.response_ids[0], x.response_ids[1])


def test_engine_batches_large_requests_without_changing_groups(tiny_model, char_tokenizer):
    small = HFEngine.from_model(tiny_model, char_tokenizer, batch_rows=4)  # one prompt x 4 samples per generate call
    groups = small.generate(PROMPTS, 4, SamplingParams(max_new_tokens=5, seed=3))
    assert [g.prompt_id for g in groups] == [0, 1, 2]
    batch, lp = learner_logprobs(tiny_model, groups, char_tokenizer.pad_token_id)
    torch.testing.assert_close(batch.behavior_logprobs[batch.response_mask], lp[batch.response_mask], atol=2e-5, rtol=0)


@pytest.mark.parametrize("batch_rows", [4, 64])
def test_one_prompt_twice_in_a_launch_gets_two_samples_whatever_the_chunking(tiny_model, char_tokenizer, batch_rows):
    """Each generate call of a launch has its own noise: a chunk never replays the sampling of the chunk before."""
    engine = HFEngine.from_model(tiny_model, char_tokenizer, batch_rows=batch_rows)
    twice = [Prompt(0, "40+23=", "63"), Prompt(1, "40+23=", "63")]
    first, second = engine.generate(twice, 4, SamplingParams(max_new_tokens=8, seed=5))
    assert not torch.equal(first.response_ids, second.response_ids)


@pytest.mark.parametrize("vocab", [46, 5000])
def test_sampled_logprobs_are_the_same_for_every_chunk_of_positions(vocab):
    """Each position's log-softmax of the processed scores (-inf where top-p filtered) at the sampled token, whether
    the positions are reduced one at a time, a few at a time or all at once."""
    from lit_gmc.data.engines.hf import sampled_logprobs

    gen = torch.Generator().manual_seed(vocab)
    rows, length = 12, 7
    scores = [torch.randn(rows, vocab, generator=gen) * 3 for _ in range(length)]
    for s in scores:
        s[torch.rand(rows, vocab, generator=gen) < 0.4] = -torch.inf
        s[:, 1] = 0.0  # every row keeps a token
    tokens = torch.randint(0, vocab, (rows, length), generator=gen)
    tokens[0] = 1
    rows_index = torch.arange(rows)
    want = torch.stack([s.double().log_softmax(-1)[rows_index, tokens[:, t]] for t, s in enumerate(scores)], 1)
    one_by_one = torch.stack(
        [torch.log_softmax(s, -1).gather(-1, tokens[:, t, None])[:, 0] for t, s in enumerate(scores)], 1
    )  # (rows, L)
    position_bytes = 4 * rows * vocab
    for chunk_bytes in (1, position_bytes, 3 * position_bytes, 10**9):
        got = sampled_logprobs(scores, tokens, chunk_bytes)
        assert got.shape == (rows, length) and got.dtype == torch.float32
        assert torch.equal(got, one_by_one), chunk_bytes
    torch.testing.assert_close(one_by_one.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.isinf(one_by_one).any() and torch.isfinite(one_by_one[0]).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_a_gpu_samples_are_those_of_torch_manual_seed_and_no_generator_moves(tiny_model, char_tokenizer):
    engine = HFEngine.from_model(tiny_model, char_tokenizer)
    engine.model.cuda()  # the engine's own copy; the fixture stays on the CPU
    cpu, gpus = torch.get_rng_state(), torch.cuda.get_rng_state_all()
    (group,) = engine.generate(PROMPTS[1:2], 6, SamplingParams(max_new_tokens=5, seed=11))
    assert torch.equal(torch.get_rng_state(), cpu)
    assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), gpus, strict=True))
    ids = torch.tensor([char_tokenizer(PROMPTS[1].text, add_special_tokens=False)["input_ids"]], device="cuda")
    torch.manual_seed(11)
    with torch.no_grad():
        out = engine.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, num_return_sequences=6,
            do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=char_tokenizer.pad_token_id,
            eos_token_id=char_tokenizer.eos_token_id,
        ).cpu()  # fmt: skip
    want = out[:, ids.shape[1] :]
    real = group.response_mask[:, : want.shape[1]]
    assert torch.equal(group.response_ids[:, : want.shape[1]][real], want[real])
