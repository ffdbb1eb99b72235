"""Precision of the Qwen3 setting (DESIGN.md §7): fp32 master weights, bf16 compute, bf16 copies to the engine.

An Adam step at lr 1e-6 moves a weight by about 1e-6, below half a bf16 ulp for |w| above ~2.4e-4, so bf16
parameters keep almost none of it while fp32 masters keep all of it. The tiny Qwen3 here has the standard
initialisation (std 0.02, median |w| ~0.013, RMSNorm weights 1), so nearly all of its weights sit in that range.
Each update is one real ``Trainer.fit`` step of ``GMCModule`` (manual optimisation, micro-batches of one group,
gradient checkpointing and a chunked LM head, as the Qwen3 configs run it).
"""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_tiny_model
from torch.utils.data import DataLoader

from lit_gmc.batch import RolloutGroup, collate_groups
from lit_gmc.callbacks.weight_sync import WeightSync
from lit_gmc.data.engines import vllm as vllm_engine
from lit_gmc.data.engines.hf import HFEngine
from lit_gmc.logprobs import response_logprobs
from lit_gmc.module import GMCModule
from lit_gmc.objectives import token_entropy


def shipped_qwen3_settings() -> SimpleNamespace:
    """trainer.precision, model.dtype, the optimizer and its lr of configs/qwen3_4b.yaml as the CLI parses it
    (the configs/model/qwen3_*.yaml fragments are layered over it and change none of them)."""
    from lit_gmc.cli import GMCCLI

    class ParseOnly(GMCCLI):
        def instantiate_classes(self) -> None:
            pass

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    qwen3 = Path(__file__).parents[1] / "configs" / "qwen3_4b.yaml"
    config = ParseOnly(args=["fit", "--config", str(qwen3)]).config.fit
    return SimpleNamespace(precision=config.trainer.precision, dtype=config.model.dtype,
                           optimizer=config.model.optimizer, lr=config.model.optimizer["init_args"]["lr"])  # fmt: skip


SHIPPED = shipped_qwen3_settings()
SHIPPED_PRECISION = SHIPPED.precision  # "bf16-mixed": fp32 master weights, bf16 compute
SHIPPED_DTYPE = SHIPPED.dtype  # "float32"
LR = SHIPPED.lr  # 1e-6
T_MAX = 7
KEEPS_UPDATE = 0.99  # fp32 masters: every element with a gradient moves (measured: all of them)
LOSES_UPDATE = 0.5  # bf16 parameters: only |w| < ~2.4e-4 can move (measured: ~2% of elements)
BNB_INSTALL = 'pip install -e ".[vllm]"'


def saved_actor(tmp_path_factory, tokenizer, hidden: int) -> Path:
    """A random 2-layer Qwen3 (init std 0.02) of width ``hidden`` saved with its tokenizer, in fp32."""
    path = tmp_path_factory.mktemp(f"precision_actor_{hidden}")
    make_tiny_model(tokenizer, hidden=hidden).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory, char_tokenizer) -> Path:
    """Hidden 64."""
    return saved_actor(tmp_path_factory, char_tokenizer, 64)


def rollout_batch(tokenizer, seed: int = 0):
    """2 groups x 4 random responses at version 0 with mixed rewards, so every group has a gradient."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(tokenizer)
    groups = []
    for b, prompt_len in enumerate((3, 5)):
        lengths = torch.randint(2, T_MAX + 1, (4,), generator=gen)
        mask = torch.arange(T_MAX)[None, :] < lengths[:, None]  # (G, T)
        ids = torch.randint(3, vocab, (4, T_MAX), generator=gen).masked_fill(~mask, tokenizer.pad_token_id)
        groups.append(RolloutGroup(
            prompt_id=b, prompt="", answer="", prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=gen),
            response_ids=ids, response_mask=mask,
            behavior_logprobs=torch.full((4, T_MAX), -math.log(vocab)).masked_fill(~mask, 0.0),
            finish_reasons=["stop"] * 4, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), version=0,
        ))  # fmt: skip
    return collate_groups(groups, pad_id=tokenizer.pad_token_id)


class Snapshot(pl.Callback):
    """The actor's parameters as training starts, i.e. after the precision plugin has converted the module."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = {name: p.detach().clone() for name, p in pl_module.actor.named_parameters()}


def _as_is(batch):
    return batch


TORCH_ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {**SHIPPED.optimizer["init_args"], "lr": LR}}
"""The CPU stand-in of the shipped 8-bit AdamW: torch's, with the same options."""


def one_update(actor_dir, batch, *, precision: str, dtype: str, optimizer: dict = TORCH_ADAMW,
               accelerator: str = "cpu", callbacks: tuple = ()):  # fmt: skip
    """``(module, snapshot, trainer)`` after one optimizer update of ``GMCModule`` at lr 1e-6 on ``batch``."""
    module = GMCModule(actor=str(actor_dir), dtype=dtype, optimizer=optimizer, max_response_length=T_MAX,
                       micro_batch_groups=1, logit_chunk_tokens=3, gradient_checkpointing=True)  # fmt: skip
    snapshot = Snapshot()
    trainer = pl.Trainer(accelerator=accelerator, devices=1, precision=precision, max_steps=1, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[snapshot, *callbacks])  # fmt: skip
    trainer.fit(module, DataLoader([batch], batch_size=None, collate_fn=_as_is))
    return module, snapshot, trainer


def changed_fraction(module: GMCModule, before: dict[str, torch.Tensor]) -> float:
    """Fraction of the parameter elements with a nonzero gradient whose value the update changed.

    Manual optimisation zeroes gradients at the start of a step, so after the last step they are still there.
    """
    changed = with_grad = 0
    for name, p in module.actor.named_parameters():
        has_grad = p.grad != 0
        changed += int(((p.detach() != before[name]) & has_grad).sum())
        with_grad += int(has_grad.sum())
    assert with_grad > 0, "the batch gave no gradient"
    return changed / with_grad


def test_the_shipped_settings_are_the_papers():
    # bitsandbytes' 8-bit AdamW needs CUDA: the CPU tests step torch's AdamW, the cuda-marked one the 8-bit one
    shipped = (SHIPPED_PRECISION, SHIPPED_DTYPE, SHIPPED.optimizer["class_path"], LR)
    assert shipped == ("bf16-mixed", "float32", "bitsandbytes.optim.AdamW8bit", 1e-6)
    assert SHIPPED.optimizer["init_args"] == {"lr": 1e-6, "betas": [0.9, 0.999], "weight_decay": 0.0}


def test_shipped_precision_keeps_every_update_at_lr_1e_6(actor_dir, char_tokenizer):
    module, snapshot, _ = one_update(actor_dir, rollout_batch(char_tokenizer), precision=SHIPPED_PRECISION,
                                     dtype=SHIPPED_DTYPE)  # fmt: skip
    assert {p.dtype for p in module.actor.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in module.actor.parameters()} == {torch.float32}
    assert changed_fraction(module, snapshot.before) >= KEEPS_UPDATE


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-true", "float32"), ("32-true", "bfloat16")])
def test_bf16_parameters_lose_the_update_to_rounding(actor_dir, char_tokenizer, precision, dtype):
    module, snapshot, _ = one_update(actor_dir, rollout_batch(char_tokenizer), precision=precision, dtype=dtype)
    assert {p.dtype for p in module.actor.parameters()} == {torch.bfloat16}
    assert changed_fraction(module, snapshot.before) < LOSES_UPDATE


def test_logprobs_under_bf16_autocast_are_float32_from_bf16_logits(char_tokenizer):
    """What Lightning's ``bf16-mixed`` does on CPU (``torch.autocast``, weight cache off): the LM head returns bf16
    logits; log-probs and entropies are computed from them in fp32; the checkpointed, chunked head gives the same
    values and gradients as one plain pass over the same bf16 logits. Only the head weight's gradient differs, by
    bf16 rounding (measured 1.4e-3 of its norm): it is summed over chunks from bf16 partial products instead of
    rounded once."""
    model = make_tiny_model(char_tokenizer, hidden=64).train()
    batch = rollout_batch(char_tokenizer)
    ids, mask, p = batch.input_ids, batch.attention_mask, batch.prompt_width
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        logprobs, entropy = response_logprobs(model, ids, mask, p, chunk_tokens=3)  # (N, T), (N, T)
        got = torch.autograd.grad(logprobs.masked_select(batch.response_mask).sum(), params)
        hidden = model.base_model(input_ids=ids, attention_mask=mask.long(), position_ids=batch.position_ids,
                                  use_cache=False).last_hidden_state[:, p - 1 : -1]  # fmt: skip
        logits = model.get_output_embeddings()(hidden)  # (N, T, V)
    assert logits.dtype == torch.bfloat16
    assert logprobs.dtype == entropy.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, p:, None])[..., 0]  # (N, T)
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, token_entropy(torch.log_softmax(logits.float(), -1)), atol=1e-6, rtol=0)
    want = torch.autograd.grad(expected.masked_select(batch.response_mask).sum(), params)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        assert (g - w).norm() <= 2**-8 * w.norm()  # one bf16 ulp, relative
    with torch.no_grad():
        fp32, _ = response_logprobs(model, ids, mask, p, chunk_tokens=3)
    assert not torch.equal(fp32, logprobs.detach()), "autocast was not in effect"


def test_weight_sync_gives_a_bf16_engine_rounded_copies_of_the_fp32_masters(actor_dir, char_tokenizer):
    engine_model = make_tiny_model(char_tokenizer, hidden=64, dtype=torch.bfloat16)
    engine = HFEngine.from_model(engine_model, char_tokenizer)
    module, _, _ = one_update(actor_dir, rollout_batch(char_tokenizer), precision=SHIPPED_PRECISION,
                              dtype=SHIPPED_DTYPE, callbacks=(WeightSync(engine),))  # fmt: skip
    assert engine.version == 1
    engine_params = dict(engine.model.named_parameters())
    for name, master in module.actor.named_parameters():
        assert master.dtype == torch.float32 and engine_params[name].dtype == torch.bfloat16
        torch.testing.assert_close(engine_params[name], master.detach().to(torch.bfloat16), atol=0, rtol=0)


class RecordingSink:
    def __init__(self) -> None:
        self.received: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors, version: int) -> None:
        self.received = dict(named_tensors)


def test_weight_sync_dtype_casts_each_tensor_it_sends(actor_dir, char_tokenizer):
    sink = RecordingSink()
    module, _, _ = one_update(actor_dir, rollout_batch(char_tokenizer), precision=SHIPPED_PRECISION,
                              dtype=SHIPPED_DTYPE, callbacks=(WeightSync(sink, dtype="bfloat16"),))  # fmt: skip
    assert sink.received.keys() == dict(module.actor.named_parameters()).keys()
    for name, master in module.actor.named_parameters():
        assert sink.received[name].dtype == torch.bfloat16
        torch.testing.assert_close(sink.received[name], master.detach().to(torch.bfloat16), atol=0, rtol=0)
    with pytest.raises(ValueError, match="dtype"):
        WeightSync(sink, dtype="int8")


class FakeLLM:
    """Just enough of ``vllm.LLM`` for ``VLLMEngine.load_weights``: records the tensors a reload receives."""

    def __init__(self, **kwargs) -> None:
        hf_config = SimpleNamespace(tie_word_embeddings=True)
        config = SimpleNamespace(dtype=getattr(torch, kwargs["dtype"]), hf_config=hf_config)
        self.llm_engine = SimpleNamespace(model_config=config, engine_core=SimpleNamespace(shutdown=lambda: None))
        self.received: dict[str, torch.Tensor] = {}

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        self.received = {name: t.clone() for name, t in kwargs["weights_iterator"]}  # tensors by reference


def test_vllm_engine_receives_bf16_copies_of_fp32_masters(monkeypatch, tiny_model, tiny_actor_dir, char_tokenizer):
    """``VLLMEngine.load_weights`` on a bf16 engine, with ``vllm.LLM`` replaced by a recorder (no vLLM needed)."""
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: SimpleNamespace(LLM=FakeLLM))
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND"):  # the engine sets them
        monkeypatch.setenv(var, "")
    engine = vllm_engine.VLLMEngine(dtype="bfloat16")
    engine.start(str(tiny_actor_dir), char_tokenizer)
    try:
        master = copy.deepcopy(tiny_model).float()
        engine.load_weights(master.named_parameters(), 3)
        received = engine.llm.received
    finally:
        engine.close()
    want = {name: p.detach().to(torch.bfloat16) for name, p in master.named_parameters()}
    want["lm_head.weight"] = want["model.embed_tokens.weight"]  # tied: vLLM's separate head copy is sent too
    assert received.keys() == want.keys()
    for name, tensor in received.items():
        assert tensor.dtype == torch.bfloat16, name
        torch.testing.assert_close(tensor, want[name], atol=0, rtol=0)
    assert engine.version == 3


@pytest.fixture(scope="module")
def wide_actor_dir(tmp_path_factory, char_tokenizer) -> Path:
    """Hidden 128, so the matrices have >= 4,096 elements and bitsandbytes keeps their Adam states in 8 bits."""
    return saved_actor(tmp_path_factory, char_tokenizer, 128)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason=f"needs bitsandbytes: {BNB_INSTALL}")
def test_8bit_adamw_on_fp32_masters_keeps_the_update(wide_actor_dir, char_tokenizer):
    batch = rollout_batch(char_tokenizer)
    module, snapshot, trainer = one_update(wide_actor_dir, batch, precision=SHIPPED_PRECISION, dtype=SHIPPED_DTYPE,
                                           optimizer=SHIPPED.optimizer, accelerator="gpu")  # fmt: skip
    states = trainer.optimizers[0].state.values()
    assert any(s.get("state1") is not None and s["state1"].dtype == torch.uint8 for s in states), "no 8-bit state"
    assert changed_fraction(module, snapshot.before) >= KEEPS_UPDATE
