"""``scripts/memory_estimate.py``: its formulas against real transformers Qwen3 models built small, on CPU.

Parameter counts are compared tensor by tensor with ``Qwen3ForCausalLM(Qwen3Config(...))`` so that the formula
cannot drift from the architecture; per-layer activations with what autograd actually saves for one decoder
layer (under ``bf16-mixed``'s autocast with fp32 weights, and in pure bf16); AdamW states with torch's own.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
BNB_INSTALL = 'pip install -e ".[vllm]"'


def load_script(name: str):
    """Import a script by path; not test_plots' helper, whose module needs matplotlib (the GPU machine lacks it)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    return module


mem = load_script("memory_estimate")

TINY = {  # small shapes with what distinguishes the real ones: GQA, head_dim != hidden / heads, tied or not
    "tied": mem.Arch("tied", hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, intermediate=96, vocab=101),
    "untied": mem.Arch("untied", hidden=48, layers=2, heads=6, kv_heads=3, head_dim=16, intermediate=80, vocab=77,
                       tied=False),
}  # fmt: skip


def build(arch, dtype=torch.float32) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=arch.vocab, hidden_size=arch.hidden, num_hidden_layers=arch.layers,
        num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads, head_dim=arch.head_dim,
        intermediate_size=arch.intermediate, tie_word_embeddings=arch.tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype)


@pytest.mark.parametrize("name", sorted(TINY))
def test_parameter_sizes_match_a_transformers_qwen3_tensor_by_tensor(name):
    arch = TINY[name]
    model = build(arch)
    assert mem.parameter_sizes(arch) == [p.numel() for p in model.parameters()]
    assert mem.param_count(arch) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("key", "total", "non_embedding"), [("1.7B", 1.7, 1.4), ("4B", 4.0, 3.6), ("8B", 8.2, 6.9)])
def test_qwen3_counts_are_the_published_ones(key, total, non_embedding):
    arch = mem.QWEN3[key]
    count = mem.param_count(arch)
    embeddings = arch.vocab * arch.hidden * (1 if arch.tied else 2)
    assert round(count / 1e9, 1) == total
    assert round((count - embeddings) / 1e9, 1) == non_embedding


def saved_bytes_of_one_layer(model: Qwen3ForCausalLM, tokens: int, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves inside decoder layer 1, excluding parameters and the layer's
    own inputs (which its gradient checkpoint holds), over one left-padded row of ``tokens``."""
    layer = model.model.layers[1]
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = False

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside and ptr not in excluded:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    def enter(module, args, kwargs):
        nonlocal inside
        inside = True
        inputs = [*args, *kwargs.values(), *kwargs.get("position_embeddings", ())]
        excluded.update(t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor))

    def leave(module, args, output):
        nonlocal inside
        inside = False

    handles = [layer.register_forward_pre_hook(enter, with_kwargs=True), layer.register_forward_hook(leave)]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    mask = torch.ones(1, tokens, dtype=torch.long)
    mask[0, :2] = 0  # left padding, as the learner's rows have: SDPA then takes a mask
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model.model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return sum(saved.values())


@pytest.mark.parametrize("setting", [0, 2], ids=["bf16-mixed", "pure-bf16"])
def test_layer_activation_formula_matches_what_autograd_saves(setting):
    arch = mem.Arch("calib", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=64)
    chosen = mem.SETTINGS[setting]
    model = build(arch, torch.float32 if chosen.autocast else torch.bfloat16)
    tokens = 96
    measured = saved_bytes_of_one_layer(model, tokens, chosen.autocast)
    if chosen.autocast:  # each linear's bf16 weight copy, counted apart in the estimate
        measured -= 2 * sum(m.weight.numel() for m in model.model.layers[1].modules() if isinstance(m, torch.nn.Linear))
    expected = tokens * mem.layer_activation_bytes_per_token(arch, chosen)
    assert abs(measured - expected) <= 0.03 * expected, (measured, expected)


def test_fp32_adamw_states_match_torch():
    arch = TINY["untied"]
    model = build(arch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model(input_ids=torch.randint(0, arch.vocab, (1, 5))).logits.sum().backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for k, t in s.items() if k != "step")
    assert state == mem.optimizer_bytes(mem.parameter_sizes(arch), mem.SETTINGS[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes: " + BNB_INSTALL)
def test_8bit_adamw_states_match_bitsandbytes():
    import bitsandbytes as bnb

    arch = mem.Arch("bnb", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, intermediate=768, vocab=1000)
    model = build(arch).cuda()
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-6)
    model(input_ids=torch.randint(0, arch.vocab, (1, 5), device="cuda")).logits.sum().backward()
    optimizer.step()
    per_param = ("state1", "state2", "absmax1", "absmax2")  # qmap1/qmap2 are one shared 256-entry table each
    state = sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in per_param if k in s)
    assert state == mem.optimizer_bytes(mem.parameter_sizes(arch), mem.SETTINGS[0])


@pytest.mark.parametrize("key", sorted(mem.QWEN3))
def test_per_rank_estimates_against_a_direct_computation(key):
    """FSDP2 divides weights, gradients and optimizer states by k exactly and nothing else; DDP divides nothing and
    adds one copy of the gradients (its all-reduce buckets) to the single device's figure."""
    arch, setting, work = mem.QWEN3[key], mem.SETTINGS[0], mem.Workload()
    single = mem.single_gpu(arch, setting, work)
    n, h, v = mem.param_count(arch), arch.hidden, arch.vocab
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    layer = h * q + 2 * h * kv + q * h + 2 * arch.head_dim + 3 * h * arch.intermediate + 2 * h  # one decoder layer
    root = v * h * (1 if arch.tied else 2) + h  # embedding (+ untied head) and final norm
    unsharded = ("checkpoints", "layer", "head")
    for k in (1, 2, 4, 8):
        ddp = mem.per_rank("ddp", arch, setting, work, k)
        assert all(ddp[part] == single[part] for part in ("params", "grads", "optimizer", *unsharded))
        assert ddp["buckets"] == 4 * n / mem.GIB
        assert ddp["resident"] == pytest.approx(single["resident"] + 4 * n / mem.GIB, rel=1e-12)
        assert ddp["peak"] == pytest.approx(single["peak"] + 4 * n / mem.GIB, rel=1e-12)

        fsdp = mem.per_rank("fsdp2", arch, setting, work, k)
        assert fsdp["params"] == fsdp["grads"] == 4 * n / k / mem.GIB
        assert fsdp["optimizer"] * k == single["optimizer"]  # k is a power of two: exact in floating point
        assert fsdp["resident"] * k == pytest.approx(single["resident"], rel=1e-12)
        assert all(fsdp[part] == single[part] for part in unsharded)
        assert fsdp["gathered"] == 4 * (2 * layer + root) / mem.GIB
        assert fsdp["unsharded_grads"] == 4 * (v * h + h) / mem.GIB
        peak = single["resident"] / k + 4 * (2 * layer + root + v * h + h) / mem.GIB
        peak += single["checkpoints"] + max(single["layer"], single["head"])
        assert fsdp["peak"] == pytest.approx(peak, rel=1e-12)
    assert mem.per_rank("fsdp2", arch, setting, work, 8)["peak"] < single["peak"]


def test_main_prints_the_per_rank_table_only_when_asked(capsys):
    mem.main(["--models", "8B", "--fsdp"])
    assert "| model | strategy |" not in capsys.readouterr().out
    mem.main(["--models", "8B", "--fsdp", "--learner-ranks", "1", "4", "--strategy", "fsdp2"])
    out = capsys.readouterr().out
    assert "| model | strategy | k = 1 | k = 4 |" in out
    rows = [line for line in out.splitlines() if line.startswith("| Qwen3-8B | ")]
    assert [row.split(" | ")[1] for row in rows] == ["fsdp2"]


def test_main_prints_both_tables(capsys):
    mem.main(["--models", "1.7B", "--completion-tokens", "1024", "--fsdp", "1", "2"])
    out = capsys.readouterr().out
    assert "| Qwen3-1.7B (1.72B) | fp32 master + bf16-mixed + 8-bit AdamW (shipped) |" in out
    assert "| model | k = 1 | k = 2 |" in out


@pytest.mark.parametrize("key", sorted(mem.QWEN3))
def test_the_behaviour_recompute_copy_is_counted_only_when_on(key):
    """``--data.engine.recompute_behavior_logprobs`` keeps a whole second actor in the learner's dtype (fp32 masters: 4
    bytes a parameter, 16 GiB at 4B); off (the default) it costs nothing."""
    arch, setting, work = mem.QWEN3[key], mem.SETTINGS[0], mem.Workload()
    off, on = mem.single_gpu(arch, setting, work), mem.single_gpu(arch, setting, work, recompute=True)
    copy = 4 * mem.param_count(arch) / mem.GIB
    assert off["recompute_copy"] == on["recompute_copy"] == copy  # shown either way, counted only when on
    assert on["resident"] == pytest.approx(off["resident"] + copy, rel=1e-12)
    assert on["peak"] == pytest.approx(off["peak"] + copy, rel=1e-12)


def test_main_adds_the_recompute_copy_when_asked(capsys):
    def peak_of_shipped_row(argv):
        mem.main(["--models", "1.7B", "--fsdp", *argv])
        row = next(line for line in capsys.readouterr().out.splitlines() if "(shipped) |" in line)
        return [float(cell) for cell in row.strip("| ").split(" | ")[2:]]

    off, on = peak_of_shipped_row([]), peak_of_shipped_row(["--recompute-behavior-logprobs"])
    assert off[6] == on[6] == pytest.approx(4 * 1.72e9 / mem.GIB, abs=0.1)  # the copy's column
    assert on[-1] == pytest.approx(off[-1] + on[6], abs=0.11)  # the peak, to the table's one decimal
